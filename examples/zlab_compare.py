"""dflash-mlx against z-lab's own MLX implementation on the same weights.

Runs, prompt by prompt and in alternation, mlx-lm's ``stream_generate``
(the baseline), z-lab's ``dflash.model_mlx.stream_generate`` (``dflash``
0.1.0 on PyPI, at its default block: the draft's trained size) and ours
(``--block-size``, default auto), all greedy over the same token ids, and
prints each one's decode speed, the median per-prompt speed ratios and
whether every output is identical to the baseline's. Decode time is measured
the same way for all three: from the first streamed token to the last.

    pip install --no-deps dflash==0.1.0      # z-lab's package (import name: dflash)
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python examples/zlab_compare.py                      # the bundled demo pair

Time only with nothing else running.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate as mlx_lm_stream

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.demo import demo_pair


def load_zlab_draft(path: str):
    """z-lab's ``load_draft`` fetches from the hub and loads every safetensors
    file there: hand it a directory holding only the draft's config and
    weights (the same tensor names), not our vocabulary ranking beside them."""
    from dflash import model_mlx

    with tempfile.TemporaryDirectory() as tmp:
        for name in ("config.json", "model.safetensors"):
            os.symlink(Path(path, name).resolve(), Path(tmp, name))
        model_mlx.snapshot_download = lambda repo_id, **_: repo_id
        return model_mlx.load_draft(tmp)


def decode_run(responses, eos: set[int]) -> tuple[list[int], float]:
    """Tokens of a stream up to EOS (not included) and the seconds from its
    first streamed token to its last."""
    tokens, start = [], None
    for r in responses:
        tokens.extend(r.tokens if hasattr(r, "tokens") else [r.token])  # mlx-lm streams one token
        if start is None:
            start = time.perf_counter()
    seconds = time.perf_counter() - start
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut], seconds


def main() -> None:
    pair = demo_pair()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(pair.target))
    ap.add_argument("--draft", default=str(pair.draft))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", default="auto", help="ours: auto or an integer")
    ap.add_argument("--limit", type=int, default=0, help="at most N of the demo's held-out prompts")
    args = ap.parse_args()
    block = args.block_size if args.block_size == "auto" else int(args.block_size)

    from dflash import model_mlx as zlab

    model, tokenizer = load(args.model)
    draft = load_draft(args.draft)
    zdraft = load_zlab_draft(args.draft)
    prompts = pair.load_prompts()[: args.limit or None]
    n = args.max_tokens
    eos = set(tokenizer.eos_token_ids)
    arms = {
        "mlx-lm": lambda ids: mlx_lm_stream(model, tokenizer, ids, max_tokens=n),
        "z-lab": lambda ids: zlab.stream_generate(model, zdraft, tokenizer, ids, max_tokens=n),
        f"ours b={args.block_size}": lambda ids: stream_generate(
            model, draft, tokenizer, ids, block_size=block, max_tokens=n),
    }
    for run in arms.values():  # warm-up (and ours measures its cost curve here)
        decode_run(run(tokenizer.encode(prompts[0])), eos)
    speed = {name: [] for name in arms}
    identical = {name: 0 for name in arms}
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        outputs = {}
        for name, run in arms.items():
            mx.clear_cache()
            tokens, seconds = decode_run(run(ids), eos)
            outputs[name] = tokens
            speed[name].append(max(len(tokens) - 1, 1) / seconds)
        for name in arms:
            identical[name] += outputs[name] == outputs["mlx-lm"]
    base = speed["mlx-lm"]
    print(f"{len(prompts)} prompts x {n} tokens, greedy; median decode tok/s and per-prompt ratios")
    print(f"{'arm':<14} {'tok/s':>8} {'vs mlx-lm':>10} {'vs z-lab':>9} {'identical':>10}")
    for name, s in speed.items():
        vs_base = statistics.median(a / b for a, b in zip(s, base))
        vs_zlab = statistics.median(a / b for a, b in zip(s, speed["z-lab"]))
        print(f"{name:<14} {statistics.median(s):8.1f} {vs_base:9.2f}x {vs_zlab:8.2f}x "
              f"{identical[name]:>5}/{len(prompts)}")


if __name__ == "__main__":
    main()
