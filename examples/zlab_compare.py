"""dflash-mlx against z-lab's and mlx-dspark's MLX implementations on the same weights.

Runs, prompt by prompt and in alternation, mlx-lm's ``stream_generate``
(the baseline), z-lab's ``dflash.model_mlx.stream_generate`` (``dflash``
0.1.0 on PyPI) at each of ``--zlab-blocks`` (default 8 and 16), mlx-dspark's
``dflash_generate`` (``mlx-dspark`` 0.20.3, where installed) in each of
``--dspark-arms`` and ours (``--block-size``, default auto), all greedy over
the same token ids, and prints each one's decode speed, the median
per-prompt speed ratios (against mlx-lm, and against the peers at their
best: the arm with the best median, and the faster peer arm on each prompt)
and whether every output is identical to the baseline's. Decode time is
from the first streamed token to the last; mlx-dspark streams nothing here,
so its arms take its own ``decode_seconds`` (the run less its prompt
evaluation), over every token it committed (its last round may pass
``--max-tokens``; the identity check reads the first ``--max-tokens``).

mlx-dspark's arms: ``full`` (the draft unquantized, every drafted token
verified), ``auto`` (unquantized, its measured cap on the drafts verified,
``static_cap``: calibrated once and cached by mlx-dspark) and ``default``
(its defaults: the draft quantized to 4 bits, the measured cap).

    pip install --no-deps dflash==0.1.0          # z-lab's package (import name: dflash)
    pip install --no-deps mlx-dspark==0.20.3     # optional (import name: mlx_dspark)
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python examples/zlab_compare.py                      # the bundled demo pair

Time only with nothing else running.
"""

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate as mlx_lm_stream

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.demo import demo_pair


@contextlib.contextmanager
def hub_layout(path: str):
    """A directory holding only the draft's config and weights in the hub's
    names (a DFlash2 selector's codebooks without the ``.weight`` our MLX
    layout gives them), not our vocabulary ranking: what the peers' loaders read."""
    weights = mx.load(str(Path(path, "model.safetensors")))
    hub = {k.removesuffix(".weight") if k.endswith("_codebook.weight") else k: v for k, v in weights.items()}
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(Path(path, "config.json").resolve(), Path(tmp, "config.json"))
        mx.save_safetensors(str(Path(tmp, "model.safetensors")), hub)
        yield tmp


def load_zlab_draft(path: str):
    """z-lab's ``load_draft`` fetches from the hub and loads every safetensors file there."""
    from dflash import model_mlx

    with hub_layout(path) as tmp:
        model_mlx.snapshot_download = lambda repo_id, **_: repo_id
        return model_mlx.load_draft(tmp)


def dspark_arms(model_path: str, draft_path: str, names: list[str], n: int) -> dict:
    """mlx-dspark's arms by name (``full``, ``auto``, ``default``), each
    ids -> (tokens, decode seconds, rounds); none where it is not installed."""
    try:
        from mlx_dspark.calibrate import static_cap
        from mlx_dspark.generate import dflash_generate
        from mlx_dspark.load import load_dflash, load_target
    except ImportError:
        print("mlx-dspark is not installed: its arms are left out")
        return {}
    target, tokenizer = load_target(model_path, require_tap=True)
    arms = {}
    with hub_layout(draft_path) as tmp:
        for name in names:
            quantized = name == "default"
            drafter, _ = load_dflash(tmp, quantize=quantized)
            drafter.bind(target.model)
            cap = None if name == "full" else static_cap(target, drafter, mode="dflash", target_repo=model_path,
                                                         drafter_repo=f"{draft_path}#{'q4' if quantized else 'full'}",
                                                         fallback=drafter.config.block_size - 1)

            def run(ids, drafter=drafter, cap=cap):
                r = dflash_generate(target, tokenizer, drafter, prompt_ids=list(ids), max_new_tokens=n,
                                    max_draft_tokens=cap, apply_chat_template=False)
                return r.token_ids, r.decode_seconds, r.num_rounds

            arms[f"mlx-dspark {name}"] = run
    return arms


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
    return cut((tokens, time.perf_counter() - start, cycles), eos)


def cut(run: tuple, eos: set[int]) -> tuple[list[int], float, int]:
    """An arm's (tokens, seconds, cycles) with the tokens up to EOS (not included)."""
    tokens, seconds, cycles = run
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))], seconds, cycles


def main() -> None:
    pair = demo_pair()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(pair.target))
    ap.add_argument("--draft", default=str(pair.draft))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", default="auto", help="ours: auto or an integer")
    ap.add_argument("--zlab-blocks", default="8,16", help="z-lab's fixed blocks, comma-separated")
    ap.add_argument("--dspark-arms", default="full,auto,default",
                    help="mlx-dspark's settings, comma-separated (full, auto, default); empty: none")
    ap.add_argument("--limit", type=int, default=0, help="at most N of the demo's held-out prompts")
    args = ap.parse_args()
    block = args.block_size if args.block_size == "auto" else int(args.block_size)

    from dflash import model_mlx as zlab

    model, tokenizer = load(args.model)
    zmodel = load(args.model)[0]  # z-lab's own instance: its stream_generate wraps the model's layers in hooks
    draft = load_draft(args.draft)
    zdraft = load_zlab_draft(args.draft)
    prompts = pair.load_prompts()[: args.limit or None]
    n = args.max_tokens
    eos = set(tokenizer.eos_token_ids)
    streamed = lambda stream: lambda ids: decode_run(stream(ids), eos)  # noqa: E731
    zlab_arms = {f"z-lab b={b}": streamed(lambda ids, b=int(b): zlab.stream_generate(
        zmodel, zdraft, tokenizer, ids, block_size=b, max_tokens=n)) for b in args.zlab_blocks.split(",")}
    dspark = {name: (lambda ids, run=run: cut(run(ids), eos)) for name, run in dspark_arms(
        args.model, args.draft, [a for a in args.dspark_arms.split(",") if a], n).items()}
    arms = {
        "mlx-lm": streamed(lambda ids: mlx_lm_stream(model, tokenizer, ids, max_tokens=n)),
        **zlab_arms,
        **dspark,
        f"ours b={args.block_size}": streamed(lambda ids: stream_generate(
            model, draft, tokenizer, ids, block_size=block, max_tokens=n)),
    }
    for run in arms.values():  # warm-up (and ours measures its cost curve here)
        run(tokenizer.encode(prompts[0]))
    speed = {name: [] for name in arms}
    identical = {name: 0 for name in arms}
    made = {name: [0, 0] for name in arms}  # tokens after the first, cycles
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        outputs = {}
        for name, run in (arms.items() if i % 2 == 0 else reversed(arms.items())):
            mx.clear_cache()
            tokens, seconds, cycles = run(ids)
            outputs[name] = tokens[:n]
            made[name][0] += len(tokens) - 1
            made[name][1] += cycles
            speed[name].append(max(len(tokens) - 1, 1) / seconds)
        for name in arms:
            identical[name] += outputs[name] == outputs["mlx-lm"]
    base = speed["mlx-lm"]
    peers = {group: names for group, names in (("z-lab", list(zlab_arms)), ("mlx-dspark", list(dspark))) if names}
    columns = []  # (title, per-prompt speeds to divide by)
    for group, names in peers.items():
        best_arm = max(names, key=lambda name: statistics.median(speed[name]))
        columns += [(f"vs {best_arm}", speed[best_arm]),
                    (f"vs {group} best/prompt", [max(s) for s in zip(*(speed[name] for name in names))])]
    print(f"{len(prompts)} prompts x {n} tokens, greedy; median decode tok/s and per-prompt ratios")
    print(f"{'arm':<18} {'tok/s':>8} {'vs mlx-lm':>10} " + " ".join(f"{title:>24}" for title, _ in columns)
          + f" {'identical':>10} {'tokens/cycle':>13}")
    for name, s in speed.items():
        ratios = [statistics.median(a / b for a, b in zip(s, other)) for other in [base] + [c for _, c in columns]]
        print(f"{name:<18} {statistics.median(s):8.1f} {ratios[0]:9.2f}x "
              + " ".join(f"{r:23.2f}x" for r in ratios[1:])
              + f" {identical[name]:>5}/{len(prompts)} {made[name][0] / max(made[name][1], 1):13.2f}")


if __name__ == "__main__":
    main()
