"""``dflash-mlx bench --predict``: the expected speedup on Apple M-series chips
from the cost model, with no generation run."""

from typing import Optional

from .. import validate
from ..draft import DraftConfig
from ..errors import DFlashError
from ..registry import read_config, resolve_pair
from . import cost_model as cm
from .chips import find_chips
from .presets import PRESETS
from .render import console
from .report import read_report, write_json


def _configs(model: Optional[str], draft: Optional[str], preset: Optional[str],
             measured: Optional[dict]) -> tuple[dict, dict, tuple[str, str], Optional[float], Optional[float]]:
    """(target config, draft config, their names, published speedup, preset tau)."""
    if preset is not None:
        if model or draft:
            raise DFlashError("give either --preset or --model/--draft, not both")
        if preset not in PRESETS:
            raise DFlashError(f"unknown preset '{preset}'; known: {', '.join(PRESETS)}")
        target_cfg, draft_cfg, published, preset_tau = PRESETS[preset]
        return target_cfg, draft_cfg, (preset, f"{preset} draft (assumed shape)"), published, preset_tau
    if measured and model is None and draft is None:
        model, draft = measured["config"]["model"], measured["config"]["draft"]
    pair = resolve_pair(model, draft)
    return (read_config(pair.target, "target"), read_config(pair.draft, "draft"),
            (pair.target, pair.draft), None, None)


def _print(out, rows: list[dict], blocks: list[int], tp, dp, names: tuple[str, str], context: int,
           neural: bool, preset: Optional[str], published: Optional[float]) -> None:
    from rich.table import Table

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


def main_predict(*, model: Optional[str], draft: Optional[str], preset: Optional[str],
                 tau: Optional[float], results: Optional[str], block_sizes: Optional[list[int]],
                 chips: Optional[list[str]], context: int, dtype: Optional[str], neural: bool,
                 overhead_ms: float, json_out: Optional[str], out=None, err=None) -> dict:
    """Predict, print the table and return (and with ``json_out`` write) the report.
    ``dtype`` None keeps the checkpoints' own."""
    out = out or console()
    err = err or console(stderr=True)
    validate.integer(context, "--context", low=0)
    validate.real(overhead_ms, "--overhead-ms", low=0.0)
    if tau is not None:
        validate.real(tau, "--tau", low=1.0)
    if tau is None and results is None and preset is None:
        raise DFlashError("--predict needs tau: give --tau T, --results BENCH.json or --preset NAME")
    measured = read_report(results) if results else None
    target_cfg, draft_cfg, names, published, preset_tau = _configs(model, draft, preset, measured)
    tp, dp = cm.target_profile(target_cfg, dtype), cm.draft_profile(draft_cfg, dtype)
    trained = DraftConfig.from_dict(draft_cfg).block_size

    # tau per block size: given, measured (with its per-position acceptance), or the preset's
    sources: dict[int, tuple[float, int, Optional[list[float]], str]] = {}
    if tau is not None:
        base = (tau, (block_sizes or [trained])[0], None, "given")
    elif measured:
        sides = measured["summary"]["dflash"]
        usable = {int(b): s for b, s in sides.items() if s.get("tau") and b.isdigit()}  # not auto
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
    for chip in find_chips(chips):
        for b in blocks:
            t0, b0, pa, how = sources.get(b, base)
            t = t0 if b == b0 else cm.tau_at(b, t0, b0, pa)
            kind = how if b == b0 else f"{how}, extrapolated from b={b0}"
            pred = cm.predict(tp, dp, chip, min(t, b), b, context, overhead_ms, neural)
            rows.append({**pred.to_dict(), "tau_source": kind, "bandwidth_gbs": chip.bandwidth_gbs,
                         "fp32_tflops": chip.fp32_tflops, "neural_tflops": chip.neural_tflops})
    _print(out, rows, blocks, tp, dp, names, context, neural, preset, published)
    report = {"schema": "dflash-mlx-predict", "schema_version": 1,
              "target": {"name": names[0], "params": tp.params, "weight_bytes": tp.weight_bytes},
              "draft": {"name": names[1], "params": dp.params, "weight_bytes": dp.weight_bytes},
              "context": context, "neural_accelerators": neural, "overhead_ms": overhead_ms,
              "published_speedup": published, "predictions": rows,
              "chips": [{"name": c.name, "gpu_cores": c.gpu_cores, "bandwidth_gbs": c.bandwidth_gbs,
                         "fp32_tflops": c.fp32_tflops, "neural_tflops": c.neural_tflops,
                         "source": c.source} for c in find_chips(chips)]}
    if json_out:
        write_json(report, json_out)
        err.print(f"wrote {json_out}")
    return report
