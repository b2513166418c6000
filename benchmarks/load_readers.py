"""The direct reader's sizes timed alone and the page cache's own rates (load_bench.py's
`--reader-sweep` and `--register-probe`, issue 41 item 3)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

CHUNK = 64 << 20


def raw_read_gbps(path: Path) -> float:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total, start = 0, time.perf_counter()
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    return total / (time.perf_counter() - start) / 1e9


DEFAULT_READER = "8:16:2"  # safetensors_direct's READ_THREADS : CHUNK_BYTES MiB : RING_CHUNKS
# Session 22's first sweep (8:16:2 ... 16:64:4, results/load/) found bigger rings slower in a fresh
# process (pinning them costs more than they gain); this one tries smaller chunks, whose bytes may
# still be in the CPU's cache when the GPU reads them.
SWEEP = ["8:16:2", "8:4:2", "8:4:4", "8:2:4", "4:16:2", "12:8:2", "16:4:2", "8:1:8"]


def set_reader(spec: str) -> None:
    """Set the direct reader's sizes from `threads:chunk MiB:ring chunks`."""
    from atom_models import safetensors_direct as direct

    threads, chunk_mib, ring = (int(v) for v in spec.split(":"))
    direct.READ_THREADS, direct.CHUNK_BYTES, direct.RING_CHUNKS = threads, chunk_mib << 20, ring


def reader_alone_s(path: Path, spec: str) -> float:
    """Seconds for the direct reader to bring every tensor of the checkpoint to the device."""
    from atom_models.safetensors_direct import iter_safetensors_to_device

    set_reader(spec)
    torch.cuda.synchronize()
    torch._C._host_emptyCache()  # pinned chunks allocated afresh, as in a new process
    start = time.perf_counter()
    for _name, tensor in iter_safetensors_to_device(path, "cuda"):
        del tensor
    torch.cuda.synchronize()
    return time.perf_counter() - start


def parallel_read_gbps(path: Path, threads: int, chunk: int = 16 << 20) -> float:
    """The page cache's rate read by `threads` threads (`preadv` of `chunk`s, files split in
    contiguous ranges), no GPU."""
    from concurrent.futures import ThreadPoolExecutor

    files = sorted(path.glob("*.safetensors"))
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    jobs, share = [], -(-total // threads)
    for f, size in zip(files, sizes, strict=True):
        for begin in range(0, size, share):
            jobs.append((f, begin, min(size, begin + share)))

    def read(job) -> int:
        f, begin, end = job
        view = memoryview(bytearray(chunk))
        fd, done = os.open(f, os.O_RDONLY), 0
        try:
            while begin + done < end:
                got = os.preadv(fd, [view[: min(chunk, end - begin - done)]], begin + done)
                if got <= 0:
                    break
                done += got
        finally:
            os.close(fd)
        return done

    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        read_bytes = sum(pool.map(read, jobs))
        seconds = time.perf_counter() - start
    return read_bytes / seconds / 1e9


def register_probe(path: Path) -> dict:
    """Can the GPU read the page cache itself (no CPU copy)? One warm shard mmap'd and registered
    with `cudaHostRegister` (read-only flag on a read-only mapping; then, if refused, the default
    flag on a private one), then copied to the GPU: seconds to register and to unregister, the
    copy's GB/s, and the device attributes that decide it."""
    import mmap

    import numpy as np

    shard = sorted(path.glob("*.safetensors"))[0]
    raw_read_gbps(path)  # into the page cache
    out: dict = {"shard_bytes": shard.stat().st_size}
    try:
        from cuda.bindings import runtime

        attr = runtime.cudaDeviceAttr
        for name in ("HostRegisterSupported", "HostRegisterReadOnlySupported",
                     "PageableMemoryAccessUsesHostPageTables"):  # fmt: skip
            err, value = runtime.cudaDeviceGetAttribute(getattr(attr, f"cudaDevAttr{name}"), 0)
            out[name] = int(value) if int(err) == 0 else f"error {int(err)}"
    except Exception as e:  # cuda-bindings missing: the attributes stay unknown
        out["attributes_error"] = f"{type(e).__name__}: {e}"
    cudart = torch.cuda.cudart()
    ways = (("read_only", mmap.ACCESS_READ, 8), ("private", mmap.ACCESS_COPY, 0))  # 8: read-only
    for label, access, flags in ways:
        with open(shard, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=access)
        host = np.frombuffer(mm, dtype=np.uint8)
        start = time.perf_counter()
        err = cudart.cudaHostRegister(host.ctypes.data, host.nbytes, flags)
        entry: dict = {"register_error": int(err), "register_s": time.perf_counter() - start}
        if int(err) == 0:
            src = torch.from_numpy(host)
            dst = torch.empty(host.nbytes, dtype=torch.uint8, device="cuda")
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            entry["copy_gbps"] = host.nbytes / best / 1e9
            entry["register_and_copy_gbps"] = host.nbytes / (best + entry["register_s"]) / 1e9
            start = time.perf_counter()
            cudart.cudaHostUnregister(host.ctypes.data)
            entry["unregister_s"] = time.perf_counter() - start
            del src, dst
        del host
        mm.close()
        out[label] = entry
        print(f"register {label}: {entry}", flush=True)
        if int(err) == 0:
            break
    out["chunked"] = [
        chunked_register(path, threads, chunk, populate)
        for threads, chunk, populate in ((1, 256 << 20, False), (4, 256 << 20, False),
                                         (8, 256 << 20, False), (16, 128 << 20, False),
                                         (8, 256 << 20, True), (16, 128 << 20, True))
    ]  # fmt: skip
    return out


def chunked_register(path: Path, threads: int, chunk: int = 256 << 20, populate: bool = False):
    """Every shard of the warm checkpoint to the GPU by DMA from the page cache itself: its
    mapping registered (read-only) in ``chunk``s by ``threads`` threads, each chunk copied as
    soon as it is registered (one stream), registrations unregistered after the copies. With
    ``populate`` each thread first faults its chunk's pages in (MADV_POPULATE_READ), so
    registering only pins them. Returns GB/s of the whole (registration + copy, the pipeline a
    loader would run) and of the registrations alone, and the unregister seconds."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor, as_completed

    import numpy as np

    cudart = torch.cuda.cudart()
    maps, jobs = [], []
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        host = np.frombuffer(mm, dtype=np.uint8)
        maps.append((mm, host))
        jobs += [(host, off, min(chunk, host.nbytes - off)) for off in range(0, host.nbytes, chunk)]
    total = sum(n for _, _, n in jobs)
    dst = torch.empty(max(n for _, _, n in jobs), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    populate_flag = getattr(mmap, "MADV_POPULATE_READ", 22)

    def register(job):
        host, off, n = job
        ptr = host.ctypes.data + off
        if populate:
            mm = next(m for m, h in maps if h is host)
            mm.madvise(populate_flag, off, n)
        err = cudart.cudaHostRegister(ptr, n, 8)  # cudaHostRegisterReadOnly
        return job, int(err), time.perf_counter()

    torch.cuda.synchronize()
    start = time.perf_counter()
    registered, errors, last_registered = [], set(), start
    with ThreadPoolExecutor(threads) as pool:
        for fut in as_completed([pool.submit(register, job) for job in jobs]):
            (host, off, n), err, at = fut.result()
            last_registered = max(last_registered, at)
            if err:
                errors.add(err)
                continue
            registered.append(host.ctypes.data + off)
            src = torch.from_numpy(host[off : off + n])
            with torch.cuda.stream(stream):
                dst[:n].copy_(src, non_blocking=True)
    stream.synchronize()
    seconds = time.perf_counter() - start
    t0 = time.perf_counter()
    for ptr in registered:
        cudart.cudaHostUnregister(ptr)
    out = {
        "threads": threads, "chunk_mib": chunk >> 20, "populate": populate,
        "gbps": total / seconds / 1e9, "register_gbps": total / (last_registered - start) / 1e9,
        "unregister_s": time.perf_counter() - t0, "errors": sorted(errors),
    }  # fmt: skip
    del dst
    jobs.clear()
    maps.clear()  # the mappings close when their arrays' last references go
    print("chunked register", out, flush=True)
    return out


def reader_sweep(path: Path, size: int) -> dict:
    raw_read_gbps(path)  # into the page cache
    out: dict = {"reader_gbps": {}, "page_cache_threads_gbps": {}}
    best: dict[str, float] = {}
    for _round in range(2):
        for spec in SWEEP:
            seconds = reader_alone_s(path, spec)
            best[spec] = min(best.get(spec, float("inf")), seconds)
            print(f"reader {spec}: {size / seconds / 1e9:.1f} GB/s", flush=True)
    out["reader_gbps"] = {spec: size / s / 1e9 for spec, s in best.items()}
    for threads in (1, 4, 8, 16):
        out["page_cache_threads_gbps"][threads] = max(
            parallel_read_gbps(path, threads) for _ in range(2)
        )
    out["fastest"] = max(out["reader_gbps"], key=out["reader_gbps"].get)
    set_reader(DEFAULT_READER)
    print("sweep", json.dumps(out), flush=True)
    return out
