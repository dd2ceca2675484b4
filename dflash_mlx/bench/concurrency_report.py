"""The ``bench --concurrency`` report: the summary per width from the raw
waves (``summarize``), its JSON schema and the rich tables."""

import datetime
import sys

from ..errors import DFlashError
from .report import _counts
from .summary import stats

SCHEMA = "dflash-mlx-bench-concurrency"
SCHEMA_VERSION = 1
MLX_LM, DFLASH = "mlx_lm", "dflash"


def _identity(requests: list[dict], key: str) -> dict:
    found = [q[key] for q in requests]
    return {"compared": len(found), "identical": sum(d is None for d in found),
            "near_ties": sum(d is not None and d["near_tie"] for d in found),
            "divergences": [{"prompt_id": q["prompt_id"], **q[key]} for q in requests if q[key] is not None]}


def _side(runs: list[dict]) -> dict:
    requests = [q for r in runs for q in r["requests"]]
    wall, generated = sum(r["wall_s"] for r in runs), sum(r["generated"] for r in runs)
    started = [max(q["first_s"] for q in r["requests"]) for r in runs]  # every request has its first token
    after = [(r["generated"] - len(r["requests"])) / (r["wall_s"] - s) for r, s in zip(runs, started)
             if r["wall_s"] > s]
    return {"waves": len(runs), "requests": len(requests), "generated": generated, "wall_s": wall,
            "tps": stats(r["tps"] for r in runs), "tps_total": generated / wall if wall > 0 else None,
            "latency_s": stats(q["done_s"] for q in requests), "ttft_s": stats(q["first_s"] for q in requests),
            "all_started_s": stats(started), "decode_tps": stats(after),
            "peak_memory_gb": max(r["peak_memory_gb"] for r in runs)}


def summarize(runs: list[dict], widths: list[int]) -> dict:
    """Per width: each side's aggregate tok/s (per wave, and total tokens over
    total time), per-request latency and time to first token; the ratio of our
    aggregate to mlx-lm's per paired wave; our tau (tokens per row-cycle), the
    blocks used, and identity with mlx-lm's replies and with our solo ones."""
    out = {}
    for w in widths:
        mine = [r for r in runs if r["width"] == w]
        theirs, ours = ([r for r in mine if r["side"] == s] for s in (MLX_LM, DFLASH))
        base = {(r["repeat"], r["wave"]): r for r in theirs}
        ratios = [r["tps"] / base[(r["repeat"], r["wave"])]["tps"] for r in ours
                  if r["tps"] and base[(r["repeat"], r["wave"])]["tps"]]
        side = _side(ours)
        accepted = [a for r in ours for q in r["requests"] for a in q["accepted"]]
        blocks = [b for r in ours for b in r["blocks"]]
        requests = [q for r in ours for q in r["requests"]]
        side.update(
            row_cycles=len(accepted),
            tau=(sum(accepted) + len(accepted)) / len(accepted) if accepted else None,
            cycles=len(blocks),
            block_histogram={str(b): blocks.count(b) for b in sorted(set(blocks))},
            vs_mlx_lm=_identity(requests, "vs_mlx_lm"), vs_solo=_identity(requests, "vs_solo"))
        mlx = _side(theirs)
        out[str(w)] = {"width": w, MLX_LM: mlx, DFLASH: side, "speedup": stats(ratios),
                       "speedup_total": (side["tps_total"] / mlx["tps_total"]
                                         if side["tps_total"] and mlx["tps_total"] else None)}
    return out


REQUIRED_WIDTH = {"width": int, MLX_LM: dict, DFLASH: dict, "speedup": (dict, type(None))}
REQUIRED_SIDE = ("tps", "tps_total", "latency_s", "ttft_s", "peak_memory_gb", "generated", "wall_s")


def make_report(result: dict, config: dict, machine: dict) -> dict:
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["dflash-mlx", *sys.argv[1:]]) if sys.argv else None,
            "machine": machine, "config": config, **result}


def validate_report(report: dict) -> None:
    """Raise DFlashError unless ``report`` is a concurrency report of this schema."""
    if not isinstance(report, dict) or report.get("schema") != SCHEMA or report.get("schema_version") != SCHEMA_VERSION:
        raise DFlashError(f"not a {SCHEMA} v{SCHEMA_VERSION} report")
    for key in ("config", "machine", "prompts", "runs", "solo", "summary"):
        if key not in report:
            raise DFlashError(f"report: missing '{key}'")
    widths = report["config"].get("concurrency")
    if not isinstance(widths, list) or not widths or not _counts(widths, 1):
        raise DFlashError("config: concurrency must be a list of integers >= 1")
    for w in widths:
        entry = report["summary"].get(str(w))
        if not isinstance(entry, dict):
            raise DFlashError(f"summary: missing width {w}")
        for key, types in REQUIRED_WIDTH.items():
            if not isinstance(entry.get(key), types):
                raise DFlashError(f"summary.{w}: '{key}' missing or of the wrong type")
        for side in (MLX_LM, DFLASH):
            missing = [k for k in REQUIRED_SIDE if k not in entry[side]]
            if missing:
                raise DFlashError(f"summary.{w}.{side}: missing {missing}")
        for key in ("tau", "block_histogram", "vs_mlx_lm", "vs_solo"):
            if key not in entry[DFLASH]:
                raise DFlashError(f"summary.{w}.{DFLASH}: missing '{key}'")


def _f(x, fmt="{:.1f}", none="-") -> str:
    return none if x is None else fmt.format(x)


def render(report: dict, console) -> None:
    """The rich table: one row per width, mlx-lm's figures beside ours."""
    from rich.table import Table

    cfg = report["config"]
    t = Table(title=f"{cfg['model']} + {cfg['draft']}: {len(report['prompts'])} prompts in waves of N requests "
                    f"x {cfg['repeat']} repeat(s), {cfg['max_tokens']} tokens, greedy, {cfg['dtype']}, "
                    f"block {cfg['block_size']}")
    for col in ("N", "mlx-lm tok/s", "DFlash tok/s", r"ratio median \[95%]", "total", "latency median s",
                "slowest s", "TTFT median ms", "tau", "drafted cycles", "peak MB", "= mlx-lm", "= alone"):
        t.add_column(col, justify="right", no_wrap=col.startswith("ratio"))
    med = lambda s: s["median"] if s else None  # noqa: E731
    top = lambda s: s["max"] if s else None  # noqa: E731
    pair = lambda a, b, fmt="{:.2f}": f"{_f(a, fmt)} / {_f(b, fmt)}"  # noqa: E731
    for key, entry in report["summary"].items():
        theirs, ours, sp = entry[MLX_LM], entry[DFLASH], entry["speedup"]
        ci = sp and sp["median_interval"]
        ratio = (f"{sp['median']:.2f}x" + (f" \\[{ci[0]:.2f}-{ci[1]:.2f}]" if ci else "")) if sp else "-"
        drafted = ours["cycles"] - ours["block_histogram"].get("1", 0)

        def same(ident: dict) -> str:
            text = f"{ident['identical']}/{ident['compared']}"
            return text + (f" (+{ident['near_ties']} near-tie)" if ident["near_ties"] else "")

        ttft = [s and {**s, "median": s["median"] * 1e3} for s in (theirs["ttft_s"], ours["ttft_s"])]
        t.add_row(key, _f(theirs["tps_total"]), _f(ours["tps_total"]), ratio, _f(entry["speedup_total"], "{:.2f}x"),
                  pair(med(theirs["latency_s"]), med(ours["latency_s"])),
                  pair(top(theirs["latency_s"]), top(ours["latency_s"])),
                  pair(med(ttft[0]), med(ttft[1]), "{:.0f}"), _f(ours["tau"], "{:.2f}"),
                  f"{drafted}/{ours['cycles']}",
                  pair(theirs["peak_memory_gb"] * 1e3, ours["peak_memory_gb"] * 1e3, "{:.0f}"),
                  same(ours["vs_mlx_lm"]), same(ours["vs_solo"]))
    console.print(t)
    t = Table(title="prefill, then decoding (medians over waves)")
    for col in ("N", "every first token ms, mlx-lm / DFlash", "decode tok/s after it, mlx-lm / DFlash"):
        t.add_column(col, justify="right")
    for key, entry in report["summary"].items():
        theirs, ours = entry[MLX_LM], entry[DFLASH]
        started = [s and s["median"] * 1e3 for s in (theirs.get("all_started_s"), ours.get("all_started_s"))]
        t.add_row(key, pair(*started, "{:.0f}"), pair(med(theirs.get("decode_tps")), med(ours.get("decode_tps")),
                                                       "{:.0f}"))
    console.print(t)
    for key, entry in report["summary"].items():
        blocks = " ".join(f"{b}x{n}" for b, n in entry[DFLASH]["block_histogram"].items())
        console.print(f"N={key}: blocks per cycle (block x cycles, 1: a plain batched step): {blocks}")
    console.print("tok/s: every token a wave generated over the time to its last one (prefill included), "
                  "total over the waves; ratio: ours over mlx-lm's per paired wave. Pairs of columns: "
                  "mlx-lm / DFlash.")
    for key, entry in report["summary"].items():
        for name, ident in (("mlx-lm's batched reply", entry[DFLASH]["vs_mlx_lm"]),
                            ("our reply decoded alone", entry[DFLASH]["vs_solo"])):
            for d in ident["divergences"][:5]:
                colour = "yellow" if d["near_tie"] else "red"
                gap = "-" if d["logit_gap"] is None else f"{d['logit_gap']:.2g}"
                console.print(f"[{colour}]N={key}: {d['prompt_id']} differs from {name} at token {d['index']}: "
                              f"{d['ours']} vs {d['theirs']} (logit gap {gap}"
                              f"{', a near-tie' if d['near_tie'] else ''})[/{colour}]")
    m = report["machine"]
    blas = f", BLAS: {m['blas']}" if m.get("blas") else ""
    console.print(f"machine: {m['platform']}, MLX {m['mlx']} ({m['backend']}){blas}")
