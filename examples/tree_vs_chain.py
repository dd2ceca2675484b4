"""DDTree against the chain on the bundled demo pair, greedy: tokens per cycle
and decode speed of a block-16 chain and of a tree of ``--budget`` nodes.

    python examples/tree_vs_chain.py [--prompts 8] [--max-tokens 128] [--budget 32]

Both arms are the target's greedy output (checked); each prompt runs once
untimed first (warm-up), then ``--repeat`` times, keeping the best decode
rate (prefill excluded).
"""

import argparse

from dflash_mlx import generate, load, load_draft
from dflash_mlx.demo import demo_pair


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    pair = demo_pair()
    model, tokenizer = load(str(pair.target))
    draft = load_draft(str(pair.draft))
    arms = {"chain": dict(block_size=args.block_size),
            "tree": dict(block_size=args.block_size, tree_budget=args.budget)}
    totals = {name: [0, 0, 0.0] for name in arms}  # tokens, cycles, decode seconds
    for prompt in pair.load_prompts()[: args.prompts]:
        outputs = {}
        for name, options in arms.items():
            generate(model, draft, tokenizer, prompt, max_tokens=args.max_tokens, **options)
            runs = [generate(model, draft, tokenizer, prompt, max_tokens=args.max_tokens, **options)
                    for _ in range(args.repeat)]
            result = max(runs, key=lambda r: r.generation_tps)  # decode only, prefill excluded
            outputs[name] = result.tokens
            totals[name][0] += len(result.tokens)
            totals[name][1] += len(result.acceptance_lengths)
            totals[name][2] += len(result.tokens) / result.generation_tps
        assert outputs["chain"] == outputs["tree"], "the arms disagree: one of them is not greedy"
    for name, (tokens, cycles, seconds) in totals.items():
        print(f"{name:5s} {arms[name]}: {tokens / cycles:.2f} tokens/cycle, {tokens / seconds:.1f} tok/s "
              f"({tokens} tokens, {cycles} cycles)")
    chain, tree = totals["chain"], totals["tree"]
    print(f"tree/chain: tokens per cycle x{(tree[0] / tree[1]) / (chain[0] / chain[1]):.2f}, "
          f"decode wall-clock x{tree[2] / chain[2]:.2f} (below 1: the tree is faster)")


if __name__ == "__main__":
    main()
