"""``dflash-mlx bench --predict``: the expected speedup on Apple M-series chips
from the cost model, with no generation run, for the chain at each block size
and the DDTree of each ``--tree-budget`` beside it."""

from typing import Optional

from .. import validate
from ..draft import draft_classes, is_dspark
from ..errors import DFlashError
from ..registry import read_config, resolve_pair
from . import cost_model as cm
from .batch_cost import predict_batch
from .chips import find_chips
from .presets import PRESETS
from .render import console
from .report import read_report, write_json
from .schedule import Arm

ARCHITECTURES = {"v1": "DFlash (v1)", "dflash2": "DFlash2 (conv-wrapped layers, candidate selector)",
                 "dspark": "DSpark (anchor-first block, Markov and confidence heads)"}


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


def _measured_trees(measured: Optional[dict]) -> dict[tuple[int, int], float]:
    """(budget, block) -> measured tau of each tree arm of a bench report."""
    sides = measured["summary"]["dflash"].values() if measured else []
    return {(s["tree_budget"], s["block_size"]): s["tau"] for s in sides
            if s.get("tree_budget") and s.get("tau")}


def _tree_arms(budgets: list[int], block_sizes: Optional[list[int]], measured: Optional[dict],
               trained: int) -> list[Arm]:
    """Each ``--tree-budget`` at the first ``--block-size`` (else the report's tree
    block, else the draft's trained size); without any, the report's tree arms."""
    if not budgets:
        return [Arm(b, t) for t, b in sorted(_measured_trees(measured))]
    block = (block_sizes or [(measured or {}).get("config", {}).get("tree_block_size") or trained])[0]
    return [Arm(block, t) for t in budgets]


def _print(out, rows: list[dict], arms: list[Arm], tp, dp, names: tuple[str, str], context: int,
           neural: bool, preset: Optional[str], published: Optional[float],
           draft_vocab: tuple[Optional[int], int]) -> None:
    from rich.table import Table

    best = {}
    for r in rows:
        if r["chip"] not in best or r["speedup"] > best[r["chip"]]["speedup"]:
            best[r["chip"]] = r
    trees = [a for a in arms if a.tree_budget]

    gb = lambda x: f"{x / 1e9:.2f} GB"  # noqa: E731
    out.print(f"target {names[0]}: {tp.params / 1e9:.2f} B parameters, {gb(tp.weight_bytes)} of weights; "
              f"an autoregressive step reads {gb(tp.forward(1, context, 1).bytes)}")
    rows_used, vocab = draft_vocab
    head = (f"the target's LM head, {gb(tp.head_bytes)}" if rows_used is None else
            f"{rows_used} of the LM head's {vocab} rows (--draft-vocab), {gb(tp.head_bytes * rows_used / vocab)}")
    out.print(f"draft  {names[1]}: {ARCHITECTURES[dp.architecture]}, {dp.params / 1e9:.2f} B parameters, "
              f"{gb(dp.weight_bytes)} (+ {head}, read every cycle)")
    if dp.selector_top_k:
        out.print(f"       its selector: top-{dp.selector_top_k} of each row's {dp.vocab} logits, rank "
                  f"{dp.selector_rank} codebooks ({gb(2 * dp.vocab * dp.codebook_row_bytes)}, "
                  f"{dp.selector_top_k + 1} rows gathered per drafted row), the walk")
    if dp.architecture == "dspark":
        out.print(f"       its backbone runs its trained block of {dp.trained_tokens} tokens each cycle; per drafted "
                  f"row the rank-{dp.markov_rank} Markov head gathers a W1 row and reads W2 ({gb(dp.markov_w2_bytes)}) "
                  f"whole, one row after another, and the confidence head takes a {dp.confidence_width}-wide dot; "
                  "the confidence schedule is not priced (give the tau of the verified length)")
    t = Table(title=f"predicted decode speed at {context} tokens of context"
                    + (" (M5 at the claimed Neural Accelerator rate)" if neural else ""))
    columns = ["chip", "GB/s", "TFLOPS", "arm", "tau", "mlx-lm tok/s", "DFlash tok/s", "speedup",
               "no-overlap", "verify"] + (["vs chain", "tie tau"] if trees else [])
    for col in columns:
        t.add_column(col, justify="left" if col == "chip" else "right")
    for r in rows:
        mark = " *" if len(arms) > 1 and best[r["chip"]] is r else ""
        tree = [f"{r['vs_chain']:.2f}x", f"{r['break_even_tau']:.2f}"] if r["tree_budget"] else ["", ""]
        t.add_row(r["chip"], f"{r['bandwidth_gbs']:g}", f"{r['fp32_tflops']:.1f}",
                  Arm(r["block_size"], r["tree_budget"]).label, f"{r['tau']:.2f}", f"{r['ar_tps']:.1f}",
                  f"{r['dflash_tps']:.1f}", f"{r['speedup']:.2f}x{mark}", f"{r['speedup_serial']:.2f}x",
                  r["verify_bound"], *(tree if trees else []))
    out.print(t)
    out.print("speedup: roofline with memory and compute overlapped (optimistic); no-overlap: their sum "
              "(pessimistic)." + (" *: the best arm for the chip." if len(arms) > 1 else ""))
    for arm in trees:
        r = next(r for r in rows if (r["block_size"], r["tree_budget"]) == arm[:2])
        out.print(f"{arm.label}: a DDTree of {arm.tree_budget} nodes, verified in one target pass over "
                  f"{arm.tree_budget + 1} positions after the draft's pass at b={arm.block_size}; "
                  f"tau {r['tau']:.2f}, {r['tau_source']}.")
    if trees:
        out.print("vs chain: the tree's predicted tok/s over the chain's at its block; tie tau: the tree's "
                  "tau at which it would match the chain on that chip.")
    if published is not None:
        out.print(f"published ({preset}, M5 Max, 1024 tokens, bstnxbt/dflash-mlx 0.1.4): {published:.2f}x")


def main_predict(*, model: Optional[str], draft: Optional[str], preset: Optional[str],
                 tau: Optional[float], results: Optional[str], block_sizes: Optional[list[int]],
                 chips: Optional[list[str]], context: int, dtype: Optional[str], neural: bool,
                 overhead_ms: float, json_out: Optional[str], tree_budgets: Optional[list[int]] = None,
                 tree_tau: Optional[float] = None, draft_vocab: Optional[int] = None,
                 kv: Optional[dict] = None, out=None, err=None) -> dict:
    """Predict, print the table and return (and with ``json_out`` write) the report.
    ``dtype`` None keeps the checkpoints' own. A tree arm's tau is ``tree_tau``,
    else the one measured in ``results`` for that budget and block, else the
    chain's at its block (no gain: the table then shows what the tree costs).
    ``draft_vocab`` N: the draft multiplies by N of the LM head's rows.
    ``kv`` (``kv_bits``, ``kv_group_size``, ``quantized_kv_start``): the target's
    KV cache is read quantized when ``context`` reaches the start."""
    out = out or console()
    err = err or console(stderr=True)
    validate.integer(context, "--context", low=0)
    validate.real(overhead_ms, "--overhead-ms", low=0.0)
    if tau is not None:
        validate.real(tau, "--tau", low=1.0)
    if tree_tau is not None:
        validate.real(tree_tau, "--tree-tau", low=1.0)
    if tau is None and results is None and preset is None:
        raise DFlashError("--predict needs tau: give --tau T, --results BENCH.json or --preset NAME")
    measured = read_report(results) if results else None
    target_cfg, draft_cfg, names, published, preset_tau = _configs(model, draft, preset, measured)
    for budget in tree_budgets or []:
        validate.tree_budget(budget, cm.context_length(target_cfg), "--tree-budget")
    quantized = kv is not None and context >= kv["quantized_kv_start"]
    tp = cm.target_profile(target_cfg, dtype, (kv["kv_bits"], kv["kv_group_size"]) if quantized else None)
    dp = cm.draft_profile(draft_cfg, dtype)
    vocab = int(cm.text_config(target_cfg)["vocab_size"])
    if draft_vocab is not None and validate.integer(draft_vocab, "--draft-vocab", low=1) > vocab:
        raise DFlashError(f"--draft-vocab must be at most the target's vocabulary size {vocab}, got {draft_vocab}")
    share = 1.0 if draft_vocab is None else draft_vocab / vocab
    trained = draft_classes(draft_cfg)[1].from_dict(draft_cfg).block_size
    check_trained_block(dp.architecture == "dspark", block_sizes or [trained], trained)

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
        base = (preset_tau, trained, None, "preset")
    else:
        raise DFlashError("--predict needs tau: give --tau T, --results BENCH.json or --preset NAME")
    if not 1.0 <= base[0] <= base[1]:
        raise DFlashError(f"tau must lie in [1, {base[1]}], got {base[0]:g}")

    def chain_tau(b: int) -> tuple[float, str]:
        t0, b0, pa, how = sources.get(b, base)
        if b == b0:
            return t0, how
        return min(cm.tau_at(b, t0, b0, pa), b), f"{how}, extrapolated from b={b0}"

    trees = _tree_arms(tree_budgets, block_sizes, measured, trained)
    if tree_tau is not None and not trees:
        raise DFlashError("--tree-tau needs --tree-budget (or a --results report with tree arms)")
    for arm in trees:
        if tree_tau is not None and tree_tau > arm.block_size:
            raise DFlashError(f"--tree-tau must be at most the tree's block size {arm.block_size} "
                              f"(the tree is {arm.block_size - 1} deep), got {tree_tau:g}")
    measured_trees = _measured_trees(measured)
    arms = [Arm(b) for b in block_sizes or (sorted(sources) if sources else [base[1]])] + trees
    rows = []
    for chip in find_chips(chips):
        for arm in arms:
            b = arm.block_size
            t, kind = chain_tau(b)
            chain = cm.predict(tp, dp, chip, t, b, context, overhead_ms, neural, head_share=share)
            if arm.tree_budget is None:
                rows.append(_row(chain, chip, kind))
                continue
            if tree_tau is not None:
                t, kind = tree_tau, "given (--tree-tau)"
            elif (arm.tree_budget, b) in measured_trees:
                t, kind = measured_trees[arm.tree_budget, b], f"measured ({results})"
            else:
                kind = f"the chain's at b={b} ({kind}): no tree gain assumed"
            pred = cm.predict(tp, dp, chip, t, b, context, overhead_ms, neural, tree_budget=arm.tree_budget,
                              head_share=share)
            rows.append(_row(pred, chip, kind, vs_chain=pred.dflash_tps / chain.dflash_tps,
                             break_even_tau=pred.tau * chain.dflash_tps / pred.dflash_tps))
    _print(out, rows, arms, tp, dp, names, context, neural, preset, published, (draft_vocab, vocab))
    if kv is not None:
        how = (f"{kv['kv_bits']}-bit in groups of {kv['kv_group_size']}" if quantized else
               f"full precision: below --quantized-kv-start {kv['quantized_kv_start']}")
        out.print(f"the target's KV cache at {context} tokens: {tp.kv_bytes_per_pos * context / 1e9:.3f} GB "
                  f"read per pass, {how} (--kv-bits)")
    report = {"schema": "dflash-mlx-predict", "schema_version": 1,
              "target": {"name": names[0], "params": tp.params, "weight_bytes": tp.weight_bytes},
              "draft": {"name": names[1], "architecture": dp.architecture, "params": dp.params,
                        "weight_bytes": dp.weight_bytes, "selector_top_k": dp.selector_top_k or None},
              "context": context, "neural_accelerators": neural, "overhead_ms": overhead_ms,
              "draft_vocab": draft_vocab, "kv": kv, "kv_quantized": quantized,
              "published_speedup": published, "predictions": rows,
              "chips": [{"name": c.name, "gpu_cores": c.gpu_cores, "bandwidth_gbs": c.bandwidth_gbs,
                         "fp32_tflops": c.fp32_tflops, "neural_tflops": c.neural_tflops,
                         "source": c.source} for c in find_chips(chips)]}
    if json_out:
        write_json(report, json_out)
        err.print(f"wrote {json_out}")
    return report


def check_trained_block(dspark: bool, sizes: list[int], trained: int) -> None:
    """A DSpark draft drafts no block wider than its trained one (DFlashError)."""
    if dspark and max(sizes) > trained:
        raise DFlashError(f"a DSpark draft drafts at most its trained block of {trained} (gamma {trained - 1} "
                          f"drafts and the anchor); give --block-size up to {trained}")


def _row(pred: cm.Prediction, chip, kind: str, **tree) -> dict:
    """A prediction as the report's row: the figures, where tau came from, the chip."""
    return {**pred.to_dict(), "tau_source": kind, "bandwidth_gbs": chip.bandwidth_gbs,
            "fp32_tflops": chip.fp32_tflops, "neural_tflops": chip.neural_tflops, **tree}


def main_predict_batch(*, model: Optional[str], draft: Optional[str], preset: Optional[str], tau: Optional[float],
                       block_sizes: Optional[list[int]], widths: list[int], chips: Optional[list[str]], context: int,
                       dtype: Optional[str], neural: bool, overhead_ms: float, json_out: Optional[str],
                       out=None, err=None) -> dict:
    """``--predict --concurrency``: per chip, width and block, N requests decoded
    together by plain batched steps or by DFlash cycles (``batch_cost.predict_batch``);
    tau is ``--tau`` at the first block (else the preset's at the draft's
    trained size), extrapolated to the other blocks as for one request."""
    from rich.table import Table

    out = out or console()
    err = err or console(stderr=True)
    validate.integer(context, "--context", low=0)
    validate.real(overhead_ms, "--overhead-ms", low=0.0)
    if tau is not None:
        validate.real(tau, "--tau", low=1.0)
    target_cfg, draft_cfg, names, _, preset_tau = _configs(model, draft, preset, None)
    trained = draft_classes(draft_cfg)[1].from_dict(draft_cfg).block_size
    sizes = block_sizes or [trained]
    check_trained_block(is_dspark(draft_cfg), sizes, trained)
    if tau is None and preset_tau is None:
        raise DFlashError("--predict --concurrency needs tau: give --tau T or --preset NAME")
    t0, b0 = (tau, sizes[0]) if tau is not None else (preset_tau, trained)
    if not 1.0 <= t0 <= b0:
        raise DFlashError(f"tau must lie in [1, {b0}], got {t0:g}")
    tp, dp = cm.target_profile(target_cfg, dtype), cm.draft_profile(draft_cfg, dtype)
    rows = []
    for chip in find_chips(chips):
        for n in widths:
            for b in sizes:
                t = t0 if b == b0 else min(cm.tau_at(b, t0, b0, None), b)
                rows.append(predict_batch(tp, dp, chip, t, b, n, context, overhead_ms, neural).to_dict())
    table = Table(title=f"{names[0]}: N requests decoded together at {context} tokens of context each, "
                        f"aggregate tok/s" + (" (M5 at the claimed Neural Accelerator rate)" if neural else ""))
    for col in ("chip", "N", "arm", "tau", "mlx-lm tok/s", "DFlash tok/s", "speedup", "no-overlap",
                "step", "verify"):
        table.add_column(col, justify="left" if col == "chip" else "right")
    best = {}
    for r in rows:
        key = (r["chip"], r["rows"])
        if key not in best or r["speedup"] > best[key]["speedup"]:
            best[key] = r
    for r in rows:
        mark = " *" if len(sizes) > 1 and best[(r["chip"], r["rows"])] is r else ""
        table.add_row(r["chip"], str(r["rows"]), f"b={r['block_size']}", f"{r['tau']:.2f}", f"{r['ar_tps']:.1f}",
                      f"{r['dflash_tps']:.1f}", f"{r['speedup']:.2f}x{mark}", f"{r['speedup_serial']:.2f}x",
                      r["step_bound"], r["verify_bound"])
    out.print(table)
    out.print("mlx-lm: plain batched steps over [N, 1]; DFlash: one draft pass and one verify pass over [N, b] "
              "per cycle, each row accepting tau tokens. A pass reads the weights once for all N rows, each "
              "row's KV cache and state apart; step / verify: what bounds that pass on the chip."
              + (" *: the best block for the chip and width." if len(sizes) > 1 else ""))
    report = {"schema": "dflash-mlx-predict-batch", "schema_version": 1,
              "target": {"name": names[0], "params": tp.params, "weight_bytes": tp.weight_bytes},
              "draft": {"name": names[1], "architecture": dp.architecture, "params": dp.params},
              "context": context, "neural_accelerators": neural, "overhead_ms": overhead_ms,
              "concurrency": widths, "predictions": rows}
    if json_out:
        write_json(report, json_out)
        err.print(f"wrote {json_out}")
    return report
