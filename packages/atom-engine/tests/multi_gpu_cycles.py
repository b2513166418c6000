"""Run by test_multi_gpu.py in a process of its own: build a multi-rank engine, generate, drop it;
twice (first `shutdown()`, then only `del` and `gc.collect()`), under a faulthandler watchdog that
dumps every thread's stack and exits 1 if the whole run hangs.

    python multi_gpu_cycles.py '{"model": DIR, "prompts": [[ids]], "max_tokens": N,
                                 "watchdog_s": S, "engine": {LLM keyword arguments}}'

Prints one JSON line (`{"cycles": ...}`): per cycle the greedy tokens, the worker processes seen
while the engine lived and those left 30 s after it was dropped, and (CUDA) the bytes torch had
allocated once the engine was built and once it was dropped. Public API only (`LLM`).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
import time


def children() -> list[int]:
    """This process's live spawned children: its engines' workers."""
    from atom_engine.testing import workers_of

    return workers_of(os.getpid())


def main() -> None:
    spec = json.loads(sys.argv[1])
    faulthandler.dump_traceback_later(spec["watchdog_s"], exit=True)
    import torch

    from atom_engine import LLM, SamplingParams

    cuda = spec["engine"]["device"] == "cuda"
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    ins = [{"prompt_token_ids": p} for p in spec["prompts"]]
    cycles = []
    for how in ("shutdown", "del"):
        llm = LLM(spec["model"], **spec["engine"])
        workers = children()
        tokens = [o.outputs[0].token_ids for o in llm.generate(ins, params, use_tqdm=False)]
        allocated_built = torch.cuda.memory_allocated() if cuda else 0
        if how == "shutdown":
            llm.shutdown()
        del llm
        gc.collect()
        deadline = time.monotonic() + 30
        while (left := [p for p in workers if p in children()]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if cuda:
            torch.cuda.synchronize()
        cycles.append(
            dict(
                how=how,
                tokens=tokens,
                workers=workers,
                workers_left=left,
                allocated_built=allocated_built,
                allocated_dropped=torch.cuda.memory_allocated() if cuda else 0,
            )
        )
        print(f"cycle {how}: {cycles[-1] | {'tokens': '...'}}", flush=True)
    faulthandler.cancel_dump_traceback_later()
    # The process must also exit: the watchdog is re-armed for interpreter shutdown.
    faulthandler.dump_traceback_later(spec["watchdog_s"] / 5, exit=True)
    print(json.dumps(dict(cycles=cycles)), flush=True)


if __name__ == "__main__":
    main()
