"""What a cycle costs on this machine, per block size: measured once per
(target, draft, dtype, device), cached on disk, interpolated between the
measured sizes. ``block_policy.AdaptiveBlock`` weighs expected tokens against it.

t_target(b) is one verify cycle's target work over b tokens as the loop runs it
(the recording forward, the logits, greedy acceptance, the rollback and the
draft's context injection of the kept position); t_draft(b) is one draft pass
proposing b-1 tokens (the draft plus the borrowed LM head, and the argmax).
A block of 1 is a plain target step, timed as the loop runs a run of them
(each queued before the host waits for the one before): no draft pass,
t_draft(1) = 0.

The cache lives under ``$DFLASH_MLX_CACHE_DIR`` (meant for tests), else
``$XDG_CACHE_HOME/dflash-mlx`` or ``~/.cache/dflash-mlx``, one JSON file per
key. The key holds the device (backend, default device, ``LD_PRELOAD``, which
picks the BLAS on Linux), the MLX and dflash-mlx versions, and a hash of each
model's config and of its weights' names, shapes and dtypes. An entry that
does not parse, does not hold that exact key or holds an invalid curve is
measured again and rewritten, never trusted.
"""

import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .decoder import SpeculativeDecoder, propose_block, proposer_for
from .draft import DFlashDraft
from .sampling import BlockSampler, SamplingParams
from .target import Target
from .verify import greedy_verify

SCHEMA = "dflash-mlx-cost-curve"
SCHEMA_VERSION = 1
SIZES = (1, 2, 4, 8, 12, 16, 24, 32)  # measured where they fit the draft's trained size
CONTEXT = 64  # tokens in the caches while measuring
BUDGET_S = 1.0  # about this long for the whole measurement
MAX_REPEATS = 5
PLAIN_STEPS = 8  # plain steps timed in a row for b = 1


@dataclass(frozen=True)
class CostCurve:
    """Seconds per cycle at the measured block sizes, linear in between."""

    sizes: tuple[int, ...]  # increasing, starting at 1
    target_s: tuple[float, ...]
    draft_s: tuple[float, ...]  # 0 at b = 1: no draft pass

    def __post_init__(self):
        sizes, t, d = self.sizes, self.target_s, self.draft_s
        ok = (len(sizes) >= 2 and len(t) == len(d) == len(sizes) and sizes[0] == 1
              and all(isinstance(b, int) and not isinstance(b, bool) for b in sizes)
              and all(a < b for a, b in zip(sizes, sizes[1:]))
              and all(isinstance(x, (int, float)) and 0 <= x < float("inf") for x in (*t, *d))
              and all(x > 0 for x in (*t, *d[1:])) and d[0] == 0)
        if not ok:
            raise ValueError(f"not a cost curve: {self}")

    @staticmethod
    def _interpolate(sizes, values, b: float) -> float:
        i = next((k for k in range(1, len(sizes)) if b <= sizes[k]), len(sizes) - 1)
        (b0, b1), (v0, v1) = sizes[i - 1 : i + 1], values[i - 1 : i + 1]
        return max(v0 + (v1 - v0) * (b - b0) / (b1 - b0), 0.0)  # linear past the ends too

    def target(self, b: int) -> float:
        return self._interpolate(self.sizes, self.target_s, b)

    def draft(self, b: int) -> float:
        if b == 1:
            return 0.0
        sizes, values = self.sizes[1:], self.draft_s[1:]
        return values[0] if len(sizes) == 1 else self._interpolate(sizes, values, b)

    def cycle_seconds(self, b: int) -> float:
        """t_target(b) + t_draft(b): one cycle at block b."""
        return self.target(b) + self.draft(b)

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "target_s": list(self.target_s), "draft_s": list(self.draft_s)}

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(tuple(d["sizes"]), tuple(d["target_s"]), tuple(d["draft_s"]))


def sizes_for(trained: int) -> tuple[int, ...]:
    """The block sizes measured for a draft trained at ``trained``."""
    return tuple(sorted({b for b in SIZES if b <= trained} | {1, max(trained, 2)}))


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def model_signature(config: dict, module) -> str:
    """Hash of a model's config and its weights' names, shapes and dtypes."""
    weights = [(name, list(w.shape), str(w.dtype)) for name, w in tree_flatten(module.parameters())]
    return _digest({"config": config, "weights": weights})


def _version() -> str:
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
                   "ld_preload": os.environ.get("LD_PRELOAD")},
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


def cache_path(key: dict, directory: Optional[os.PathLike] = None) -> Path:
    return cache_dir(directory) / "cost-curves" / f"{_digest(key)[:24]}.json"


def read_cached(path: Path, key: dict) -> Optional[CostCurve]:
    """The curve stored at ``path`` for exactly ``key``, or None (missing,
    corrupt, another key, another schema, an invalid curve)."""
    try:
        entry = json.loads(path.read_text())
        if entry.get("schema") != SCHEMA or entry.get("schema_version") != SCHEMA_VERSION:
            return None
        if entry.get("key") != json.loads(json.dumps(key)):
            return None
        return CostCurve.from_dict(entry["curve"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_cached(path: Path, key: dict, curve: CostCurve) -> bool:
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


def _plain_step_seconds(target: Target, draft: DFlashDraft, prompt: mx.array) -> float:
    """Seconds per plain target step (b = 1) in a run of them, pipelined as the
    loop runs them: each queued before the host waits for the one before. A
    decoder of its own, so the caller's cache stays as it is."""
    plain = SpeculativeDecoder(target, proposer_for(draft, target), draft.config.target_layer_ids, 1)
    plain.prefill(prompt)
    for _ in range(2):  # warm-up; the timed run starts with a step in flight, as in a long run
        plain.cycle()
    tic = time.perf_counter()
    for _ in range(PLAIN_STEPS):
        plain.cycle()
    seconds = (time.perf_counter() - tic) / PLAIN_STEPS
    plain.close()
    return seconds


def measure(target: Target, draft: DFlashDraft, sizes: tuple[int, ...],
            budget_s: float = BUDGET_S) -> CostCurve:
    """Time each pass at each size b > 1: one warm-up of each, then as many
    repeats (1 to ``MAX_REPEATS``) as fit the budget; the median of the
    repeats. b = 1: ``PLAIN_STEPS`` plain steps in a row."""
    layer_ids = draft.config.target_layer_ids
    proposer = proposer_for(draft, target)
    greedy = BlockSampler(SamplingParams())
    cache = target.make_cache()
    tokens = mx.arange(CONTEXT + max(sizes), dtype=mx.int32) % target.vocab_size
    out = target.forward(tokens[None, :CONTEXT], cache, layer_ids)
    proposer.observe(out.features, tokens[:CONTEXT])
    mx.eval([c.state for c in cache], [c.state for c in proposer.cache])
    y = tokens[CONTEXT - 1 : CONTEXT]

    def target_pass(b: int) -> None:
        block = tokens[CONTEXT : CONTEXT + b]
        out = target.forward(block[None], cache, layer_ids, record=True)
        accepted, nxt = greedy_verify(target.logits(out.hidden), block[None, 1:])
        mx.eval(accepted, nxt)
        target.rollback(cache, out, 1)
        proposer.observe(out.features[:, :1], block[:1])
        mx.eval([c.state for c in cache], [c.state for c in proposer.cache])

    def draft_pass(b: int) -> None:
        mx.eval(propose_block(proposer, y, b, greedy)[0])  # a DFlash2 draft's walk included

    passes = [(b, kind, run) for b in sizes for kind, run in (("target", target_pass), ("draft", draft_pass))
              if b > 1]
    tic = time.perf_counter()
    for b, _, run in passes:
        run(b)
    warm = time.perf_counter() - tic
    repeats = max(1, min(MAX_REPEATS, int(max(budget_s - warm, 0) / max(warm, 1e-9))))
    seconds = {(b, kind): _median_seconds(lambda: run(b), repeats) for b, kind, run in passes}
    seconds[1, "target"] = _plain_step_seconds(target, draft, tokens[:CONTEXT])
    return CostCurve(tuple(sizes), tuple(seconds[b, "target"] for b in sizes),
                     tuple(0.0 if b == 1 else seconds[b, "draft"] for b in sizes))


def cost_curve(target: Target, draft: DFlashDraft, directory: Optional[os.PathLike] = None,
               refresh: bool = False) -> CostCurve:
    """The pair's curve on this machine: from the cache, else measured (about a
    second) and cached. ``refresh`` measures again whatever the cache holds."""
    key = cache_key(target, draft)
    path = cache_path(key, directory)
    curve = None if refresh else read_cached(path, key)
    if curve is None:
        curve = measure(target, draft, tuple(key["sizes"]))
        write_cached(path, key, curve)
    return curve
