"""Auto against fixed blocks on the same tokens and prices, without timing noise.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python examples/auto_replay.py [--prompts demo] [--max-tokens 128] [--blocks 4,8,16] \\
            [--tables demo-tables.json] [--curve cost-curve.json]

Decodes each prompt greedily once, records what a cycle would accept at every
position and block size (``dflash_mlx.bench.replay.acceptance_table``), then
replays ``block_size="auto"``'s policy and each fixed block over those records,
pricing every cycle on the pair's cost curve for this machine (cached, else
measured first). The replay makes exactly the loop's cycles
(tests/test_replay.py), so what differs between the arms is the policy alone;
where ``dflash-mlx bench`` ranks them otherwise, the curve's prices differ from
what the cycles cost. Tokens per second here are priced, not timed. Two
ceilings are printed beside them: each reply at its own best fixed block (from
2 to the draft's trained size, or plain steps), and in hindsight (``hindsight``:
every cycle's block chosen knowing what it will accept), which no policy passes.
``--tables`` keeps the records in a file (read back when it exists: the
prompts' replies are decoded and recorded once, about 10 ms a position and
block size on the demo pair); ``--curve`` prices on a cached curve file
(``~/.cache/dflash-mlx/cost-curves/*.json``) instead of this machine's.
"""

import argparse
import json
from pathlib import Path

from dflash_mlx import Target, generate, load, load_draft
from dflash_mlx.atomic import write_text
from dflash_mlx.bench.prompts import select_prompts
from dflash_mlx.bench.replay import acceptance_table, hindsight, replay
from dflash_mlx.chat import encode, template_ids
from dflash_mlx.demo import demo_pair
from dflash_mlx.loop.block_policy import AdaptiveBlock, FixedBlock
from dflash_mlx.loop.cost_curve import CostCurve, cost_curve

pair = demo_pair()
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=str(pair.target))
parser.add_argument("--draft", default=str(pair.draft))
parser.add_argument("--prompts", default="demo", help="demo, builtin or a JSONL file of {prompt, category, id}")
parser.add_argument("--no-chat-template", action="store_true", help="feed prompts as they are")
parser.add_argument("--max-tokens", type=int, default=128)
parser.add_argument("--blocks", default="4,8,16", help="fixed blocks to replay beside auto")
parser.add_argument("--tables", help="read the records from this file if it exists, else write them to it")
parser.add_argument("--curve", help="a cached cost-curve file to price on (default: this machine's)")
args = parser.parse_args()

model, tokenizer = load(args.model)
draft = load_draft(args.draft)
target = Target(model)
curve = CostCurve.from_dict(json.loads(Path(args.curve).read_text())["curve"]) if args.curve else cost_curve(target, draft)


def recorded() -> list[dict]:
    """Each prompt's id, length and acceptance table: from ``--tables``, else decoded and recorded."""
    if args.tables and Path(args.tables).exists():
        return json.loads(Path(args.tables).read_text())
    records = []
    for k, p in enumerate(select_prompts(args.prompts, None, None)):
        ids = encode(tokenizer, p["prompt"]) if args.no_chat_template else template_ids(tokenizer, p["prompt"])
        reply = generate(model, draft, tokenizer, ids, max_tokens=args.max_tokens,
                         block_size=draft.config.block_size).tokens
        if len(reply) > 1:
            records.append({"id": p.get("id", k), "prompt_tokens": len(ids),
                            "table": acceptance_table(target, draft, ids, reply)})
    if args.tables:
        write_text(Path(args.tables), json.dumps(records))
    return records


fixed = [int(b) for b in args.blocks.split(",")]
arms = {"auto": lambda: AdaptiveBlock(curve, draft.config.block_size)}
arms.update({f"b={b}": (lambda b=b: FixedBlock(b)) for b in fixed})
ceilings = ("best fixed per reply", "hindsight")
totals = {name: [0, 0.0, 0] for name in [*arms, *ceilings]}  # tokens, seconds, cycles
for record in recorded():
    table, prompt_tokens, row = record["table"], record["prompt_tokens"], []
    every_fixed = [replay(table, prompt_tokens, FixedBlock(b), curve, args.max_tokens)
                   for b in range(1, draft.config.block_size + 1)]
    outs = {name: replay(table, prompt_tokens, policy(), curve, args.max_tokens) for name, policy in arms.items()}
    outs[ceilings[0]] = min(every_fixed, key=lambda out: out.seconds)
    outs[ceilings[1]] = hindsight(table, prompt_tokens, curve, args.max_tokens)
    for name, out in outs.items():
        totals[name][0] += out.tokens
        totals[name][1] += out.seconds
        totals[name][2] += len(out.blocks)
        row.append(f"{name} {out.tokens / out.seconds:.0f}")
    print(f"{record['id']}: {len(table)} tokens, priced tokens/s: " + ", ".join(row), flush=True)

rates = {name: tokens / seconds for name, (tokens, seconds, _) in totals.items()}
best = max((r, name) for name, r in rates.items() if name in arms and name != "auto")
print(f"\npriced on the curve measured {curve.sizes} (plain step {curve.cycle_seconds(1) * 1e3:.2f} ms):")
for name, (tokens, seconds, cycles) in totals.items():
    print(f"  {name:20s} {rates[name]:7.1f} tokens/s  {tokens / cycles:.2f} tokens/cycle")
print(f"auto / best fixed ({best[1]}): {rates['auto'] / best[0]:.3f}x")
