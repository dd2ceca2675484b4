"""dflash-mlx against z-lab's own MLX implementation on the same weights.

Runs, prompt by prompt and in alternation, mlx-lm's ``stream_generate``
(the baseline), z-lab's ``dflash.model_mlx.stream_generate`` (``dflash``
0.1.0 on PyPI) at each of ``--zlab-blocks`` (default 8 and 16) and ours
(``--block-size``, default auto), all greedy over the same token ids, and
prints each one's decode speed, the median per-prompt speed ratios (against
mlx-lm, and against z-lab at its best block: the faster of its arms on each
prompt, and the arm with the best median) and whether every output is
identical to the baseline's. Decode time is measured
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
    weights in the hub's names (a DFlash2 selector's codebooks without the
    ``.weight`` our MLX layout gives them), not our vocabulary ranking."""
    from dflash import model_mlx

    weights = mx.load(str(Path(path, "model.safetensors")))
    hub = {k.removesuffix(".weight") if k.endswith("_codebook.weight") else k: v for k, v in weights.items()}
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(Path(path, "config.json").resolve(), Path(tmp, "config.json"))
        mx.save_safetensors(str(Path(tmp, "model.safetensors")), hub)
        model_mlx.snapshot_download = lambda repo_id, **_: repo_id
        return model_mlx.load_draft(tmp)


def decode_run(responses, eos: set[int]) -> tuple[list[int], float, int]:
    """Tokens of a stream up to EOS (not included), the seconds from its
    first streamed token to its last, and how many responses came after the
    first (a speculative loop's cycles)."""
    tokens, start, cycles = [], None, -1
    for r in responses:
        cycles += 1
        tokens.extend(r.tokens if hasattr(r, "tokens") else [r.token])  # mlx-lm streams one token
        if start is None:
            start = time.perf_counter()
    seconds = time.perf_counter() - start
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut], seconds, cycles


def main() -> None:
    pair = demo_pair()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(pair.target))
    ap.add_argument("--draft", default=str(pair.draft))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", default="auto", help="ours: auto or an integer")
    ap.add_argument("--zlab-blocks", default="8,16", help="z-lab's fixed blocks, comma-separated")
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
    zlab_arms = {f"z-lab b={b}": (lambda ids, b=int(b): zlab.stream_generate(
        model, zdraft, tokenizer, ids, block_size=b, max_tokens=n)) for b in args.zlab_blocks.split(",")}
    arms = {
        "mlx-lm": lambda ids: mlx_lm_stream(model, tokenizer, ids, max_tokens=n),
        **zlab_arms,
        f"ours b={args.block_size}": lambda ids: stream_generate(
            model, draft, tokenizer, ids, block_size=block, max_tokens=n),
    }
    for run in arms.values():  # warm-up (and ours measures its cost curve here)
        decode_run(run(tokenizer.encode(prompts[0])), eos)
    speed = {name: [] for name in arms}
    identical = {name: 0 for name in arms}
    made = {name: [0, 0] for name in arms}  # tokens after the first, cycles
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        outputs = {}
        for name, run in (arms.items() if i % 2 == 0 else reversed(arms.items())):
            mx.clear_cache()
            tokens, seconds, cycles = decode_run(run(ids), eos)
            outputs[name] = tokens
            made[name][0] += len(tokens) - 1
            made[name][1] += cycles
            speed[name].append(max(len(tokens) - 1, 1) / seconds)
        for name in arms:
            identical[name] += outputs[name] == outputs["mlx-lm"]
    base = speed["mlx-lm"]
    best_arm = max(zlab_arms, key=lambda name: statistics.median(speed[name]))
    best = [max(s) for s in zip(*(speed[name] for name in zlab_arms))]  # per prompt
    print(f"{len(prompts)} prompts x {n} tokens, greedy; median decode tok/s and per-prompt ratios")
    print(f"{'arm':<14} {'tok/s':>8} {'vs mlx-lm':>10} {'vs ' + best_arm:>14} {'vs z-lab best/prompt':>21} "
          f"{'identical':>10} {'tokens/cycle':>13}")
    for name, s in speed.items():
        vs_base = statistics.median(a / b for a, b in zip(s, base))
        vs_arm = statistics.median(a / b for a, b in zip(s, speed[best_arm]))
        vs_best = statistics.median(a / b for a, b in zip(s, best))
        print(f"{name:<14} {statistics.median(s):8.1f} {vs_base:9.2f}x {vs_arm:13.2f}x {vs_best:20.2f}x "
              f"{identical[name]:>5}/{len(prompts)} {made[name][0] / max(made[name][1], 1):13.2f}")


if __name__ == "__main__":
    main()
