"""Statistics of a benchmark from its raw runs: pairs of a DFlash run (chain
or tree) and the baseline run next to it, speedup, acceptance and greedy identity."""

import math
import statistics
from typing import Iterable, Optional

from .schedule import BASELINE, DFLASH, Arm


def compare_tokens(baseline: list[int], dflash: list[int]) -> dict:
    """Greedy identity of two token lists: ``identical`` and the ``first_divergence``
    (index and each side's token there, None where that side has ended)."""
    n = min(len(baseline), len(dflash))
    index = next((i for i in range(n) if baseline[i] != dflash[i]), None)
    if index is None and len(baseline) != len(dflash):
        index = n
    if index is None:
        return {"identical": True, "first_divergence": None}
    at = lambda seq: seq[index] if index < len(seq) else None  # noqa: E731
    return {"identical": False, "first_divergence": {
        "index": index, "baseline": at(baseline), "dflash": at(dflash),
        "baseline_tokens": len(baseline), "dflash_tokens": len(dflash)}}


def stats(values: Iterable[Optional[float]]) -> Optional[dict]:
    """n, median, mean, geometric mean, min, max and quartiles of the non-None
    values, and the median's 95% interval (``median_interval``)."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    q1, q3 = (statistics.quantiles(xs, n=4, method="inclusive")[::2] if len(xs) > 1 else (xs[0], xs[0]))
    positive = all(x > 0 for x in xs)
    return {"n": len(xs), "median": statistics.median(xs), "mean": statistics.fmean(xs),
            "geomean": statistics.geometric_mean(xs) if positive else None,
            "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3, "median_interval": median_interval(xs)}


def median_interval(xs: list[float], confidence: float = 0.95) -> Optional[list[float]]:
    """[low, high] holding the median of the distribution sorted ``xs`` were
    drawn from with at least ``confidence``, whatever that distribution: the
    order statistics x_(k) and x_(n+1-k) for the largest k whose binomial
    coverage 1 - 2 P(Binomial(n, 1/2) < k) reaches it (15 runs: the 4th and
    12th). None when too few values allow any (fewer than 6 at 95%)."""
    n, below, k = len(xs), 0.0, 0
    while k < n // 2:
        below += math.comb(n, k) / 2**n  # P(B <= k): [x_(k+1), x_(n-k)] misses the median with 2 P(B <= k)
        if 2 * below > 1 - confidence:
            break
        k += 1
    return [xs[k - 1], xs[n - k]] if k else None


def acceptance(runs: list[dict], block_size, tree_budget: Optional[int] = None) -> dict:
    """tau, per-position acceptance and tokens per cycle over DFlash runs of one
    arm (``"auto"``: the blocks each cycle used, ``blocks`` per run).

    tau is the mean of accepted + 1 over cycles (a tree's accepted is the depth
    of its accepted path); ``accepted_histogram[a]`` counts cycles with a drafts
    accepted (0..b-1); the acceptance rate is accepted drafts over drafts
    verified (b-1 per chain cycle, the ``tree_budget`` nodes per tree cycle);
    ``position_acceptance[i-1]`` is the share of cycles whose draft position
    (tree depth) i was accepted, P(a >= i); tokens per
    cycle is the decode tokens (after the prefill token) over cycles, i.e. what
    was emitted once the end (EOS or max_tokens) cut the last cycle short.
    """
    accepted = [a for r in runs for a in r["accepted"]]
    cycles = len(accepted)
    blocks = [b for r in runs for b in (r.get("blocks") or [r["block_size"]] * r["cycles"])]
    width = max(blocks, default=2) if block_size == "auto" else block_size
    drafted = sum(tree_budget or b - 1 for b in blocks)
    hist = [0] * width
    for a in accepted:
        hist[a] += 1
    decode_tokens = sum(max(r["generated"] - 1, 0) for r in runs)
    at_least = [sum(hist[i:]) for i in range(1, width)]
    return {
        "cycles": cycles,
        "tau": (sum(accepted) + cycles) / cycles if cycles else None,
        "acceptance_rate": sum(accepted) / drafted if drafted else None,
        "block_histogram": {str(b): blocks.count(b) for b in sorted(set(blocks))},
        "tokens_per_cycle": decode_tokens / cycles if cycles else None,
        "accepted_histogram": hist,
        "position_acceptance": [n / cycles for n in at_least] if cycles else [],
    }


def make_pairs(runs: list[dict], compare: bool) -> list[dict]:
    """Each DFlash run (chain or tree) with the baseline run of the same prompt and repeat."""
    base = {(r["prompt_id"], r["repeat"]): r for r in runs if r["arm"] == BASELINE}
    pairs = []
    for r in runs:
        if r["arm"] != DFLASH:
            continue
        b = base.get((r["prompt_id"], r["repeat"]))
        if b is None:
            continue
        pair = {
            "prompt_id": r["prompt_id"], "category": r["category"], "repeat": r["repeat"],
            "block_size": r["block_size"], "tree_budget": r.get("tree_budget"),
            "confidence_schedule": r.get("confidence_schedule"),
            "baseline_step": b["step"], "dflash_step": r["step"],
            "speedup": (r["decode_tps"] / b["decode_tps"]
                        if r["decode_tps"] and b["decode_tps"] else None),
            "wall_speedup": b["wall_s"] / r["wall_s"] if r["wall_s"] > 0 else None,
            "tau": (sum(r["accepted"]) + r["cycles"]) / r["cycles"] if r["cycles"] else None,
        }
        if compare:
            pair.update(compare_tokens(b["tokens"], r["tokens"]))
        else:
            pair.update(identical=None, first_divergence=None)
        pairs.append(pair)
    return pairs


def _side(runs: list[dict]) -> dict:
    return {
        "runs": len(runs),
        "prefill_tps": stats(r["prefill_tps"] for r in runs),
        "decode_tps": stats(r["decode_tps"] for r in runs),
        "peak_memory_gb": stats(r["peak_memory_gb"] for r in runs),
        "wall_s": sum(r["wall_s"] for r in runs),
        "decode_s": sum(r["decode_s"] for r in runs),
        "decode_tokens": sum(max(r["generated"] - 1, 0) for r in runs),
        "distinct_token_ratio": stats(r.get("distinct_token_ratio") for r in runs),
    }


def summarize(runs: list[dict], pairs: list[dict], arms: list[Arm]) -> dict:
    """The summary block of the report, from the raw runs and pairs alone: the
    baseline, and each DFlash arm under its ``Arm.key``."""
    baseline = [r for r in runs if r["arm"] == BASELINE]
    out = {"baseline": _side(baseline), "dflash": {}}
    for arm in arms:
        b, tree = arm.block_size, arm.tree_budget
        mine = [r for r in runs if r["arm"] == DFLASH and Arm.of(r) == arm]
        ps = [p for p in pairs if Arm.of(p) == arm]
        side = {"block_size": b, "tree_budget": tree, "confidence_schedule": arm.confidence_schedule, **_side(mine)}
        side.update(acceptance(mine, b, tree))
        side["speedup"] = stats(p["speedup"] for p in ps)
        side["wall_speedup"] = stats(p["wall_speedup"] for p in ps)
        # total decode tokens over total decode time, each side: the aggregate ratio
        base = out["baseline"]
        side["speedup_total"] = (
            (side["decode_tokens"] / side["decode_s"]) / (base["decode_tokens"] / base["decode_s"])
            if side["decode_s"] > 0 and base["decode_s"] > 0 and base["decode_tokens"] else None)
        categories = sorted({p["category"] for p in ps})
        side["by_category"] = {
            c: {"speedup": stats(p["speedup"] for p in ps if p["category"] == c),
                "tau": acceptance([r for r in mine if r["category"] == c], b, tree)["tau"]}
            for c in categories}
        compared = [p for p in ps if p["identical"] is not None]
        side["compared"] = len(compared)
        side["identical"] = sum(p["identical"] for p in compared) if compared else None
        side["divergences"] = [
            {"prompt_id": p["prompt_id"], "repeat": p["repeat"], **p["first_divergence"]}
            for p in compared if not p["identical"]]
        out["dflash"][arm.key] = side
    return out

