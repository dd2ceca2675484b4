"""Kernel: KV injection for every draft layer (``metal/kv_inject.metal``).

The draft appends, for each layer l, ``K = rope(k_norm_l(k_proj_l(ctx)))`` at
the context's absolute positions and ``V = v_proj_l(ctx)`` to layer l's
context cache (DESIGN.md section 2). Done layer by layer that is about 4n small
ops. Here it is two: one matmul with the K/V projections of all layers stacked
(a quantized matmul for a quantized draft), then one launch that applies every
layer's k_norm and RoPE and lays K and V out for the caches.

:class:`InjectionPlan` holds the stacked weights for a draft; the draft's
``inject`` asks :func:`injection_plan` for it and falls back to the per-layer
path, with the reason, when there is none.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .registry import TOLERANCES, KernelSpec, Launch, mismatch, register

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MAX_HEAD_DIM = 512  # 8 rotation pairs per lane
MAX_POSITION = 1 << 24  # positions stay exact in float32


# ---------------------------------------------------------------- the kernel
def reference(kv, norm_w, inv_freq, offset, *, n_layers, n_kv, head_dim,
              eps, pos_scale=1.0, mscale=1.0) -> tuple[mx.array, mx.array]:
    """Pure-MLX semantics of the kernel. Returns keys, values [L, B, H, T, D]."""
    B, T, _ = kv.shape
    x = kv.reshape(B, T, n_layers, 2, n_kv, head_dim).transpose(2, 3, 0, 4, 1, 5)
    freqs = 1.0 / inv_freq.astype(mx.float32)
    norm_w = norm_w.astype(kv.dtype)  # the kernel's outputs have kv's dtype
    keys = []
    for layer in range(n_layers):
        k = mx.fast.rms_norm(x[layer, 0], norm_w[layer], eps)
        if mscale != 1.0:
            k = k * mscale
        keys.append(mx.fast.rope(k, head_dim, traditional=False, base=None, scale=pos_scale,
                                 offset=offset, freqs=freqs))
    return mx.stack(keys), x[:, 1]


def kernel_inputs(kv, norm_w, inv_freq, offset, *, n_layers, n_kv, head_dim,
                  eps, pos_scale=1.0, mscale=1.0) -> list:
    params = mx.array([eps, pos_scale, mscale], dtype=mx.float32)
    return [kv, norm_w.astype(kv.dtype), inv_freq.astype(mx.float32), params,
            mx.array(offset, dtype=mx.int32)]


def configure(kv, norm_w, inv_freq, offset, *, n_layers, n_kv, head_dim, **_) -> Launch:
    B, T, _ = kv.shape
    units = 2 * n_layers * n_kv
    shape = (n_layers, B, n_kv, T, head_dim)
    return Launch(
        grid=(32 * units, T, B),
        threadgroup=(min(256, 32 * units), 1, 1),
        output_shapes=[shape, shape],
        output_dtypes=[kv.dtype, kv.dtype],
        template=[("T", kv.dtype), ("HEAD_DIM", head_dim)],
    )


def unsupported(kv, norm_w, inv_freq, offset, *, n_layers, n_kv, head_dim, **_) -> Optional[str]:
    if kv.ndim != 3:
        return "kv must be [B, T, C]"
    if kv.dtype not in DTYPES:
        return f"dtype {kv.dtype} (kernel: float32, float16, bfloat16)"
    if head_dim % 2 or not 2 <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim {head_dim} (kernel: even, 2..{MAX_HEAD_DIM})"
    if kv.shape[-1] != 2 * n_layers * n_kv * head_dim:
        return f"kv has {kv.shape[-1]} columns, expected {2 * n_layers * n_kv * head_dim}"
    if tuple(norm_w.shape) != (n_layers, head_dim) or tuple(inv_freq.shape) != (head_dim // 2,):
        return "norm_w must be [L, D] and inv_freq [D/2]"
    if not (0 <= offset and offset + kv.shape[1] <= MAX_POSITION):
        return f"positions beyond {MAX_POSITION}"
    return None


def default_inv_freq(head_dim: int, base: float) -> mx.array:
    """nn.RoPE's inverse frequencies base^(-2j/D), computed in float64."""
    j = np.arange(0, head_dim, 2, dtype=np.float64)
    return mx.array((base ** (-j / head_dim)).astype(np.float32))


def make_inputs(rng: np.random.Generator, *, B: int, T: int, n_layers: int, n_kv: int, head_dim: int,
                dtype=mx.float32, offset: int = 0, base: float = 10000.0):
    """Random kernel arguments: (inputs tuple, params dict)."""
    kv = mx.array(rng.normal(size=(B, T, 2 * n_layers * n_kv * head_dim)).astype(np.float32)).astype(dtype)
    norm_w = mx.array((1 + 0.2 * rng.normal(size=(n_layers, head_dim))).astype(np.float32)).astype(dtype)
    params = dict(n_layers=n_layers, n_kv=n_kv, head_dim=head_dim, eps=1e-6)
    return (kv, norm_w, default_inv_freq(head_dim, base), offset), params


def sample(rng: np.random.Generator) -> tuple[tuple, dict]:
    return make_inputs(rng, B=1, T=3, n_layers=2, n_kv=2, head_dim=64, offset=5)


def compare(got, want, inputs, params) -> Optional[str]:
    kv, _, inv_freq, offset = inputs
    rtol, atol = TOLERANCES[kv.dtype]
    if kv.dtype == mx.float32:
        # float32 RoPE angles carry about position * 2^-24 rad of rounding, and
        # implementations round them differently: allow that much rotation
        last = (offset + kv.shape[1]) * params.get("pos_scale", 1.0) * float(mx.max(inv_freq))
        peak = float(mx.max(mx.abs(want[0]))) if want[0].size else 0.0
        atol += 4 * last * 2.0**-24 * peak
    return (mismatch("keys", got[0], want[0], rtol, atol)
            or mismatch("values", got[1], want[1]))  # values are a copy: bit-exact


KERNEL = register(KernelSpec(
    name="kv_inject",
    source_file="kv_inject.metal",
    input_names=("kv", "norm_w", "inv_freq", "params", "offset"),
    output_names=("keys", "values"),
    reference=reference,
    kernel_inputs=kernel_inputs,
    configure=configure,
    sample=sample,
    compare=compare,
    unsupported=unsupported,
    description="every draft layer's k_norm + RoPE and K/V cache layout in one launch",
))


# ---------------------------------------------------------------- RoPE variants
@dataclass(frozen=True)
class RopeTable:
    """A RoPE module's rotation as the kernel takes it."""

    inv_freq: mx.array  # [D/2] float32
    pos_scale: float = 1.0
    mscale: float = 1.0


def _rope_classes() -> dict[str, type]:
    from mlx_lm.models import rope_utils

    names = ("Llama3RoPE", "YarnRoPE", "SuScaledRoPE", "ProportionalRoPE")
    return {n: getattr(rope_utils, n) for n in names if hasattr(rope_utils, n)}


def rope_table(rope: Any, head_dim: int) -> tuple[Optional[RopeTable], Optional[str]]:
    """(table, None) for a RoPE module the kernel reproduces, else (None, reason).

    Supported: ``nn.RoPE`` (default and ``linear`` scaling, mrope), and mlx-lm's
    ``llama3``, ``yarn``, ``longrope`` and ``proportional`` RoPE, all in the
    non-interleaved layout over the full head. Not supported: interleaved
    ("traditional") RoPE, partial rotation, and ``dynamic`` NTK scaling, whose
    base changes with the sequence length.
    """
    name = type(rope).__name__
    if getattr(rope, "traditional", False):
        return None, f"{name} is the interleaved (traditional) RoPE layout"
    if isinstance(rope, nn.RoPE):
        if rope.dims != head_dim:
            return None, f"partial RoPE ({rope.dims} of {head_dim} dims)"
        return RopeTable(default_inv_freq(head_dim, float(rope.base)), float(rope.scale)), None
    classes = _rope_classes()
    if not any(isinstance(rope, c) for c in classes.values()):
        return None, f"{name} is not a RoPE variant the injection kernel implements"
    dims = getattr(rope, "dims", getattr(rope, "dim", None))
    if dims != head_dim:
        return None, f"partial RoPE ({dims} of {head_dim} dims)"
    inv_freq = (1.0 / rope._freqs.astype(mx.float32)).astype(mx.float32)
    mscale = 1.0
    if "YarnRoPE" in classes and isinstance(rope, classes["YarnRoPE"]):
        mscale = float(rope.mscale)
    if "SuScaledRoPE" in classes and isinstance(rope, classes["SuScaledRoPE"]):
        mscale = float(rope._scale)
    return RopeTable(inv_freq, 1.0, mscale), None


# ---------------------------------------------------------------- the draft side
_PROJ_ARRAYS = ("weight", "scales", "biases", "bias")


def _signature(proj: nn.Module) -> tuple:
    """Projections with equal signatures can share one (quantized) matmul."""
    if isinstance(proj, nn.QuantizedLinear):
        return ("quantized", proj.group_size, proj.bits, getattr(proj, "mode", "affine"),
                "biases" in proj, "bias" in proj, proj["scales"].dtype)
    if isinstance(proj, nn.Linear):
        return ("linear", proj["weight"].dtype, "bias" in proj)
    return ("other", id(proj))


class InjectionPlan:
    """The stacked K/V projection of all draft layers, plus what the kernel needs.

    Building it concatenates each run of layers whose projections share a
    signature (all of them, normally) into one weight (or one packed quantized
    weight with its scales and biases) and re-points each layer's projection
    arrays at row slices of it. The parameters keep their names, shapes and
    values; they only become views, so the weights are not held twice.
    """

    def __init__(self, draft: Any, table: RopeTable):
        attn0 = draft.layers[0].self_attn
        self.n_layers = len(draft.layers)
        self.n_kv = attn0.n_kv_heads
        self.head_dim = attn0.head_dim
        self.eps = float(attn0.k_norm.eps)
        self.rope = table
        self.groups: list[tuple[nn.Module, dict[str, mx.array]]] = []
        projections = []
        for layer in draft.layers:
            projections += [layer.self_attn.k_proj, layer.self_attn.v_proj]
        run: list[nn.Module] = []
        for proj in projections + [None]:
            if run and (proj is None or _signature(proj) != _signature(run[0])):
                self.groups.append(self._stack(run))
                run = []
            if proj is not None:
                run.append(proj)
        self._norms = [layer.self_attn.k_norm for layer in draft.layers]
        self._norm_w: dict[mx.Dtype, mx.array] = {}
        self.sources = self._source_arrays(draft)

    @staticmethod
    def _stack(run: list[nn.Module]) -> tuple[nn.Module, dict[str, mx.array]]:
        names = [n for n in _PROJ_ARRAYS if n in run[0]]
        stacked = {n: mx.concatenate([p[n] for p in run], axis=0) for n in names}
        mx.eval(stacked)
        for n, arr in stacked.items():
            start = 0
            for p in run:
                rows = p[n].shape[0]
                p[n] = arr[start:start + rows]
                start += rows
        return run[0], stacked

    @staticmethod
    def _source_arrays(draft: Any) -> tuple:
        arrays = []
        for layer in draft.layers:
            attn = layer.self_attn
            for proj in (attn.k_proj, attn.v_proj):
                arrays += [proj[n] for n in _PROJ_ARRAYS if n in proj]
            arrays += [attn.k_norm.weight, attn.rope]
        return tuple(arrays)

    def current(self, draft: Any) -> bool:
        """Still built from the draft's present arrays (weights not replaced since)."""
        now = self._source_arrays(draft)
        return len(now) == len(self.sources) and all(a is b for a, b in zip(now, self.sources))

    def project(self, ctx: mx.array) -> mx.array:
        """[B, T, L*2*H*D]: every layer's k_proj then v_proj of ctx."""
        outs = []
        for proto, arrays in self.groups:
            if isinstance(proto, nn.QuantizedLinear):
                y = mx.quantized_matmul(
                    ctx, arrays["weight"], scales=arrays["scales"], biases=arrays.get("biases"),
                    transpose=True, group_size=proto.group_size, bits=proto.bits,
                    mode=getattr(proto, "mode", "affine"),
                )
                if "bias" in arrays:
                    y = y + arrays["bias"]
            elif "bias" in arrays:
                y = mx.addmm(arrays["bias"], ctx, arrays["weight"].T)
            else:
                y = ctx @ arrays["weight"].T
            outs.append(y)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)

    def norm_weights(self, dtype: mx.Dtype) -> mx.array:
        if dtype not in self._norm_w:
            self._norm_w[dtype] = mx.stack([n.weight for n in self._norms]).astype(dtype)
        return self._norm_w[dtype]

    def __call__(self, ctx: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """keys, values [L, B, H, T, D] for positions offset .. offset+T-1."""
        kv = self.project(ctx)
        return KERNEL(
            kv, self.norm_weights(kv.dtype), self.rope.inv_freq, offset,
            n_layers=self.n_layers, n_kv=self.n_kv, head_dim=self.head_dim, eps=self.eps,
            pos_scale=self.rope.pos_scale, mscale=self.rope.mscale,
        )


_PLAN_ATTR = "_dflash_injection_plan"
_warned_reasons: set[str] = set()


def plan_reason(draft: Any) -> tuple[Optional[RopeTable], Optional[str]]:
    """(rope table, None) if the stacked path applies to ``draft``, else (None, why not)."""
    if not draft.layers:
        return None, "the draft has no layers"
    attn0 = draft.layers[0].self_attn
    table, reason = rope_table(attn0.rope, attn0.head_dim)
    if reason:
        return None, reason
    for layer in draft.layers[1:]:
        attn = layer.self_attn
        if type(attn.rope) is not type(attn0.rope) or (attn.n_kv_heads, attn.head_dim) != (attn0.n_kv_heads, attn0.head_dim):
            return None, "draft layers differ in RoPE or head layout"
    return table, None


def injection_plan(draft: Any, cache: list) -> Optional[InjectionPlan]:
    """The draft's (cached) plan, or None: then inject layer by layer. A RoPE the
    kernel does not implement is reported once with the reason."""
    if len({c.offset for c in cache}) > 1:
        return None  # caches out of step (never in the loop): the per-layer path handles it
    plan = getattr(draft, _PLAN_ATTR, None)
    if isinstance(plan, InjectionPlan) and plan.current(draft):
        return plan
    table, reason = plan_reason(draft)
    if reason is not None:
        if reason not in _warned_reasons:
            _warned_reasons.add(reason)
            warnings.warn(
                f"dflash-mlx: KV injection runs layer by layer (the reference path): {reason}",
                RuntimeWarning, stacklevel=3,
            )
        object.__setattr__(draft, _PLAN_ATTR, None)
        return None
    plan = InjectionPlan(draft, table)
    object.__setattr__(draft, _PLAN_ATTR, plan)
    return plan


__all__ = [
    "InjectionPlan", "KERNEL", "RopeTable", "default_inv_freq", "injection_plan", "make_inputs",
    "plan_reason", "reference", "rope_table",
]
