"""GGUF -> Hugging Face checkpoint conversion: the result loads in transformers and computes the
same logits as transformers' direct GGUF load."""

from __future__ import annotations

import json

import pytest
import torch

from atom_models.convert import convert_gguf_to_hf, main, parse_size


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("100MB") == 10**8
    assert parse_size("1.5 GiB") == 3 * 2**29
    assert parse_size("123") == 123 and parse_size(7) == 7
    with pytest.raises(ValueError, match="Cannot parse size"):
        parse_size("lots")


def test_sharded_float32_matches_transformers(bundled, reference, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = convert_gguf_to_hf(bundled, tmp_path / "hf", max_shard_size="200MB")

    # ~538 MB of float32 weights -> 3 shards and an index; no stray single-file checkpoint.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert set(index["weight_map"].values()) == set(shards)
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embeddings
    assert index["metadata"]["total_size"] == sum(
        p.numel() * 4 for n, p in reference.state_dict().items() if n != "lm_head.weight"
    )
    assert not (out / "model.safetensors").exists()
    assert not list(out.glob(".*"))  # temporary shard names are gone

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.startswith("<|im_start|>system\n") and tok.eos_token_id == 2
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        expected = reference(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    assert tok.decode(logits[0, -1].argmax()) == tok.decode(expected[0, -1].argmax())


def test_cli_bfloat16_single_file(bundled, reference, tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "bf16"
    out.mkdir()  # an earlier, sharded conversion must not survive into this one
    (out / "model-00001-of-00009.safetensors").write_bytes(b"stale")
    (out / "model.safetensors.index.json").write_text("{}")
    assert main([str(bundled), str(out), "--dtype", "bfloat16"]) == 0
    assert str(out) in capsys.readouterr().out

    assert sorted(p.name for p in out.glob("model*.safetensors*")) == ["model.safetensors"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    state = reference.state_dict()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(state) - {"lm_head.weight"}
        for name in ["model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight"]:
            tensor = f.get_tensor(name)
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
