"""`atom generate "prompt"` and `atom chat`: the engine in a terminal, text printed as it comes."""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import TextIO

from atom_engine.chat_template import apply_chat_template
from atom_engine.cli.args import engine_config_from_args
from atom_engine.engine import LLMEngine
from atom_engine.sampling_params import SamplingParams

_ids = itertools.count()


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help="most tokens to generate (default: %(default)s)",
    )
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)"
    )
    group.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    group.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
    )


def stream_generate(
    engine: LLMEngine, prompt: str | list[int], params: SamplingParams, out: TextIO
) -> str:
    """Run one request to the end, writing its text to `out` as it grows; returns the text.

    Ctrl-C stops the request (its blocks are freed) and keeps what was generated.
    """
    request_id = f"cli-{next(_ids)}"
    engine.add_request(request_id, prompt, params)
    text = ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                new = output.outputs[0].text
                out.write(new[len(text) :])
                out.flush()
                text = new
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    return text


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    engine = LLMEngine(engine_config_from_args(args))
    try:
        prompt: str | list[int] = args.prompt
        if args.chat:
            messages = [{"role": "user", "content": args.prompt}]
            prompt = apply_chat_template(engine.tokenizer, messages)
        stream_generate(engine, prompt, params, sys.stdout)
        sys.stdout.write("\n")
    finally:
        engine.shutdown()
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """Read user turns from stdin until EOF or /exit; /reset clears the conversation."""
    params = sampling_params_from_args(args)
    engine = LLMEngine(engine_config_from_args(args))
    try:
        return _chat(engine, args, params)
    finally:
        engine.shutdown()


def _chat(engine: LLMEngine, args: argparse.Namespace, params: SamplingParams) -> int:
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        print("atom chat: /exit to quit, /reset to start over", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            break
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = list(system)
            continue
        history.append({"role": "user", "content": line})
        try:
            prompt = apply_chat_template(engine.tokenizer, history)
            reply = stream_generate(engine, prompt, params, sys.stdout)
        except ValueError as e:  # the conversation no longer fits, ...
            history.pop()
            print(f"atom chat: {e} (/reset starts over)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": reply})
    return 0
