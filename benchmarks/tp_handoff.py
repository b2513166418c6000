"""Per-step cost of the tensor-parallel hand-off on the CPU: rank 0 packs a step's `StepInputs` and
writes it to a worker's pipe; the worker reads and unpacks it. No model runs: this is what the
hand-off adds to a step, at decode batch 1 and 64 (and a 512-token prefill chunk for scale).

    python benchmarks/tp_handoff.py [--steps 2000] [--out benchmarks/results/tp-handoff-cpu.json]

Reported per step, medians over rounds of `--steps` steps:
- rank0_us: rank 0's own time (pack + write to one worker's pipe): added to every step;
- delivered_us: from rank 0 starting the pack to the worker holding unpacked inputs (measured as
  a round trip with a one-byte reply, minus half of a bare one-byte round trip): how far behind
  rank 0 the worker starts its forward.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from atom_engine.step_inputs import OP_LAUNCH, StepInputs

BLOCK_SIZE = 16


def decode_inputs(batch: int, context: int) -> StepInputs:
    blocks = -(-context // BLOCK_SIZE)
    return StepInputs(
        ids=list(range(batch)),
        seq_lens=[context] * batch,
        query_lens=[1] * batch,
        tables=[list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)],
        gathers=[(i, i) for i in range(batch)],  # async: every input id comes from the device
        sample_rows=list(range(batch)),
        prompt_rows=[],
    )


def prefill_inputs(tokens: int) -> StepInputs:
    blocks = -(-tokens // BLOCK_SIZE)
    return StepInputs(
        ids=list(range(tokens)),
        seq_lens=[tokens],
        query_lens=[tokens],
        tables=[list(range(blocks))],
        gathers=[],
        sample_rows=[tokens - 1],
        prompt_rows=[],
    )


def follower(steps, replies) -> None:
    while True:
        data = steps.recv_bytes()
        if data == b"x":
            return
        if data != b"p":
            StepInputs.unpack(data)
        replies.send_bytes(b"k")


def measure(inputs: StepInputs, steps: int, send, recv) -> dict:
    """One step at a time (as the engine hands them off): rank 0's pack + write, and the round
    trip to a worker that unpacked it."""
    rank0 = round_trip = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        send(inputs.pack(OP_LAUNCH))
        t1 = time.perf_counter()
        recv()
        t2 = time.perf_counter()
        rank0 += t1 - t0
        round_trip += t2 - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        send(b"p")
        recv()
    bare = (time.perf_counter() - t0) / steps
    return {
        "rank0_us": rank0 / steps * 1e6,
        "delivered_us": (round_trip / steps - bare / 2) * 1e6,
        "bare_round_trip_us": bare * 1e6,
        "bytes": len(inputs.pack(OP_LAUNCH)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    steps_r, steps_w = ctx.Pipe(duplex=False)
    replies_r, replies_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=follower, args=(steps_r, replies_w), daemon=True)
    proc.start()
    cases = {
        "decode batch 1, 2048-token context": decode_inputs(1, 2048),
        "decode batch 64, 1024-token contexts": decode_inputs(64, 1024),
        "prefill chunk of 512 tokens": prefill_inputs(512),
    }
    results = {}
    try:
        for name, inputs in cases.items():
            rounds = [
                measure(inputs, args.steps, steps_w.send_bytes, replies_r.recv_bytes)
                for _ in range(args.rounds)
            ]
            results[name] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
            print(
                f"{name:40s} rank 0 {results[name]['rank0_us']:7.1f} us/step, "
                f"delivered {results[name]['delivered_us']:7.1f} us/step, "
                f"{results[name]['bytes']} bytes"
            )
    finally:
        steps_w.send_bytes(b"x")
        proc.join(5)
    if args.out:
        record = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.processor() or platform.machine()}, {mp.cpu_count()} cores",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "load_average_1min": os.getloadavg()[0],  # other processes on the machine
            "steps": args.steps,
            "rounds": args.rounds,
            "results": results,
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
