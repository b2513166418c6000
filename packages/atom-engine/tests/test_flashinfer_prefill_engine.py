"""`ATOM_FLASHINFER=prefill_attention` in the engine (a GPU with FlashInfer installed): the steps
with a prefill take FlashInfer's planned kernel (`native_host.fi_prefill`) and give the log-probs
ATOM's kernel gives, eagerly and beside the CUDA graphs (piecewise graphs keep attention eager;
the whole-forward mixed graphs keep ATOM's kernel), with chunked prefills and prefix-cache hits
(prefill rows over a cached prefix)."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig

from atom_engine import LLM, SamplingParams
from atom_models.native_host import fi_prefill
from atom_models.testing import save_random_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_gpu_flashinfer_prefill_agrees_with_atoms(eager, tmp_path, monkeypatch):
    """Twelve prompts of 40-900 tokens in chunks of at most 256 tokens a step, twice (the second
    time the prefix cache holds every full block): each first token's top-20 log-probs (the
    prefill's output) within 0.15 nats of ATOM's (bf16 logits step by 1/16 at these sizes), the
    same first token unless ATOM's top two are within that."""
    pytest.importorskip("flashinfer")
    config = LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    save_random_checkpoint(config, tmp_path, seed=5)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in range(40, 960, 80)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    runs = {}
    for setting in ("0", "prefill_attention"):
        monkeypatch.setenv("ATOM_FLASHINFER", setting)
        fi_prefill._PREFILLS.clear()
        llm = LLM(
            str(tmp_path), dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
            block_size=16, num_kv_blocks=512, max_num_batched_tokens=256, enforce_eager=eager,
        )  # fmt: skip
        outs = []
        for _ in range(2):  # the second round's prompts hit the prefix cache
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            outs += [o.outputs[0] for o in got]
        assert llm.engine.stats().prefix_cache_hit_rate > 0
        plans = sum(p.plans for p in fi_prefill._PREFILLS.values())
        if setting == "0":
            assert plans == 0
        else:
            assert plans >= 8  # 12 prompts of 40-900 tokens in 256-token steps, twice
        runs[setting] = outs
        llm.shutdown()
    compared = 0
    for atom, fi in zip(runs["0"], runs["prefill_attention"], strict=True):
        top_atom, top_fi = atom.logprobs[0], fi.logprobs[0]
        for token in top_atom.keys() & top_fi.keys():
            delta = abs(top_atom[token].logprob - top_fi[token].logprob)
            assert delta < 0.15, (token, top_atom[token], top_fi[token])
            compared += 1
        if atom.token_ids[0] != fi.token_ids[0]:
            best = sorted((lp.logprob for lp in top_atom.values()), reverse=True)
            assert best[0] - best[1] < 0.15
    assert compared >= 20 * len(prompts)
