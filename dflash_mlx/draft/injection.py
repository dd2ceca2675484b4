"""The draft's KV injection plan: every layer's K/V projection in one matmul,
then the ``kv_inject`` kernel (or its reference) for k_norm and RoPE.

``InjectionPlan`` belongs to one draft instance (``DFlashDraft.inject`` builds
it on first use and rebuilds it when the weights are replaced). It needs the
RoPE as a table of inverse frequencies; :func:`rope_table` reads it from the
RoPE module and proves it once against the module itself on a small probe, so
a change in mlx-lm's RoPE classes sends injection to the layer-by-layer path
with the reason instead of computing something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from ..kernels import kv_inject

PROBE_OFFSET = 37  # positions of the RoPE probe: offset .. offset + 2
PROBE_TOLERANCE = 1e-4  # relative to the probe's largest value


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


def _read_table(rope: Any, head_dim: int) -> tuple[Optional[RopeTable], Optional[str]]:
    """(table, None) for a RoPE module of a kind the kernel reproduces, else (None, reason).

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
        return RopeTable(kv_inject.default_inv_freq(head_dim, float(rope.base)), float(rope.scale)), None
    classes = _rope_classes()
    if not any(isinstance(rope, c) for c in classes.values()):
        return None, f"{name} is not a RoPE variant the injection kernel implements"
    dims = getattr(rope, "dims", getattr(rope, "dim", None))
    if dims != head_dim:
        return None, f"partial RoPE ({dims} of {head_dim} dims)"
    freqs = getattr(rope, "_freqs", None)  # mlx-lm keeps the periods private; the probe checks them
    if freqs is None:
        return None, f"{name} exposes no frequencies"
    inv_freq = (1.0 / freqs.astype(mx.float32)).astype(mx.float32)
    mscale = 1.0
    if "YarnRoPE" in classes and isinstance(rope, classes["YarnRoPE"]):
        mscale = float(rope.mscale)
    if "SuScaledRoPE" in classes and isinstance(rope, classes["SuScaledRoPE"]):
        mscale = float(getattr(rope, "_scale", 1.0))
    return RopeTable(inv_freq, 1.0, mscale), None


def _probe_mismatch(rope: Any, table: RopeTable, head_dim: int) -> Optional[str]:
    """None if the kernel's rotation (the reference's formula) equals the module's own."""
    x = mx.random.normal((1, 1, 3, head_dim), key=mx.random.key(0))
    want = rope(x, offset=PROBE_OFFSET)
    got = mx.fast.rope(x * table.mscale, head_dim, traditional=False, base=None, scale=table.pos_scale,
                       offset=PROBE_OFFSET, freqs=1.0 / table.inv_freq)
    error = float(mx.max(mx.abs(got - want))) / max(float(mx.max(mx.abs(want))), 1e-30)
    if not error <= PROBE_TOLERANCE:
        return f"{type(rope).__name__}'s rotation is not the one read from it (relative error {error:.2e})"
    return None


def rope_table(rope: Any, head_dim: int) -> tuple[Optional[RopeTable], Optional[str]]:
    """(table, None) for a RoPE module the kernel reproduces, proven on a probe;
    else (None, reason)."""
    table, reason = _read_table(rope, head_dim)
    if table is not None:
        reason = _probe_mismatch(rope, table, head_dim)
    return (None, reason) if reason else (table, None)


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

    def __init__(self, draft: Any):
        self.rope, self.reason = plan_reason(draft)
        self.groups: list[tuple[nn.Module, dict[str, mx.array]]] = []
        if self.reason is None:
            self._build(draft)
        self.sources = self._source_arrays(draft)

    def _build(self, draft: Any) -> None:
        attn0 = draft.layers[0].self_attn
        self.n_layers = len(draft.layers)
        self.n_kv = attn0.n_kv_heads
        self.head_dim = attn0.head_dim
        self.eps = float(attn0.k_norm.eps)
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
            for proj in (attn[name] for name in ("k_proj", "v_proj") if name in attn):  # Gemma 4's K = V: no v_proj
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
        return kv_inject.KERNEL(
            kv, self.norm_weights(kv.dtype), self.rope.inv_freq, offset,
            n_layers=self.n_layers, n_kv=self.n_kv, head_dim=self.head_dim, eps=self.eps,
            pos_scale=self.rope.pos_scale, mscale=self.rope.mscale,
        )


def plan_reason(draft: Any) -> tuple[Optional[RopeTable], Optional[str]]:
    """(rope table, None) if the stacked path applies to ``draft``, else (None, why not)."""
    if not draft.layers:
        return None, "the draft has no layers"
    attn0 = draft.layers[0].self_attn
    if hasattr(attn0, "v_norm"):
        return None, "the draft's values are RMS-normed (Gemma 4's v_norm), which the kernel does not do"
    table, reason = rope_table(attn0.rope, attn0.head_dim)
    if reason:
        return None, reason
    for layer in draft.layers[1:]:
        attn = layer.self_attn
        if type(attn.rope) is not type(attn0.rope) or (attn.n_kv_heads, attn.head_dim) != (attn0.n_kv_heads, attn0.head_dim):
            return None, "draft layers differ in RoPE or head layout"
    return table, None
