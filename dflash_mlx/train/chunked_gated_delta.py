"""A chunked gated delta rule for training the target (qwen3_5 hybrids).

mlx-lm's training path runs the GatedDeltaNet recurrence one timestep at a
time; here it runs C steps at once with matmuls, the same function in exact
arithmetic. Per head, with rows indexed by time inside a chunk and the state
S_0 it starts from (log-decays l_t = log g_t, gamma_t = exp(l_1 + ... + l_t)):

    S_t = gamma_t S_0 + sum_{s<=t} (gamma_t / gamma_s) d_s k_s^T
    d_t = beta_t (v_t - g_t S_{t-1} k_t)

so the deltas D solve (I + A) D = diag(beta) (V - diag(gamma) K S_0^T) with
A[t, s] = beta_t (gamma_t / gamma_s) k_t.k_s strictly lower triangular. Every
ratio gamma_t / gamma_s (s <= t) is exp of a sum of log-decays over (s, t],
summed directly (no difference of two cumulative sums) and masked before the
exp, so none overflows and strong decays keep their precision.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.gated_delta import compute_g

from ..targets import split_qkv

# Gates below this count as this (log -69): the state is then wiped to within
# float32 precision anyway. The forward would survive log(0) = -inf (no two
# sums are subtracted), but its gradient 1/g would not: below the floor the
# gradient w.r.t. g is 0 (mlx-lm's is finite there, and d/dx of g = exp(x)
# is ~0 in both).
GATE_FLOOR = 1e-30


def unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for a strictly lower triangular [..., C, C], C a power of two.

    Blocked doubling: a unit lower triangular [[L11, 0], [L21, L22]] has inverse
    [[X11, 0], [-X22 L21 X11, X22]]. Every intermediate is a block of the final
    inverse, so nothing grows beyond it (unlike a Neumann series by squaring,
    whose powers of a can reach binomial sizes and cancel)."""
    C = a.shape[-1]
    if C & (C - 1):
        raise ValueError(f"chunk size must be a power of two, got {C}")
    levels = [a[..., None, :, :]]  # diagonal blocks of size C, C/2, ..., 2
    while levels[-1].shape[-1] > 2:
        blk = levels[-1]
        m = blk.shape[-1] // 2
        halves = mx.stack([blk[..., :m, :m], blk[..., m:, m:]], axis=-3)
        levels.append(halves.reshape(*blk.shape[:-3], -1, m, m))
    inv = mx.ones((*a.shape[:-2], C, 1, 1), dtype=a.dtype)
    for blk in reversed(levels if C > 1 else []):
        m = blk.shape[-1] // 2
        x11, x22 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        x21 = -(x22 @ (blk[..., m:, :m] @ x11))
        top = mx.concatenate([x11, mx.zeros_like(x11)], axis=-1)
        inv = mx.concatenate([top, mx.concatenate([x21, x22], axis=-1)], axis=-2)
    return inv[..., 0, :, :]


def _chunks(x: mx.array, n: int, C: int) -> mx.array:
    """[B, T, H, ...] -> [B, H, n, C, ...], zero-padded in time to n * C."""
    pad = n * C - x.shape[1]
    if pad:
        x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], n, C, *x.shape[2:])
    return mx.moveaxis(x, 3, 1)


def chunked_gated_delta(q, k, v, g, beta, state=None, chunk: int = 32):
    """The gated delta rule over [B, T] in chunks of ``chunk`` steps.

    Same contract as mlx-lm's ``gated_delta_ops`` with scalar gates: q, k
    [B, T, Hk, Dk] (normalized), v [B, T, Hv, Dv], g and beta [B, T, Hv],
    state [B, Hv, Dv, Dk] or None (zeros). Returns y [B, T, Hv, Dv] and the
    final state, float32. Differentiable."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if g.ndim != 3:
        raise ValueError(f"expected scalar gates [B, T, Hv], got shape {g.shape}")
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if Hv // Hk > 1:
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    C = min(chunk, 1 << max(T - 1, 0).bit_length())  # a short sequence: one small chunk
    n = -(-T // C)
    f32 = mx.float32
    # padded steps have g = 1 (log 0), beta = 0 and k = 0: they leave the state alone
    lg = _chunks(mx.log(mx.maximum(g.astype(f32), GATE_FLOOR)), n, C)  # [B, H, n, C]
    q, k, v = (_chunks(t.astype(f32), n, C) for t in (q, k, v))  # [B, H, n, C, D]
    beta = _chunks(beta.astype(f32), n, C)

    row, col = mx.arange(C)[:, None], mx.arange(C)[None, :]
    # seg[t, s] = l_{s+1} + ... + l_t for s <= t: each a sum of its own terms
    seg = mx.cumsum(mx.where(row > col, lg[..., :, None], 0.0), axis=-2)
    decay = mx.exp(mx.where(row >= col, seg, -mx.inf))  # gamma_t / gamma_s, 0 above
    gamma = mx.exp(mx.cumsum(lg, axis=-1))[..., None]  # [B, H, n, C, 1]
    kk = k @ mx.swapaxes(k, -1, -2)
    a = mx.where(row > col, beta[..., None] * decay * kk, 0.0)
    rhs = beta[..., None] * mx.concatenate([v, gamma * k], axis=-1)
    uw = unit_lower_inverse(a) @ rhs
    u, w = uw[..., :Dv], uw[..., Dv:]  # deltas D = u - w S_0^T
    attn = (q @ mx.swapaxes(k, -1, -2)) * decay  # [B, H, n, C, C], diagonal kept
    to_end = mx.swapaxes(decay[..., -1:, :], -1, -2) * k  # (gamma_C / gamma_s) k_s
    last = gamma[..., -1, :, None]  # gamma_C, [B, H, n, 1, 1]

    s = state.astype(f32)[:, :, None]  # [B, H, 1, Dv, Dk]
    ys = []
    # one split per input (its gradient is one concatenation, not n padded slices)
    for u_, w_, q_, attn_, gamma_, end_, last_ in zip(
        *(mx.split(t, n, axis=2) for t in (u, w, q, attn, gamma, to_end, last))
    ):
        st = mx.swapaxes(s, -1, -2)
        d = u_ - w_ @ st  # this chunk's deltas, [B, H, 1, C, Dv]
        ys.append(gamma_ * (q_ @ st) + attn_ @ d)
        s = last_ * s + mx.swapaxes(d, -1, -2) @ end_
    y = mx.concatenate(ys, axis=2).reshape(B, Hv, n * C, Dv)
    return mx.moveaxis(y, 1, 2)[:, :T], s[:, :, 0]


def _gated_delta_net(gdn: nn.Module, x: mx.array, chunk: int) -> mx.array:
    """mlx-lm's GatedDeltaNet forward without cache or mask, chunked."""
    B, S, _ = x.shape
    qkv = gdn.in_proj_qkv(x)
    z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
    b, a = gdn.in_proj_b(x), gdn.in_proj_a(x)
    conv_state = mx.zeros((B, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype)
    conv_out = nn.silu(gdn.conv1d(mx.concatenate([conv_state, qkv], axis=1)))
    q, k, v = split_qkv(gdn, conv_out)
    g, beta = compute_g(gdn.A_log, a, gdn.dt_bias), mx.sigmoid(b)
    out, _ = chunked_gated_delta(q, k, v, g, beta, None, chunk)
    return gdn.out_proj(gdn.norm(out, z).reshape(B, S, -1))


def _text_model(model: nn.Module):
    """The qwen3_5 text model and its language-model wrapper, or ValueError."""
    lm = getattr(model, "language_model", None)
    text = getattr(lm, "model", None)
    layers = getattr(text, "layers", None)
    ok = layers is not None and all(hasattr(text, n) for n in ("embed_tokens", "norm"))
    ok = ok and all(
        hasattr(layer, "is_linear") and hasattr(layer, "linear_attn" if layer.is_linear else "self_attn")
        for layer in layers
    )
    if not ok:
        raise ValueError(f"training_logits needs an mlx-lm qwen3_5 model, got {type(model).__name__}")
    if getattr(text, "pipeline_size", 1) > 1:
        raise ValueError("training_logits does not support a pipelined (sharded) model")
    return lm, text


def training_logits(model: nn.Module, inputs: mx.array, chunk: int = 32) -> mx.array:
    """``model(inputs)`` for an mlx-lm qwen3_5 model without cache, with every
    GatedDeltaNet recurrence chunked (``chunked_gated_delta``)."""
    lm, text = _text_model(model)
    h = text.embed_tokens(inputs)
    fa_mask = create_attention_mask(h, None)
    for layer in text.layers:
        if not layer.is_linear:
            h = layer(h, mask=fa_mask, cache=None)
            continue
        h = h + _gated_delta_net(layer.linear_attn, layer.input_layernorm(h), chunk)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = text.norm(h)
    if lm.args.tie_word_embeddings:
        return text.embed_tokens.as_linear(h)
    return lm.lm_head(h)
