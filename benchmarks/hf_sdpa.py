"""Per-step time of transformers' `generate` (Llama-3-8B shape, random weights, 512-token prompts)
in the order the first probe ran them: a first generate pays for torch's cuDNN SDPA plans, one per
new key length; later ones with the same lengths do not.

    python benchmarks/hf_sdpa.py --out x.json
    python benchmarks/hf_sdpa.py --no-cudnn --out y.json   # SDPA off its cuDNN backend
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-cudnn", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM

    if args.no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(SHAPES["llama3-8b"](), dtype=torch.bfloat16)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    rows = []

    def run(batch, new, mask=True, min_new=True, label=""):
        ids = torch.randint(0, 128000, (batch, 512), generator=gen).cuda()
        kwargs = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
        if mask:
            kwargs["attention_mask"] = torch.ones_like(ids)
        if min_new:
            kwargs["min_new_tokens"] = new
        with torch.no_grad():
            warm = dict(kwargs, max_new_tokens=2, min_new_tokens=2 if min_new else 0)
            model.generate(ids, **warm)  # 2 tokens: only the first key lengths
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        steps = out.shape[1] - 512
        row = {
            "label": label, "batch": batch, "new_tokens": steps, "seconds": elapsed,
            "ms_per_step": 1e3 * elapsed / steps, "out_tok_per_s": batch * steps / elapsed,
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)

    run(1, 64, label="batch 1, first lengths 513-576")
    run(64, 64, label="batch 64 with mask and min_new_tokens, first lengths 513-576")
    run(64, 64, mask=False, min_new=False, label="batch 64 plain, lengths 513-576 seen before")
    run(64, 128, label="batch 64, lengths 513-576 seen, 577-640 first")
    result = {
        "bench": "hf_sdpa",
        "cudnn_sdp": not args.no_cudnn,
        "attn_implementation": model.config._attn_implementation,
        "runs": rows,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
