"""The GatedDeltaNet layer kind (Qwen3.5/3.6 and Qwen3-Next hybrids): recording
forward and exact rollback.

The verify pass runs the layer's own submodules in the same order as
``mlx_lm.models.qwen3_5.GatedDeltaNet`` (or ``qwen3_next.Qwen3NextGatedDeltaNet``:
the same convolution and gated delta rule behind a differently laid-out input
projection, ``project``) and records the conv input and the
per-step q, k, v, a, b together with the state it started from. Rollback to
``keep`` accepted tokens slices the conv window and sets the recurrent state
to the one after ``keep`` steps, bit-identical to the state the verify pass
went through, without re-running any projection.

Where no Metal device is in use the recurrence runs in ``gated_delta_steps``
(mlx-lm's ops path, bit for bit, in fewer graph nodes), which also returns the
state every ``CHECKPOINT_EVERY`` steps; the record keeps them, and rollback
takes the last one at or before ``keep`` and replays the few steps after it.

Where Metal is available the recurrence runs in dflash-mlx's own kernels
(``dflash_mlx.kernels.gdn``, through the registry's dispatch and self-check):
``gdn_verify`` for the block, on mlx-lm's own g and beta, which the record then
keeps, and ``gdn_replay`` for the rollback, with the same arithmetic, so the
restored state is again one the verify pass went through. When a kernel is off
there, mlx-lm's ``gated_delta_update`` runs the block and replays ``keep`` steps.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_ssm_mask
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

from . import gated_delta_steps
from ..errors import DFlashError
from ..kernels import gdn as gdn_kernels


@dataclass
class GatedDeltaRecord:
    conv_input: mx.array  # [B, K-1+T, conv_dim]: old conv window then the block
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    state: Optional[mx.array]  # recurrent state before the block
    layer: nn.Module  # the GatedDeltaNet (for A_log, dt_bias, kernel choice)
    g: Optional[mx.array] = None  # [B, T, Hv] decay the verify kernel used (kernel path only)
    beta: Optional[mx.array] = None  # [B, T, Hv] sigmoid(b) it used (kernel path only)
    states: Optional[list] = None  # states after every, 2*every, ... steps (gated_delta_steps path only)
    every: int = 0  # steps between those states

    def row(self, r: int) -> "GatedDeltaRecord":
        """Row r of a batch's record, as a record of its own."""
        one = lambda a: None if a is None else a[r : r + 1]
        return GatedDeltaRecord(
            one(self.conv_input), one(self.q), one(self.k), one(self.v), one(self.a), one(self.b),
            one(self.state), self.layer, one(self.g), one(self.beta),
            None if self.states is None else [one(s) for s in self.states], self.every,
        )


def split_qkv(gdn: nn.Module, conv_out: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """q, k, v [B, S, heads, dim] from the conv output, q and k normalized, as
    mlx-lm's GatedDeltaNet makes them."""
    B, S, _ = conv_out.shape
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
            [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
            [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)
    return q, k, v


def sum_heads(gdn: nn.Module, out: mx.array) -> mx.array:
    """The layer's output summed over the group when mlx-lm's ``shard()`` split
    its heads across ranks (tensor parallel, ``sharding_group``), as its own call does."""
    group = getattr(gdn, "sharding_group", None)
    return out if group is None else mx.distributed.all_sum(out, group=group)


def project(gdn: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The convolution's input (q, k, v side by side) [B, S, conv_dim], z [B, S, Hv, Dv],
    b and a [B, S, Hv] of a GatedDeltaNet over ``x``, from either projection layout:
    qwen3_5's separate ``in_proj_qkv/z/b/a``, or qwen3_next's head-grouped
    ``in_proj_qkvz``/``in_proj_ba``, unscrambled by the layer's own method."""
    B, S, _ = x.shape
    if hasattr(gdn, "in_proj_qkvz"):
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
        return mx.concatenate([t.reshape(B, S, -1) for t in (q, k, v)], axis=-1), z, b, a
    z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    return gdn.in_proj_qkv(x), z, gdn.in_proj_b(x), gdn.in_proj_a(x)


def recording_attention(gdn: nn.Module, x: mx.array, mask, cache: ArraysCache):
    """GatedDeltaNet forward over [B, T, H] that also returns its record."""
    if mask is not None or cache.lengths is not None:
        raise NotImplementedError("padded batches are not supported in verification")
    B, S, _ = x.shape
    qkv, z, b, a = project(gdn, x)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -(gdn.conv_kernel_size - 1) :, :])
    conv_out = nn.silu(gdn.conv1d(conv_input))
    q, k, v = split_qkv(gdn, conv_out)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim), dtype=mx.float32)
    g, beta = compute_g(gdn.A_log, a, gdn.dt_bias), mx.sigmoid(b)  # as gated_delta_update makes them
    states, every = None, gated_delta_steps.CHECKPOINT_EVERY
    if not gdn.training and gdn_kernels.VERIFY.active(q, k, v, g, beta, state):
        out, cache[1] = gdn_kernels.VERIFY.launch(q, k, v, g, beta, state)  # the record keeps g, beta
    elif _metal_in_use():  # mlx-lm's own kernel may run
        out, cache[1] = gated_delta_update(
            q, k, v, a, b, gdn.A_log, gdn.dt_bias, state, None, use_kernel=not gdn.training
        )
        g = beta = None
    else:  # gated_delta_update's ops path, bit for bit, keeping states for the rollback
        out, states = gated_delta_steps.steps(q, k, v, g, beta, state, every)
        cache[1] = states[-1]
        g = beta = None
    cache.advance(S)
    out = sum_heads(gdn, gdn.out_proj(gdn.norm(out, z).reshape(B, S, -1)))
    return out, GatedDeltaRecord(conv_input, q, k, v, a, b, state, gdn, g, beta, states, every)


def _metal_in_use() -> bool:
    """Whether mlx-lm's ``gated_delta_update`` may run its own Metal kernel here
    (elsewhere it runs its ops path, which ``gated_delta_steps`` reproduces)."""
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def recording_layer(layer: nn.Module, x: mx.array, mask, cache: ArraysCache):
    """A qwen3_5 or qwen3_next decoder layer whose GatedDeltaNet records for rollback."""
    r, record = recording_attention(layer.linear_attn, layer.input_layernorm(x), mask, cache)
    h = x + r
    return h + layer.mlp(layer.post_attention_layernorm(h)), record


def restore(cache: ArraysCache, record: GatedDeltaRecord, keep: int) -> None:
    """Set ``cache`` to its state after the first ``keep`` recorded steps."""
    window = record.conv_input.shape[1] - record.q.shape[1]
    cache[0] = mx.contiguous(record.conv_input[:, keep : keep + window, :])
    if record.g is not None and gdn_kernels.REPLAY.enabled():
        args = (record.k, record.v, record.g, record.beta, record.state,
                mx.full((record.k.shape[0],), keep, dtype=mx.int32))
        if gdn_kernels.REPLAY.active(*args):
            (cache[1],) = gdn_kernels.REPLAY.launch(*args)
            return
    gdn = record.layer
    if record.states is None:  # the block ran in a kernel: mlx-lm's recurrence from its start
        _, cache[1] = gated_delta_update(
            *(t[:, :keep] for t in (record.q, record.k, record.v, record.a, record.b)),
            gdn.A_log, gdn.dt_bias, record.state, None, use_kernel=not gdn.training,
        )
        return
    checkpoint = keep // record.every  # the last state kept at or before keep
    start = checkpoint * record.every
    cache[1] = record.state if checkpoint == 0 else record.states[checkpoint - 1]
    if start < keep:  # at most every - 1 steps
        a, b = record.a[:, start:keep], record.b[:, start:keep]
        _, states = gated_delta_steps.steps(
            *(t[:, start:keep] for t in (record.q, record.k, record.v)),
            compute_g(gdn.A_log, a, gdn.dt_bias), mx.sigmoid(b), cache[1], record.every,
        )
        cache[1] = states[-1]


def restore_rows(cache: ArraysCache, record: GatedDeltaRecord, keeps: list[int]) -> None:
    """Set each row r of a batch's ``cache`` to its state after its first
    ``keeps[r]`` recorded steps, each as ``restore`` sets a request's own
    cache, so a row's state is the one it would have alone: where the block
    ran in the verify kernel, one ``gdn_replay`` launch with each row's own
    step count; where it ran in ``gated_delta_steps``, each row's last kept
    state and the few steps after it replayed for all rows at once; else row by row."""
    if len(set(keeps)) == 1:
        restore(cache, record, keeps[0])
        return
    if record.g is not None and gdn_kernels.REPLAY.enabled():
        args = (record.k, record.v, record.g, record.beta, record.state, mx.array(keeps, dtype=mx.int32))
        if gdn_kernels.REPLAY.active(*args):
            cache[0] = _conv_windows(record, keeps)
            (cache[1],) = gdn_kernels.REPLAY.launch(*args)
            return
    if record.states is not None:
        cache[0] = _conv_windows(record, keeps)
        cache[1] = _replayed_rows(record, keeps)
        return
    rows = []
    for r, keep in enumerate(keeps):
        row = ArraysCache(2)
        restore(row, record.row(r), keep)
        rows.append(row)
    cache[0] = mx.concatenate([row[0] for row in rows])
    cache[1] = mx.concatenate([row[1] for row in rows])


def _conv_windows(record: GatedDeltaRecord, keeps: list[int]) -> mx.array:
    """Every row's conv window after its first ``keeps[r]`` recorded steps, in one gather."""
    window = record.conv_input.shape[1] - record.q.shape[1]
    at = mx.array(keeps, dtype=mx.int32)[:, None] + mx.arange(window, dtype=mx.int32)
    return mx.take_along_axis(record.conv_input, at[..., None], axis=1)


def _replayed_rows(record: GatedDeltaRecord, keeps: list[int]) -> mx.array:
    """Every row's state after its first ``keeps[r]`` steps, from the states
    ``gated_delta_steps`` kept: row r's last one at or before its keep, then
    its remaining steps (fewer than ``every``), stepped for all rows together
    (a row with none left keeps its state). Each row's arithmetic is the one
    ``restore`` does for it alone."""
    every, T = record.every, record.q.shape[1]
    kept = [record.state, *record.states]  # kept[c]: the state after c * every steps
    starts = [keep // every * every for keep in keeps]
    state = mx.concatenate([kept[start // every][r : r + 1] for r, start in enumerate(starts)])
    gdn = record.layer
    for i in range(max(keep - start for keep, start in zip(keeps, starts))):
        t = mx.array([min(start + i, T - 1) for start in starts], dtype=mx.int32)
        q, k, v, a, b = (mx.take_along_axis(x, t.reshape(-1, *[1] * (x.ndim - 1)), axis=1)
                         for x in (record.q, record.k, record.v, record.a, record.b))
        _, stepped = gated_delta_steps.steps(q, k, v, compute_g(gdn.A_log, a, gdn.dt_bias), mx.sigmoid(b), state,
                                             every)
        going = mx.array([start + i < keep for keep, start in zip(keeps, starts)]).reshape(-1, 1, 1, 1)
        state = mx.where(going, stepped[-1], state)
    return state


class GatedDelta:
    """Layer kind of mlx-lm's qwen3_5 and qwen3_next GatedDeltaNet layers (``layer.is_linear``),
    whose cache is an ``ArraysCache`` of conv and recurrent state."""

    name = "gated_delta"

    @staticmethod
    def claims(layer: nn.Module) -> bool:
        return bool(getattr(layer, "is_linear", False))

    def cache(self, cache):
        if not isinstance(cache, ArraysCache):
            raise DFlashError(f"a GatedDeltaNet layer has a '{type(cache).__name__}' cache; expected mlx-lm's ArraysCache")
        return cache

    def mask(self, h: mx.array, cache):
        return create_ssm_mask(h, cache)

    def __call__(self, layer: nn.Module, h: mx.array, mask, cache, record: bool):
        if record:
            return recording_layer(layer, h, mask, cache)
        return layer(h, mask, cache), None

    def rollback(self, cache: ArraysCache, record: GatedDeltaRecord, keep: int, block: int) -> None:
        restore(cache, record, keep)

    def row_cache(self, cache: ArraysCache) -> ArraysCache:
        row = ArraysCache(len(cache.cache))  # mlx-lm's ArraysCache batches its rows already; a new one
        row.cache = list(cache.cache)  # so extending the batch leaves the request's own cache as it was
        return row

    def rollback_rows(self, cache: ArraysCache, record: GatedDeltaRecord, keeps: list[int], block: int) -> None:
        restore_rows(cache, record, keeps)


GATED_DELTA = GatedDelta()
