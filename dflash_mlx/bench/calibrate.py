"""``dflash-mlx bench --calibrate``: measure the pair's cost curve on this
machine afresh, cache it (where ``block_size="auto"`` reads it) and print it."""

import time
from typing import Optional

import mlx.core as mx

from ..loop.cost_curve import CostCurve, cache_key, cache_path, cost_curve
from ..precision import dtype_name
from ..registry import resolve_pair
from .render import console


def print_curve(curve: CostCurve, out, title: str) -> None:
    """One row per measured block size at the curve's context: target and draft
    pass, the cycle (a plain step's with the injection of its position), the
    tau a cycle needs to beat a plain step (cycle / cycle(1)), and how much the
    cycle grows per 1,000 more tokens of context."""
    from rich.table import Table

    t = Table(title=title, caption=f"at {curve.context} tokens of context")
    for col in ("block", "target ms", "draft ms", "cycle ms", "break-even tau", "+ms per 1k context"):
        t.add_column(col, justify="right")
    step = curve.cycle_seconds(1)
    far = curve.context + 1000
    for b in curve.sizes:
        t.add_row(str(b), f"{curve.target(b) * 1e3:.2f}", "-" if b == 1 else f"{curve.draft(b) * 1e3:.2f}",
                  f"{curve.cycle_seconds(b) * 1e3:.2f}", f"{curve.cycle_seconds(b) / step:.2f}",
                  f"{(curve.cycle_seconds(b, far) - curve.cycle_seconds(b)) * 1e3:.2f}")
    out.print(t)


def load_pair(pair, dtype: str, draft_dtype: str = "auto", launch=None):
    """(target model, tokenizer, draft, dtype used) for a resolved pair: ``auto``
    is float32 on the CPU backend (its fast matmuls) and the checkpoints' own
    dtype elsewhere, ``keep`` the checkpoints' own. ``draft_dtype`` (``--draft-dtype``)
    other than auto sets the draft's instead (``precision.choose_draft_dtype``).
    On a rank of ``launch`` (``distributed.Launch``) the target is its sharded ``Target``."""
    from ..loading import load, load_draft

    target, tokenizer = launch.load(pair.target) if launch else load(pair.target)
    draft = load_draft(pair.draft, dtype=draft_dtype)
    if dtype == "auto":
        dtype = "float32" if mx.default_device() == mx.cpu else "keep"
    if dtype != "keep":
        (target.model if launch else target).set_dtype(getattr(mx, dtype))
        if draft_dtype == "auto":
            draft.set_dtype(getattr(mx, dtype))
    return target, tokenizer, draft, dtype


def main_calibrate(*, model: Optional[str], draft: Optional[str], dtype: str, draft_dtype: str = "auto",
                   out=None, err=None) -> CostCurve:
    from ..targets import Target

    out = out or console()
    err = err or console(stderr=True)
    pair = resolve_pair(model, draft)
    target_model, _, dft, dtype = load_pair(pair, dtype, draft_dtype)
    target = Target(target_model)
    mx.eval(target_model.parameters(), dft.parameters())
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    curve = cost_curve(target, dft, refresh=True)
    seconds = time.perf_counter() - tic
    name = "checkpoint dtype" if dtype == "keep" else dtype
    print_curve(curve, out, f"cost per cycle on this machine: {pair.target} + {pair.draft}, {name} "
                            f"(draft {dtype_name(dft)})")
    gb = 1024**3
    err.print(f"measured in {seconds:.2f} s; memory: {held / gb:.3f} GB held by the models, peak "
              f"{mx.get_peak_memory() / gb:.3f} GB while measuring, {mx.get_active_memory() / gb:.3f} GB "
              f"held after; cached in {cache_path(cache_key(target, dft))}", markup=False, highlight=False)
    return curve
