"""Auto against fixed blocks on the same tokens and prices, without timing noise.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python examples/auto_replay.py [--prompts demo] [--max-tokens 128] [--blocks 4,8,16]

Decodes each prompt greedily once, records what a cycle would accept at every
position and block size (``dflash_mlx.bench.replay.acceptance_table``), then
replays ``block_size="auto"``'s policy and each fixed block over those records,
pricing every cycle on the pair's cost curve for this machine (cached, else
measured first). The replay makes exactly the loop's cycles
(tests/test_replay.py), so what differs between the arms is the policy alone;
where ``dflash-mlx bench`` ranks them otherwise, the curve's prices differ from
what the cycles cost. Tokens per second here are priced, not timed.
"""

import argparse

from dflash_mlx import Target, generate, load, load_draft
from dflash_mlx.bench.prompts import select_prompts
from dflash_mlx.bench.replay import acceptance_table, replay
from dflash_mlx.chat import encode, template_ids
from dflash_mlx.demo import demo_pair
from dflash_mlx.loop.block_policy import AdaptiveBlock, FixedBlock
from dflash_mlx.loop.cost_curve import cost_curve

pair = demo_pair()
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=str(pair.target))
parser.add_argument("--draft", default=str(pair.draft))
parser.add_argument("--prompts", default="demo", help="demo, builtin or a JSONL file of {prompt, category, id}")
parser.add_argument("--no-chat-template", action="store_true", help="feed prompts as they are")
parser.add_argument("--max-tokens", type=int, default=128)
parser.add_argument("--blocks", default="4,8,16", help="fixed blocks to replay beside auto")
args = parser.parse_args()

model, tokenizer = load(args.model)
draft = load_draft(args.draft)
target = Target(model)
curve = cost_curve(target, draft)
fixed = [int(b) for b in args.blocks.split(",")]
arms = {"auto": lambda: AdaptiveBlock(curve, draft.config.block_size)}
arms.update({f"b={b}": (lambda b=b: FixedBlock(b)) for b in fixed})
totals = {name: [0, 0.0, 0] for name in arms}  # tokens, seconds, cycles
for k, p in enumerate(select_prompts(args.prompts, None, None)):
    ids = encode(tokenizer, p["prompt"]) if args.no_chat_template else template_ids(tokenizer, p["prompt"])
    reply = generate(model, draft, tokenizer, ids, max_tokens=args.max_tokens, block_size=max(fixed)).tokens
    if len(reply) < 2:
        continue
    table = acceptance_table(target, draft, ids, reply)
    row = []
    for name, policy in arms.items():
        out = replay(table, len(ids), policy(), curve, args.max_tokens)
        totals[name][0] += out.tokens
        totals[name][1] += out.seconds
        totals[name][2] += len(out.blocks)
        row.append(f"{name} {out.tokens / out.seconds:.0f}")
    print(f"{p.get('id', k)}: {len(reply)} tokens, priced tokens/s: " + ", ".join(row), flush=True)

rates = {name: tokens / seconds for name, (tokens, seconds, _) in totals.items()}
best = max((r, name) for name, r in rates.items() if name != "auto")
print(f"\npriced on the curve measured {curve.sizes} (plain step {curve.cycle_seconds(1) * 1e3:.2f} ms):")
for name, (tokens, seconds, cycles) in totals.items():
    print(f"  {name:6s} {rates[name]:7.1f} tokens/s  {tokens / cycles:.2f} tokens/cycle")
print(f"auto / best fixed ({best[1]}): {rates['auto'] / best[0]:.3f}x")
