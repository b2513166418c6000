"""`atom bench throughput | serve`: the argument parsers. `atom`'s CLI calls `add_parser`."""

from __future__ import annotations

import argparse

from atom_engine.bench.metrics import SERVE_METRICS
from atom_engine.cli.args import add_engine_args, engine_config_from_args


def _csv(kind):
    def parse(text: str) -> list:
        return [kind(item) for item in text.split(",") if item.strip()]

    return parse


def _metric_names(text: str) -> list[str]:
    names = _csv(str)(text)
    unknown = [n for n in names if n not in SERVE_METRICS]
    if unknown:
        choices = ",".join(SERVE_METRICS)
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {choices}")
    return names


def _add_throughput(subparsers) -> None:
    parser = subparsers.add_parser(
        "throughput",
        help="offline throughput of the engine (random token-id or ShareGPT prompts)",
        description="Offline generation throughput through LLM.generate. Every request ignores "
        "EOS, so output lengths are exact.",
    )
    add_engine_args(parser)
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--num-prompts", type=int, default=1000)
    bench.add_argument(
        "--input-len",
        type=int,
        default=1024,
        help="prompt tokens of random prompts (default: 1024)",
    )
    bench.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="output tokens (random default: 128; ShareGPT: caps the reply length)",
    )
    bench.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random lengths uniform in [L*(1-R), L*(1+R)] (default: 0)",
    )
    bench.add_argument(
        "--dataset-name",
        choices=("random", "sharegpt"),
        default=None,
        help="default: sharegpt with --dataset-path, else random",
    )
    bench.add_argument("--dataset-path", default=None, help="a ShareGPT-format JSON file")
    bench.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="prompts run once, untimed, before the benchmark (default: 0)",
    )
    bench.add_argument("--output-json", default=None, help="also write the results here")
    bench.add_argument("--disable-tqdm", action="store_true")
    parser.set_defaults(func=_run_throughput)


def _run_throughput(args: argparse.Namespace) -> int:
    from atom_engine.bench import throughput

    throughput.main(args, engine_config_from_args(args))
    return 0


def _add_serve(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, E2E latency)",
        description="Streams requests to a running OpenAI-compatible server (ATOM, vLLM, ...) "
        "and reports vLLM-style serving metrics.",
    )
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument(
        "--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions"
    )
    target.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    target.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    target.add_argument(
        "--tokenizer",
        default=None,
        help="for random prompts and token counts: a Hub ID, a local HF directory or .gguf "
        "file (default: the bundled SmolLM2 tokenizer)",
    )
    target.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the tokenizer's own code (auto_map), as transformers does",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=1000)
    load.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (default: inf, all at once)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps: 1 is Poisson, lower is burstier",
    )
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, ATOM)")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--skip-test-request",
        action="store_true",
        help="skip the single request sent first to check the setup",
    )
    load.add_argument("--seed", type=int, default=0)
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random")
    data.add_argument("--dataset-path", default=None)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="cap on ShareGPT output lengths"
    )
    report = parser.add_argument_group("report")
    report.add_argument(
        "--percentile-metrics",
        type=_metric_names,
        default=list(SERVE_METRICS),
        help="comma-separated, from ttft,tpot,itl,e2el (default: all)",
    )
    report.add_argument(
        "--metric-percentiles",
        type=_csv(float),
        default=[90.0, 99.0],
        help="comma-separated percentiles besides mean and median (default: 90,99)",
    )
    report.add_argument("--save-result", action="store_true")
    report.add_argument("--result-dir", default=None)
    report.add_argument("--result-filename", default=None)
    report.add_argument("--disable-tqdm", action="store_true")
    parser.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    import sys

    from atom_engine.bench import serve

    try:
        serve.main(args)
    except (RuntimeError, OSError) as e:  # the server is unreachable or refuses the setup
        print(f"atom bench serve: error: {e}", file=sys.stderr)
        return 1
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` (with `throughput` and `serve`) on the `atom` CLI's subparsers."""
    parser = subparsers.add_parser("bench", help="benchmark the engine or a running server")
    nested = parser.add_subparsers(
        dest="bench_command", metavar="{throughput,serve}", required=True
    )
    _add_throughput(nested)
    _add_serve(nested)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m atom_engine.bench.cli bench ...`: the same commands without the `atom` CLI."""
    parser = argparse.ArgumentParser(prog="atom")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
