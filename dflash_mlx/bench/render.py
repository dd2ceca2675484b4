"""The bench report on a terminal (rich tables) and as a PNG chart."""

import contextlib
import warnings
from pathlib import Path
from typing import Callable, Iterator

from .. import validate
from ..errors import DFlashError
from .schedule import Arm


def console(stderr: bool = False):
    """A rich console; wide when not a terminal, so piped tables do not wrap."""
    from rich.console import Console

    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=240)


def _f(x, fmt="{:.1f}", none="-") -> str:
    return none if x is None else fmt.format(x)


def labelled(report: dict) -> list[tuple[str, dict]]:
    """(label, summary) of each DFlash arm: ``b=16``, ``B=32 b=16`` (a tree),
    ``b=auto sched`` (the confidence schedule on); reports from before tree
    arms name each side by its block size alone."""
    return [(Arm(side.get("block_size", key), side.get("tree_budget"), side.get("confidence_schedule")).label, side)
            for key, side in report["summary"]["dflash"].items()]


def render(report: dict, console) -> None:
    """The rich tables: the baseline and one row per arm (chains and trees),
    speedup by category, acceptance per position, divergences."""
    from rich.table import Table

    cfg, summ = report["config"], report["summary"]
    base = summ["baseline"]
    arch = {"dspark": " (DSpark)", "dflash2": " (DFlash2)", "v1": " (DFlash v1)"}.get(cfg.get("draft_architecture"), "")
    t = Table(title=f"{cfg['model']} + {cfg['draft']}{arch}: {len(report['prompts'])} prompts x {cfg['repeat']} "
                    f"repeat(s), {cfg['max_tokens']} tokens, temperature {cfg['temperature']:g}, {cfg['dtype']}")
    for col in ("arm", "prefill tok/s", "decode tok/s", r"speedup median \[q1-q3] (min-max)", "total",
                "tau", "tok/cycle", "accept", "peak GB", "wall s", "identical"):
        t.add_column(col, justify="left" if col == "arm" else "right")
    med = lambda s: s["median"] if s else None  # noqa: E731
    t.add_row("mlx-lm (baseline)", _f(med(base["prefill_tps"])), _f(med(base["decode_tps"])), "1.00x", "",
              "", "", "", _f(base["peak_memory_gb"] and base["peak_memory_gb"]["max"], "{:.2f}"),
              _f(base["wall_s"]), "")
    sides = labelled(report)
    for b, side in sides:
        sp = side["speedup"]
        spread = (f"{sp['median']:.2f}x \\[{sp['q1']:.2f}-{sp['q3']:.2f}] ({sp['min']:.2f}-{sp['max']:.2f})"
                  if sp else "-")
        ident = f"{side['identical']}/{side['compared']}" if side["identical"] is not None else "n/a"
        name = "DDTree" if side.get("tree_budget") else "DFlash"
        t.add_row(f"{name} {b}", _f(med(side["prefill_tps"])), _f(med(side["decode_tps"])), spread,
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
        for b, _ in sides:
            t.add_column(b, justify="right")
        for c in cats:
            cells = []
            for _, side in sides:
                cat = side["by_category"].get(c)
                cells.append(f"{cat['speedup']['median']:.2f}x ({cat['tau']:.2f})"
                             if cat and cat["speedup"] and cat["tau"] else "-")
            t.add_row(c, *cells)
        console.print(t)

    width = max(len(side["accepted_histogram"]) for side in summ["dflash"].values())
    if width > 1:
        t = Table(title="acceptance: share of cycles whose draft position (tree depth) i was accepted, P(a >= i)")
        t.add_column("arm")
        for i in range(1, width):
            t.add_column(str(i), justify="right")
        for b, side in sides:
            pa = side["position_acceptance"]
            t.add_row(b, *[f"{x:.2f}" for x in pa], *[""] * (width - 1 - len(pa)))
        console.print(t)
    else:  # a table of no positions would squeeze its title into the arm column
        console.print("acceptance: no arm accepted a draft position")
    for b, side in sides:
        hist = side["accepted_histogram"]
        console.print(f"accepted drafts per cycle, {b} (a = 0..{len(hist) - 1}): {hist}")
        if b.startswith(Arm(validate.AUTO).label):
            blocks = " ".join(f"{k}x{n}" for k, n in side["block_histogram"].items())
            console.print(f"blocks used per cycle, {b} (block x cycles): {blocks}")

    for b, side in sides:
        for d in side["divergences"][:10]:
            console.print(f"[red]{b}: {d['prompt_id']} repeat {d['repeat']} diverges at token "
                          f"{d['index']}: baseline {d['baseline']} vs DFlash {d['dflash']}[/red]")
        extra = len(side["divergences"]) - 10
        if extra > 0:
            console.print(f"[red]{b}: ... and {extra} more divergences (see the JSON)[/red]")
    m = report["machine"]
    blas = f", BLAS: {m['blas']}" if m.get("blas") else ""
    console.print(f"machine: {m['platform']}, MLX {m['mlx']} ({m['backend']}){blas}")


NO_MATPLOTLIB = "--plot needs matplotlib: pip install matplotlib (in a clone of dflash-mlx: pip install '.[plot]')"


def plot(report: dict, path: str | Path) -> None:
    """PNG: median speedup per category and arm (whiskers: min-max), and the
    acceptance histogram of each arm."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DFlashError(NO_MATPLOTLIB) from None
    summ = labelled(report)
    cats = sorted({c for _, side in summ for c in side["by_category"]})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(summ), 1)
    for j, (b, side) in enumerate(summ):
        med, lo, hi = [], [], []
        for c in cats:
            s = side["by_category"].get(c, {}).get("speedup")
            med.append(s["median"] if s else 0)
            lo.append(s["median"] - s["min"] if s else 0)
            hi.append(s["max"] - s["median"] if s else 0)
        xs = [i + (j - (len(summ) - 1) / 2) * width for i in range(len(cats))]
        ax1.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=b)
        hist = side["accepted_histogram"]
        total = sum(hist) or 1
        ax2.bar([a + (j - (len(summ) - 1) / 2) * width for a in range(len(hist))],
                [h / total for h in hist], width, label=f"{b} (tau {side['tau'] or 0:.2f})")
    ax1.axhline(1.0, color="gray", lw=1, ls="--")
    ax1.set_xticks(range(len(cats)), cats)
    ax1.set_ylabel("decode speedup over mlx-lm (median, min-max)")
    ax1.set_title("speedup by prompt category")
    ax1.legend()
    ax2.set_xlabel("draft tokens accepted per cycle (a tree: its path's depth)")
    ax2.set_ylabel("share of cycles")
    ax2.set_title("acceptance histogram")
    ax2.legend()
    cfg = report["config"]
    fig.suptitle(f"dflash-mlx bench: {Path(cfg['model']).name} + {Path(cfg['draft']).name}, "
                 f"{cfg['max_tokens']} tokens, {cfg['dtype']}, {report['machine']['backend']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@contextlib.contextmanager
def stepping(err, name: str, total: int, remaining: bool = False, width: int = 40) -> Iterator[Callable[[str], None]]:
    """A progress bar of ``total`` runs on ``err``, with the untrained-block
    warning (already given once) silenced: yields ``on_step(description)``,
    which counts the run before as done and names the next; the last counts
    as done on leaving."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn(f"{{task.description:<{width}}}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               *([TimeRemainingColumn()] if remaining else []))
    with Progress(*columns, console=err, transient=False) as progress, warnings.catch_warnings():
        warnings.simplefilter("ignore", validate.UntrainedBlockWarning)
        task = progress.add_task(name, total=total)
        started = [False]

        def on_step(description: str) -> None:
            if started[0]:
                progress.advance(task)
            started[0] = True
            progress.update(task, description=description)

        yield on_step
        progress.advance(task)
