"""Engine flags generated from `EngineConfig`: one `--flag` per field, documented by its `help`.

`int | None` fields take an int, `bool` fields get `--x / --no-x`, and the default shown is the
dataclass default, so a new config field becomes a flag of every engine command by itself. `--help`
groups them as `vllm serve --help` groups the same flags (`FLAG_GROUPS`); a field in no group
lands in the last one, "engine".
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from atom_engine.config import CUDAGRAPH_MODES, DTYPES, KV_CACHE_DTYPES, EngineConfig
from atom_models.checkpoint import LOAD_FORMATS

# (title, description, fields) of `--help`'s groups: vLLM's ModelConfig, LoadConfig, CacheConfig,
# SchedulerConfig, CompilationConfig, ParallelConfig and SpeculativeConfig, in its order.
FLAG_GROUPS = (
    ("model", "the checkpoint, its tokenizer and numerics", (
        "model", "revision", "gguf_file", "tokenizer", "trust_remote_code",
        "skip_tokenizer_init", "dtype", "max_model_len", "seed")),
    ("load", "how the weights are read", ("load_format", "download_dir", "show_progress")),
    ("device", "where the model runs", ("device", "num_threads")),
    ("cache", "the paged KV cache", (
        "block_size", "enable_prefix_caching", "gpu_memory_utilization", "cpu_kv_cache_space",
        "num_kv_blocks", "kv_cache_dtype")),
    ("scheduler", "what one engine step takes", (
        "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
        "async_scheduling")),
    ("compilation", "CUDA graphs and torch.compile", ("enforce_eager", "cudagraph_mode")),
    ("parallel", "tensor, expert and data parallelism, on one node or several", (
        "tensor_parallel_size", "data_parallel_size", "enable_expert_parallel", "nnodes",
        "node_rank", "dist_init_addr", "dist_timeout")),
    ("speculative decoding", None, ("speculative_config",)),
)  # fmt: skip
# Fields whose values are a fixed set: `--help` lists them as vLLM's does ({auto,float32,...}).
CHOICES = {
    "dtype": ("auto", *DTYPES),
    "kv_cache_dtype": ("auto", *KV_CACHE_DTYPES),
    "load_format": LOAD_FORMATS,
    "cudagraph_mode": CUDAGRAPH_MODES,
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(annotation) -> type:
    """`int | None` -> int, `str` -> str (the type argparse converts the flag's value with)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"EngineConfig fields must be one type or None, got {annotation}")
        annotation = args[0]
    return annotation


def _parser(parse):
    """A field's own parser as an argparse type: its ValueError message becomes the error."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def on_off(value: bool) -> str:
    return "on" if value else "off"


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every `EngineConfig` field as a flag to `parser`, in `FLAG_GROUPS`' groups."""
    groups = {}
    for title, about, names in FLAG_GROUPS:
        group = parser.add_argument_group(title, about)
        groups.update(dict.fromkeys(names, group))
    other = None  # "engine": fields no group names
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        group = groups.get(field.name)
        if group is None:
            other = other or parser.add_argument_group("engine", "other EngineConfig fields")
            group = other
        kind = _scalar_type(hints[field.name])
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        help_text = field.metadata.get("help", "")
        names = [_flag(field.name), *field.metadata.get("aliases", ())]  # -tp, -dp as in vLLM
        if kind is bool:
            group.add_argument(
                *names,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text if default is None else f"{help_text} (default: {on_off(default)})",
            )
        else:
            shown = "" if default is None else " (default: %(default)s)"
            choices = CHOICES.get(field.name)
            group.add_argument(
                *names,
                type=_parser(field.metadata["type"]) if "type" in field.metadata else kind,
                default=default,
                dest=field.name,
                choices=choices,
                metavar=None if choices else field.name.upper(),
                help=help_text + shown,
            )
    _add_master_addr(groups["nnodes"])
    return parser


def _add_master_addr(group) -> None:
    """vLLM's spelling of node 0's address: --master-addr and --master-port (its defaults
    127.0.0.1 and 29501), folded into dist_init_addr."""
    group.add_argument(
        "--master-addr",
        default=None,
        help="node 0's address, as vLLM spells it (with --master-port: --dist-init-addr)",
    )
    group.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="node 0's rendezvous port, as vLLM spells it (default with --master-addr: 29501)",
    )


def _dist_init_addr(args: argparse.Namespace) -> str | None:
    addr, port = getattr(args, "master_addr", None), getattr(args, "master_port", None)
    if addr is None and port is None:
        return args.dist_init_addr
    if args.dist_init_addr is not None:
        raise ValueError("give --dist-init-addr or --master-addr / --master-port, not both")
    host = addr or "127.0.0.1"
    return f"[{host}]:{port or 29501}" if ":" in host else f"{host}:{port or 29501}"


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed flags (raises ValueError for invalid values)."""
    values = {name: getattr(args, name) for name in EngineConfig.field_names()}
    values["dist_init_addr"] = _dist_init_addr(args)
    return EngineConfig(**values)
