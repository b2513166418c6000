"""Token sampling (greedy, temperature, top-k, top-p, min-p, per-request seeds), logprobs,
penalties."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom_kernels.ops._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_shape,
    check_tensor,
)
from atom_kernels.registry import get_op

# B = sequences (rows), V = vocab, N = number of top logprobs.


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] fp32, log_softmax of the raw logits at token_ids
    top_logprobs: torch.Tensor  # [B, N] fp32, the N largest raw log-probs, descending
    top_token_ids: torch.Tensor  # [B, N] int64


def _check_logits(op: str, logits: torch.Tensor) -> None:
    check_tensor(op, "logits", logits, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,))
    if logits.shape[1] == 0:
        raise ValueError(f"{op}: logits has an empty vocab dim, shape {tuple(logits.shape)}")


def _check_row_param(
    op: str, name: str, t: torch.Tensor | None, logits: torch.Tensor, dtypes, optional: bool
) -> None:
    if t is None and optional:
        return
    kind = "int" if dtypes == INDEX_DTYPES else "float"
    check_tensor(op, name, t, ndim=1, dtypes=dtypes)
    check_shape(op, name, t, (logits.shape[0],), f"(one {kind} per row of logits)")
    check_same_device(op, "logits", logits, **{name: t})


_FLOATS = FLOAT_DTYPES + (torch.float64,)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Mask (set to -inf) the tokens top-k, then top-p, then min-p exclude; returns new fp32 logits.

    logits: [B, V]; top_k: [B] int (<= 0 or >= V: off; ties with the k-th value are kept);
    top_p: [B] float (1.0: off; keeps the smallest set of most likely tokens whose probability
    reaches p, at least one; a token tied with that set's least likely one may be kept too: the
    CPU and GPU samplers keep every such tie, the torch reference keeps them as its sort orders
    them); min_p: [B] float (0: off; drops tokens with prob < min_p * max prob).
    Any of the three may be None (off for every row).
    """
    op = "apply_top_k_top_p_min_p"
    _check_logits(op, logits)
    _check_row_param(op, "top_k", top_k, logits, INDEX_DTYPES, True)
    _check_row_param(op, "top_p", top_p, logits, _FLOATS, True)
    _check_row_param(op, "min_p", min_p, logits, _FLOATS, True)
    return get_op(op, logits.device)(logits, top_k, top_p, min_p)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    generators: list[torch.Generator | None] | None = None,
    num_logprobs: int = 0,
) -> SamplerOutput:
    """Pick one token per row.

    logits: [B, V] any float dtype (fp32 math); temperature, top_p, min_p: [B] float; top_k: [B]
    int. Rows with temperature 0 (< 1e-5, vLLM's epsilon) are greedy: argmax, ties -> lowest id.
    Other rows: logits / temperature, ``apply_top_k_top_p_min_p`` (top_k / top_p / min_p may be
    None: off for every row), then a draw; no host sync beyond the filters' own. A row whose
    ``generators[b]`` is a torch.Generator draws only from it (the same seed gives the same token
    whatever the rest of the batch is); other rows use the global RNG. Log-probs are of the raw
    logits (vLLM's default): the chosen token's, and the top ``num_logprobs`` ([B, 0] when 0).
    """
    op = "sample"
    _check_logits(op, logits)
    _check_row_param(op, "temperature", temperature, logits, _FLOATS, False)
    _check_row_param(op, "top_k", top_k, logits, INDEX_DTYPES, True)
    _check_row_param(op, "top_p", top_p, logits, _FLOATS, True)
    _check_row_param(op, "min_p", min_p, logits, _FLOATS, True)
    num_seqs, vocab_size = logits.shape
    if generators is not None:
        if len(generators) != num_seqs:
            raise ValueError(
                f"{op}: generators has {len(generators)} entries, expected {num_seqs} "
                "(one per row of logits, None for unseeded rows)"
            )
        for b, g in enumerate(generators):
            if g is not None and not isinstance(g, torch.Generator):
                raise ValueError(f"{op}: generators[{b}] must be a torch.Generator or None")
            if g is not None and g.device.type != logits.device.type:
                raise ValueError(
                    f"{op}: generators[{b}] is on {g.device}, expected {logits.device.type} "
                    "(the device of logits)"
                )
    if not isinstance(num_logprobs, int) or not 0 <= num_logprobs <= vocab_size:
        raise ValueError(
            f"{op}: num_logprobs must be an int in [0, {vocab_size}], got {num_logprobs!r}"
        )
    return get_op(op, logits.device)(
        logits, temperature, top_k, top_p, min_p, generators, num_logprobs
    )


def greedy_argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy tokens: ``logits.argmax(-1)`` exactly (ties -> lowest id, a NaN wins), int64 [B],
    written into ``out`` ([B] int64, contiguous) when given, and returned.

    logits: [B, V] any float dtype. The sampler's all-greedy fast path; ``sample`` gives the
    same ids for greedy rows but also computes log-probs."""
    op = "greedy_argmax"
    _check_logits(op, logits)
    if out is not None:
        check_tensor(op, "out", out, ndim=1, dtypes=(torch.int64,))
        check_shape(op, "out", out, (logits.shape[0],), "(one id per row of logits)")
        check_same_device(op, "logits", logits, out=out)
        if not out.is_contiguous():
            raise ValueError(f"{op}: out must be contiguous, got strides {out.stride()}")
    return get_op(op, logits.device)(logits, out)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    repetition_penalty: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties; returns new fp32 logits [B, V].

    prompt_token_ids: [B, Lp], output_token_ids: [B, Lo] int64, padded with -1 or V.
    repetition_penalty [B] (1.0: off) applies to tokens seen in prompt or output: positive logits
    are divided by it, others multiplied. frequency_penalty [B] (times the token's count) and
    presence_penalty [B] (once if present) are subtracted for output tokens only.
    """
    op = "apply_penalties"
    _check_logits(op, logits)
    for name, t in (("prompt_token_ids", prompt_token_ids), ("output_token_ids", output_token_ids)):
        check_tensor(op, name, t, ndim=2, dtypes=INDEX_DTYPES)
        if t.shape[0] != logits.shape[0]:
            raise ValueError(
                f"{op}: {name} has shape {tuple(t.shape)}, expected ({logits.shape[0]}, L) "
                "(one row per row of logits)"
            )
        check_same_device(op, "logits", logits, **{name: t})
    _check_row_param(op, "presence_penalty", presence_penalty, logits, _FLOATS, False)
    _check_row_param(op, "frequency_penalty", frequency_penalty, logits, _FLOATS, False)
    _check_row_param(op, "repetition_penalty", repetition_penalty, logits, _FLOATS, False)
    return get_op(op, logits.device)(
        logits,
        prompt_token_ids,
        output_token_ids,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
    )
