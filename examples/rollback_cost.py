"""Rollback and verify against an autoregressive step on the hybrid synthetic target.

    python examples/rollback_cost.py --block 16 [--json out.json]

A random ~220M-parameter qwen3_5 target (GatedDeltaNet + attention) is built in
memory; see ``dflash_mlx.bench.rollback_cost`` for what each figure is.
"""

import argparse
import json

from dflash_mlx.bench.rollback_cost import main_rollback

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--block", type=int, default=16, help="verified block size")
parser.add_argument("--json", help="also write the figures to this file")
args = parser.parse_args()

result = main_rollback(args.block)
if args.json:
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
