"""``dflash-mlx bench``: the autoregressive baseline and DFlash side by side.

For every prompt and repeat the same loaded target runs mlx-lm's own
``stream_generate`` (the baseline) and DFlash at each ``--block-size``,
back to back, in an order that alternates between consecutive units (so drift
and background load hit both sides alike), after an untimed warm-up.

Every run is timed the same way from outside the generator: prefill is the
time to the first token; decode is the time from the first token to the last,
over the tokens after the first. The allocator cache is freed and the peak
memory counter reset before each run. Speedup is the ratio of decode speeds
of one baseline run and the DFlash run next to it (a pair); the summary gives
its median and spread over pairs, by block size and by prompt category. At
temperature 0 the DFlash tokens must equal the baseline's; every pair is
compared and the first divergence of each mismatch reported.

The report (``--json``) keeps every raw figure: per-run tokens, timings,
per-cycle acceptance, memory, plus the machine (platform, MLX version and
backend, BLAS on Linux) and the exact configuration.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from .errors import DFlashError

SCHEMA = "dflash-mlx-bench"
SCHEMA_VERSION = 1
BASELINE = "baseline"
DFLASH = "dflash"


# ---------------------------------------------------------------- order of runs

@dataclass(frozen=True)
class Step:
    """One timed run: a prompt, a repeat, and an arm (baseline or DFlash at a block size)."""

    prompt: int
    repeat: int
    arm: str
    block_size: Optional[int] = None

    @property
    def label(self) -> str:
        return BASELINE if self.arm == BASELINE else f"{DFLASH} b={self.block_size}"


def schedule(n_prompts: int, repeats: int, block_sizes: list[int]) -> list[Step]:
    """Every (repeat, prompt) unit runs the baseline and each block size back to
    back; consecutive units reverse the order, so neither side always goes first.
    Repeats are the outer loop, so a repeat sees every prompt before the next starts."""
    steps = []
    unit = 0
    for r in range(repeats):
        for p in range(n_prompts):
            arms = [Step(p, r, BASELINE)] + [Step(p, r, DFLASH, b) for b in block_sizes]
            steps += arms if unit % 2 == 0 else arms[::-1]
            unit += 1
    return steps


# ---------------------------------------------------------------- identity

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


# ---------------------------------------------------------------- one run

def _timed(responses: Iterable) -> tuple[list, float, float]:
    """Drain a generator; (responses, seconds to the first one, seconds to the last)."""
    out, first = [], None
    tic = time.perf_counter()
    for r in responses:
        if first is None:
            first = time.perf_counter() - tic
        out.append(r)
    total = time.perf_counter() - tic
    return out, (total if first is None else first), total


def _record(prompt_tokens: int, tokens: list[int], finish: Optional[str], first_s: float,
            total_s: float, last) -> dict:
    import mlx.core as mx

    decode_s = total_s - first_s
    generated = len(tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "tokens": tokens,
        "generated": generated,
        "finish_reason": finish,
        "prefill_s": first_s,
        "decode_s": decode_s,
        "wall_s": total_s,
        "prefill_tps": prompt_tokens / first_s if first_s > 0 else None,
        # tokens after the first over the time after it: the same clock for both sides
        "decode_tps": (generated - 1) / decode_s if generated > 1 and decode_s > 0 else None,
        "reported_prompt_tps": getattr(last, "prompt_tps", None),
        "reported_generation_tps": getattr(last, "generation_tps", None),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        # a degenerate model repeats a few tokens: near 0 for a loop of one token
        "distinct_token_ratio": len(set(tokens)) / generated if generated else None,
    }


def _fresh() -> None:
    """Before a run: let work the last run queued but never waited for (both
    generators queue their next step ahead) finish off the clock, free the
    allocator cache and reset the peak memory counter."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()


def run_baseline(model, tokenizer, ids: list[int], max_tokens: int, sampling: dict) -> dict:
    """mlx-lm's ``stream_generate`` on the target alone."""
    import mlx.core as mx
    from mlx_lm import stream_generate as mlx_lm_stream_generate
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(sampling["temperature"], sampling["top_p"], sampling["min_p"],
                           top_k=sampling["top_k"])
    if sampling.get("seed") is not None:
        mx.random.seed(sampling["seed"])
    _fresh()
    responses, first, total = _timed(
        mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=sampler))
    # the last response carries the EOS token itself when generation stopped on it
    tokens = [r.token for r in responses if r.finish_reason != "stop"]
    last = responses[-1] if responses else None
    return _record(len(ids), tokens, last.finish_reason if last else None, first, total, last)


def run_dflash(model, draft, tokenizer, ids: list[int], max_tokens: int, block_size: int,
               sampling: dict) -> dict:
    """DFlash ``stream_generate``; adds the per-cycle accepted draft counts."""
    from .generate import stream_generate

    _fresh()
    responses, first, total = _timed(stream_generate(
        model, draft, tokenizer, ids, block_size=block_size, max_tokens=max_tokens,
        temperature=sampling["temperature"], top_p=sampling["top_p"], top_k=sampling["top_k"],
        min_p=sampling["min_p"], seed=sampling.get("seed")))
    tokens = [t for r in responses for t in r.tokens]
    last = responses[-1] if responses else None
    rec = _record(len(ids), tokens, last.finish_reason if last else None, first, total, last)
    accepted = [r.accepted for r in responses[1:]]  # the first response is the prefill token
    rec.update(cycles=len(accepted), accepted=accepted)
    return rec


# ---------------------------------------------------------------- statistics

def stats(values: Iterable[Optional[float]]) -> Optional[dict]:
    """n, median, mean, geometric mean, min, max and quartiles of the non-None values."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    q1, q3 = (statistics.quantiles(xs, n=4, method="inclusive")[::2] if len(xs) > 1 else (xs[0], xs[0]))
    positive = all(x > 0 for x in xs)
    return {"n": len(xs), "median": statistics.median(xs), "mean": statistics.fmean(xs),
            "geomean": statistics.geometric_mean(xs) if positive else None,
            "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3}


def acceptance(runs: list[dict], block_size: int) -> dict:
    """tau, per-position acceptance and tokens per cycle over DFlash runs of one block size.

    tau is the mean of accepted + 1 over cycles; ``accepted_histogram[a]`` counts
    cycles with a drafts accepted (0..b-1); ``position_acceptance[i-1]`` is the
    share of cycles whose draft position i was accepted, P(a >= i); tokens per
    cycle is the decode tokens (after the prefill token) over cycles, i.e. what
    was emitted once the end (EOS or max_tokens) cut the last cycle short.
    """
    accepted = [a for r in runs for a in r["accepted"]]
    cycles = len(accepted)
    hist = [0] * block_size
    for a in accepted:
        hist[a] += 1
    decode_tokens = sum(max(r["generated"] - 1, 0) for r in runs)
    at_least = [sum(hist[i:]) for i in range(1, block_size)]
    return {
        "cycles": cycles,
        "tau": (sum(accepted) + cycles) / cycles if cycles else None,
        "acceptance_rate": sum(accepted) / (cycles * (block_size - 1)) if cycles else None,
        "tokens_per_cycle": decode_tokens / cycles if cycles else None,
        "accepted_histogram": hist,
        "position_acceptance": [n / cycles for n in at_least] if cycles else [],
    }


def make_pairs(runs: list[dict], compare: bool) -> list[dict]:
    """Each DFlash run with the baseline run of the same prompt and repeat."""
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
            "block_size": r["block_size"], "baseline_step": b["step"], "dflash_step": r["step"],
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


def summarize(runs: list[dict], pairs: list[dict], block_sizes: list[int]) -> dict:
    """The summary block of the report, from the raw runs and pairs alone."""
    baseline = [r for r in runs if r["arm"] == BASELINE]
    out = {"baseline": _side(baseline), "dflash": {}}
    for b in block_sizes:
        mine = [r for r in runs if r["arm"] == DFLASH and r["block_size"] == b]
        ps = [p for p in pairs if p["block_size"] == b]
        side = _side(mine)
        side.update(acceptance(mine, b))
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
                "tau": acceptance([r for r in mine if r["category"] == c], b)["tau"]}
            for c in categories}
        compared = [p for p in ps if p["identical"] is not None]
        side["compared"] = len(compared)
        side["identical"] = sum(p["identical"] for p in compared) if compared else None
        side["divergences"] = [
            {"prompt_id": p["prompt_id"], "repeat": p["repeat"], **p["first_divergence"]}
            for p in compared if not p["identical"]]
        out["dflash"][str(b)] = side
    return out


# ---------------------------------------------------------------- machine

def machine_info() -> dict:
    """Platform, Python, MLX (version, backend, device) and BLAS on Linux."""
    import mlx.core as mx

    from importlib import metadata

    def version(dist: str) -> Optional[str]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    metal = cuda = False
    try:
        metal = bool(mx.metal.is_available())
    except Exception:
        pass
    try:
        cuda = bool(mx.cuda.is_available())
    except Exception:
        pass
    info = {
        "platform": platform.platform(),
        "system": platform.system(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "dflash_mlx": version("dflash-mlx"),
        "backend": "metal" if metal else ("cuda" if cuda else "cpu"),
        "default_device": str(mx.default_device()),
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "reference_kernels_forced": os.environ.get("DFLASH_MLX_REFERENCE"),
    }
    if metal:
        try:
            dev = mx.metal.device_info()
            info["metal"] = {k: dev.get(k) for k in ("architecture", "memory_size", "max_recommended_working_set_size")}
        except Exception:
            info["metal"] = {}
    if platform.system() == "Linux":
        from .doctor import blas_report  # /proc/self/maps: reference BLAS or OpenBLAS

        info["blas"], info["blas_advice"] = blas_report()
    return info


# ---------------------------------------------------------------- the run

def _apply_template(tokenizer, text: str, chat: bool) -> str:
    if not chat or not getattr(tokenizer, "has_chat_template", False):
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)


def encode(tokenizer, text: str) -> list[int]:
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def run_bench(
    model, draft, tokenizer, prompts: list[dict], *, block_sizes: list[int], max_tokens: int,
    repeat: int = 1, sampling: Optional[dict] = None, chat_template: bool = True,
    warmup_tokens: int = 16, on_step: Optional[Callable[[str], None]] = None,
    runners: Optional[dict] = None,
) -> dict:
    """Run the schedule; returns prompts, runs, pairs and the summary.

    ``on_step(description)`` is called before every run (warm-up included) for a
    progress display. ``runners`` replaces ``{"baseline": run_baseline, "dflash":
    run_dflash}`` (tests give the baseline another target, for instance).
    """
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 0, **(sampling or {})}
    runners = {BASELINE: run_baseline, DFLASH: run_dflash, **(runners or {})}
    if not prompts:
        raise DFlashError("no prompts to run")
    if max_tokens <= 0:
        raise DFlashError(f"max_tokens must be positive, got {max_tokens}")
    if repeat <= 0:
        raise DFlashError(f"repeat must be positive, got {repeat}")
    bad = [b for b in block_sizes if b < 2]
    if bad or not block_sizes:
        raise DFlashError(f"block sizes must be at least 2, got {block_sizes}")
    encoded = [encode(tokenizer, _apply_template(tokenizer, p["prompt"], chat_template)) for p in prompts]

    def call(step: Step, tokens: int) -> dict:
        ids = encoded[step.prompt]
        if step.arm == BASELINE:
            return runners[BASELINE](model, tokenizer, ids, tokens, sampling)
        return runners[DFLASH](model, draft, tokenizer, ids, tokens, step.block_size, sampling)

    if warmup_tokens > 0:  # untimed: weights paged in, kernels and buffers allocated
        for step in schedule(1, 1, block_sizes):
            if on_step:
                on_step(f"warm-up {step.label}")
            call(step, min(warmup_tokens, max_tokens))
    runs = []
    for i, step in enumerate(schedule(len(prompts), repeat, block_sizes)):
        p = prompts[step.prompt]
        if on_step:
            on_step(f"{p['id']} r{step.repeat} {step.label}")
        rec = call(step, max_tokens)
        runs.append({"step": i, "prompt_id": p["id"], "category": p["category"],
                     "repeat": step.repeat, "arm": step.arm, "block_size": step.block_size, **rec})
    pairs = make_pairs(runs, compare=sampling["temperature"] == 0)
    return {
        "prompts": [{**p, "prompt_tokens": len(ids)} for p, ids in zip(prompts, encoded)],
        "runs": runs,
        "pairs": pairs,
        "summary": summarize(runs, pairs, block_sizes),
    }


# ---------------------------------------------------------------- the report

REQUIRED = {
    "top": {"schema": str, "schema_version": int, "created": str, "machine": dict, "config": dict,
            "prompts": list, "runs": list, "pairs": list, "summary": dict},
    "config": {"model": str, "draft": str, "max_tokens": int, "block_sizes": list, "repeat": int,
               "temperature": (int, float), "dtype": str, "chat_template": bool, "prompts": str},
    "machine": {"platform": str, "mlx": str, "backend": str, "python": str},
    "run": {"step": int, "prompt_id": str, "category": str, "repeat": int, "arm": str,
            "prompt_tokens": int, "tokens": list, "generated": int, "prefill_s": float,
            "decode_s": float, "wall_s": float, "peak_memory_gb": float},
    "dflash_run": {"block_size": int, "cycles": int, "accepted": list},
    "pair": {"prompt_id": str, "category": str, "repeat": int, "block_size": int,
             "baseline_step": int, "dflash_step": int},
    "side": {"runs": int, "wall_s": float, "decode_tokens": int},
    "dflash_side": {"cycles": int, "accepted_histogram": list, "position_acceptance": list,
                    "by_category": dict, "compared": int, "divergences": list},
}


def validate_report(report: dict) -> None:
    """Raise DFlashError if ``report`` is not a bench report of this schema."""

    def need(obj: dict, kind: str, where: str) -> None:
        if not isinstance(obj, dict):
            raise DFlashError(f"{where}: expected an object")
        for key, types in REQUIRED[kind].items():
            if key not in obj:
                raise DFlashError(f"{where}: missing '{key}'")
            ok = isinstance(obj[key], types) and not (types is int and isinstance(obj[key], bool))
            if types is float:
                ok = isinstance(obj[key], (int, float)) and not isinstance(obj[key], bool)
            if not ok:
                raise DFlashError(f"{where}: '{key}' has type {type(obj[key]).__name__}")

    need(report, "top", "report")
    if report["schema"] != SCHEMA or report["schema_version"] != SCHEMA_VERSION:
        raise DFlashError(f"report schema is {report['schema']} v{report['schema_version']}, "
                          f"expected {SCHEMA} v{SCHEMA_VERSION}")
    need(report["config"], "config", "config")
    need(report["machine"], "machine", "machine")
    for i, run in enumerate(report["runs"]):
        need(run, "run", f"runs[{i}]")
        if run["arm"] == DFLASH:
            need(run, "dflash_run", f"runs[{i}]")
            if len(run["accepted"]) != run["cycles"]:
                raise DFlashError(f"runs[{i}]: {run['cycles']} cycles but {len(run['accepted'])} accepted counts")
        elif run["arm"] != BASELINE:
            raise DFlashError(f"runs[{i}]: unknown arm '{run['arm']}'")
    for i, pair in enumerate(report["pairs"]):
        need(pair, "pair", f"pairs[{i}]")
    need(report["summary"].get("baseline"), "side", "summary.baseline")
    for b in report["config"]["block_sizes"]:
        side = report["summary"].get("dflash", {}).get(str(b))
        need(side, "side", f"summary.dflash.{b}")
        need(side, "dflash_side", f"summary.dflash.{b}")
        if len(side["accepted_histogram"]) != b:
            raise DFlashError(f"summary.dflash.{b}: histogram has {len(side['accepted_histogram'])} bins")


def _jsonable(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def write_json(report: dict, path: str | Path) -> None:
    """Write atomically (a temporary file renamed over ``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(report), indent=1) + "\n")
    tmp.replace(path)


def read_report(path: str | Path) -> dict:
    try:
        report = json.loads(Path(path).read_text())
    except OSError as e:
        raise DFlashError(f"cannot read '{path}': {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise DFlashError(f"'{path}' is not valid JSON ({e.msg})") from None
    validate_report(report)
    return report


def make_report(result: dict, config: dict, machine: dict) -> dict:
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["dflash-mlx", *sys.argv[1:]]) if sys.argv else None,
            "machine": machine, "config": config, **result}


# ---------------------------------------------------------------- rendering

def console(stderr: bool = False):
    """A rich console; wide when not a terminal, so piped tables do not wrap."""
    from rich.console import Console

    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=160)


def _f(x, fmt="{:.1f}", none="-") -> str:
    return none if x is None else fmt.format(x)


def render(report: dict, console) -> None:
    """The rich tables: one row per arm, speedup by category, acceptance per position, divergences."""
    from rich.table import Table

    cfg, summ = report["config"], report["summary"]
    base = summ["baseline"]
    t = Table(title=f"{cfg['model']} + {cfg['draft']}: {len(report['prompts'])} prompts x {cfg['repeat']} "
                    f"repeat(s), {cfg['max_tokens']} tokens, temperature {cfg['temperature']:g}, {cfg['dtype']}")
    for col in ("arm", "prefill tok/s", "decode tok/s", r"speedup median \[q1-q3] (min-max)", "total",
                "tau", "tok/cycle", "accept", "peak GB", "wall s", "identical"):
        t.add_column(col, justify="left" if col == "arm" else "right")
    med = lambda s: s["median"] if s else None  # noqa: E731
    t.add_row("mlx-lm (baseline)", _f(med(base["prefill_tps"])), _f(med(base["decode_tps"])), "1.00x", "",
              "", "", "", _f(base["peak_memory_gb"] and base["peak_memory_gb"]["max"], "{:.2f}"),
              _f(base["wall_s"]), "")
    for b, side in summ["dflash"].items():
        sp = side["speedup"]
        spread = (f"{sp['median']:.2f}x \\[{sp['q1']:.2f}-{sp['q3']:.2f}] ({sp['min']:.2f}-{sp['max']:.2f})"
                  if sp else "-")
        ident = f"{side['identical']}/{side['compared']}" if side["identical"] is not None else "n/a"
        t.add_row(f"DFlash b={b}", _f(med(side["prefill_tps"])), _f(med(side["decode_tps"])), spread,
                  _f(side["speedup_total"], "{:.2f}x"), _f(side["tau"], "{:.2f}"),
                  _f(side["tokens_per_cycle"], "{:.2f}"), _f(side["acceptance_rate"], "{:.0%}"),
                  _f(side["peak_memory_gb"] and side["peak_memory_gb"]["max"], "{:.2f}"),
                  _f(side["wall_s"]), ident)
    console.print(t)
    dist = base["distinct_token_ratio"]
    if dist:
        console.print(f"distinct-token ratio of the baseline's output: median {dist['median']:.2f} "
                      f"(min {dist['min']:.2f}); a model stuck in a loop scores near 0")

    cats = sorted({c for side in summ["dflash"].values() for c in side["by_category"]})
    if cats:
        t = Table(title="median speedup (tau) by prompt category")
        t.add_column("category")
        for b in summ["dflash"]:
            t.add_column(f"b={b}", justify="right")
        for c in cats:
            cells = []
            for side in summ["dflash"].values():
                cat = side["by_category"].get(c)
                cells.append(f"{cat['speedup']['median']:.2f}x ({cat['tau']:.2f})"
                             if cat and cat["speedup"] and cat["tau"] else "-")
            t.add_row(c, *cells)
        console.print(t)

    t = Table(title="acceptance: share of cycles whose draft position i was accepted, P(a >= i)")
    t.add_column("block")
    width = max(int(b) for b in summ["dflash"])
    for i in range(1, width):
        t.add_column(str(i), justify="right")
    for b, side in summ["dflash"].items():
        pa = side["position_acceptance"]
        t.add_row(f"b={b}", *[f"{x:.2f}" for x in pa], *[""] * (width - 1 - len(pa)))
    console.print(t)
    for b, side in summ["dflash"].items():
        hist = side["accepted_histogram"]
        console.print(f"accepted drafts per cycle, b={b} (a = 0..{int(b) - 1}): {hist}")

    for b, side in summ["dflash"].items():
        for d in side["divergences"][:10]:
            console.print(f"[red]b={b}: {d['prompt_id']} repeat {d['repeat']} diverges at token "
                          f"{d['index']}: baseline {d['baseline']} vs DFlash {d['dflash']}[/red]")
        extra = len(side["divergences"]) - 10
        if extra > 0:
            console.print(f"[red]b={b}: ... and {extra} more divergences (see the JSON)[/red]")
    m = report["machine"]
    blas = f", BLAS: {m['blas']}" if m.get("blas") else ""
    console.print(f"machine: {m['platform']}, MLX {m['mlx']} ({m['backend']}){blas}")


def plot(report: dict, path: str | Path) -> None:
    """PNG: median speedup per category and block size (whiskers: min-max), and
    the acceptance histogram of each block size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DFlashError("--plot needs matplotlib: pip install 'dflash-mlx[plot]'") from None
    summ = report["summary"]["dflash"]
    cats = sorted({c for side in summ.values() for c in side["by_category"]})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(summ), 1)
    for j, (b, side) in enumerate(summ.items()):
        med, lo, hi = [], [], []
        for c in cats:
            s = side["by_category"].get(c, {}).get("speedup")
            med.append(s["median"] if s else 0)
            lo.append(s["median"] - s["min"] if s else 0)
            hi.append(s["max"] - s["median"] if s else 0)
        xs = [i + (j - (len(summ) - 1) / 2) * width for i in range(len(cats))]
        ax1.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=f"b={b}")
        hist = side["accepted_histogram"]
        total = sum(hist) or 1
        ax2.bar([a + (j - (len(summ) - 1) / 2) * width for a in range(len(hist))],
                [h / total for h in hist], width, label=f"b={b} (tau {side['tau'] or 0:.2f})")
    ax1.axhline(1.0, color="gray", lw=1, ls="--")
    ax1.set_xticks(range(len(cats)), cats)
    ax1.set_ylabel("decode speedup over mlx-lm (median, min-max)")
    ax1.set_title("speedup by prompt category")
    ax1.legend()
    ax2.set_xlabel("draft tokens accepted per cycle")
    ax2.set_ylabel("share of cycles")
    ax2.set_title("acceptance histogram")
    ax2.legend()
    cfg = report["config"]
    fig.suptitle(f"dflash-mlx bench: {Path(cfg['model']).name} + {Path(cfg['draft']).name}, "
                 f"{cfg['max_tokens']} tokens, {cfg['dtype']}, {report['machine']['backend']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- command entry points

def resolve_pair(model: Optional[str], draft: Optional[str]) -> tuple[str, str]:
    """--model/--draft, the registry's draft for --model, or the bundled demo pair."""
    if model is None and draft is None:
        from .demo import demo_pair

        try:
            pair = demo_pair()
        except DFlashError as e:
            raise DFlashError(f"no --model/--draft given and the default demo pair is unavailable "
                              f"({e}); pass --model and --draft") from None
        return str(pair.target), str(pair.draft)
    if model is None:
        raise DFlashError("--draft needs --model (the target it was trained for)")
    if draft is None:
        from .registry import KNOWN_PAIRS, find_draft

        draft = find_draft(model)
        if draft is None:
            raise DFlashError(f"no known DFlash draft for target '{model}'; pass --draft, or use one of: "
                              + ", ".join(KNOWN_PAIRS))
    return model, draft


def select_prompts(source: str, categories: Optional[list[str]], limit: Optional[int]) -> list[dict]:
    """'builtin', 'demo' (the demo pair's held-out prompts) or a JSONL file."""
    from .bench_prompts import builtin_prompts, load_prompts, select

    if source == "builtin":
        prompts = builtin_prompts()
    elif source == "demo":
        from .demo import demo_pair

        prompts = load_prompts(demo_pair().prompts, default_category="heldout")
    else:
        prompts = load_prompts(source)
    if limit is not None and limit <= 0:
        raise DFlashError(f"--limit must be positive, got {limit}")
    return select(prompts, categories, limit)


def parse_block_sizes(values: Optional[list[str]]) -> Optional[list[int]]:
    """Repeated and/or comma-separated block sizes, in order, without duplicates."""
    if not values:
        return None
    out = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                b = int(part)
            except ValueError:
                raise DFlashError(f"--block-size takes integers, got '{part}'") from None
            if b < 2:
                raise DFlashError(f"--block-size must be at least 2, got {b}")
            if b not in out:
                out.append(b)
    return out or None


def main_run(*, model: Optional[str], draft: Optional[str], prompts: str, max_tokens: int,
             block_sizes: Optional[list[int]], sampling: dict, repeat: int, limit: Optional[int],
             categories: Optional[list[str]], dtype: str, chat_template: bool, warmup: bool,
             json_out: Optional[str], plot_out: Optional[str], err=None, out=None) -> dict:
    """Everything ``dflash-mlx bench`` does without --predict."""
    import mlx.core as mx
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    from .loading import load, load_draft

    if dtype not in ("auto", "keep", *DTYPES):
        raise DFlashError(f"--dtype must be auto, keep, {', '.join(DTYPES)}; got '{dtype}'")
    if plot_out:  # fail before a long run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise DFlashError("--plot needs matplotlib: pip install 'dflash-mlx[plot]'") from None
    chosen = select_prompts(prompts, categories, limit)
    model_id, draft_id = resolve_pair(model, draft)
    target, tokenizer = load(model_id)
    dft = load_draft(draft_id)
    if dtype == "auto":
        dtype = "float32" if mx.default_device() == mx.cpu else "keep"
    if dtype != "keep":
        target.set_dtype(getattr(mx, dtype))
        dft.set_dtype(getattr(mx, dtype))
    block_sizes = block_sizes or [dft.config.block_size]
    err = err or console(stderr=True)
    out = out or console()
    steps = len(chosen) * repeat * (1 + len(block_sizes)) + (1 + len(block_sizes) if warmup else 0)
    columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task("bench", total=steps)
        started = [False]

        def on_step(description: str) -> None:
            if started[0]:
                progress.advance(task)
            started[0] = True
            progress.update(task, description=description)

        result = run_bench(target, dft, tokenizer, chosen, block_sizes=block_sizes,
                           max_tokens=max_tokens, repeat=repeat, sampling=sampling,
                           chat_template=chat_template, warmup_tokens=16 if warmup else 0,
                           on_step=on_step)
        progress.advance(task)
    config = {"model": model_id, "draft": draft_id, "max_tokens": max_tokens,
              "block_sizes": block_sizes, "repeat": repeat, **sampling,
              "dtype": "checkpoint" if dtype == "keep" else dtype, "chat_template": chat_template,
              "prompts": prompts, "categories": categories, "limit": limit, "warmup": warmup,
              "draft_trained_block_size": dft.config.block_size}
    report = make_report(result, config, machine_info())
    validate_report(report)
    if json_out:  # first: a long run's figures survive a broken terminal
        write_json(report, json_out)
        err.print(f"wrote {json_out}")
    render(report, out)
    if plot_out:
        plot(report, plot_out)
        err.print(f"wrote {plot_out}")
    return report


DTYPES = ("float32", "float16", "bfloat16")


def _read_config(path_or_repo: str, what: str) -> dict:
    from .loading import resolve

    path = resolve(path_or_repo, what, ["*.json"]) / "config.json"
    try:
        return json.loads(path.read_text())
    except OSError:
        raise DFlashError(f"{what} '{path_or_repo}' has no config.json") from None
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path} is not valid JSON ({e.msg})") from None


def main_predict(*, model: Optional[str], draft: Optional[str], preset: Optional[str],
                 tau: Optional[float], results: Optional[str], block_sizes: Optional[list[int]],
                 chips: Optional[list[str]], context: int, dtype: str, neural: bool,
                 overhead_ms: float, json_out: Optional[str], out=None, err=None) -> dict:
    """``dflash-mlx bench --predict``: no generation, the cost model only."""
    from rich.table import Table

    from . import cost_model as cm

    out = out or console()
    err = err or console(stderr=True)
    if context < 0:
        raise DFlashError(f"--context must be >= 0, got {context}")
    if tau is None and results is None and preset is None:
        raise DFlashError("--predict needs tau: give --tau T, --results BENCH.json or --preset NAME")
    measured = read_report(results) if results else None
    published = None
    if preset is not None:
        if model or draft:
            raise DFlashError("give either --preset or --model/--draft, not both")
        if preset not in cm.PRESETS:
            raise DFlashError(f"unknown preset '{preset}'; known: {', '.join(cm.PRESETS)}")
        target_cfg, draft_cfg, published, preset_tau = cm.PRESETS[preset]
        names = (preset, f"{preset} draft (assumed shape)")
    else:
        if measured and model is None and draft is None:
            model, draft = measured["config"]["model"], measured["config"]["draft"]
        model, draft = resolve_pair(model, draft)
        target_cfg, draft_cfg = _read_config(model, "target"), _read_config(draft, "draft")
        names, preset_tau = (model, draft), None
    dt = None if dtype in ("auto", "keep") else dtype
    if dt is not None and dt not in DTYPES:
        raise DFlashError(f"--dtype must be auto, keep, {', '.join(DTYPES)}; got '{dtype}'")
    tp, dp = cm.target_profile(target_cfg, dt), cm.draft_profile(draft_cfg, dt)
    trained = int((draft_cfg.get("dflash_config") or {}).get("block_size", draft_cfg.get("block_size", 16)))

    # tau per block size: given, measured (with its per-position acceptance), or the preset's
    sources: dict[int, tuple[float, int, Optional[list[float]], str]] = {}
    if tau is not None:
        base = (tau, (block_sizes or [trained])[0], None, "given")
    elif measured:
        sides = measured["summary"]["dflash"]
        usable = {int(b): s for b, s in sides.items() if s.get("tau")}
        if not usable:
            raise DFlashError(f"{results} has no measured tau")
        b0 = max(usable)
        base = (usable[b0]["tau"], b0, usable[b0]["position_acceptance"], f"measured ({results})")
        for b, s in usable.items():
            sources[b] = (s["tau"], b, s["position_acceptance"], f"measured ({results})")
    elif preset_tau is not None:
        base = (preset_tau, 16, None, "preset")
    else:
        raise DFlashError("--predict needs tau: give --tau T, --results BENCH.json or --preset NAME")
    if not 1.0 <= base[0] <= base[1]:
        raise DFlashError(f"tau must lie in [1, {base[1]}], got {base[0]:g}")
    blocks = block_sizes or (sorted(sources) if sources else [base[1]])
    rows = []
    for chip in cm.find_chips(chips):
        for b in blocks:
            t0, b0, pa, how = sources.get(b, base)
            t = t0 if b == b0 else cm.tau_at(b, t0, b0, pa)
            kind = how if b == b0 else f"{how}, extrapolated from b={b0}"
            pred = cm.predict(tp, dp, chip, min(t, b), b, context, overhead_ms, neural)
            rows.append({**pred.to_dict(), "tau_source": kind, "bandwidth_gbs": chip.bandwidth_gbs,
                         "fp32_tflops": chip.fp32_tflops, "neural_tflops": chip.neural_tflops})
    best = {}
    for r in rows:
        if r["chip"] not in best or r["speedup"] > best[r["chip"]]["speedup"]:
            best[r["chip"]] = r

    gb = lambda x: f"{x / 1e9:.2f} GB"  # noqa: E731
    out.print(f"target {names[0]}: {tp.params / 1e9:.2f} B parameters, {gb(tp.weight_bytes)} of weights; "
              f"an autoregressive step reads {gb(tp.forward(1, context, 1).bytes)}")
    out.print(f"draft  {names[1]}: {dp.params / 1e9:.2f} B parameters, {gb(dp.weight_bytes)} "
              f"(+ the target's LM head, {gb(tp.head_bytes)}, read every cycle)")
    t = Table(title=f"predicted decode speed at {context} tokens of context"
                    + (" (M5 at the claimed Neural Accelerator rate)" if neural else ""))
    for col in ("chip", "GB/s", "TFLOPS", "block", "tau", "mlx-lm tok/s", "DFlash tok/s",
                "speedup", "no-overlap", "verify"):
        t.add_column(col, justify="left" if col == "chip" else "right")
    for r in rows:
        mark = " *" if len(blocks) > 1 and best[r["chip"]] is r else ""
        t.add_row(r["chip"], f"{r['bandwidth_gbs']:g}", f"{r['fp32_tflops']:.1f}", str(r["block_size"]),
                  f"{r['tau']:.2f}", f"{r['ar_tps']:.1f}", f"{r['dflash_tps']:.1f}",
                  f"{r['speedup']:.2f}x{mark}", f"{r['speedup_serial']:.2f}x", r["verify_bound"])
    out.print(t)
    out.print("speedup: roofline with memory and compute overlapped (optimistic); no-overlap: their sum "
              "(pessimistic)." + (" *: the best block size for the chip." if len(blocks) > 1 else ""))
    if published is not None:
        out.print(f"published ({preset}, M5 Max, 1024 tokens, bstnxbt/dflash-mlx 0.1.4): {published:.2f}x")
    report = {"schema": "dflash-mlx-predict", "schema_version": 1,
              "target": {"name": names[0], "params": tp.params, "weight_bytes": tp.weight_bytes},
              "draft": {"name": names[1], "params": dp.params, "weight_bytes": dp.weight_bytes},
              "context": context, "neural_accelerators": neural, "overhead_ms": overhead_ms,
              "published_speedup": published, "predictions": rows,
              "chips": [{"name": c.name, "gpu_cores": c.gpu_cores, "bandwidth_gbs": c.bandwidth_gbs,
                         "fp32_tflops": c.fp32_tflops, "neural_tflops": c.neural_tflops,
                         "source": c.source} for c in cm.find_chips(chips)]}
    if json_out:
        write_json(report, json_out)
        err.print(f"wrote {json_out}")
    return report
