"""A quantized target's verify pass through the block-verify matmul kernel.

``VerificationMatmuls`` finds one model instance's ``nn.QuantizedLinear``
layers once; while a verify pass of that instance is under way it stands a
:class:`VerifyLinear` in for each of them, and puts them back when the last
such pass ends. A stand-in runs the kernel only for a call made inside a
verify pass of its model in the same thread (or asyncio task); any other call,
say another thread's prefill on the same model, goes to the layer itself, so
concurrent generations on one model each compute what they would alone. No
mlx-lm class is patched, other instances are untouched, and the module tree
(parameters, weights) never changes. Where the ``qmm_verify`` kernel cannot
run nothing is swapped; inputs it does not cover go to the layer's own call.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..kernels import qmm

# ids of the models whose verify pass this thread (or task) is running
_VERIFYING: contextvars.ContextVar[frozenset] = contextvars.ContextVar("dflash_verifying", default=frozenset())
# verify passes under way per model id, in every thread; the stand-ins stay while any runs
_PASSES: dict[int, int] = {}
_PASSES_LOCK = threading.Lock()


def quantized_matmul(x: mx.array, module: nn.Module) -> Optional[mx.array]:
    """``module``'s quantized matmul of ``x`` [..., K] through the kernel (its
    bias added), or None when the kernel does not run for it (the caller then
    uses the module itself)."""
    if getattr(module, "mode", "affine") != "affine":
        return None
    biases = module.get("biases")
    rows = int(np.prod(x.shape[:-1])) if x.ndim > 1 else 1
    if biases is None or rows > qmm.MAX_ROWS or x.ndim < 1:
        return None
    x2 = x.reshape(rows, x.shape[-1])
    args = (x2, module["weight"], module["scales"], biases)
    params = dict(group_size=module.group_size, bits=module.bits)
    if not qmm.KERNEL.active(*args, **params):
        return None
    (y,) = qmm.KERNEL.launch(*args, **params)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y + module["bias"] if "bias" in module else y


class VerifyLinear:
    """Stands in for one ``nn.QuantizedLinear`` of model ``model_id`` while a
    block is verified: in that verify pass the kernel where it covers the
    input, else (and for every other caller) the layer's own call."""

    def __init__(self, inner: nn.QuantizedLinear, model_id: int):
        self.inner = inner
        self.model_id = model_id

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(x, self.inner) if self.model_id in _VERIFYING.get() else None
        return self.inner(x) if y is None else y

    def __getattr__(self, name: str) -> Any:  # weight, scales, bits ... as the layer's
        return getattr(self.inner, name)


def _quantized_linears(module: nn.Module) -> list[tuple[Any, Any, nn.QuantizedLinear]]:
    """(parent module, attribute, layer) for every nn.QuantizedLinear that is a
    module's attribute under ``module``. Layers held directly in a list (none in
    the mlx-lm models we support) are left out: swapping a list item would change
    the parameter tree, so they keep MLX's matmul."""
    found: list = []
    seen: set[int] = set()

    def visit(container, key, value):
        if isinstance(value, nn.QuantizedLinear):
            if container is not None:
                found.append((container, key, value))
            return
        if isinstance(value, nn.Module):
            if id(value) in seen:
                return
            seen.add(id(value))
            for k, v in value.items():
                visit(value, k, v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(None, None, v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(None, None, v)

    visit(None, None, module)
    return found


class VerificationMatmuls:
    """The swap plan for one model instance: found once, applied per verify pass."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.sites = _quantized_linears(model)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[int]:
        """Within the block, the instance's quantized linears use the kernel
        for this thread. Yields how many were swapped (0 where the kernel cannot run)."""
        if not self.sites or not qmm.KERNEL.enabled():
            yield 0
            return
        key = id(self.model)
        with _PASSES_LOCK:
            if not _PASSES.get(key):
                self._swap()
            _PASSES[key] = _PASSES.get(key, 0) + 1
        token = _VERIFYING.set(_VERIFYING.get() | {key})
        try:
            yield len(self.sites)
        finally:
            _VERIFYING.reset(token)
            with _PASSES_LOCK:
                _PASSES[key] -= 1
                if not _PASSES[key]:
                    del _PASSES[key]
                    for parent, name, _ in self.sites:
                        vars(parent).pop(name, None)

    def _swap(self) -> None:
        for parent, name, layer in self.sites:
            # an instance attribute shadows the module's child of the same
            # name for attribute lookup; the child itself (the parameter
            # tree) is left as it is. nn.Module.__setattr__ would drop it.
            object.__setattr__(parent, name, VerifyLinear(layer, id(self.model)))


def verification_matmuls(model: nn.Module):
    """Context manager: ``model``'s quantized linears use the kernel inside it."""
    return VerificationMatmuls(model)()
