"""The engine's configuration: user arguments, validated once, flowing down from here.

Every field is also an `atom serve` / `atom generate` flag (see `atom_engine.cli.args`); a field's
`help` metadata is its flag's documentation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from atom_engine import envs
from atom_engine.spec_config import SpeculativeConfig
from atom_models.checkpoint import check_load_format

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV-cache dtypes besides "auto" (the model's dtype); fp8 caches carry per-tensor scales.
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
CUDAGRAPH_MODES = ("full", "full_and_piecewise", "full_decode_only", "none")


def _help(text: str) -> dict:
    return {"help": text}


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value (`--speculative-config '{"method": "ngram", ...}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def split_host_port(addr: str) -> tuple[str, int]:
    """`HOST:PORT` (`[v6addr]:PORT` too) -> (host, port); ValueError naming dist_init_addr."""
    host, sep, port = addr.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"dist_init_addr must be HOST:PORT (PORT < 65535), got {addr!r}")
    return host, int(port)


@dataclass
class EngineConfig:
    model: str | None = field(
        default=None,
        # A Hub ID is downloaded to the HF cache or found there (`atom_engine.hub`).
        metadata=_help(
            "a Hub ID (org/name[/FILE.gguf]), a local directory or a .gguf file (default: the "
            "bundled SmolLM2)"
        ),
    )
    revision: str | None = field(
        default=None,
        metadata=_help("the Hub model's branch, tag or commit (default: its main branch)"),
    )
    download_dir: str | None = field(
        default=None,
        metadata=_help("Hub downloads go to this cache directory (default: the HF cache)"),
    )
    gguf_file: str | None = field(
        default=None,
        metadata=_help("the one .gguf file of the model's repo or directory to load"),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=_help("tokenizer directory or Hub ID (default: the model's own)"),
    )
    dtype: str = field(
        default="auto",
        metadata=_help("weights and activations; auto: float32 on the CPU, bfloat16 on a GPU"),
    )
    device: str = field(default="auto", metadata=_help("auto, cpu, cuda, cuda:N"))
    max_model_len: int | None = field(
        default=None,
        metadata=_help("longest prompt + completion in tokens (default: the model's context)"),
    )
    max_num_seqs: int = field(default=128, metadata=_help("most sequences in one step"))
    max_num_batched_tokens: int | None = field(
        default=None,
        # Decodes first, then chunked prefills. On the CPU it bounds how long a long prompt's
        # step delays the others (the NOTE in __post_init__).
        metadata=_help("token budget of one step (default: 2048 on a GPU, 512 on the CPU)"),
    )
    long_prefill_token_threshold: int | None = field(
        default=None,
        # So that new requests start beside a long prompt's chunks.
        metadata=_help(
            "most tokens one prefill takes per step while requests wait (0: no cap; default: the "
            "budget / 4)"
        ),
    )
    block_size: int = field(default=16, metadata=_help("tokens per KV-cache block"))
    enable_prefix_caching: bool = field(
        default=True, metadata=_help("reuse the KV cache of shared prompt prefixes")
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_help("fraction of GPU memory ATOM may use (weights, activations, KV cache)"),
    )
    cpu_kv_cache_space: float = field(
        default=1.0, metadata=_help("KV-cache size in GiB when running on the CPU")
    )
    num_kv_blocks: int | None = field(
        default=None, metadata=_help("override the number of KV-cache blocks")
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_help(
            "auto: the model's dtype; fp8, fp8_e4m3: float8_e4m3fn with the checkpoint's k/v "
            "scales (else 1.0)"
        ),
    )
    load_format: str = field(
        default="auto",
        # auto: a .gguf file as GGUF, a directory as safetensors; safetensors: the directory's
        # shards, read in parallel; fastsafetensors: through that package (pip install
        # fastsafetensors); gguf: a .gguf file; dummy: random weights (benchmarks).
        metadata=_help(
            "how to read the weights (auto: by the path; dummy: random, for benchmarks)"
        ),
    )
    show_progress: bool = field(
        default=True,
        metadata=_help("start-up progress bars on stderr (tensor-parallel rank 0)"),
    )
    skip_tokenizer_init: bool = field(
        default=False,
        metadata=_help("run without a tokenizer: prompts must be token ids, outputs have no text"),
    )
    num_threads: int | None = field(
        default=None,
        # Unset: per step, the cores the process may use (affinity and cgroup quota) for a
        # batched step, one fewer (left to the server) for a one-token step.
        metadata=_help(
            "CPU: torch's compute threads per rank (default: OMP_NUM_THREADS, else the usable "
            "cores)"
        ),
    )
    seed: int = field(default=0, metadata=_help("seed of the engine's random sampling"))
    enforce_eager: bool = field(
        default=False,
        metadata=_help("never capture CUDA graphs, never torch.compile the model on the CPU"),
    )
    cudagraph_mode: str = field(
        default="full",
        # full: a step of up to 8192 tokens and 512 sequences replays a whole-forward graph,
        # attention included (decode steps at their batch size, steps with a prefill padded to a
        # ladder of token counts; models with MLA attention, which reads the step's lengths on
        # the host, take full_and_piecewise's pieces for the latter). full_and_piecewise: steps
        # with a prefill replay the forward in pieces cut at the attention layers, which run
        # eagerly. full_decode_only: steps with a prefill run eagerly. none: as --enforce-eager.
        metadata=_help("which steps replay CUDA graphs, as vLLM names the modes"),
    )
    async_scheduling: bool | None = field(
        default=None,
        # Requests with log-probs or penalties run their steps without overlap.
        metadata=_help(
            "schedule step N+1 while the device runs step N (default: on for CUDA, off on the CPU)"
        ),
    )

    speculative_config: dict | None = field(
        default=None,
        metadata={
            # {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
            # "prompt_lookup_min": m} (prompt lookup, any model) or {"method": "mtp",
            # "num_speculative_tokens": k} (a DeepSeek-V3-family checkpoint's MTP layers). Drafts
            # are verified by rejection sampling: outputs follow the model's own distribution.
            "help": 'JSON, as vLLM spells it: {"method": "ngram" or "mtp", '
            '"num_speculative_tokens": k, ...}',
            "type": _json_object,
        },
    )

    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "ranks the model is split over, a process each (a GPU each; gloo on the CPU)",
            "aliases": ["-tp"],
        },
    )
    enable_expert_parallel: bool = field(
        default=False,
        # Attention and shared experts stay tensor-parallel.
        metadata=_help("MoE: whole experts per tensor-parallel rank, not a slice of every expert"),
    )
    data_parallel_size: int = field(
        default=1,
        metadata={
            "help": "engine replicas, each with its own ranks and KV cache, balanced by load",
            "aliases": ["-dp"],
        },
    )
    nnodes: int = field(
        default=1,
        # vLLM spells it --nnodes / -n too; its --master-addr / --master-port give dist_init_addr.
        metadata={
            "help": "nodes the tensor-parallel ranks span, tensor_parallel_size / nnodes on each "
            "(as SGLang's --nnodes)",
            "aliases": ["-n"],
        },
    )
    node_rank: int = field(
        default=0,
        metadata={
            "help": "this node: 0 serves HTTP and schedules, the others run their ranks only",
            "aliases": ["-r"],
        },
    )
    dist_init_addr: str | None = field(
        default=None,
        # A TCPStore on PORT; rank 0's steps to the other nodes on PORT+1 (atom_engine.nodes).
        metadata=_help("HOST:PORT of node 0, reachable from every node (needed with nnodes > 1)"),
    )
    dist_timeout: float | None = field(
        default=None,
        metadata=_help(
            "seconds the nodes wait for each other at start-up (default: "
            "$ATOM_TP_CONNECT_TIMEOUT, 300)"
        ),
    )
    trust_remote_code: bool = field(
        default=False,
        metadata=_help(
            "run the checkpoint's own config and tokenizer code (auto_map); only for checkpoints "
            "you trust"
        ),
    )

    def __post_init__(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if self.dtype not in ("auto", *DTYPES):
            fail("dtype", f"must be auto or one of {', '.join(DTYPES)}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                fail("device", "must be auto, cpu, cuda or cuda:N")
        if self.max_model_len is not None and self.max_model_len < 1:
            fail("max_model_len", "must be >= 1")
        if self.max_num_seqs < 1:
            fail("max_num_seqs", "must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            fail("num_threads", "must be >= 1")
        if self.max_num_batched_tokens is None:
            # NOTE: on this 2-core CPU (load ~3), while a 1,500-token prompt prefilled, 2048-token
            # steps stalled a decoding stream 28.7 s and a short request's first token 29.4 s;
            # 512-token steps with the long-prefill cap of 128: 1.2 s and 0.97 s, and the long
            # prompt itself finished sooner (15.2 s against 29.9 s). Medians of 2 alternating
            # rounds, benchmarks/hol_cpu.py -> benchmarks/results/hol-cpu.json.
            cpu = self.resolved_device().type == "cpu"
            self.max_num_batched_tokens = 512 if cpu else 2048
        if self.max_num_batched_tokens < 1:
            fail("max_num_batched_tokens", "must be >= 1")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            fail("long_prefill_token_threshold", "must be >= 0 (0: no cap)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            fail("block_size", "must be a power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            fail("gpu_memory_utilization", "must be in (0, 1]")
        if not self.cpu_kv_cache_space > 0:
            fail("cpu_kv_cache_space", "must be > 0 GiB")
        check_load_format(self.load_format)  # names the choices, or the missing package
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            fail("cudagraph_mode", f"must be one of {', '.join(CUDAGRAPH_MODES)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            fail("num_kv_blocks", "must be >= 1")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            fail("kv_cache_dtype", f"must be one of auto, {', '.join(KV_CACHE_DTYPES)}")
        if self.gguf_file is not None and not self.gguf_file.endswith(".gguf"):
            fail("gguf_file", "must name a .gguf file")
        if self.speculative_config is not None:
            if isinstance(self.speculative_config, SpeculativeConfig):
                self.speculative_config = self.speculative_config.to_dict()
            SpeculativeConfig.from_dict(self.speculative_config)  # names the bad field
        if self.tensor_parallel_size < 1:
            fail("tensor_parallel_size", "must be >= 1")
        if self.data_parallel_size < 1:
            fail("data_parallel_size", "must be >= 1")
        self._check_nodes(fail)

    def _check_nodes(self, fail) -> None:
        if self.nnodes < 1:
            fail("nnodes", "must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            fail("node_rank", f"must be in 0..{self.nnodes - 1} (nnodes {self.nnodes})")
        if self.dist_timeout is not None and not self.dist_timeout > 0:
            fail("dist_timeout", "must be > 0 seconds")
        if self.nnodes == 1:
            return
        if self.data_parallel_size > 1:  # whole replicas on each node, their ranks on it
            if self.data_parallel_size % self.nnodes:
                raise ValueError(
                    f"data_parallel_size {self.data_parallel_size} does not split over nnodes "
                    f"{self.nnodes}: every node runs data_parallel_size / nnodes replicas"
                )
        elif self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} does not split over nnodes "
                f"{self.nnodes}: every node runs tensor_parallel_size / nnodes ranks"
            )
        if self.dist_init_addr is None:
            raise ValueError(
                f"nnodes {self.nnodes} needs dist_init_addr (--dist-init-addr HOST:PORT, or "
                "--master-addr / --master-port): node 0's address, the same on every node"
            )
        split_host_port(self.dist_init_addr)  # raises naming the field

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks of one engine on one node (all of them with data parallelism:
        each replica stays on its node)."""
        if self.data_parallel_size > 1:
            return self.tensor_parallel_size
        return self.tensor_parallel_size // self.nnodes

    def replicas_per_node(self) -> int:
        return max(1, self.data_parallel_size // self.nnodes)

    def resolved_dist_timeout(self) -> float:
        return self.dist_timeout or envs.ATOM_TP_CONNECT_TIMEOUT

    def resolved_speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def resolved_long_prefill_token_threshold(self) -> int:
        if self.long_prefill_token_threshold is None:
            return max(1, self.max_num_batched_tokens // 4)
        return self.long_prefill_token_threshold

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_kv_cache_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype) or self.resolved_dtype()

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.float32 if self.resolved_device().type == "cpu" else torch.bfloat16
