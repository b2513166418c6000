"""Safetensors shards copied to a CUDA device straight from the page cache
(`ATOM_SAFETENSORS_DIRECT=register`): no read into pinned memory, the copy engine reads the pages.

Each shard is mapped read-only; a thread registers the mapping with the CUDA driver
(`cudaHostRegister`, read-only: the pages are pinned where they lie in the page cache) in chunks of
`CHUNK_BYTES`, at most `AHEAD_CHUNKS` (or the largest tensor's span, plus one) ahead of the copies.
The consumer walks the tensors in file order: once the chunks a tensor lies in are registered it
copies the tensor on one copy stream and yields the device tensor with the current stream waiting
on the copy (no host wait). A chunk every tensor of which has been copied is released by a third
thread once those copies are done (unregistered, its budget returned). So each byte crosses host
memory once, read by the DMA (the pinned-ring reader, `safetensors_direct`, moves it three times).
NOTE (benchmarks/load_readers.py `chunked_register`, one H200 host, 2026-11-28,
benchmarks/results/load/s23/): registering runs at 31-41 GB/s, the copies from registered pages
at the pinned rate (54 GB/s); one registering thread ahead of one copy stream moved the warm
16 GB checkpoint at 29.4 GB/s, more registering threads slower (24 GB/s: they slow the copies).

On a CPU device the same walk runs with no registration and CPU copies (the tests' path).
"""

from __future__ import annotations

import mmap
import queue
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from atom_models.progress import progress_bar
from atom_models.safetensors_direct import read_header
from atom_models.weights import safetensors_files

CHUNK_BYTES = 256 << 20
AHEAD_CHUNKS = 4
_READ_ONLY = 8  # cudaHostRegisterReadOnly


@dataclass
class Chunk:
    """Bytes [start, end) of file ``file`` (its index), registered as one range."""

    file: int
    start: int
    end: int


@dataclass
class Tensor:
    name: str
    dtype: torch.dtype
    shape: list[int]
    file: int
    offset: int
    nbytes: int
    first_chunk: int  # the chunks it lies in (global indices, registered in order)
    last_chunk: int


def plan(sizes: list[int], headers: list[list], chunk_bytes: int) -> tuple[list[Chunk], list]:
    """(the chunks of every file in order, its tensors in file order with the chunks each lies
    in). A file's chunks are ``chunk_bytes`` from its start (page-aligned), the last shorter."""
    chunks: list[Chunk] = []
    tensors: list[Tensor] = []
    for file, (size, entries) in enumerate(zip(sizes, headers, strict=True)):
        base = len(chunks)
        chunks += [Chunk(file, s, min(size, s + chunk_bytes)) for s in range(0, size, chunk_bytes)]
        for name, dtype, shape, offset, nbytes in sorted(entries, key=lambda e: e[3]):
            first = base + offset // chunk_bytes
            last = base + max(offset, offset + nbytes - 1) // chunk_bytes
            tensors.append(Tensor(name, dtype, shape, file, offset, nbytes, first, last))
    return chunks, tensors


def budget(tensors: list[Tensor], ahead: int) -> int:
    """Chunks registered at once at most: ``ahead``, or the widest tensor's span plus one (its
    chunks must all be registered while the one after waits)."""
    span = max((t.last_chunk - t.first_chunk + 1 for t in tensors), default=1)
    return max(ahead, span + 1)


def _pieces(t: Tensor, chunks: list[Chunk]) -> list[tuple[int, int]]:
    """The tensor's byte ranges (from its start) that each lie in one chunk."""
    end = t.offset + t.nbytes
    return [
        (max(c.start, t.offset) - t.offset, min(c.end, end) - t.offset)
        for c in chunks[t.first_chunk : t.last_chunk + 1]
        if min(c.end, end) > max(c.start, t.offset)
    ]


def iter_safetensors_registered(
    model_dir: str | Path,
    device: torch.device | str,
    *,
    show_progress: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    files = safetensors_files(model_dir)
    chunks, tensors = plan(
        [f.stat().st_size for f in files], [read_header(f) for f in files], CHUNK_BYTES
    )
    maps = []
    for f in files:
        with open(f, "rb") as fh:
            maps.append(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
    hosts = [np.frombuffer(m, dtype=np.uint8) for m in maps]
    cudart = torch.cuda.cudart() if cuda else None
    slots = threading.Semaphore(budget(tensors, AHEAD_CHUNKS))
    ready = [threading.Event() for _ in chunks]  # registered, or the registrar failed
    pinned = [False] * len(chunks)  # registered and not yet unregistered
    failure: list[BaseException] = []
    stop = threading.Event()
    releases: queue.Queue = queue.Queue()

    def pointer(c: Chunk) -> int:
        return hosts[c.file].ctypes.data + c.start

    def register_all() -> None:
        try:
            if cuda:
                torch.cuda.set_device(device)
            for i, c in enumerate(chunks):
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                if cuda:
                    err = cudart.cudaHostRegister(pointer(c), c.end - c.start, _READ_ONLY)
                    if int(err) != 0:
                        raise RuntimeError(
                            f"cudaHostRegister of {files[c.file].name} [{c.start}, {c.end}) "
                            f"failed: {err} (ATOM_SAFETENSORS_DIRECT=1 reads through pinned "
                            "memory instead)"
                        )
                pinned[i] = True
                ready[i].set()
        except BaseException as e:  # raised in the consumer
            failure.append(e)
        finally:
            for event in ready:  # a consumer waiting on a chunk never registered wakes up
                event.set()

    def release_all() -> None:
        while (item := releases.get()) is not None:
            i, copied = item
            if copied is not None:
                copied.synchronize()  # the copies reading the chunk are done
            if cuda and pinned[i]:
                cudart.cudaHostUnregister(pointer(chunks[i]))
            pinned[i] = False
            slots.release()

    registrar = threading.Thread(target=register_all, daemon=True, name="atom-register")
    releaser = threading.Thread(target=release_all, daemon=True, name="atom-unregister")
    stream = torch.cuda.Stream(device) if cuda else None
    bar = progress_bar(
        desc="Loading safetensors checkpoint",
        total=sum(t.nbytes for t in tensors),
        enabled=show_progress,
        unit="B",
        unit_scale=True,
    )
    released = 0  # chunks before this one are handed to the releaser
    last_copy = None  # the stream's last copy: every earlier copy is done once it is
    try:
        registrar.start()
        releaser.start()
        for t in tensors:
            while released < t.first_chunk:  # every tensor reading these was copied
                releases.put((released, last_copy))
                released += 1
            ready[t.last_chunk].wait()
            if failure:
                raise failure[0]
            with warnings.catch_warnings():  # the mapping is read-only: torch warns once
                warnings.simplefilter("ignore", UserWarning)
                src = torch.from_numpy(hosts[t.file][t.offset : t.offset + t.nbytes])
            if cuda:
                with torch.cuda.stream(stream):
                    out = torch.empty(t.nbytes, dtype=torch.uint8, device=device)
                    # one copy a chunk: a copy's source lies in one registration (the driver
                    # refuses a range over two: cudaErrorInvalidValue)
                    for begin, end in _pieces(t, chunks):
                        out[begin:end].copy_(src[begin:end], non_blocking=True)
                    last_copy = stream.record_event()
                current = torch.cuda.current_stream(device)
                current.wait_event(last_copy)
                out.record_stream(current)
            else:
                out = src.clone()
            del src
            bar.update(t.nbytes)
            yield t.name, out.view(t.dtype).view(t.shape)
    finally:
        stop.set()
        registrar.join()
        for i in range(released, len(chunks)):
            releases.put((i, last_copy))  # registered or not: the releaser checks
        releases.put(None)
        releaser.join()
        bar.close()
        hosts.clear()
        for m in maps:
            try:
                m.close()
            except BufferError:  # a view still alive: the mapping closes when it goes
                pass
