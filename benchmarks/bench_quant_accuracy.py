"""Accuracy of `--quantization` on the default model against a reference nobody here wrote:
transformers' own loading of the same GGUF (dequantized to float32: the converted directory).

    .venv/bin/python benchmarks/bench_quant_accuracy.py [--modes none,int8,int4-g64,int4-g32,gguf]
        [--chunk 8] [--lm-head int8] [--out benchmarks/results/quant_accuracy.json]

- Teacher-forced mean log-likelihood of a fixed text (the Zen of Python, `this.s`) under
  transformers fp32 and under radixlm in each mode (bfloat16 activations); the perplexity ratio
  to radixlm bf16 (`none`) and to transformers fp32.
- Held-out prompts: transformers generates 24 greedy tokens per prompt; radixlm reads the same
  sequence teacher-forced; greedy agreement (its argmax == transformers' token) and mean
  |logit difference| over those positions.
- Resident weight bytes of each mode.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import math
import os
from pathlib import Path

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
]
NEW_TOKENS = 24


def zen() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints it
        import this as zen_module

    return codecs.decode(zen_module.s, "rot13")


def hf_logits(model, ids: list[int]) -> torch.Tensor:  # [L, V] float32
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def radix_logits(runner, ids: list[int], chunk: int) -> torch.Tensor:  # [L, V] float32
    """Teacher-forced logits of every position, prefilled in chunks of `chunk` tokens over the
    paged prefix (below the kernels' `dequant_min_rows`, int8 16 / int4 32: the low-bit
    kernels, as in decode; at or above: the float copy, as in a long prefill)."""
    from radixlm.kernels.forward_batch import ForwardBatch

    ps = runner.page_size
    pages = list(range(-(-len(ids) // ps)))
    out = []
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        fb = ForwardBatch.build([part], [start], [pages], [list(range(len(part)))], ps, "cpu")
        out.append(runner.forward(fb).float())
    return torch.cat(out)


def mean_loglik(logits: torch.Tensor, ids: list[int]) -> float:
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="none,int8,int4-g64,int4-g32,gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lm-head", default="int8", help="the quantized modes' LM head: int8 | int4")
    p.add_argument("--chunk", type=int, default=8, help="prefill chunk (tokens per forward)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from radixlm.config import CacheConfig
    from radixlm.runtime.model_runner import ModelRunner
    from radixlm.runtime.models.loader import load_tokenizer, resolve_model_path

    model_dir = resolve_model_path(None)
    tok = load_tokenizer(model_dir)
    text_ids = tok(zen())["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref_text = hf_logits(hf, text_ids)
    seqs = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2
            )
        full = out[0].tolist()
        seqs.append((len(ids), full, hf_logits(hf, full)))
    del hf
    results: dict[str, dict[str, float]] = {
        "transformers-fp32": {"mean_loglik": mean_loglik(ref_text, text_ids)}
    }
    print(f"text: {len(text_ids)} tokens; {len(PROMPTS)} prompts x {NEW_TOKENS} greedy tokens")
    for mode in args.modes.split(","):
        quant, _, g = mode.partition("-g")
        runner = ModelRunner(
            model_dir,
            "bfloat16",
            torch.device("cpu"),
            CacheConfig(page_size=16, num_pages=64),
            quantization=quant,
            quantization_group_size=int(g or 32),
            quantization_lm_head=args.lm_head,
        )
        ll = mean_loglik(radix_logits(runner, text_ids, args.chunk), text_ids)
        agree, n, diff = 0, 0, 0.0
        for plen, full, ref in seqs:
            lg = radix_logits(runner, full, args.chunk)
            gen = slice(plen - 1, len(full) - 1)  # the positions that chose generated tokens
            agree += (lg[gen].argmax(-1) == torch.tensor(full[plen:])).sum().item()
            n += len(full) - plen
            diff += (lg[gen] - ref[gen]).abs().mean().item() * (len(full) - plen)
        results[mode] = {
            "mean_loglik": ll,
            "greedy_agreement": agree / n,
            "mean_abs_logit_diff": diff / n,
            "weight_mb": runner.weight_bytes / 1e6,
        }
        print(mode, {k: round(v, 4) for k, v in results[mode].items()}, flush=True)
    base = results.get("none", {}).get("mean_loglik")
    ref = results["transformers-fp32"]["mean_loglik"]
    for r in results.values():
        r["ppl_ratio_vs_transformers_fp32"] = math.exp(ref - r["mean_loglik"])
        if base is not None:
            r["ppl_ratio_vs_radixlm_bf16"] = math.exp(base - r["mean_loglik"])
    bf16_mb = results.get("none", {}).get("weight_mb")
    print("| mode | ppl / bf16 | ppl / transformers fp32 | greedy agreement | mean abs logit diff "
          "| weights MB (x bf16) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        mb = r.get("weight_mb")
        size = "" if mb is None else f"{mb:.1f}" + (f" ({mb / bf16_mb:.3f}x)" if bf16_mb else "")
        print(
            f"| {mode} | {r.get('ppl_ratio_vs_radixlm_bf16', float('nan')):.4f} | "
            f"{r['ppl_ratio_vs_transformers_fp32']:.4f} | "
            f"{r.get('greedy_agreement', float('nan')):.3f} | "
            f"{r.get('mean_abs_logit_diff', float('nan')):.3f} | {size} |"
        )
    if args.out:
        info = {"text_tokens": len(text_ids), "prompts": PROMPTS, "load": os.getloadavg()}
        args.out.write_text(json.dumps({"info": info, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
