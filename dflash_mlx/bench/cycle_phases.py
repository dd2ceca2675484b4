"""Where one verify cycle's time goes on a real pair (``examples/cycle_phases.py``
prints it): the demo pair by default, at a fixed block, greedy, over held-out prompts.

Each cycle runs the steps of ``SpeculativeDecoder.cycle`` through the same
public pieces, with the host waiting after each phase so that each is timed
alone, graph building (Python) apart from evaluation:

- draft: the draft's own proposer (``proposer_for``: a DFlash2 draft's
  candidate-selector walk, a DSpark draft's Markov walk) drafting greedily;
- verify: ``Target.forward`` over the block with ``record=True``, the logits
  and greedy acceptance, up to the host reading the accepted length;
- rollback: ``Target.rollback`` to the kept tokens;
- inject: the kept positions' features into the draft's context cache.

Next to them: the real loop's time per cycle at the same block (where the
draft of the next block overlaps the host's streaming), and mlx-lm's own time
per token (t_AR). Every figure is a median over the cycles.
"""

import statistics
import time

import mlx.core as mx

from ..draft import DFlashDraft
from ..loop import BlockSampler, Proposer, SamplingParams, SpeculativeDecoder, propose_block, proposer_for
from ..targets import Target
from .rollback_cost import graph_ops
from .synthetic import _autoregressive

PHASES = ("draft", "verify", "rollback", "inject")


def _ms(tic: float) -> float:
    return (time.perf_counter() - tic) * 1e3


def _cycle_phases(target: Target, proposer: Proposer, layer_ids: list[int], cache: list,
                  y: mx.array, block: int) -> tuple[dict, mx.array, int]:
    """One cycle, phase by phase: ({phase: (build ms, eval ms)}, next y, accepted)."""
    times = {}
    tic = time.perf_counter()
    sampler = BlockSampler(SamplingParams())
    drafted, _, _ = propose_block(proposer, y, block, sampler)
    built = _ms(tic)
    mx.eval(drafted)
    times["draft"] = (built, _ms(tic) - built)

    tic = time.perf_counter()
    tokens = mx.concatenate([y, drafted])
    out = target.forward(tokens[None], cache, layer_ids, record=True)
    accepted, next_token = sampler.verify(target.logits(out.hidden)[0], drafted, None)
    built = _ms(tic)
    a = accepted.item()
    times["verify"] = (built, _ms(tic) - built)

    tic = time.perf_counter()
    target.rollback(cache, out, a + 1)
    built = _ms(tic)
    mx.eval([c.state for c in cache])
    times["rollback"] = (built, _ms(tic) - built)

    tic = time.perf_counter()
    proposer.observe(out.features[:, : a + 1], tokens[: a + 1])
    built = _ms(tic)
    mx.eval([c.state for c in proposer.cache])
    times["inject"] = (built, _ms(tic) - built)
    return times, next_token.reshape(1), a


def verify_nodes(target: Target, layer_ids: list[int], prompt: mx.array, block: int) -> int:
    """Graph nodes of one recording verify pass over ``block`` tokens, logits and argmax included."""
    cache = target.make_cache()
    mx.eval(target.forward(prompt[None], cache, layer_ids).hidden)
    out = target.forward(prompt[None, :block], cache, layer_ids, record=True)
    return sum(graph_ops(mx.argmax(target.logits(out.hidden), axis=-1), out.features).values())


def medians(phases: dict, accepted: list[int], loop_ms: list[float]) -> dict:
    """Cycles, tau, each phase's median build and eval ms and the loop's median
    cycle from per-cycle samples (``phases``: name -> (build ms, eval ms))."""
    return {
        "cycles": len(accepted),
        "tau": 1 + statistics.mean(accepted),
        "phases": {p: {"build_ms": statistics.median(b), "eval_ms": statistics.median(e)}
                   for p, (b, e) in phases.items()},
        "loop_cycle_ms": statistics.median(loop_ms),
    }


def cycle_phases(model, draft: DFlashDraft, prompts: list[mx.array], block: int,
                 max_tokens: int = 128) -> dict:
    """Median per-cycle ms of each phase, of the real loop's cycle and of t_AR."""
    target = Target(model)
    layer_ids = draft.config.target_layer_ids
    phases = {p: ([], []) for p in PHASES}
    accepted, loop_accepted, loop_ms, ar_ms = [], [], [], []
    for prompt in prompts:
        cache = target.make_cache()
        proposer = proposer_for(draft, target)
        decoder = SpeculativeDecoder(target, proposer, layer_ids, block, cache=cache)
        y, made = mx.array([decoder.prefill(prompt)]), 1
        decoder.close()
        while made < max_tokens:
            times, y, a = _cycle_phases(target, proposer, layer_ids, cache, y, block)
            for p, (build, run) in times.items():
                phases[p][0].append(build)
                phases[p][1].append(run)
            accepted.append(a)
            made += a + 1
        decoder = SpeculativeDecoder(target, proposer_for(draft, target), layer_ids, block)
        decoder.prefill(prompt)
        made = 1
        while made < max_tokens:
            tic = time.perf_counter()
            cycle = decoder.cycle()
            loop_ms.append(_ms(tic))
            loop_accepted.append(cycle.accepted)
            made += len(cycle.tokens)
        decoder.close()
        ar_ms.append(1e3 / _autoregressive(model, prompt, max_tokens)[1])
    return {
        "block": block,
        **medians(phases, accepted, loop_ms),
        "accepted": accepted,  # per cycle, phase by phase
        "loop_accepted": loop_accepted,  # per cycle, the real loop (the same when both are greedy)
        "t_ar_ms": statistics.median(ar_ms),
        "samples": {"phases": phases, "loop_ms": loop_ms, "t_ar_ms": ar_ms},  # every cycle's (prompt's for t_AR)
        "verify_nodes": verify_nodes(target, layer_ids, prompts[0], block),
    }


def main_phases(model, draft: DFlashDraft, prompts: list[mx.array], block: int = 16,
                max_tokens: int = 128, out=None) -> dict:
    from rich.table import Table

    from .render import console

    out = out or console()
    result = cycle_phases(model, draft, prompts, block, max_tokens)
    t_ar = result["t_ar_ms"]
    t = Table(title=f"one cycle at block {block}, phase by phase (median over {result['cycles']} "
                    f"cycles, tau {result['tau']:.2f}); t_AR {t_ar:.2f} ms")
    for col in ("phase", "graph build ms", "eval ms", "total ms", "total / t_AR"):
        t.add_column(col, justify="right")
    total = 0.0
    for p, f in result["phases"].items():
        ms = f["build_ms"] + f["eval_ms"]
        total += ms
        t.add_row(p, f"{f['build_ms']:.2f}", f"{f['eval_ms']:.2f}", f"{ms:.2f}", f"{ms / t_ar:.2f}")
    t.add_row("sum of phases", "", "", f"{total:.2f}", f"{total / t_ar:.2f}")
    loop = result["loop_cycle_ms"]
    t.add_row("the loop's cycle", "", "", f"{loop:.2f}", f"{loop / t_ar:.2f}")
    out.print(t)
    out.print(f"verify pass at block {block}: {result['verify_nodes']} graph nodes")
    return result
