"""When each token arrives: mlx-lm's decoding and DFlash's (auto) on one long prompt, token by token.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=1 \
        python examples/token_timeline.py [--context 2500] [--prompt 2] [--runs 16]

The two sides alternate in one process (the order flips every run) on a prompt
of ``--context`` tokens cut from Python's standard library as ``bench
--context`` cuts them, with auto on the pair's cost curve (measured once if not
cached). Prints each step's median time over the runs for the first steps, the
step where DFlash differs most (a probe's draft pass, where one runs), and the
sums of the per-step medians before and after it. Greedy; time only with
nothing else running.
"""

import argparse
import statistics
import time

from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_sampler

from dflash_mlx import Target, load, load_draft, stream_generate
from dflash_mlx.bench.long_context import context_prompts
from dflash_mlx.bench.runs import fresh
from dflash_mlx.loop.cost_curve import cost_curve
from dflash_mlx.demo import demo_pair

pair = demo_pair()
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=str(pair.target))
parser.add_argument("--draft", default=str(pair.draft))
parser.add_argument("--context", type=int, default=2500, help="prompt tokens")
parser.add_argument("--prompt", type=int, default=2, help="which of the three prompts of that length (1-3)")
parser.add_argument("--max-tokens", type=int, default=96)
parser.add_argument("--runs", type=int, default=16, help="runs of each side")
parser.add_argument("--show", type=int, default=14, help="steps printed one by one")
args = parser.parse_args()

model, tokenizer = load(args.model)
draft = load_draft(args.draft)
ids = context_prompts(tokenizer, [args.context], 3)[args.prompt - 1]["ids"]
curve = cost_curve(Target(model), draft)


def arrivals(responses) -> list[float]:
    """Seconds from the call to each token's arrival."""
    times, tic = [], time.perf_counter()
    for r in responses:
        times += [time.perf_counter() - tic] * (len(r.tokens) if hasattr(r, "tokens") else 1)
    return times


sides = {
    "mlx-lm": lambda: arrivals(mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens,
                                                      sampler=make_sampler(0.0))),
    "DFlash auto": lambda: arrivals(stream_generate(model, draft, tokenizer, ids, max_tokens=args.max_tokens,
                                                    block_size="auto", cost_curve=curve)),
}
runs = {name: [] for name in sides}
for r in range(args.runs):
    for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
        fresh()
        runs[name].append(sides[name]())

steps = min(len(t) for ts in runs.values() for t in ts) - 1
medians = {name: [statistics.median(t[i + 1] - t[i] for t in ts) * 1e3 for i in range(steps)]
           for name, ts in runs.items()}
print(f"{args.context}-token prompt {args.prompt}, {args.runs} runs each: median ms of steps 1-{args.show}")
for name, m in medians.items():
    print(f"  {name:12s}", " ".join(f"{x:5.1f}" for x in m[: args.show]))
base, mine = medians["mlx-lm"], medians["DFlash auto"]
k = max(range(steps), key=lambda i: mine[i] - base[i])
print(f"largest difference at step {k + 1}: {mine[k]:.1f} against {base[k]:.1f} ms")
print(f"sums of the per-step medians, DFlash / mlx-lm: steps 1-{k}: {sum(mine[:k]):.1f} / {sum(base[:k]):.1f} ms; "
      f"steps {k + 2}-{steps}: {sum(mine[k + 1:]):.1f} / {sum(base[k + 1:]):.1f} ms")
