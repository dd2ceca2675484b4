"""A quantized target's verify pass through the block-verify matmul kernel.

``VerificationMatmuls`` finds one model instance's ``nn.QuantizedLinear``
layers once; for the duration of one verify pass it stands a
:class:`VerifyLinear` in for each of them, and puts them back after it. No
mlx-lm class is patched, other instances are untouched, and the module tree
(parameters, weights) never changes. Where the ``qmm_verify`` kernel cannot
run nothing is swapped; inputs it does not cover go to the layer's own call.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..kernels import qmm


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
    """Stands in for one ``nn.QuantizedLinear`` while a block is verified: the
    kernel where it covers the input, else the layer's own call."""

    def __init__(self, inner: nn.QuantizedLinear):
        self.inner = inner

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(x, self.inner)
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
        """Within the block, the instance's quantized linears use the kernel.
        Yields how many were swapped (0 where the kernel cannot run)."""
        if not self.sites or not qmm.KERNEL.enabled():
            yield 0
            return
        done = []
        try:
            for parent, key, layer in self.sites:
                # an instance attribute shadows the module's child of the same
                # name for attribute lookup; the child itself (the parameter
                # tree) is left as it is. nn.Module.__setattr__ would drop it.
                object.__setattr__(parent, key, VerifyLinear(layer))
                done.append((parent, key))
            yield len(done)
        finally:
            for parent, key in reversed(done):
                vars(parent).pop(key, None)


def verification_matmuls(model: nn.Module):
    """Context manager: ``model``'s quantized linears use the kernel inside it."""
    return VerificationMatmuls(model)()
