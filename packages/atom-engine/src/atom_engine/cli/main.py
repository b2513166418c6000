"""`atom`: serve | generate | chat | convert (| bench, registered by `atom_engine.bench.cli`)."""

from __future__ import annotations

import argparse
import logging
import sys

from atom_engine import envs
from atom_engine.cli.args import add_engine_args

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _serve(args: argparse.Namespace) -> int:
    from atom_engine.server.api_server import run_server

    if args.model_tag is not None:  # `atom serve MODEL`, as `vllm serve MODEL`
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(
                f"the model is named twice: {args.model_tag!r} and --model {args.model!r}"
            )
        args.model = args.model_tag
    return run_server(args)


def _generate(args: argparse.Namespace) -> int:
    from atom_engine.cli.generate import run_generate

    return run_generate(args)


def _chat(args: argparse.Namespace) -> int:
    from atom_engine.cli.generate import run_chat

    return run_chat(args)


def _add_serve(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /start_profile, /stop_profile.",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as --model takes it: a Hub ID (org/name) or a local path",
    )
    # vLLM's "Frontend" group: the server's own flags, before the engine's.
    frontend = serve.add_argument_group("frontend", "the OpenAI-compatible HTTP server")
    frontend.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: --model, or the file's stem)",
    )
    frontend.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; 0.0.0.0 for every interface (default: %(default)s)",
    )
    frontend.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default: %(default)s)"
    )
    frontend.add_argument(
        "--api-key",
        default=envs.ATOM_API_KEY,
        help="require `Authorization: Bearer KEY` on /v1/* (default: $ATOM_API_KEY)",
    )
    frontend.add_argument(
        "--uvicorn-log-level",
        choices=UVICORN_LOG_LEVELS,
        default="info",
        help="uvicorn's log level (default: %(default)s)",
    )
    frontend.add_argument(
        "--profiler-dir",
        default=None,
        help="enables /start_profile and /stop_profile, writing torch.profiler traces here "
        "(default: $ATOM_TORCH_PROFILER_DIR)",
    )
    frontend.add_argument(
        "--drain-timeout",
        type=float,
        default=5.0,
        help="on SIGTERM / SIGINT, seconds requests in flight may take to finish "
        "(default: %(default)s)",
    )
    frontend.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=16 << 20,
        help="larger request bodies get a 413 unread (default: %(default)s, 16 MiB)",
    )
    frontend.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,  # responses_api.store.DEFAULT_STORE_SIZE
        help="how many /v1/responses responses the server keeps (most recently used) for "
        "previous_response_id and GET /v1/responses/{id}; 0 keeps none (default: %(default)s)",
    )
    # The parsers' names, without importing the server (the CLI starts fast).
    frontend.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "deepseek_v3"),
        default=None,
        # "required" and named tools need no parser.
        help='the model\'s tool-call format, parsed from its text for tool_choice "auto"',
    )
    frontend.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted as vLLM's (--tool-call-parser enables auto tool choice)",
    )
    frontend.add_argument(
        "--reasoning-parser",
        choices=("deepseek_r1", "qwen3"),
        default=None,
        help="split the model's <think>...</think> into reasoning_content (chat completions)",
    )
    frontend.add_argument(
        "--headless",
        action="store_true",
        help="accepted as vLLM's: a node of --node-rank > 0 never serves HTTP (node 0 refuses it)",
    )
    add_engine_args(serve)
    serve.set_defaults(func=_serve)


def _add_generate_and_chat(subparsers) -> None:
    from atom_engine.cli.generate import add_sampling_args

    generate = subparsers.add_parser(
        "generate",
        help="complete one prompt and print it",
        description="Generate a completion of PROMPT, printed as it is generated.",
    )
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the chat template",
    )
    add_sampling_args(generate, max_tokens=64)
    add_engine_args(generate)
    generate.set_defaults(func=_generate)

    chat = subparsers.add_parser(
        "chat",
        help="interactive chat in the terminal",
        description="Chat with the model: one user turn per line on stdin; /exit (or EOF) quits, "
        "/reset starts over. Replies stream as they are generated.",
    )
    chat.add_argument("--system", default=None, help="a system message")
    add_sampling_args(chat, max_tokens=512)
    add_engine_args(chat)
    chat.set_defaults(func=_chat)


def _add_convert(subparsers) -> None:
    # Parsed by atom_models.convert itself (see `main`); registered here to appear in --help.
    subparsers.add_parser(
        "convert",
        add_help=False,
        help="convert a GGUF file into a Hugging Face checkpoint directory "
        "(atom convert MODEL.gguf OUT_DIR [--dtype D] [--max-shard-size S])",
    )


def _add_bench(subparsers) -> None:
    """`atom bench`, when `atom_engine.bench.cli` exists: it registers itself with add_parser."""
    try:
        from atom_engine.bench import cli as bench_cli
    except ModuleNotFoundError as e:
        if e.name in ("atom_engine.bench", "atom_engine.bench.cli"):
            return  # not installed
        print(f"atom: `atom bench` is unavailable: {e}", file=sys.stderr)
        return
    except Exception as e:  # a broken bench module must not break `atom serve`
        print(f"atom: `atom bench` is unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return
    bench_cli.add_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    from atom_engine import __version__

    parser = argparse.ArgumentParser(prog="atom", description="ATOM: an LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"atom {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_serve(subparsers)
    _add_generate_and_chat(subparsers)
    _add_convert(subparsers)
    _add_bench(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["convert"]:
        from atom_models.convert import main as convert_main

        return convert_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.INFO if args.command == "serve" else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except ValueError as e:  # invalid flags (EngineConfig, SamplingParams), a missing model
        print(f"atom {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from atom_engine.nodes import NodeError

        if not isinstance(e, NodeError):
            raise
        # Over several nodes: one did not arrive, was refused, or went away.
        print(f"atom {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
