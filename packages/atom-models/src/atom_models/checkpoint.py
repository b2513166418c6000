"""Reading a checkpoint's tensors in each `load_format`.

- `auto`: a `.gguf` file as GGUF, a directory as safetensors.
- `safetensors`: a directory's safetensors shards, read by a bounded pool of threads (one shard
  each, at most `MAX_READ_THREADS`) into a bounded queue: a few tensors wait at a time, never the
  whole model. Each tensor is memory-mapped and read whole (`get_tensor`); the parameter's
  `weight_loader` then copies only this tensor-parallel rank's slice of it. Over several ranks
  the tensors come as `CheckpointSlice`s instead: a loader's `narrow` reads only its range. On a
  CUDA device one rank reads the tensors straight to the device (`safetensors_direct`: pread
  into pinned chunks, copies on side streams, several threads per shard).
- `fastsafetensors`: the same shards through the `fastsafetensors` package (an optional extra),
  a shard at a time straight to the model's device; a clear error without the package.
- `gguf`: a `.gguf` file (what `auto` does for one).
- `dummy`: no checkpoint read; random weights (`loader.init_dummy_weights`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from atom_models.checkpoint_slice import CheckpointSlice
from atom_models.progress import progress_bar
from atom_models.weights import safetensors_files

LOAD_FORMATS = ("auto", "safetensors", "fastsafetensors", "gguf", "dummy")
MAX_READ_THREADS = 8
_FASTSAFETENSORS_MISSING = (
    "load_format 'fastsafetensors' needs the fastsafetensors package: pip install "
    "fastsafetensors (or pip install 'atom-models[fastsafetensors]')"
)


def direct_reads() -> str:
    """`ATOM_SAFETENSORS_DIRECT`: how one rank reading whole tensors on a CUDA device reads them:
    `1` (default; any value but the two below) file -> pinned memory -> device
    (`safetensors_direct`), `register` the device's DMA from the page cache registered in place
    (`safetensors_registered`), `0` through mmap'd CPU tensors as the CPU does (comparison)."""
    from atom_kernels import envs

    value = envs.get("ATOM_SAFETENSORS_DIRECT")
    return value if value in ("0", "register") else "1"


def check_load_format(load_format: str) -> None:
    """ValueError for a format that is not one of LOAD_FORMATS, or whose package is missing."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    if load_format == "fastsafetensors":
        try:
            import fastsafetensors  # noqa: F401
        except ImportError:
            raise ValueError(_FASTSAFETENSORS_MISSING) from None


def check_checkpoint(model: str | Path, load_format: str) -> None:
    """ValueError when the checkpoint at `model` cannot be read in `load_format`."""
    check_load_format(load_format)
    path = Path(model)
    if load_format == "gguf" and not path.is_file():
        raise ValueError(f"load_format 'gguf' reads a .gguf file; {path} is not a file")
    if load_format in ("safetensors", "fastsafetensors"):
        if not path.is_dir():
            raise ValueError(
                f"load_format {load_format!r} reads a checkpoint directory; {path} is not one "
                "(a .gguf file loads with load_format 'auto' or 'gguf')"
            )
        try:
            safetensors_files(path)
        except FileNotFoundError as e:
            raise ValueError(f"load_format {load_format!r}: {e}") from None


def iter_checkpoint(
    model: str | Path,
    load_format: str = "auto",
    *,
    device: torch.device | str = "cpu",
    show_progress: bool = False,
    slices: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The `(name, tensor)` pairs of the checkpoint at `model`, read in `load_format`.
    `slices` (a tensor-parallel rank): safetensors come as `CheckpointSlice`s, read by range."""
    check_checkpoint(model, load_format)
    path = Path(model)
    if load_format == "dummy":
        raise ValueError("load_format 'dummy' reads no checkpoint")
    if path.is_file():
        from atom_models.gguf_file import iter_gguf_weights

        return iter_gguf_weights(path)
    if load_format == "fastsafetensors":
        return iter_fastsafetensors(path, device, show_progress=show_progress)
    direct = direct_reads() if torch.device(device).type == "cuda" and not slices else "0"
    if direct == "register":
        from atom_models.safetensors_registered import iter_safetensors_registered

        return iter_safetensors_registered(path, device, show_progress=show_progress)
    if direct == "1":
        from atom_models.safetensors_direct import iter_safetensors_to_device

        return iter_safetensors_to_device(path, device, show_progress=show_progress)
    return iter_safetensors_parallel(path, show_progress=show_progress, slices=slices)


_DONE = object()  # a reader thread's shard is read


def iter_safetensors_parallel(
    model_dir: str | Path,
    *,
    max_threads: int = MAX_READ_THREADS,
    show_progress: bool = False,
    slices: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of every shard, read by min(max_threads, shards) threads; the order is the
    reads' (a shard's tensors in its order). The caller's consumption bounds the memory: at most
    3 tensors per thread are held (2 queued a thread, one being read). With `slices` the threads
    only open the shards and yield `CheckpointSlice`s: the loading thread reads each rank's range
    as it loads it."""
    from safetensors import safe_open

    files = safetensors_files(model_dir)
    num_threads = max(1, min(max_threads, len(files)))
    results: queue.Queue = queue.Queue(maxsize=2 * num_threads)
    stop = threading.Event()  # the consumer left: readers end

    def put(item) -> None:
        while not stop.is_set():
            try:
                results.put(item, timeout=0.1)
                return
            except queue.Full:
                pass

    def read_all(paths: list[Path]) -> None:
        for path in paths:
            if stop.is_set():
                return
            read(path)

    def read(path: Path) -> None:
        try:
            # Unclosed with `slices`: the file stays open while its slices live.
            f = safe_open(str(path), framework="pt")
            with contextlib.nullcontext() if slices else f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if stop.is_set():
                        return
                    put((name, CheckpointSlice(f, name) if slices else f.get_tensor(name)))
        except BaseException as e:  # handed to the consumer, raised there
            put(e)
        finally:
            put(_DONE)

    # Daemon threads (not an executor's): a reader blocked on a consumer that is gone never
    # keeps the process from exiting.
    readers = [
        threading.Thread(target=read_all, args=(files[i::num_threads],), daemon=True,
                         name=f"atom-safetensors-{i}")
        for i in range(num_threads)
    ]  # fmt: skip
    bar = progress_bar(
        desc="Loading safetensors checkpoint shards",
        total=len(files),
        enabled=show_progress,
        unit="shard",
    )
    try:
        for reader in readers:
            reader.start()
        done = 0
        while done < len(files):
            item = results.get()
            if item is _DONE:
                done += 1
                bar.update()
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        stop.set()
        for reader in readers:
            reader.join(timeout=1.0)
        bar.close()


def iter_fastsafetensors(
    model_dir: str | Path, device: torch.device | str, *, show_progress: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of every shard through fastsafetensors, one shard on `device` at a time
    (vLLM's fastsafetensors iterator, one rank's group). `nogds`: read with pread through a
    bounce buffer, which works on every machine (GPUDirect Storage is not assumed)."""
    try:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    except ImportError:
        raise ValueError(_FASTSAFETENSORS_MISSING) from None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    files = safetensors_files(model_dir)
    bar = progress_bar(
        files,
        desc="Loading safetensors using Fastsafetensor loader",
        enabled=show_progress,
        unit="shard",
    )
    for path in bar:
        loader = SafeTensorsFileLoader(SingleGroup(), str(device), nogds=True)
        try:
            loader.add_filenames({0: [str(path)]})
            buffer = loader.copy_files_to_device()
            try:
                for name in list(buffer.key_to_rank_lidx):
                    yield name, buffer.get_tensor(name)
            finally:
                buffer.close()
        finally:
            loader.close()
