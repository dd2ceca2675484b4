"""What a reduced drafting vocabulary saves: the draft's proposal at block b
with the full LM head against the head over the N top-ranked ids, on the
synthetic target of ``dflash-mlx bench --synthetic`` (a random ~200M-parameter
llama built in memory, vocabulary 32000) and a random 1-layer DFlash draft.

    python examples/draft_vocab_cost.py [--vocab-size 151936] [--sizes 4096,16384] [--block-size 16]

Each figure is the best of ``--repeats`` proposals (background load only slows
a pass down). What it costs in acceptance is measured on a trained pair:
``dflash-mlx bench --prompts demo -b 16 --draft-vocab N`` against the same
command without ``--draft-vocab``.
"""

import argparse
import time

import mlx.core as mx
import numpy as np

from dflash_mlx import Target
from dflash_mlx.bench.synthetic import synthetic_target
from dflash_mlx.loop.decoder import DraftProposer
from dflash_mlx.draft import DFlashDraft
from dflash_mlx.draft import rank_tokens, subset_head
from dflash_mlx.train.config import DraftTrainConfig, draft_config_for


def best_ms(proposer: DraftProposer, block_size: int, repeats: int) -> float:
    y = mx.array([1], dtype=mx.int32)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        tic = time.perf_counter()
        mx.eval(proposer.propose(y, block_size))
        times.append(time.perf_counter() - tic)
    return 1e3 * min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--sizes", default="4096,8192", help="Comma-separated drafting vocabulary sizes.")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    target = Target(synthetic_target(vocab_size=args.vocab_size))
    draft = DFlashDraft(draft_config_for(target, DraftTrainConfig(num_layers=1), args.vocab_size - 1))
    mx.eval(draft.parameters())
    cache = draft.make_cache()
    features = mx.random.normal((1, 64, target.hidden_size * len(draft.config.target_layer_ids)))
    draft.inject(features, cache)  # a context of 64 positions
    ranking = rank_tokens(np.random.default_rng(0).zipf(1.3, 200_000) % args.vocab_size, args.vocab_size)
    full = best_ms(DraftProposer(draft, target, cache), args.block_size, args.repeats)
    print(f"vocabulary {args.vocab_size}, block {args.block_size}: full head {full:.1f} ms per proposal")
    for n in (int(s) for s in args.sizes.split(",")):
        head = subset_head(target, ranking, n)
        ms = best_ms(DraftProposer(draft, target, cache, head), args.block_size, args.repeats)
        print(f"  --draft-vocab {n:6d}: {ms:.1f} ms ({ms / full:.2f} of the full head's time)")


if __name__ == "__main__":
    main()
