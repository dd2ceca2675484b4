"""Where one verify cycle's time goes on the demo pair (or any pair), phase by phase.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python examples/cycle_phases.py --block 16 [--limit 8] [--json out.json]

See ``dflash_mlx.bench.cycle_phases`` for what each figure is. Time only with
nothing else running.
"""

import argparse
import json

import mlx.core as mx

from dflash_mlx import load, load_draft
from dflash_mlx.bench.cycle_phases import main_phases
from dflash_mlx.demo import demo_pair

pair = demo_pair()
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=str(pair.target))
parser.add_argument("--draft", default=str(pair.draft))
parser.add_argument("--block", type=int, default=16, help="fixed block size")
parser.add_argument("--max-tokens", type=int, default=128)
parser.add_argument("--limit", type=int, default=8, help="the first N of the demo's held-out prompts")
parser.add_argument("--json", help="also write the figures to this file")
args = parser.parse_args()

model, tokenizer = load(args.model)
draft = load_draft(args.draft)
prompts = [mx.array(tokenizer.encode(p)) for p in pair.load_prompts()[: args.limit]]
result = main_phases(model, draft, prompts, args.block, args.max_tokens)
if args.json:
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
