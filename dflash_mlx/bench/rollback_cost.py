"""Per-phase cost of one verified block on the hybrid synthetic target, against an
autoregressive step (``examples/rollback_cost.py`` prints it).

- t_AR: mlx-lm's own greedy decoding, time per token (as ``bench --synthetic``).
- verify: ``Target.forward`` over the block with ``record=True``, argmax of the logits.
- rollback at every kept length: ``Target.rollback`` (attention trimmed;
  GatedDeltaNet states taken from the verify pass's checkpoints, at most
  ``CHECKPOINT_EVERY`` - 1 steps replayed), next to replaying the kept steps
  from the block's start with mlx-lm's ``gated_delta_update`` in every
  GatedDeltaNet layer, which is what rollback did before.
- the verify pass's recurrence, summed over the GatedDeltaNet layers: graph
  nodes and time of mlx-lm's ``gated_delta_ops`` and of ``gated_delta_steps``
  on the same inputs.

Every time is the fastest of its repeats (background load only slows a run down).
"""

import io
import re
import time
from collections import Counter

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, gated_delta_update

from ..targets import CHECKPOINT_EVERY, steps
from ..targets import Target
from .synthetic import PROMPT, RUNS, _autoregressive, hybrid_target

REPEATS = 3


def graph_ops(*arrays) -> Counter:
    """Primitives in the (not yet evaluated) graph behind ``arrays``, by name."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))


def _timed(run) -> float:
    """Milliseconds ``run`` takes, its outputs evaluated."""
    tic = time.perf_counter()
    mx.eval(run())
    return (time.perf_counter() - tic) * 1e3


def _replay_from_start(records: list, keep: int) -> list:
    return [gated_delta_update(*(t[:, :keep] for t in (r.q, r.k, r.v, r.a, r.b)), r.layer.A_log,
                               r.layer.dt_bias, r.state, None, use_kernel=False)[1] for r in records]


def _recurrence(records: list) -> dict:
    """Nodes and ms of the verify recurrence over every GatedDeltaNet layer, mlx-lm's and ours."""
    inputs = [(r.q, r.k, r.v, compute_g(r.layer.A_log, r.a, r.layer.dt_bias), mx.sigmoid(r.b), r.state)
              for r in records]
    mx.eval(inputs)
    ways = {"mlx_lm": lambda: [gated_delta_ops(*x) for x in inputs],
            "steps": lambda: [steps(*x) for x in inputs]}
    out = {}
    for name, run in ways.items():
        out[f"{name}_nodes"] = sum(graph_ops(*(x for _, x in tree_flatten(run()))).values())
        _timed(run)
        out[f"{name}_ms"] = min(_timed(run) for _ in range(REPEATS))
    return out


def rollback_costs(model=None, block: int = 16) -> dict:
    """t_AR, t_verify, the verify recurrence and one row per kept length 1..block-1 (ms)."""
    model = model or hybrid_target()
    target = Target(model)
    prompt = mx.arange(PROMPT, dtype=mx.int32) * 7 % target.vocab_size
    t_ar = 1e3 / max(_autoregressive(model, prompt, 33)[1] for _ in range(RUNS))
    cache = target.make_cache()
    target.forward(prompt[None], cache, [0])
    tokens = mx.arange(block, dtype=mx.int32)[None]

    def verify():
        out = target.forward(tokens, cache, [0], record=True)
        mx.eval(mx.argmax(target.logits(out.hidden), axis=-1), [c.state for c in cache])
        return out

    before = [list(c.cache) if isinstance(c, ArraysCache) else c.offset for c in cache]

    def undo():  # back to the cache before the block
        for c, saved in zip(cache, before):
            if isinstance(c, ArraysCache):
                c.cache = list(saved)
            else:
                c.trim(c.offset - saved)

    times = []
    for _ in range(REPEATS + 1):
        tic = time.perf_counter()
        out = verify()
        times.append((time.perf_counter() - tic) * 1e3)
        undo()
    records = [r for r in out.records if r is not None]
    rows = []
    for keep in range(1, block):
        rollback, replay = [], []
        for _ in range(REPEATS):
            out = verify()

            def roll_back():
                target.rollback(cache, out, keep)
                return [c.state for c in cache]

            rollback.append(_timed(roll_back))
            replay.append(_timed(lambda: _replay_from_start([r for r in out.records if r is not None], keep)))
            undo()
        rows.append({"keep": keep, "rollback_ms": min(rollback), "replay_from_start_ms": min(replay)})
    return {"block": block, "checkpoint_every": CHECKPOINT_EVERY, "gated_delta_layers": len(records),
            "t_ar_ms": t_ar, "t_verify_ms": min(times[1:]), "recurrence": _recurrence(records), "rows": rows}


def main_rollback(block: int = 16, out=None) -> dict:
    from rich.table import Table

    from .render import console

    out = out or console()
    result = rollback_costs(block=block)
    t_ar = result["t_ar_ms"]
    t = Table(title=f"hybrid synthetic target ({result['gated_delta_layers']} GatedDeltaNet layers), block {block}: "
                    f"t_AR {t_ar:.1f} ms, verify {result['t_verify_ms']:.1f} ms "
                    f"({result['t_verify_ms'] / t_ar:.2f} t_AR), checkpoints every {result['checkpoint_every']} steps")
    for col in ("keep", "rollback ms", "rollback / t_AR", "replay from start ms", "replay / t_AR"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(str(r["keep"]), f"{r['rollback_ms']:.2f}", f"{r['rollback_ms'] / t_ar:.3f}",
                  f"{r['replay_from_start_ms']:.2f}", f"{r['replay_from_start_ms'] / t_ar:.3f}")
    out.print(t)
    rec = result["recurrence"]
    out.print(f"verify recurrence over {block} steps, all GatedDeltaNet layers: mlx-lm gated_delta_ops "
              f"{rec['mlx_lm_nodes']} graph nodes, {rec['mlx_lm_ms']:.1f} ms; gated_delta_steps "
              f"{rec['steps_nodes']} nodes, {rec['steps_ms']:.1f} ms")
    return result
