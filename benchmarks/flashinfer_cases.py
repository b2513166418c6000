"""The op pairs of flashinfer_compare.py: for each row, ATOM's public op and FlashInfer 0.7.2's
call on the same inputs, the bytes (and FLOPs) the op must move at least, and the agreement check.

B = sequences, T = tokens, H / Hk = query / kv heads, D = head dim, P = page size,
L / R = MLA latent / rope dims, V = vocab.
FlashInfer's side is a builder: it plans (host work, JIT compile at first use) and returns the
callable that is timed; with FlashInfer absent it is never called. Paged caches are shared: ATOM's
[num_blocks, 16, Hk, D] blocks are FlashInfer's NHD pages at P = 16 (vLLM's default block size,
the one vLLM runs FlashInfer with), or, at ``fi_page_size`` 1 (SGLang's), the same memory viewed as
one-token pages with the block table expanded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from kernels import attention_bytes, attention_flops

import atom_kernels as ak

BLOCK = 16  # ATOM's engine block size (EngineConfig.block_size)
EPS = 1e-5
TOP_K, TOP_P = 50, 0.9


@dataclass(frozen=True)
class Sizes:
    decode_heads: tuple = ((32, 8), (64, 4))
    head_dim: int = 128
    decode_batches: tuple = (1, 64, 256)
    decode_contexts: tuple = (512, 4096, 32768)
    prefill: tuple = ((4096, 0), (4096, 12288), (16384, 0), (16384, 16384))  # (new, prefix)
    prefill_heads: tuple = (32, 8)
    mla_heads: tuple = (128,)  # a rank's: DeepSeek-V3 / Kimi-K2 at TP 1 (or DP attention), TP 8: 16
    mla_dims: tuple = (512, 64)  # (L, R): DeepSeek-V3
    mla_batches: tuple = (1, 64, 256)
    mla_contexts: tuple = (4096, 32768)
    tokens: tuple = (64, 2048, 8192)  # norms, SiLU-and-mul
    hidden: int = 4096  # Llama-3-8B
    intermediate: int = 14336
    rope_tokens: tuple = (64, 8192)
    sample_batches: tuple = (1, 256)
    vocabs: tuple = (128256, 151936)  # Llama-3, Qwen3


FULL = Sizes()
TINY = Sizes(
    decode_heads=((4, 2),), head_dim=32, decode_batches=(1, 3), decode_contexts=(20,),
    prefill=((8, 0), (8, 12)), prefill_heads=(4, 2), mla_heads=(4,), mla_dims=(32, 16),
    mla_batches=(2,), mla_contexts=(20,), tokens=(5,), hidden=64, intermediate=96,
    rope_tokens=(7,), sample_batches=(3,), vocabs=(1000,),
)  # fmt: skip
GROUPS = ("decode", "prefill", "mla", "norm", "silu", "rope", "sampling")


@dataclass
class Case:
    op: str
    shape: str
    atom: Callable[[], object]
    flashinfer: Callable[[object], Callable[[], object]]  # fi module -> the timed callable
    check: Callable[[object, object | None], dict]  # (ATOM's output, FlashInfer's or None)
    bytes: float
    flops: float = 0.0
    reset: Callable[[], None] | None = None  # restores what FlashInfer's call overwrites
    atom_reset: Callable[[], None] | None = None  # restores what ATOM's (in-place) call overwrites
    extra: dict = field(default_factory=dict)


def close(a: torch.Tensor, b: torch.Tensor | None, atol: float = 2e-2) -> dict:
    """Max |a - b| over a bf16-scale tolerance; b None: only that ATOM's output is finite."""
    out = {"atom_finite": bool(torch.isfinite(a.float()).all())}
    if b is not None:
        diff = (a.float() - b.float()).abs()
        out["max_abs_diff"] = float(diff.max())
        out["agree"] = bool((diff <= atol + atol * b.float().abs()).all())
    return out


def _paged(batch, context, kv_heads, dims, device, generator):
    """A shuffled block table over fresh random pages: caches [N, BLOCK, *dims] per tensor."""
    blocks_per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, device=device, generator=generator).int()
    block_tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    shape = (num_blocks, BLOCK, *dims) if kv_heads is None else (num_blocks, BLOCK, kv_heads, *dims)
    return block_tables, seq_lens, shape


def fi_pages(block_tables, seq_lens, page_size: int) -> dict:
    """FlashInfer's CSR page metadata for ATOM's block table: indptr [B + 1], indices, the last
    page's length [B], and (CSR MLA) the kv lengths; ``page_size`` 1 expands every block."""
    device, rows, lens = block_tables.device, [], seq_lens.tolist()
    for b, n in enumerate(lens):
        blocks = block_tables[b, : math.ceil(n / BLOCK)].long()
        if page_size == 1:
            rows.append(
                (blocks[:, None] * BLOCK + torch.arange(BLOCK, device=device)).flatten()[:n]
            )
        else:
            rows.append(blocks)
    counts = torch.tensor([0] + [len(r) for r in rows], device=device)
    return {
        "indptr": torch.cumsum(counts, 0).int(),
        "indices": torch.cat(rows).int(),
        "last_page_len": ((seq_lens - 1) % page_size + 1).int(),
        "kv_lens": seq_lens.int(),
    }


def _planned(call: Callable[[], object], wrapper) -> Callable[[], object]:
    """``call`` tagged with the backend the wrapper's plan() chose (fa2 / fa3 / ...): the row
    records it."""
    call.backend = str(getattr(wrapper, "_backend", None))
    return call


def _pages_view(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    return cache if page_size == BLOCK else cache.view(-1, 1, *cache.shape[2:])


def decode_cases(s: Sizes, device, page_size: int, gen) -> Iterator[Case]:
    d, dt = s.head_dim, torch.bfloat16
    for heads, kv_heads in s.decode_heads:
        for batch in s.decode_batches:
            for context in s.decode_contexts:
                bt, sl, shape = _paged(batch, context, kv_heads, (d,), device, gen)
                kc = torch.randn(shape, dtype=dt, device=device, generator=gen)
                vc = torch.randn(shape, dtype=dt, device=device, generator=gen)
                q = torch.randn(batch, heads, d, dtype=dt, device=device, generator=gen)
                qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
                scale = d**-0.5

                def atom(q=q, kc=kc, vc=vc, bt=bt, sl=sl, qsl=qsl, scale=scale):
                    return ak.paged_attention(q, kc, vc, bt, sl, qsl, scale, max_query_len=1)

                def flashinfer(fi, q=q, kc=kc, vc=vc, bt=bt, sl=sl, heads=heads, kv=kv_heads):
                    m = fi_pages(bt, sl, page_size)
                    ws = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
                    # vLLM's rule (FlashInfer backend): tensor cores when the group is over 4
                    w = fi.BatchDecodeWithPagedKVCacheWrapper(
                        ws, "NHD", use_tensor_cores=heads // kv > 4
                    )
                    w.plan(
                        m["indptr"], m["indices"], m["last_page_len"], heads, kv, d, page_size,
                        q_data_type=dt, kv_data_type=dt, sm_scale=d**-0.5,
                    )  # fmt: skip
                    pages = (_pages_view(kc, page_size), _pages_view(vc, page_size))
                    return _planned(lambda: w.run(q, pages), w)

                nbytes = attention_bytes([1] * batch, [context] * batch, heads, kv_heads, d, 2, 2)
                yield Case(
                    "decode_attention", f"H={heads}/{kv_heads} D={d} B={batch} ctx={context}",
                    atom, flashinfer, close, nbytes,
                )  # fmt: skip
                del kc, vc, atom, flashinfer  # the next case's caches: one row's at a time


def prefill_cases(s: Sizes, device, page_size: int, gen) -> Iterator[Case]:
    d, dt = s.head_dim, torch.bfloat16
    heads, kv_heads = s.prefill_heads
    for new, prefix in s.prefill:
        bt, sl, shape = _paged(1, new + prefix, kv_heads, (d,), device, gen)
        kc = torch.randn(shape, dtype=dt, device=device, generator=gen)
        vc = torch.randn(shape, dtype=dt, device=device, generator=gen)
        q = torch.randn(new, heads, d, dtype=dt, device=device, generator=gen)
        qsl = torch.tensor([0, new], dtype=torch.int32, device=device)

        def atom(q=q, kc=kc, vc=vc, bt=bt, sl=sl, qsl=qsl, new=new):
            return ak.paged_attention(q, kc, vc, bt, sl, qsl, d**-0.5, max_query_len=new)

        def flashinfer(fi, q=q, kc=kc, vc=vc, bt=bt, sl=sl, qsl=qsl):
            m = fi_pages(bt, sl, page_size)
            ws = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
            w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            w.plan(
                qsl, m["indptr"], m["indices"], m["last_page_len"], heads, kv_heads, d, page_size,
                causal=True, sm_scale=d**-0.5, q_data_type=dt, kv_data_type=dt,
            )  # fmt: skip
            pages = (_pages_view(kc, page_size), _pages_view(vc, page_size))
            return _planned(lambda: w.run(q, pages), w)

        seq = [new + prefix]
        yield Case(
            "prefill_attention", f"H={heads}/{kv_heads} D={d} new={new} prefix={prefix} causal",
            atom, flashinfer, close,
            attention_bytes([new], seq, heads, kv_heads, d, 2, 2),
            attention_flops([new], seq, heads, d, d),
        )  # fmt: skip
        del kc, vc, atom, flashinfer


def mla_cases(s: Sizes, device, page_size: int, gen) -> Iterator[Case]:
    (lat, rope), dt = s.mla_dims, torch.bfloat16
    scale = (128 + rope) ** -0.5  # DeepSeek-V3's qk_nope 128 + qk_rope 64
    shapes = [(h, b, c) for h in s.mla_heads for b in s.mla_batches for c in s.mla_contexts]
    for heads, batch, context in shapes:
        bt, sl, shape = _paged(batch, context, None, (lat + rope,), device, gen)
        cache = torch.randn(shape, dtype=dt, device=device, generator=gen)
        q = torch.randn(batch, heads, lat + rope, dtype=dt, device=device, generator=gen)
        q_lat, q_pe = q[..., :lat].contiguous(), q[..., lat:].contiguous()
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)

        def atom(q_lat=q_lat, q_pe=q_pe, cache=cache, bt=bt, sl=sl, qsl=qsl):
            return ak.mla_paged_attention(q_lat, q_pe, cache, bt, sl, qsl, scale, max_query_len=1)

        def flashinfer(fi, q=q, cache=cache, bt=bt, sl=sl, qsl=qsl, heads=heads):
            from flashinfer.mla._batch_mla import MLAPlanMetadata

            m = fi_pages(bt, sl, page_size)
            ws = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
            w = fi.BatchMLAPagedAttentionWrapper(ws)
            meta = MLAPlanMetadata.csr(qsl, m["indptr"], m["indices"], m["kv_lens"])
            w.plan(
                metadata=meta, num_heads=heads, head_dim_ckv=lat, head_dim_kpe=rope,
                page_size=page_size, causal=False, sm_scale=scale, q_data_type=dt,
                kv_data_type=dt,
            )  # fmt: skip
            pages = _pages_view(cache, page_size)
            return _planned(lambda: w.run(query=q, kv_cache=pages), w)

        nbytes = 2 * (batch * context * (lat + rope) + batch * heads * (2 * lat + rope))
        yield Case(
            "mla_decode", f"H={heads} L={lat}+{rope} B={batch} ctx={context}",
            atom, flashinfer, close, float(nbytes),
        )  # fmt: skip
        del cache, atom, flashinfer


def norm_cases(s: Sizes, device, gen) -> Iterator[Case]:
    dt = torch.bfloat16
    for tokens in s.tokens:
        x = torch.randn(tokens, s.hidden, dtype=dt, device=device, generator=gen)
        res = torch.randn(tokens, s.hidden, dtype=dt, device=device, generator=gen)
        w = torch.rand(s.hidden, dtype=dt, device=device, generator=gen) + 0.5
        nbytes = x.numel() * x.element_size()
        yield Case(
            "rms_norm", f"T={tokens} N={s.hidden}",
            lambda x=x, w=w: ak.rms_norm(x, w, EPS),
            lambda fi, x=x, w=w: lambda: fi.rmsnorm(x, w, EPS),
            close, 2.0 * nbytes,
        )  # fmt: skip
        x_fi, res_fi = x.clone(), res.clone()

        def reset(x=x, res=res, x_fi=x_fi, res_fi=res_fi):
            x_fi.copy_(x)
            res_fi.copy_(res)

        def fi_fused(fi, x_fi=x_fi, res_fi=res_fi, w=w):
            def call():  # in place: residual += x, x = rmsnorm(residual)
                fi.fused_add_rmsnorm(x_fi, res_fi, w, EPS)
                return x_fi, res_fi

            return call

        def check_fused(a, b):
            out = close(a[0], None if b is None else b[0])
            out["residual"] = close(a[1], None if b is None else b[1])
            if b is not None:
                out["agree"] = out["agree"] and out["residual"]["agree"]
            return out

        yield Case(
            "fused_add_rms_norm", f"T={tokens} N={s.hidden}",
            lambda x=x, r=res, w=w: ak.fused_add_rms_norm(x, r, w, EPS),
            fi_fused, check_fused, 4.0 * nbytes, reset=reset,
        )  # fmt: skip
        x_at, res_at = x.clone(), res.clone()

        def atom_reset(x=x, res=res, x_at=x_at, res_at=res_at):
            x_at.copy_(x)
            res_at.copy_(res)

        def atom_in_place(x_at=x_at, res_at=res_at, w=w):
            ak.fused_add_rms_norm_(x_at, res_at, w, EPS)
            return x_at, res_at

        yield Case(  # both in place: what each kernel reads, it overwrites
            "fused_add_rms_norm_", f"T={tokens} N={s.hidden}", atom_in_place,
            fi_fused, check_fused, 4.0 * nbytes, reset=reset, atom_reset=atom_reset,
        )  # fmt: skip


def silu_cases(s: Sizes, device, gen) -> Iterator[Case]:
    for tokens in s.tokens:
        g = torch.randn(tokens, 2 * s.intermediate, dtype=torch.bfloat16, device=device,
                        generator=gen)  # fmt: skip
        yield Case(
            "silu_and_mul", f"T={tokens} N={s.intermediate}",
            lambda g=g: ak.silu_and_mul(g),
            lambda fi, g=g: lambda: fi.silu_and_mul(g),
            close, 1.5 * g.numel() * g.element_size(),
        )  # fmt: skip


def rope_cases(s: Sizes, device, gen) -> Iterator[Case]:
    d, (heads, kv_heads), dt = s.head_dim, s.prefill_heads, torch.bfloat16
    for tokens in s.rope_tokens:
        cache = ak.rope_cos_sin_cache(d, max(tokens, 8192), 500000.0, device=device)
        positions = torch.randperm(cache.shape[0], device=device, generator=gen)[:tokens]
        q = torch.randn(tokens, heads, d, dtype=dt, device=device, generator=gen)
        k = torch.randn(tokens, kv_heads, d, dtype=dt, device=device, generator=gen)
        q_fi, k_fi = q.clone(), k.clone()

        def reset(q=q, k=k, q_fi=q_fi, k_fi=k_fi):
            q_fi.copy_(q)
            k_fi.copy_(k)

        def flashinfer(fi, q_fi=q_fi, k_fi=k_fi, positions=positions, cache=cache):
            def call():  # the vLLM layout: [T, H * D], cos | sin halves, fp32 cache
                fi.apply_rope_with_cos_sin_cache_inplace(
                    positions, q_fi.view(q_fi.shape[0], -1), k_fi.view(k_fi.shape[0], -1),
                    d, cache, is_neox=True,
                )  # fmt: skip
                return q_fi, k_fi

            return call

        def check(a, b):
            out = close(a[0], None if b is None else b[0])
            out["k"] = close(a[1], None if b is None else b[1])
            if b is not None:
                out["agree"] = out["agree"] and out["k"]["agree"]
            return out

        nbytes = 2 * (q.numel() + k.numel()) * 2 + tokens * d * 4
        yield Case(
            "rotary_embedding", f"T={tokens} H={heads}/{kv_heads} D={d} neox",
            lambda q=q, k=k, p=positions, c=cache: ak.rotary_embedding(p, q, k, c, True),
            flashinfer, check, float(nbytes), reset=reset,
        )  # fmt: skip


def sampling_cases(s: Sizes, device, gen) -> Iterator[Case]:
    for vocab in s.vocabs:
        for batch in s.sample_batches:
            logits = 4 * torch.randn(batch, vocab, device=device, generator=gen)  # fp32
            temperature = torch.ones(batch, device=device)
            top_k = torch.full((batch,), TOP_K, dtype=torch.int32, device=device)
            top_p = torch.full((batch,), TOP_P, device=device)
            allowed_p = torch.isfinite(ak.apply_top_k_top_p_min_p(logits, top_k, top_p, None))
            kth = logits.topk(TOP_K, dim=-1).values[:, -1:]
            allowed_k = logits >= kth

            def check(a, b, allowed_k=allowed_k, allowed_p=allowed_p):
                """Each side's draws inside the top-k set and inside top-k then top-p (the
                fraction of rows); the two draws are random, so not compared to each other."""
                out = {}
                for name, ids in (("atom", a.token_ids), ("flashinfer", b)):
                    if ids is not None:
                        ids = ids.long()[:, None]
                        out[f"{name}_in_top_k"] = float(allowed_k.gather(1, ids).float().mean())
                        out[f"{name}_in_top_p"] = float(allowed_p.gather(1, ids).float().mean())
                if b is not None:
                    out["agree"] = out["atom_in_top_k"] == out["flashinfer_in_top_k"] == 1.0
                return out

            yield Case(
                "top_k_top_p_sampling", f"B={batch} V={vocab} k={TOP_K} p={TOP_P} fp32",
                lambda lg=logits, t=temperature, k=top_k, p=top_p: ak.sample(lg, t, k, p, None),
                lambda fi, lg=logits, k=top_k, p=top_p: lambda: (
                    fi.sampling.top_k_top_p_sampling_from_logits(lg, k, p)
                ),
                check, float(logits.numel() * 4),
            )  # fmt: skip


def cases(groups, sizes: Sizes, device, page_size: int, seed: int = 0) -> Iterator[Case]:
    """Every case of the groups, built one at a time (a decode case's caches reach 34 GB)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    paged = {"decode": decode_cases, "prefill": prefill_cases, "mla": mla_cases}
    flat = {"norm": norm_cases, "silu": silu_cases, "rope": rope_cases}
    flat["sampling"] = sampling_cases
    for group in GROUPS:
        if group in groups and group in paged:
            yield from paged[group](sizes, device, page_size, gen)
        elif group in groups:
            yield from flat[group](sizes, device, gen)
