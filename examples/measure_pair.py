"""Measure a target/draft pair on held-out prompts: acceptance length tau,
speedup over mlx-lm's autoregressive ``stream_generate``, losslessness, and the
distinct-token ratio of the target's own greedy output.

Defaults to the bundled demo pair and its held-out prompts (which neither the
target nor the draft trained on). On Linux, run float32 with OpenBLAS::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python examples/measure_pair.py --max-tokens 128 --block-size 16

Both decoders run on the same loaded target, one prompt at a time, alternating
(so background load affects both alike); speed is decode tokens per second
with the prompt's prefill excluded, as each generator reports it.
"""

import argparse
import json
import platform
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm import stream_generate as mlx_lm_stream_generate

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.demo import demo_pair


def run_mlx_lm(model, tokenizer, ids, max_tokens):
    tokens, tps = [], 0.0
    for r in mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=max_tokens):
        if r.finish_reason != "stop":  # mlx-lm yields the EOS token's step too
            tokens.append(r.token)
        tps = r.generation_tps
    return tokens, tps


def run_dflash(model, draft, tokenizer, ids, max_tokens, block_size):
    tokens, accepts, tps = [], [], 0.0
    for i, r in enumerate(stream_generate(model, draft, tokenizer, ids, max_tokens=max_tokens,
                                          block_size=block_size)):
        tokens += r.tokens
        if i > 0:
            accepts.append(r.accepted)
        tps = r.generation_tps
    return tokens, accepts, tps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="target directory (default: the bundled demo target)")
    ap.add_argument("--draft", help="draft directory (default: the bundled demo draft)")
    ap.add_argument("--prompts", help="JSONL of {\"prompt\": ...} (default: the demo's held-out prompts)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=0, help="use only the first N prompts")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    pair = demo_pair() if not (args.target and args.draft and args.prompts) else None
    target = args.target or str(pair.target)
    draft_dir = args.draft or str(pair.draft)
    prompts_file = args.prompts or str(pair.prompts)
    prompts = [json.loads(l)["prompt"] for l in open(prompts_file) if l.strip()]
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]

    model, tokenizer = load(target)
    model.set_dtype(mx.float32)
    draft = load_draft(draft_dir)
    draft.set_dtype(mx.float32)

    warm = tokenizer.encode(prompts[0])
    run_mlx_lm(model, tokenizer, warm, 16)
    run_dflash(model, draft, tokenizer, warm, 16, args.block_size)

    rows = []
    for n, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        ref, ref_tps = run_mlx_lm(model, tokenizer, ids, args.max_tokens)
        out, accepts, tps = run_dflash(model, draft, tokenizer, ids, args.max_tokens, args.block_size)
        rows.append({
            "prompt_tokens": len(ids), "tokens": len(out), "identical": out == ref,
            "cycles": len(accepts), "accepted": accepts,
            "mlx_lm_tps": ref_tps, "dflash_tps": tps,
            "distinct_ratio": len(set(ref)) / max(len(ref), 1),
        })
        r = rows[-1]
        tau = (sum(accepts) + len(accepts)) / max(len(accepts), 1)
        print(f"[{n + 1}/{len(prompts)}] tau {tau:.2f}  mlx-lm {ref_tps:.1f} tok/s  dflash {tps:.1f} tok/s  "
              f"identical {r['identical']}  distinct {r['distinct_ratio']:.2f}", file=sys.stderr)

    accepts = [a for r in rows for a in r["accepted"]]
    tau = (sum(accepts) + len(accepts)) / len(accepts)
    hist = np.bincount(accepts, minlength=args.block_size).tolist()
    # decode time per prompt = tokens / tps; speedup from total tokens over total time
    t_ref = sum(r["tokens"] / r["mlx_lm_tps"] for r in rows if r["mlx_lm_tps"] > 0)
    t_dfl = sum(r["tokens"] / r["dflash_tps"] for r in rows if r["dflash_tps"] > 0)
    total = sum(r["tokens"] for r in rows)
    summary = {
        "prompts": len(rows),
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "tau": tau,
        "accepted_histogram": hist,
        "identical": sum(r["identical"] for r in rows),
        "mlx_lm_tps": total / t_ref,
        "dflash_tps": total / t_dfl,
        "speedup": t_ref / t_dfl,
        "distinct_token_ratio": float(np.mean([r["distinct_ratio"] for r in rows])),
        "machine": f"{platform.machine()} {platform.system()}, MLX {mx.__version__}, "
                   f"default device {mx.default_device()}",
        "rows": rows,
    }
    print(
        f"\n{len(rows)} held-out prompts x {args.max_tokens} tokens, block {args.block_size}, greedy, float32\n"
        f"  tau (mean acceptance length): {tau:.2f}\n"
        f"  accepted-drafts histogram (0..{args.block_size - 1}): {hist}\n"
        f"  mlx-lm stream_generate: {summary['mlx_lm_tps']:.1f} tok/s\n"
        f"  dflash-mlx:             {summary['dflash_tps']:.1f} tok/s  ({summary['speedup']:.2f}x)\n"
        f"  token-identical to mlx-lm greedy: {summary['identical']}/{len(rows)}\n"
        f"  distinct-token ratio of the target's greedy output: {summary['distinct_token_ratio']:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
