"""Proof, once per model instance, that the target adapter's layer loop is the
model's own forward.

The adapter re-runs mlx-lm's layers one by one and copies the GatedDeltaNet
forward to record what rollback needs. If an mlx-lm release changes a model's
forward, that copy would silently compute something else: lower acceptance, or
output that is no longer the target's. So before the first generation with a
model, a few prompt tokens go through ``model(tokens)`` and through the
adapter (the plain forward for the first tokens, the recording forward of a
verify pass for the rest), and the logits must agree within the dtype's
rounding. One short extra forward, once per model instance.
"""

import threading
import weakref
from importlib.metadata import PackageNotFoundError, version

import mlx.core as mx

from ..errors import DFlashError
from .adapter import Target

CHECK_TOKENS = 8  # prompt tokens the check runs on
PLAIN_TOKENS = 3  # of which the first go through the plain forward, the rest through a verify pass
TOLERANCE = {mx.float32: 1e-3, mx.float16: 3e-2, mx.bfloat16: 1e-1}  # x max(1, max |logit|)

_checked: dict[int, weakref.ref] = {}
_lock = threading.Lock()


def _mlx_lm_version() -> str:
    try:
        return version("mlx-lm")
    except PackageNotFoundError:
        return "unknown"


def forward_mismatch(target: Target, tokens: mx.array) -> tuple[float, mx.Dtype]:
    """(largest |adapter logits - model logits| over ``tokens`` [T] relative to
    max(1, max |model logits|), the model's logits dtype)."""
    tokens = tokens[None, :CHECK_TOKENS]
    split = min(PLAIN_TOKENS, tokens.shape[1] - 1) if tokens.shape[1] > 1 else 1
    cache = target.make_cache()
    plain = target.forward(tokens[:, :split], cache, [0])
    parts = [target.logits(plain.hidden)]
    if split < tokens.shape[1]:
        recorded = target.forward(tokens[:, split:], cache, [0], record=True)
        parts.append(target.logits(recorded.hidden))
    ours = mx.concatenate(parts, axis=1).astype(mx.float32)
    theirs = target.model(tokens, cache=target.make_cache())
    dtype, theirs = theirs.dtype, theirs.astype(mx.float32)
    scale = mx.maximum(mx.max(mx.abs(theirs)), 1.0)
    return (mx.max(mx.abs(ours - theirs)) / scale).item(), dtype


def check_forward(target: Target, tokens: mx.array) -> None:
    """Raise a one-line DFlashError if the adapter does not reproduce the
    model's own logits on the first prompt tokens; once per model instance."""
    model = target.model
    with _lock:
        ref = _checked.get(id(model))
        if ref is not None and ref() is model:
            return
    error, dtype = forward_mismatch(target, tokens)
    if not error <= TOLERANCE.get(dtype, TOLERANCE[mx.bfloat16]):
        raise DFlashError(
            f"dflash-mlx's forward of this '{target.model_type}' model differs from the model's own "
            f"(relative logit error {error:.2e}) under mlx-lm {_mlx_lm_version()}; this mlx-lm version "
            "is not supported (pyproject.toml names the supported range)"
        )
    with _lock:
        _checked[id(model)] = weakref.ref(model, lambda _, key=id(model): _checked.pop(key, None))
