"""Safetensors shards read straight to a CUDA device: the `safetensors` load format's path on a GPU
when one rank reads whole tensors.

The shards' headers give each tensor's byte range. `READ_THREADS` threads share the tensors
(largest first, so no thread is left with the tail); each reads its tensors with `os.preadv` into
its own ring of `RING_CHUNKS` pinned chunks of `CHUNK_BYTES` and copies them to the device on its
own stream, going round the ring (a chunk is refilled once its last copy is done). The consumer
gets a device tensor once its copies are done. So the bytes go file -> pinned memory -> device
with no pageable copy and no full CPU copy of the model; at most two tensors a thread wait on the
device. The three sizes are module constants read at each call (`benchmarks/load_bench.py
--reader-sweep` times them on a machine).
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from atom_models.checkpoint_slice import _DTYPES
from atom_models.progress import progress_bar
from atom_models.weights import safetensors_files

READ_THREADS = 8
CHUNK_BYTES = 16 << 20
RING_CHUNKS = 2


def read_header(path: Path) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """(name, dtype, shape, file offset, bytes) of each tensor of a safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path.name}: tensor {name} has dtype {info['dtype']}, unsupported")
        start, end = info["data_offsets"]
        entries.append((name, dtype, list(info["shape"]), base + start, end - start))
    return entries


def iter_safetensors_to_device(
    model_dir: str | Path,
    device: torch.device | str,
    *,
    max_threads: int | None = None,
    show_progress: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    files = safetensors_files(model_dir)
    tensors = [(path, *entry) for path in files for entry in read_header(path)]
    tensors.sort(key=lambda t: -t[5])
    num_threads = max(1, min(max_threads or READ_THREADS, len(tensors)))
    chunk_bytes, ring = CHUNK_BYTES, max(2, RING_CHUNKS)
    results: queue.Queue = queue.Queue(maxsize=2 * num_threads)
    stop = threading.Event()
    done_marker = object()

    def put(item) -> None:
        while not stop.is_set():
            try:
                results.put(item, timeout=0.1)
                return
            except queue.Full:
                pass

    def read_all(jobs) -> None:
        try:
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device)
            chunks = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
                      for _ in range(ring)]  # fmt: skip
            views = [memoryview(c.numpy()) for c in chunks]
            events: list = [None] * ring
            files: dict[Path, int] = {}
            try:
                turn = 0
                for path, name, dtype, shape, offset, nbytes in jobs:
                    if stop.is_set():
                        return
                    fd = files.get(path)
                    if fd is None:
                        fd = files[path] = os.open(path, os.O_RDONLY)
                    with torch.cuda.stream(stream):
                        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
                        done = 0
                        while done < nbytes:
                            if events[turn] is not None:
                                events[turn].synchronize()  # the chunk's last copy is done
                            size = min(chunk_bytes, nbytes - done)
                            got = os.preadv(fd, [views[turn][:size]], offset + done)
                            if got != size:
                                raise OSError(f"{path.name}: short read of tensor {name}")
                            out[done : done + size].copy_(chunks[turn][:size], non_blocking=True)
                            events[turn] = stream.record_event()
                            done += size
                            turn = (turn + 1) % ring
                        ready = stream.record_event()
                    put((name, out.view(dtype).view(shape), ready, stream))
            finally:
                for fd in files.values():
                    os.close(fd)
                for event in events:
                    if event is not None:
                        event.synchronize()  # no copy left reading a chunk about to be freed
        except BaseException as e:  # handed to the consumer, raised there
            put(e)
        finally:
            put(done_marker)

    readers = [
        threading.Thread(target=read_all, args=(tensors[i::num_threads],), daemon=True,
                         name=f"atom-safetensors-direct-{i}")
        for i in range(num_threads)
    ]  # fmt: skip
    bar = progress_bar(
        desc="Loading safetensors checkpoint",
        total=sum(t[5] for t in tensors),
        enabled=show_progress,
        unit="B",
        unit_scale=True,
    )
    try:
        for reader in readers:
            reader.start()
        finished = 0
        while finished < num_threads:
            item = results.get()
            if item is done_marker:
                finished += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                name, tensor, ready, stream = item
                ready.synchronize()
                tensor.record_stream(torch.cuda.current_stream(device))
                bar.update(tensor.numel() * tensor.element_size())
                yield name, tensor
    finally:
        stop.set()
        for reader in readers:
            reader.join(timeout=5.0)
        bar.close()
