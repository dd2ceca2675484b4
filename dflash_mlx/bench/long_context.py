"""``dflash-mlx bench --context 1k,4k,...``: prompts of exact token lengths and
the comparison with mlx-lm per context class.

The prompts are cut from Python's standard library sources (every ``*.py``
directly in the running Python's ``Lib`` folder, read in name order): prompt i
of a context starts at file i * n / k of the n files (k prompts per context)
and runs on through the next files until the tokenizer has made enough
tokens, then is cut to the exact length. The same Python and tokenizer give
the same prompts. They are fed as token ids, without a chat template.

Per context class and arm the report keeps (``contexts``): decode speedup
(DFlash tok/s over mlx-lm's on the same prompt and repeat, median over those
pairs, with the interval that holds the pairs' median with 95% confidence), each
side's prefill speed and time to first token (medians), tau, and each side's
peak memory (the largest run's).
"""

import re
import sysconfig
from pathlib import Path
from typing import Callable, Optional

from ..chat import encode
from ..errors import DFlashError
from .schedule import BASELINE, DFLASH, Arm
from .summary import acceptance, stats

PROMPTS_PER_CONTEXT = 3
CHARS_PER_TOKEN = 4  # a first guess at how much source text makes a token; grown when short


def parse_context(text: str) -> int:
    """A context length as typed: ``4096``, ``4k`` (4 x 1024) or ``3.5k``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kK]?)\s*", text)
    if not match:
        raise DFlashError(f"Invalid value for '--context': '{text}' is not a token count such as 4096 or 4k")
    tokens = float(match.group(1)) * (1024 if match.group(2) else 1)
    if tokens != int(tokens) or tokens < 1:
        raise DFlashError(f"Invalid value for '--context': '{text}' is not a whole number of tokens >= 1")
    return int(tokens)


def label(tokens: int) -> str:
    """The context class's name: ``4k`` for 4096 tokens, else the count."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def fitting(lengths: list[int], max_tokens: int, positions: Optional[int],
            warn: Callable[[str], None]) -> list[int]:
    """The context lengths whose prompt plus ``max_tokens`` fit the target's
    ``positions``; each other one is skipped with one ``warn`` line (all of
    them skipped: a DFlashError)."""
    if positions is None:
        return list(lengths)
    kept = [n for n in lengths if n + max_tokens <= positions]
    for n in lengths:
        if n not in kept:
            warn(f"context {label(n)} skipped: {n} prompt tokens and {max_tokens} generated pass the "
                 f"target's {positions} positions; use --synthetic --context for longer contexts")
    if not kept:
        raise DFlashError(f"no --context fits the target's {positions} positions with --max-tokens "
                          f"{max_tokens}; give a shorter context")
    return kept


def stdlib_sources() -> list[Path]:
    """The corpus: the standard library's top-level ``*.py`` files, by name."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise DFlashError("no Python standard library sources found to cut --context prompts from")
    return files


def _ids_from(files: list[Path], tokenizer, tokens: int) -> list[int]:
    budget = tokens * CHARS_PER_TOKEN
    while True:
        text, used = "", 0
        while len(text) < budget and used < len(files):
            text += files[used].read_text(encoding="utf-8", errors="replace") + "\n"
            used += 1
        ids = encode(tokenizer, text)
        if len(ids) >= tokens:
            return ids[:tokens]
        if used == len(files):
            raise DFlashError(f"the standard library sources make only {len(ids)} tokens, "
                              f"fewer than --context {tokens}")
        budget *= 2


def context_prompts(tokenizer, lengths: list[int], per_context: int = PROMPTS_PER_CONTEXT) -> list[dict]:
    """``per_context`` prompts of each length: dicts with ``ids`` (exactly that
    many), their decoded ``prompt`` text, ``id`` and ``category`` (the class)."""
    files = stdlib_sources()
    out = []
    for n in lengths:
        for i in range(per_context):
            start = i * len(files) // per_context
            ids = _ids_from(files[start:] + files[:start], tokenizer, n)
            out.append({"id": f"ctx{label(n)}-{i + 1}", "category": label(n),
                        "prompt": tokenizer.decode(ids), "ids": ids})
    return out


def _median(values) -> Optional[float]:
    s = stats(values)
    return s["median"] if s else None


def _side(runs: list[dict]) -> dict:
    return {"prefill_tps": _median(r["prefill_tps"] for r in runs),
            "ttft_s": _median(r["prefill_s"] for r in runs),
            "decode_tps": _median(r["decode_tps"] for r in runs),
            "peak_memory_gb": max((r["peak_memory_gb"] for r in runs), default=None)}


def context_summary(runs: list[dict], pairs: list[dict], arms: list[Arm], lengths: list[int]) -> list[dict]:
    """One row per context class and DFlash arm: both sides' figures, the
    decode speedup and tau (``bench --context``'s table)."""
    rows = []
    for n in lengths:
        name = label(n)
        base = [r for r in runs if r["arm"] == BASELINE and r["category"] == name]
        for arm in arms:
            mine = [r for r in runs if r["arm"] == DFLASH and r["category"] == name
                    and Arm.of(r) == arm]
            ps = [p for p in pairs if p["category"] == name and Arm.of(p) == arm]
            identical = [p["identical"] for p in ps if p.get("identical") is not None]
            speedup = stats(p["speedup"] for p in ps) or {}
            rows.append({"context": name, "context_tokens": n, "arm": arm.key, "label": arm.label, "prompts": len(ps),
                         "speedup": speedup.get("median"), "speedup_interval": speedup.get("median_interval"),
                         "tau": acceptance(mine, arm.block_size, arm.tree_budget)["tau"] if mine else None,
                         "identical": sum(identical) if identical else None,
                         "baseline": _side(base), "dflash": _side(mine)})
    return rows


def render_contexts(rows: list[dict], console) -> None:
    """The per-context table: DFlash beside mlx-lm."""
    from rich.table import Table

    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    t = Table(title="by context: DFlash beside mlx-lm (medians over prompts; memory: the largest run)")
    for col in ("context", "arm", r"speedup \[95% interval]", "tau", "prefill tok/s", "TTFT s", "decode tok/s",
                "peak GB", "identical"):
        t.add_column(col, justify="left" if col in ("context", "arm") else "right")
    for r in rows:
        b, d = r["baseline"], r["dflash"]
        interval = r.get("speedup_interval")
        speedup = f(r["speedup"], "{:.2f}x") + (" \\[{:.2f}-{:.2f}]".format(*interval) if interval else "")
        t.add_row(r["context"], r["label"], speedup, f(r["tau"], "{:.2f}"),
                  f"{f(d['prefill_tps'], '{:.0f}')} / {f(b['prefill_tps'], '{:.0f}')}",
                  f"{f(d['ttft_s'], '{:.2f}')} / {f(b['ttft_s'], '{:.2f}')}",
                  f"{f(d['decode_tps'])} / {f(b['decode_tps'])}",
                  f"{f(d['peak_memory_gb'], '{:.2f}')} / {f(b['peak_memory_gb'], '{:.2f}')}",
                  "-" if r["identical"] is None else f"{r['identical']}/{r['prompts']}")
    console.print(t)
    console.print("each cell with two figures: DFlash / mlx-lm; the speedup's interval holds the median of "
                  "the pairs' distribution with 95% confidence (none below 6 pairs)", markup=False, highlight=False)
