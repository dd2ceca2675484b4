"""Where one verify cycle's time goes, phase by phase, beside z-lab's loop where installed.

On the demo pair by default (or any pair); z-lab's loop is ``dflash`` 0.1.0.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python examples/cycle_phases.py --block 16 [--limit 8] [--json out.json]

See ``dflash_mlx.bench.cycle_phases`` for what each of our figures is. z-lab's
cycle (its ``stream_generate``, greedy) is run the same way through its own
pieces, the host waiting after each phase:

- draft: its draft's ``propose`` over the block, which also projects the
  previous cycle's kept features into the draft's context (our "inject");
- verify: mlx-lm's forward over the block with its layer hooks, the argmax,
  and the host reading both token lists;
- rollback: its trim, or its GatedDeltaNet state capture's replay of the
  kept steps from the block's start.

Its loop's cycle is the time between two of its streamed responses. Time only
with nothing else running.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

from dflash_mlx import load, load_draft
from dflash_mlx.bench.cycle_phases import PHASES, cycle_phases, main_phases, medians
from dflash_mlx.bench.rollback_cost import graph_ops
from dflash_mlx.demo import demo_pair

ZLAB_PHASES = ("draft", "verify", "rollback")


def _ms(tic: float) -> float:
    return (time.perf_counter() - tic) * 1e3


def zlab_cycles(zlab, model, zdraft, prompt: mx.array, block: int, max_tokens: int, phases: dict) -> list[int]:
    """z-lab's greedy cycles over one prompt, phase by phase (appended to
    ``phases``: name -> (build ms list, eval ms list)); returns the accepted drafts per cycle."""
    mask_id = int(zdraft.config.mask_token_id)
    target_cache, draft_cache = zlab.make_prompt_cache(model), zlab.make_prompt_cache(zdraft)
    logits, hidden, offset = zlab._prefill_target(model, prompt, target_cache, None, 2048)
    for c in draft_cache:
        c.offset = offset
    tokens = [mx.argmax(logits[0, -1]).item()]
    capture = None if zlab.can_trim_prompt_cache(target_cache) else zlab._GDNStateCapture()
    accepted = []
    try:
        while len(tokens) < max_tokens:
            times = {}
            tic = time.perf_counter()
            ids = mx.array([[tokens[-1]] + [mask_id] * (block - 1)])
            drafted, _, _ = zdraft.propose(ids, hidden, draft_cache, 0.0, logits_start=1)
            if (trim := draft_cache[0].offset - (prompt.size + len(tokens) - 1)) > 0:
                zlab._trim_recent_cache(draft_cache, trim)
            built = _ms(tic)
            mx.eval(drafted)
            times["draft"] = (built, _ms(tic) - built)

            tic = time.perf_counter()
            if capture is not None:
                capture.clear()
            logits = model(mx.concatenate([mx.array([[tokens[-1]]]), drafted], axis=1), target_cache)
            hidden = mx.concatenate(model._hidden_states, axis=-1)
            verdict = mx.argmax(logits, axis=-1)
            built = _ms(tic)
            mx.eval(verdict, hidden)
            d, t = drafted[0].tolist(), verdict[0].tolist()
            a = next((i for i in range(len(d)) if d[i] != t[i]), len(d))
            times["verify"] = (built, _ms(tic) - built)

            tic = time.perf_counter()
            if (trim := block - a - 1) > 0:
                if capture is None:
                    zlab._trim_recent_cache(target_cache, trim)
                else:
                    capture.rollback(target_cache, a, trim)
            hidden = hidden[:, : a + 1, :]
            built = _ms(tic)
            mx.eval([c.state for c in target_cache], hidden)
            times["rollback"] = (built, _ms(tic) - built)

            for p, (b, e) in times.items():
                phases[p][0].append(b)
                phases[p][1].append(e)
            accepted.append(a)
            tokens += d[:a] + [t[a]]
    finally:
        if capture is not None:
            capture.close()
    return accepted


def zlab_prompt(zlab, model, zdraft, tokenizer, prompt: mx.array, block: int, max_tokens: int) -> dict:
    """z-lab's cycles over one prompt phase by phase, then its own loop's time per cycle."""
    phases = {p: ([], []) for p in ZLAB_PHASES}
    accepted = zlab_cycles(zlab, model, zdraft, prompt, block, max_tokens, phases)
    loop_ms, last = [], None
    for r in zlab.stream_generate(model, zdraft, tokenizer, prompt, block_size=block, max_tokens=max_tokens):
        now = time.perf_counter()
        if last is not None and r.accepted is not None:
            loop_ms.append((now - last) * 1e3)
        last = now
    return {"accepted": accepted, "samples": {"phases": phases, "loop_ms": loop_ms}}


def zlab_verify_nodes(model, prompt: mx.array, block: int) -> int:
    """Graph nodes of z-lab's verify pass (mlx-lm's forward with its hooks, the argmax, the features)."""
    from dflash import model_mlx as zlab

    cache = zlab.make_prompt_cache(model)
    mx.eval(model(prompt[None], cache))
    logits = model(prompt[None, :block], cache)
    return sum(graph_ops(mx.argmax(logits, axis=-1), mx.concatenate(model._hidden_states, axis=-1)).values())


def pooled(runs: list[dict]) -> dict:
    """Medians over every cycle of several runs (one per prompt)."""
    names = runs[0]["samples"]["phases"]
    phases = {p: [sum((r["samples"]["phases"][p][i] for r in runs), []) for i in (0, 1)] for p in names}
    out = medians(phases, sum((r["accepted"] for r in runs), []), sum((r["samples"]["loop_ms"] for r in runs), []))
    if "t_ar_ms" in runs[0]["samples"]:
        out["t_ar_ms"] = statistics.median(sum((r["samples"]["t_ar_ms"] for r in runs), []))
    return out


def side_by_side(ours: dict, zlab: dict, block: int) -> None:
    """Both cycles' phases in one table, in ms and in mlx-lm steps (t_AR)."""
    from rich.table import Table

    from dflash_mlx.bench.render import console

    t_ar = ours["t_ar_ms"]
    t = Table(title=f"one cycle at block {block}: ours (tau {ours['tau']:.2f}) beside z-lab's (tau "
                    f"{zlab['tau']:.2f}); medians, ms (t_AR {t_ar:.2f} ms)")
    for col in ("phase", "ours build", "ours eval", "ours total", "z-lab build", "z-lab eval", "z-lab total",
                "ours / z-lab"):
        t.add_column(col, justify="right")
    sums = [0.0, 0.0]
    for p in PHASES:
        row, totals = [p], []
        for i, result in enumerate((ours, zlab)):
            f = result["phases"].get(p)
            if f is None:  # z-lab injects the kept features inside its draft pass
                row += ["", "", "(in draft)"]
                totals.append(None)
                continue
            ms = f["build_ms"] + f["eval_ms"]
            sums[i] += ms
            totals.append(ms)
            row += [f"{f['build_ms']:.2f}", f"{f['eval_ms']:.2f}", f"{ms:.2f}"]
        row.append(f"{totals[0] / totals[1]:.2f}" if None not in totals else "")
        t.add_row(*row)
    t.add_row("sum of phases", "", "", f"{sums[0]:.2f}", "", "", f"{sums[1]:.2f}", f"{sums[0] / sums[1]:.2f}")
    loops = ours["loop_cycle_ms"], zlab["loop_cycle_ms"]
    t.add_row("the loop's cycle", "", "", f"{loops[0]:.2f}", "", "", f"{loops[1]:.2f}", f"{loops[0] / loops[1]:.2f}")
    t.add_row("... per token made", "", "", f"{loops[0] / ours['tau']:.2f}", "", "",
              f"{loops[1] / zlab['tau']:.2f}", f"{loops[0] / ours['tau'] / (loops[1] / zlab['tau']):.2f}")
    console().print(t)
    console().print(f"verify graph nodes at block {block}: ours {ours['verify_nodes']}, z-lab {zlab['verify_nodes']}")


def main() -> None:
    pair = demo_pair()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(pair.target))
    parser.add_argument("--draft", default=str(pair.draft))
    parser.add_argument("--block", type=int, default=16, help="fixed block size")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=8, help="the first N of the demo's held-out prompts")
    parser.add_argument("--no-zlab", action="store_true", help="ours alone, even where z-lab's dflash is installed")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    model, tokenizer = load(args.model)
    draft = load_draft(args.draft)
    prompts = [mx.array(tokenizer.encode(p)) for p in pair.load_prompts()[: args.limit]]
    try:
        from dflash import model_mlx as zlab
        from zlab_compare import load_zlab_draft
    except ImportError:
        args.no_zlab = True
        print("z-lab's dflash is not installed (pip install --no-deps dflash==0.1.0): ours alone")
    if args.no_zlab:
        result = main_phases(model, draft, prompts, args.block, args.max_tokens)
    else:
        zmodel = load(args.model)[0]  # z-lab's own instance: it wraps the model's layers in hooks
        zdraft = load_zlab_draft(args.draft)
        zlab._patch_model(zmodel, zdraft.config.target_layer_ids)  # what its stream_generate does first
        zdraft.bind(zmodel)
        ours, theirs = [], []
        for i, prompt in enumerate(prompts):  # the two loops alternate, prompt by prompt
            arms = [lambda: ours.append(cycle_phases(model, draft, [prompt], args.block, args.max_tokens)),
                    lambda: theirs.append(zlab_prompt(zlab, zmodel, zdraft, tokenizer, prompt, args.block,
                                                      args.max_tokens))]
            for arm in arms if i % 2 == 0 else arms[::-1]:
                arm()
        result = {"ours": pooled(ours), "zlab": pooled(theirs)}
        result["ours"]["verify_nodes"] = ours[0]["verify_nodes"]
        result["zlab"]["verify_nodes"] = zlab_verify_nodes(zmodel, prompts[0], args.block)
        side_by_side(result["ours"], result["zlab"], args.block)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
