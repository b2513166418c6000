"""Structured output in the engine: grammars compiled for the bundled tokenizer (cached, errors
named), the logits mask of constrained rows only, the speculative-decoding masks of k+1
positions, and the offline API (`SamplingParams(structured_outputs=...)`)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from atom_engine import SamplingParams, StructuredOutputsParams
from atom_engine.sampling_params import InvalidRequest
from atom_engine.sequence import Sequence
from atom_engine.structured_output import GrammarCompiler, GrammarState, apply_grammar_bitmasks

VOCAB = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "pop": {"type": "integer", "minimum": 0, "maximum": 40},
    },
    "required": ["city", "pop"],
}


@pytest.fixture(scope="module")
def compiler(bundled_tokenizer):
    return GrammarCompiler(bundled_tokenizer, VOCAB, {EOS})


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    import xgrammar as xgr

    logits = torch.zeros(1, VOCAB)
    xgr.apply_token_bitmask_inplace(logits, bitmask[row : row + 1].clone())
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_compile_is_cached_and_errors_name_the_field(compiler):
    before = compiler.num_compiled
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA))) is first
    assert compiler.compile(StructuredOutputsParams(json=dict(SCHEMA))) is first
    assert compiler.num_compiled == before + 1
    for bad in (
        StructuredOutputsParams(json={"type": "nope"}),
        StructuredOutputsParams(json="{not json"),
        StructuredOutputsParams(regex="(a"),
        StructuredOutputsParams(grammar="root ::= undefined_rule"),
    ):
        with pytest.raises(InvalidRequest) as e:
            compiler.compile(bad)
        assert e.value.param == "structured_outputs" and "[" not in str(e.value)[:2]
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_choice_matches_exactly(compiler, bundled_tokenizer):
    choices = ['say "hi"', "two\nlines", "café ☕", "back\\slash"]
    compiled = compiler.compile(StructuredOutputsParams(choice=choices))
    for choice in choices:
        state = GrammarState(compiled, {EOS})
        assert state.matcher.accept_string(choice) and state.matcher.is_completed()
        assert state.advance([EOS])  # a stop token terminates a complete match
    state = GrammarState(compiled, {EOS})
    assert not state.matcher.accept_string("say hi")
    with pytest.raises(ValueError, match="does not match"):
        GrammarState(compiled, {EOS}).advance(bundled_tokenizer.encode("nope"))


def test_mask_applies_to_constrained_rows_only(compiler, bundled_tokenizer):
    compiled = compiler.compile(StructuredOutputsParams(regex="[0-9]{2}"))
    seqs = [Sequence("r", i, [1, 2, 3], SamplingParams(), None, 0.0) for i in range(3)]
    seqs[1].grammar = GrammarState(compiled, {EOS})
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    apply_grammar_bitmasks(seqs, logits)
    assert torch.equal(logits[0], expected[0]) and torch.equal(logits[2], expected[2])
    kept = torch.isfinite(logits[1])
    assert torch.equal(logits[1][kept], expected[1][kept])
    texts = {bundled_tokenizer.decode([t]) for t in torch.nonzero(kept).flatten().tolist()}
    assert texts and all(t.isdigit() and len(t) <= 2 for t in texts)


def test_speculative_masks_of_k_plus_one_positions(compiler, bundled_tokenizer):
    """fill_bitmasks gives, for each position of a draft, the mask a matcher advanced by the
    draft tokens before it gives; it leaves the matcher as it was; rows after a token the
    grammar rejects are untouched."""
    import xgrammar as xgr

    compiled = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    good = bundled_tokenizer.encode('{"city": "Tokyo", "pop": 1', add_special_tokens=False)
    bad = bundled_tokenizer.encode("x", add_special_tokens=False)
    draft = good + bad + good[:2]
    state = GrammarState(compiled, {EOS})
    state.advance(good[:1])  # a sequence part-way through its answer
    bitmask = torch.zeros(len(draft) + 1, (VOCAB + 31) // 32, dtype=torch.int32)
    accepted = state.fill_bitmasks(draft[1:], bitmask, 0)
    assert accepted == len(good) - 1
    reference = GrammarState(compiled, {EOS})
    reference.advance(good[:1])
    one = xgr.allocate_token_bitmask(1, VOCAB)
    for j in range(accepted + 1):
        reference.fill_bitmask(one, 0)
        assert torch.equal(bitmask[j], one[0]), j
        if j < accepted:
            reference.advance([draft[1 + j]])
    assert not bitmask[accepted + 1 :].any()  # after the rejected token: untouched
    # Unchanged: the next mask is that of the first position, and the whole run is accepted.
    state.fill_bitmask(one, 0)
    assert torch.equal(one[0], bitmask[0])
    assert not state.advance(good[1:]) and not state.is_terminated
    assert _allowed(bitmask, 0) and bitmask.shape[0] == len(draft) + 1


def test_offline_llm(smollm2_llm):
    schema_params = SamplingParams(
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=48,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    choice_params = SamplingParams(
        temperature=0,
        max_tokens=16,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=[" yes", " no"]),
    )
    outs = smollm2_llm.generate(
        ["A city as JSON:", "Is water wet? Answer:"], [schema_params, choice_params], use_tqdm=False
    )
    for completion in outs[0].outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        assert completion.token_ids[-1] == EOS
    (answer,) = outs[1].outputs
    assert answer.text in (" yes", " no") and answer.finish_reason == "stop"
    assert len(answer.token_ids) <= 3  # the grammar ended it (ignore_eos: EOS alone does not)


@pytest.mark.slow  # builds a second engine (with speculation): ~1 min of CPU
def test_speculative_decoding_keeps_constrained_greedy_outputs(smollm2_llm):
    """With n-gram drafts (k=3) verified against the grammar's masks, constrained greedy
    outputs are token for token those without speculation, and drafts are accepted."""
    from atom_engine import LLM

    prompts = [
        'Cities: {"city": "Paris", "pop": 2}\n{"city": "Tokyo", "pop": 14}\n{"city": "Paris",',
        "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,",
    ]
    params = [
        SamplingParams(
            temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)
        ),
        SamplingParams(
            temperature=0,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(regex=r"( [0-9],){2,4} 9"),
        ),
    ]
    expected = [o.outputs[0] for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    with LLM(
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                            "prompt_lookup_min": 1},
    ) as llm:  # fmt: skip
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats().spec_decode
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert outs[1].text.endswith(" 9") and all(o.finish_reason == "stop" for o in outs)
    assert stats.num_accepted_tokens > 0
