"""What a cycle costs on this machine, per block size and context length:
measured once per (target, draft, dtype, device), cached on disk, interpolated
between the measured sizes. ``block_policy.AdaptiveBlock`` weighs expected
tokens against it.

A cycle at b is timed as the loop runs it: the decoder's own cycles, each
from the end of the one before, in runs at one block, with runs of plain
steps between them (``loop_cycle_seconds``). t_draft(b) is one draft pass
proposing b-1 tokens (the draft plus the borrowed LM head, and the argmax),
timed alone; t_target(b) is the rest of the cycle (the recording forward, the
logits, acceptance, the rollback and the draft's context injection of the
kept positions). A block of 1 is a plain target step: no draft pass,
t_draft(1) = 0. A plain step's position still reaches the draft's context
cache, in one batch when the draft next runs: ``inject_s`` per position, part
of a plain step's price.

Attention makes every pass grow with the context; the weights do not. Each
pass is timed at ``CONTEXT`` and again at ``LONG_CONTEXT`` tokens (or what the
target's positions allow), and the difference per token is its context
slope: t(b, n) = t(b) + slope(b) * (n - CONTEXT) for n past ``CONTEXT``.

The cache lives under ``$DFLASH_MLX_CACHE_DIR`` (meant for tests), else
``$XDG_CACHE_HOME/dflash-mlx`` or ``~/.cache/dflash-mlx``, one JSON file per
key. The key holds the device (backend, default device, ``LD_PRELOAD``, which
picks the BLAS on Linux, and the BLAS thread counts set in the environment:
one OpenBLAS thread against two changes every pass's time), the MLX and
dflash-mlx versions, and a hash of each model's config and of its weights'
names, shapes and dtypes. An entry that
does not parse, does not hold that exact key or holds an invalid curve is
measured again and rewritten, never trusted.
"""

import functools
import hashlib
import itertools
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .decoder import SpeculativeDecoder, propose_block, proposer_for
from ..draft import DFlashDraft
from .sampling import BlockSampler, SamplingParams
from ..targets import Target

SCHEMA = "dflash-mlx-cost-curve"
SCHEMA_VERSION = 5  # 2: context slopes, a plain step's injection; 3: slopes from 2,048 tokens, a plain step's median;
# 4: timed again while a plain step times faster at the long context (older entries may hold such a curve);
# 5: the loop's own cycles, interleaved with plain steps
SIZES = (1, 2, 4, 8, 12, 16, 24, 32)  # measured where they fit the draft's trained size
CONTEXT = 64  # tokens in the caches while measuring
LONG_CONTEXT = 2048  # the second context timed, for the slopes
INJECT_BATCH = 64  # positions injected in one batch while measuring inject_s
BUDGET_S = 1.0  # about this long for the whole measurement
MAX_REPEATS = 5
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")  # in the key when set
ROUNDS = 3  # rounds of the loop's cycles timed at each context (``loop_cycle_seconds``)
RUN = 4  # cycles in a row at one block within a round (the middle ones are timed)
MEASURE_TRIES = 3  # measurements at most, while a plain step times faster at the long context than the short


@dataclass(frozen=True)
class CostCurve:
    """Seconds per cycle at the measured block sizes, linear in between, at
    ``context`` tokens; past it each pass grows by its slope per token. No
    slopes: the same cost at every context."""

    sizes: tuple[int, ...]  # increasing, starting at 1
    target_s: tuple[float, ...]
    draft_s: tuple[float, ...]  # 0 at b = 1: no draft pass
    context: int = CONTEXT  # tokens in the caches when target_s and draft_s were timed
    target_slope: tuple[float, ...] = ()  # seconds more per context token, per size; () none
    draft_slope: tuple[float, ...] = ()
    inject_s: float = 0.0  # seconds to inject one plain step's position into the draft's context

    def __post_init__(self):
        sizes, t, d = self.sizes, self.target_s, self.draft_s
        slopes = (*self.target_slope, *self.draft_slope)
        ok = (len(sizes) >= 2 and len(t) == len(d) == len(sizes) and sizes[0] == 1
              and all(isinstance(b, int) and not isinstance(b, bool) for b in sizes)
              and all(a < b for a, b in zip(sizes, sizes[1:]))
              and all(isinstance(x, (int, float)) and 0 <= x < float("inf")
                      for x in (*t, *d, *slopes, self.inject_s))
              and all(x > 0 for x in (*t, *d[1:])) and d[0] == 0
              and all(len(s) in (0, len(sizes)) for s in (self.target_slope, self.draft_slope))
              and isinstance(self.context, int) and self.context >= 0)
        if not ok:
            raise ValueError(f"not a cost curve: {self}")

    @staticmethod
    def _interpolate(sizes, values, b: float) -> float:
        i = next((k for k in range(1, len(sizes)) if b <= sizes[k]), len(sizes) - 1)
        (b0, b1), (v0, v1) = sizes[i - 1 : i + 1], values[i - 1 : i + 1]
        return max(v0 + (v1 - v0) * (b - b0) / (b1 - b0), 0.0)  # linear past the ends too

    def _at(self, sizes, values, slopes, b: float, context: Optional[int]) -> float:
        value = values[0] if len(sizes) == 1 else self._interpolate(sizes, values, b)
        if not slopes or context is None or context <= self.context:
            return value
        slope = slopes[0] if len(sizes) == 1 else self._interpolate(sizes, slopes, b)
        return value + slope * (context - self.context)

    def target(self, b: int, context: Optional[int] = None) -> float:
        """One verify cycle's target work at block b with ``context`` tokens
        cached (None: as measured)."""
        return self._at(self.sizes, self.target_s, self.target_slope, b, context)

    def draft(self, b: int, context: Optional[int] = None) -> float:
        if b == 1:
            return 0.0
        return self._at(self.sizes[1:], self.draft_s[1:], self.draft_slope[1:], b, context)

    def cycle_seconds(self, b: int, context: Optional[int] = None) -> float:
        """t_target(b) + t_draft(b): one cycle at block b; a plain step (b = 1)
        adds the deferred injection of its position (``inject_s``)."""
        return self.target(b, context) + self.draft(b, context) + (self.inject_s if b == 1 else 0.0)

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "target_s": list(self.target_s), "draft_s": list(self.draft_s),
                "context": self.context, "target_slope": list(self.target_slope),
                "draft_slope": list(self.draft_slope), "inject_s": self.inject_s}

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(tuple(d["sizes"]), tuple(d["target_s"]), tuple(d["draft_s"]), d.get("context", CONTEXT),
                   tuple(d.get("target_slope", ())), tuple(d.get("draft_slope", ())), d.get("inject_s", 0.0))


def sizes_for(trained: int) -> tuple[int, ...]:
    """The block sizes measured for a draft trained at ``trained``."""
    return tuple(sorted({b for b in SIZES if b <= trained} | {1, max(trained, 2)}))


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def model_signature(config: dict, module) -> str:
    """Hash of a model's config and its weights' names, shapes and dtypes."""
    weights = [(name, list(w.shape), str(w.dtype)) for name, w in tree_flatten(module.parameters())]
    return _digest({"config": config, "weights": weights})


@functools.lru_cache(maxsize=None)
def _version() -> str:
    """The installed dflash-mlx's version (read once: about 1 ms a lookup, on every auto generation)."""
    from importlib import metadata

    try:
        return metadata.version("dflash-mlx")
    except metadata.PackageNotFoundError:
        return "unknown"


def cache_key(target: Target, draft: DFlashDraft) -> dict:
    """What a measured curve depends on."""
    try:
        backend = "metal" if mx.metal.is_available() else "cpu"
    except Exception:
        backend = "cpu"
    return {
        "device": {"backend": backend, "default": str(mx.default_device()),
                   "ld_preload": os.environ.get("LD_PRELOAD"),
                   "blas_threads": {k: v for k in BLAS_THREADS if (v := os.environ.get(k))}},
        "mlx": mx.__version__,
        "dflash_mlx": _version(),
        "target": model_signature(vars(target.args), target.model),
        "draft": model_signature(draft.config.to_dict(), draft),
        "sizes": list(sizes_for(draft.config.block_size)),
    }


def cache_dir(override: Optional[os.PathLike] = None) -> Path:
    if override is not None:
        return Path(override)
    if os.environ.get("DFLASH_MLX_CACHE_DIR"):
        return Path(os.environ["DFLASH_MLX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash-mlx"


def cache_path(key: dict, directory: Optional[os.PathLike] = None, folder: str = "cost-curves") -> Path:
    return cache_dir(directory) / folder / f"{_digest(key)[:24]}.json"


def read_cached(path: Path, key: dict, kind=CostCurve):
    """The curve (a ``kind``, by its ``from_dict``) stored at ``path`` for
    exactly ``key``, or None (missing, corrupt, another key, another schema,
    an invalid curve)."""
    try:
        entry = json.loads(path.read_text())
        if entry.get("schema") != SCHEMA or entry.get("schema_version") != SCHEMA_VERSION:
            return None
        if entry.get("key") != json.loads(json.dumps(key)):
            return None
        return kind.from_dict(entry["curve"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_cached(path: Path, key: dict, curve) -> bool:
    """Write atomically (a temporary file renamed over it); False if it cannot be written."""
    entry = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "key": key, "curve": curve.to_dict(),
             "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entry, indent=1) + "\n")
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False


def _median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        run()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


class BlockScript:
    """A block policy that answers the given blocks in turn, then plain steps (measuring)."""

    def __init__(self, blocks):
        self.blocks = iter(blocks)

    def choose(self, context: int = 0, left: Optional[int] = None) -> int:
        return next(self.blocks, 1)

    def update(self, block_size: int, accepted: int) -> None:
        pass


def loop_cycle_seconds(decoder: SpeculativeDecoder, sizes: tuple[int, ...], rounds: int = ROUNDS,
                       clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """{b: seconds of one of the loop's own cycles at b} for a prefilled
    ``decoder``: ``rounds`` rounds, each of ``RUN`` plain steps then ``RUN``
    cycles at b, for every b > 1 of ``sizes`` in turn, each cycle timed from
    the end of the one before, as the loop pipelines them (a plain step queued
    before the host waits for the one before it; a block drafted while the
    host streams the last cycle's tokens). A cycle is timed where the cycles
    before and after it are at its own block, so its price holds what a run of
    them pays and nothing of a switch; each b's is the median of its timings.

    Plain steps run beside every size in every round, so each price and the
    plain step's come from the same moments: the ratios the policy weighs hold
    while the machine's speed wanders (timed pass by pass, apart from the plain
    steps, six curves a minute apart priced the demo pair's b = 8 at 2.9 to 3.6
    plain steps where its loop ran about 2.5)."""
    script = [b for _ in range(rounds) for size in sizes[1:] for b in [1] * RUN + [size] * RUN]
    decoder.policy = BlockScript(script)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    before, last = None, clock()
    for _ in script:  # the prefill queued the first (plain) cycle: the script's last block is only queued
        block = decoder.block_size
        decoder.cycle()
        now = clock()
        if before == block == decoder.block_size:
            times[block].append(now - last)
        before, last = block, now
    decoder.close()
    return {b: statistics.median(t) for b, t in times.items()}


def fed_past_context(sizes: tuple[int, ...]) -> int:
    """Positions measuring feeds past a context at most: the cycles of
    ``loop_cycle_seconds`` (each keeps at most its block), the prefill's
    token, and the largest block drafted after them."""
    return 1 + ROUNDS * RUN * sum(1 + b for b in sizes[1:]) + max(sizes)


def long_context(target: Target, sizes: tuple[int, ...]) -> Optional[int]:
    """The second context timed: ``LONG_CONTEXT``, or what the target's
    positions leave room for; None when that is too short to tell a slope."""
    fed = fed_past_context(sizes)
    room = getattr(target.args, "max_position_embeddings", None) or LONG_CONTEXT + fed
    n = min(LONG_CONTEXT, room - fed)
    return n if n >= 4 * CONTEXT else None


def _pass_seconds(target: Target, draft: DFlashDraft, sizes: tuple[int, ...], context: int,
                  budget_s: float) -> dict:
    """{(b, "target"|"draft"): seconds} with ``context`` tokens in the caches:
    the loop's cycles at each size (``loop_cycle_seconds``), then each draft
    pass at b > 1 warmed up once and repeated (1 to ``MAX_REPEATS`` times, as
    many as fit the budget), the median. A cycle's target work is its time
    less its draft pass, never below a plain step's (b = 1: the plain step)."""
    greedy = BlockSampler(SamplingParams())
    proposer = proposer_for(draft, target)
    decoder = SpeculativeDecoder(target, proposer, draft.config.target_layer_ids, 1)
    decoder.prefill(mx.arange(context, dtype=mx.int32) % target.vocab_size)
    cycles = loop_cycle_seconds(decoder, sizes)
    y = decoder.pending

    def draft_pass(b: int) -> None:
        mx.eval(propose_block(proposer, y, b, greedy)[0])  # a DFlash2 draft's walk included

    drafted = [b for b in sizes if b > 1]
    tic = time.perf_counter()
    for b in drafted:
        draft_pass(b)
    warm = time.perf_counter() - tic
    repeats = max(1, min(MAX_REPEATS, int(max(budget_s - warm, 0) / max(warm, 1e-9))))
    seconds = {(b, "draft"): _median_seconds(lambda: draft_pass(b), repeats) for b in drafted}
    seconds.update({(b, "target"): max(cycles[b] - seconds.get((b, "draft"), 0.0), cycles[1]) for b in sizes})
    return seconds


def _inject_seconds(target: Target, draft: DFlashDraft) -> float:
    """Seconds per position to inject ``INJECT_BATCH`` plain steps' features
    into the draft's context cache in one batch, as the loop does when the
    draft next runs."""
    proposer = proposer_for(draft, target)
    features = mx.zeros((1, INJECT_BATCH, draft.config.feature_size), dtype=target.final_norm.weight.dtype)
    ids = mx.zeros((INJECT_BATCH,), dtype=mx.int32)

    def inject() -> None:
        proposer.observe(features, ids)
        mx.eval([c.state for c in proposer.cache])

    inject()  # warm-up
    return _median_seconds(inject, MAX_REPEATS) / INJECT_BATCH


def measure(target: Target, draft: DFlashDraft, sizes: tuple[int, ...],
            budget_s: float = BUDGET_S, agree: Callable[[bool], bool] = bool) -> CostCurve:
    """Time the loop's cycles and the draft passes at ``CONTEXT`` and at
    ``long_context`` tokens (the draft passes in half the budget each; see
    ``_pass_seconds``), and the injection of a plain step's position. Each
    pass's slopes over the sizes are one straight line fitted
    to them (``slope_line``): b queries attend over the context, and a line
    is steadier than each difference of two noisy timings.

    A plain step over the long context cannot cost less than over the short
    one; where it times so, something held up the short context's timings
    (a curve measured while the test suite ran priced the demo target's
    plain step at 8.5 ms at 64 tokens and no more at 2,048, against 5.6 ms
    then observed at 2,500, and auto speculated at a loss there), and both
    are timed again, ``MEASURE_TRIES`` times at most (the last kept).
    ``agree`` turns this process's verdict into the one every process
    measuring together acts on (ranks of a sharded target run the same
    collectives)."""
    far_context = long_context(target, sizes)
    for _ in range(MEASURE_TRIES):
        near = _pass_seconds(target, draft, sizes, CONTEXT, budget_s / 2)
        far = near if far_context is None else _pass_seconds(target, draft, sizes, far_context, budget_s / 2)
        if agree(far is near or far[1, "target"] >= near[1, "target"]):
            break
    span = max((far_context or CONTEXT) - CONTEXT, 1)

    def slope(kind: str, first: int) -> tuple[float, ...]:
        raw = [(f - n) / span for f, n in zip(pass_column(far, kind, sizes), pass_column(near, kind, sizes))]
        return (0.0,) * first + slope_line(sizes[first:], raw[first:])

    return CostCurve(tuple(sizes), pass_column(near, "target", sizes), pass_column(near, "draft", sizes),
                     CONTEXT, slope("target", 0), slope("draft", 1), _inject_seconds(target, draft))


def pass_column(table: dict, kind: str, sizes: tuple[int, ...]) -> tuple[float, ...]:
    """One kind's seconds at each size from ``{(b, kind): seconds}`` (0 where
    not timed), never less than at a smaller size: a pass over more tokens
    does not cost less, so a repeat that ran fast by chance at a large b (a
    curve measured on a busy machine once priced b = 16 below b = 12) is
    lifted to the largest time before it."""
    return tuple(itertools.accumulate((table.get((b, kind), 0.0) for b in sizes), max))


def slope_line(sizes, slopes) -> tuple[float, ...]:
    """The least-squares line a + c * b through measured (b, slope) points,
    neither term below 0, at each size."""
    n = len(sizes)
    mean_b, mean_s = sum(sizes) / n, sum(slopes) / n
    var = sum((b - mean_b) ** 2 for b in sizes)
    c = max(sum((b - mean_b) * (s - mean_s) for b, s in zip(sizes, slopes)) / var, 0.0) if var else 0.0
    a = max(mean_s - c * mean_b, 0.0)
    return tuple(a + c * b for b in sizes)


def cost_curve(target: Target, draft: DFlashDraft, directory: Optional[os.PathLike] = None,
               refresh: bool = False) -> CostCurve:
    """The pair's curve on this machine: from the cache, else measured (a few
    seconds) and cached. ``refresh`` measures again whatever the cache holds."""
    key = cache_key(target, draft)
    path = cache_path(key, directory)
    curve = None if refresh else read_cached(path, key)
    if curve is None:
        curve = measure(target, draft, tuple(key["sizes"]))
        write_cached(path, key, curve)
    return curve


_forgotten: set = set()  # cache files this process removed after drift


def forget(target: Target, draft: DFlashDraft, directory: Optional[os.PathLike] = None) -> None:
    """Remove the pair's cached curve, so its next use measures it again; once
    per process and curve, so a machine whose load keeps changing does not
    measure again before every generation (the watch still rescales each run)."""
    path = cache_path(cache_key(target, draft), directory)
    if path in _forgotten:
        return
    _forgotten.add(path)
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
