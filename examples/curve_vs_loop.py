"""The cost curve's price of a cycle against the loop's own cycles, at each block size.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 [OPENBLAS_NUM_THREADS=1] \\
        python examples/curve_vs_loop.py [--cycles 10]

Measures the pair's curve afresh (``loop.cost_curve.measure``, as ``block_size="auto"``
would), then runs one ``SpeculativeDecoder`` at each fixed block in turn, timing a run of
its cycles (each from the end of the one before, after three to warm up; their median).
Both are printed in milliseconds and in plain steps. The prompt is a stretch of ids, so
the drafts are mostly rejected: the loop's figure is the cost of a cycle, not its gain.
Time only with nothing else running.
"""

import argparse
import statistics
import time

import mlx.core as mx

from dflash_mlx import Target, load, load_draft
from dflash_mlx.demo import demo_pair
from dflash_mlx.loop.block_policy import FixedBlock
from dflash_mlx.loop.cost_curve import CONTEXT, measure, sizes_for
from dflash_mlx.loop.decoder import SpeculativeDecoder, proposer_for

pair = demo_pair()
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=str(pair.target))
parser.add_argument("--draft", default=str(pair.draft))
parser.add_argument("--cycles", type=int, default=10, help="cycles timed at each block size")
args = parser.parse_args()

model, _ = load(args.model)
draft = load_draft(args.draft)
target = Target(model)
sizes = sizes_for(draft.config.block_size)
curve = measure(target, draft, sizes)
decoder = SpeculativeDecoder(target, proposer_for(draft, target), draft.config.target_layer_ids, 1)
decoder.prefill(mx.arange(CONTEXT, dtype=mx.int32) % target.vocab_size)
loop = {}
for b in sizes:
    decoder.policy = FixedBlock(b)
    for _ in range(3):
        decoder.cycle()
    times, last = [], time.perf_counter()
    for _ in range(args.cycles):
        decoder.cycle()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    loop[b] = statistics.median(times)
print(f"{'b':>3} {'curve ms':>9} {'steps':>6} {'loop ms':>8} {'steps':>6}")
for b in sizes:
    priced = curve.cycle_seconds(b)
    print(f"{b:>3} {priced * 1e3:>9.2f} {priced / curve.cycle_seconds(1):>6.2f} "
          f"{loop[b] * 1e3:>8.2f} {loop[b] / loop[1]:>6.2f}")
