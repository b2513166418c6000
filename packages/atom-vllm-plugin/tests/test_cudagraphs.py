"""CUDA graphs with ATOM active, decided by vLLM's own objects: the default cudagraph mode survives.

A fresh interpreter makes ATOM's CUDA platform vLLM's current platform (vLLM's CPU build cannot
import its CUDA platform module for one missing extension, stubbed here; the modules that would
load CUDA-only extensions under a CUDA platform are imported first, on the CPU platform), builds
the default `VllmConfig` for SmolLM2 from `EngineArgs` as `vllm serve` would on an H100, builds
ATOM's model from it (on the CPU, the only device here), and resolves the cudagraph mode the way
vLLM's GPU model runners do: the least `get_cudagraph_support` over the model's attention layers'
backends, then `CompilationConfig.resolve_cudagraph_mode_and_sizes`, told whether the model has a
compiled submodule (vLLM's `has_compiled_submodule`, what the V2 runner passes as
`piecewise_capture_available`).

The same resolution with what ATOM declared before (NEVER, an uncompiled model) gives NONE: every
decode step would have run eagerly.
"""

from __future__ import annotations

import pytest
import torch

CHILD = r"""
import copy, json, os, sys, tempfile, types

sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
import torch
import vllm.platforms as platforms
# Imported while the platform is still vLLM's CPU one: under a CUDA platform these modules import
# flash-attention and CUDA fusion passes at import time.
import vllm.compilation.backends, vllm.compilation.wrapper  # noqa: E401
import vllm.model_executor.layers.attention, vllm.model_executor.model_loader  # noqa: E401
from vllm.v1.worker.gpu.cudagraph_utils import has_compiled_submodule

import atom_vllm_plugin.model
from atom_vllm_plugin.platforms.cuda import AtomCudaPlatform
from vllm.platforms.interface import DeviceCapability

H100 = DeviceCapability(9, 0)
AtomCudaPlatform.get_device_capability = classmethod(lambda cls, device_id=0: H100)
platforms._current_platform = AtomCudaPlatform()

from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionCGSupport

cfg = EngineArgs(model=MODEL, dtype="bfloat16", max_model_len=512).create_engine_config()
cc = cfg.compilation_config
out = {
    "platform": type(platforms.current_platform).__name__,
    "device": str(cfg.device_config.device),
    "mode": cc.mode.name if hasattr(cc.mode, "name") else str(cc.mode),
    "default": cc.cudagraph_mode.name,
    "splits_attention": cc.splitting_ops_contain_attention(),
}

with set_current_vllm_config(cfg):
    init_distributed_environment(1, 0, "file://" + tempfile.mktemp(), 0, "gloo")
    initialize_model_parallel(1, 1)
cfg.device_config.device = torch.device("cpu")  # the model's tensors live on this CPU
with set_current_vllm_config(cfg), torch.device("cpu"):
    model = atom_vllm_plugin.model.AtomForCausalLM(vllm_config=cfg, prefix="")
cfg.device_config.device = torch.device("cuda")
layers = [m for m in model.modules() if isinstance(m, Attention)]
out["model"] = type(model.model).__module__ + "." + type(model.model).__qualname__
out["compiled"] = has_compiled_submodule(model)


def min_support():
    # GPUModelRunner._check_and_update_cudagraph_mode / attn_utils: the least support wins.
    least, name = AttentionCGSupport.ALWAYS, None
    for layer in layers:
        backend = layer.get_attn_backend()
        support = backend.get_builder_cls().get_cudagraph_support(
            cfg, layer.get_kv_cache_spec(cfg)
        )
        if support.value < least.value:
            least, name = support, backend.__name__
    return least, name, sorted({layer.get_attn_backend().__name__ for layer in layers})


def resolve(support, name, compiled, v2=True):
    fresh = copy.deepcopy(cc)
    return fresh.resolve_cudagraph_mode_and_sizes(
        support, name, 1, use_v2_model_runner=v2, piecewise_capture_available=compiled
    ).name


support, name, backends = min_support()
out["backends"] = backends
out["support"] = support.name
out["atom_v2"] = resolve(support, name, out["compiled"])
out["atom_v1"] = resolve(support, name, out["compiled"], v2=False)
never = AttentionCGSupport.NEVER
out["before"] = resolve(never, "AtomAttentionBackend", False)
out["uncompiled"] = resolve(support, name, False)
out["never_compiled"] = resolve(never, "AtomAttentionBackend", True)

# atom_kernels' torch reference (reads the batch on the host) must not be captured.
import atom_kernels.registry

os.environ["ATOM_KERNEL_BACKEND"] = "torch"
atom_kernels.registry._reset_for_tests()
support, name, _ = min_support()
out["torch_support"] = support.name
out["torch_resolved"] = resolve(support, name, out["compiled"])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def resolved(run_python, smollm2_dir) -> dict:
    return run_python(f"MODEL = {str(smollm2_dir)!r}\n" + CHILD)


def test_config_is_vllms_default_for_an_h100(resolved) -> None:
    assert resolved["platform"] == "AtomCudaPlatform"
    assert resolved["device"] == "cuda"
    assert resolved["mode"] == "VLLM_COMPILE"
    assert resolved["default"] == "FULL_AND_PIECEWISE"
    assert resolved["splits_attention"]  # piecewise graphs are split at vLLM's attention ops


def test_atom_model_on_atom_attention_is_compiled(resolved) -> None:
    assert resolved["model"] == "atom_models.models.llama.LlamaForCausalLM"
    assert resolved["backends"] == ["AtomAttentionBackend"]
    assert resolved["compiled"]  # support_torch_compile: what piecewise graphs need


def test_default_cudagraph_mode_survives_with_atom(resolved) -> None:
    assert resolved["support"] == "ALWAYS"  # atom_kernels' Triton ops on a CUDA device
    assert resolved["atom_v2"] == "FULL_AND_PIECEWISE"
    assert resolved["atom_v1"] == "FULL_AND_PIECEWISE"


def test_what_each_part_contributes(resolved) -> None:
    # What ATOM declared before this change: no graphs at all.
    assert resolved["before"] == "NONE"
    # Graph support without a compiled model: decode graphs only.
    assert resolved["uncompiled"] == "FULL_DECODE_ONLY"
    # A compiled model without graph support: piecewise graphs around eager attention.
    assert resolved["never_compiled"] == "PIECEWISE"


def test_torch_reference_kernels_are_never_captured(resolved) -> None:
    assert resolved["torch_support"] == "NEVER"
    assert resolved["torch_resolved"] == "PIECEWISE"


# --- the metadata builder, on the CPU platform of this process ----------------------------------


def make_builder(smollm2_dir, cudagraph_mode):
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from atom_vllm_plugin.attention.backend import AtomAttentionMetadataBuilder

    cfg = EngineArgs(model=str(smollm2_dir), dtype="float32", enforce_eager=True,
                     block_size=16).create_engine_config()  # fmt: skip
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode[cudagraph_mode]
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
    return AtomAttentionMetadataBuilder(spec, ["layers.0.attn"], cfg, torch.device("cpu"))


class PersistentBuffers:
    """A runner's input buffers: sized for the largest batch, a step uses their first rows."""

    def __init__(self, max_reqs: int = 8, max_tokens: int = 32, max_blocks: int = 4) -> None:
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32)
        self.block_table = torch.zeros(max_reqs, max_blocks, dtype=torch.int32)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64)

    def common(self, query_lens: list[int], seq_lens: list[int]):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        num_reqs, num_tokens = len(query_lens), sum(query_lens)
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
        self.query_start_loc[: num_reqs + 1] = starts
        self.seq_lens[:num_reqs] = torch.tensor(seq_lens)
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            query_start_loc_cpu=self.query_start_loc[: num_reqs + 1].clone(),
            seq_lens=self.seq_lens[:num_reqs],
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_table_tensor=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens],
        )


def test_metadata_are_views_of_the_runners_buffers(smollm2_dir) -> None:
    """What a FULL graph reads at replay is what the runner wrote into its buffers, not a copy
    made when the graph was captured."""
    builder = make_builder(smollm2_dir, "FULL_AND_PIECEWISE")
    buffers = PersistentBuffers()
    captured = builder.build_for_cudagraph_capture(buffers.common([1] * 4, [1] * 4))
    for name, buffer in [("query_start_loc", buffers.query_start_loc),
                         ("seq_lens", buffers.seq_lens), ("block_table", buffers.block_table),
                         ("slot_mapping", buffers.slot_mapping)]:  # fmt: skip
        assert getattr(captured, name).data_ptr() == buffer.data_ptr(), name
    # A later step of the same shape (what a replay runs): the runner rewrites its buffers, and
    # the captured metadata see the new batch.
    buffers.common([1] * 4, [7, 9, 11, 13])
    assert captured.seq_lens.tolist() == [7, 9, 11, 13]


@pytest.mark.parametrize(
    ("query_lens", "num_padding", "decode_only"),
    [([1, 1, 1], 0, True), ([1, 5, 1], 0, False), ([1, 1, 1], 2, False), ([4], 0, False)],
)
def test_decode_only_steps(smollm2_dir, query_lens, num_padding, decode_only) -> None:
    """One query row per sequence and no padding row: the kernel may skip its prefill path."""
    builder = make_builder(smollm2_dir, "NONE")
    common = PersistentBuffers().common(query_lens, [q + 3 for q in query_lens])
    if num_padding:  # a padded step: more token rows than query rows
        from dataclasses import replace

        common = replace(common, num_actual_tokens=common.num_actual_tokens + num_padding)
    assert builder.build(0, common).decode_only is decode_only


@pytest.mark.parametrize(
    ("cudagraph_mode", "decode_only"),
    [("FULL_AND_PIECEWISE", True), ("FULL_DECODE_ONLY", True), ("FULL", False)],
)
def test_full_graphs_replayed_for_mixed_batches_keep_the_prefill_kernel(
    smollm2_dir, cudagraph_mode, decode_only
) -> None:
    """In FULL mode one graph per size serves decodes and prefills alike: captured from a
    dummy batch of single-token requests, it must still launch the prefill kernel."""
    builder = make_builder(smollm2_dir, cudagraph_mode)
    common = PersistentBuffers().common([1] * 4, [1] * 4)
    assert builder.build(0, common).decode_only  # an eager step of decodes skips it
    assert builder.build_for_cudagraph_capture(common).decode_only is decode_only


def test_cpu_platform_compiles_the_model_by_default(smollm2_dir, monkeypatch) -> None:
    """vLLM's CPU platform compiles its own models, and ATOM's by default; 0 keeps it eager."""
    from vllm.engine.arg_utils import EngineArgs

    from atom_vllm_plugin.model import compile_enabled

    cfg = EngineArgs(model=str(smollm2_dir), dtype="float32").create_engine_config()
    monkeypatch.delenv("ATOM_VLLM_PLUGIN_COMPILE", raising=False)
    assert compile_enabled(cfg)
    monkeypatch.setenv("ATOM_VLLM_PLUGIN_COMPILE", "0")
    assert not compile_enabled(cfg)


GENERATE = r"""
import gc, json
from vllm import LLM, SamplingParams
from vllm.v1.worker.gpu.cudagraph_utils import has_compiled_submodule

params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9], list(range(100, 140)), [42] * 3)]
out = {}
for name, eager in RUNS:
    llm = LLM(model=MODEL, dtype="float32", enforce_eager=eager, max_model_len=512, seed=0)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    (compiled,) = llm.apply_model(has_compiled_submodule)
    out[name] = {"tokens": tokens, "compiled": compiled}
    del llm
    gc.collect()
print(json.dumps(out))
"""


def generate(run_python, model_dir, runs, max_tokens=12, **switches) -> dict:
    code = f"MODEL, RUNS, MAX_TOKENS = {str(model_dir)!r}, {runs!r}, {max_tokens}\n" + GENERATE
    return run_python(code, timeout=900, **switches)


def test_compiled_model_generates_the_same_tokens(run_python, smollm2_dir) -> None:
    """vLLM's torch.compile traces ATOM's model (Dynamo over atom-models, vLLM's attention op as
    the split point) and the compiled model greedily generates what the eager one does. On this
    CPU with ATOM_VLLM_PLUGIN_COMPILE=1 and Dynamo's eager backend (VLLM_CPU_CI_ENV=1), the
    tracing GPUs get by default, without Inductor's code generation."""
    runs = [("eager", True), ("compiled", False)]
    run = generate(run_python, smollm2_dir, runs, ATOM_VLLM_PLUGIN_COMPILE="1", VLLM_CPU_CI_ENV="1")
    assert not run["eager"]["compiled"]
    assert run["compiled"]["compiled"]
    assert run["compiled"]["tokens"] == run["eager"]["tokens"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer, LlamaConfig

    from atom_models.testing import save_random_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama-graphs")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    save_random_checkpoint(config, path, seed=1, tokenizer=tokenizer)
    return path


def test_compiled_model_on_triton_kernels(run_python, tiny_llama) -> None:
    """The GPU path of the same tracing: atom_kernels' Triton ops (interpreted on this CPU) enter
    vLLM's compiled graph as ATOM's custom ops with their fake implementations, ATOM's Triton
    attention runs at vLLM's split points, and the tokens equal the torch reference's, eager."""
    # The eager reference: vLLM's engine in this process (the plugin's defaults, as here).
    reference = {"MODEL": str(tiny_llama), "RUNS": [("eager", True)], "MAX_TOKENS": 6}
    exec(GENERATE, reference)
    triton = generate(
        run_python, tiny_llama, [("compiled", False)], max_tokens=6,
        ATOM_KERNEL_BACKEND="triton", TRITON_INTERPRET="1", ATOM_VLLM_PLUGIN_COMPILE="1",
        VLLM_CPU_CI_ENV="1",
    )  # fmt: skip
    assert triton["compiled"]["compiled"]
    assert "ATOM (atom_kernels triton kernels)" in triton["_stdout"] + triton["_stderr"]
    assert not reference["out"]["eager"]["compiled"]
    assert triton["compiled"]["tokens"] == reference["out"]["eager"]["tokens"]
