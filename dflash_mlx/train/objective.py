"""The training objective of a DFlash draft: the published block-diffusion
recipe (``docs/architecture.md``):

- anchor positions are sampled in each training sequence;
- each block is [anchor token, mask x (b-1)] at positions anchor..anchor+b-1;
- block queries see the frozen target's features of every position before the
  anchor (as injected context keys/values) and every position of their own
  block (only the earlier ones on causal layers: the draft's sliding layers
  unless the config sets ``is_causal``, as at inference);
- cross-entropy on block positions 1..b-1 against the true continuation, with
  weights exp(-(k-1)/gamma) that decay with the position k in the block;
- the target's embedding and LM head are shared and frozen; the draft's
  layers, ``fc`` and norms are trained;
- a DFlash2 draft's convolutions run inside each block, and its candidate
  selector's loss is added (``dflash2.py``);
- a DSpark draft's block and loss are its own (``dspark.py``).

Many blocks of one sequence are trained in one forward: every block's queries
score the shared context keys, masked to positions < anchor_j and, on sliding
layers, to what each query's window reaches (``draft.visible``), plus its own
block's keys only.
``draft_train_forward`` reuses the draft's own modules (``keys_values`` for
K/V, the same norms and projections), and a test
checks it against the cached inference path block by block.
"""

import time
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..draft import DFlash2Draft, DFlashDraft, DraftConfig, visible
from ..targets import Target
from .config import DraftTrainConfig
from .data import SequenceData
from .dflash2 import selector_loss
from .progress import log


def context_mask(anchors: mx.array, seq_len: int, block_size: int, window: Optional[int] = None) -> mx.array:
    """Boolean [B, m, b, T]: block position i of block j (absolute position
    anchor_j + i) sees context positions < anchor_j that its window reaches
    (the draft's own rule, :func:`dflash_mlx.draft.visible`)."""
    queries = anchors[:, :, None] + mx.arange(block_size)  # [B, m, b]
    keys = mx.arange(seq_len)
    return visible(queries, keys, window, causal=True) & (keys < anchors[:, :, None, None])


def _block_attention(q, kc, vc, kb, vb, ctx_mask, blk_mask, scale):
    """Attention of every block over [its context ; itself].

    q: [B, m, nh, b, hd]; kc, vc: [B, nkv, T, hd] (context, shared by all
    blocks); kb, vb: [B, m, nkv, b, hd] (each block's own keys); ctx_mask:
    [B, m, b, T]; blk_mask: [b, b] (the same in every block). Scores are split into a context part and a b x b own-block
    part, so no block ever scores another block's keys. Returns [B, m, b, nh*hd].
    """
    B, m, nh, b, hd = q.shape
    nkv, T = kc.shape[1], kc.shape[2]
    rep = nh // nkv
    q = (q * scale).reshape(B, m, nkv, rep, b, hd).transpose(0, 2, 3, 1, 4, 5)  # [B,nkv,rep,m,b,hd]
    kb = kb.transpose(0, 2, 1, 3, 4)[:, :, None]  # [B, nkv, 1, m, b, hd]
    vb = vb.transpose(0, 2, 1, 3, 4)[:, :, None]
    s_ctx = (q.reshape(B, nkv, rep, m * b, hd) @ kc[:, :, None].swapaxes(-1, -2))
    s_ctx = s_ctx.reshape(B, nkv, rep, m, b, T)
    s_ctx = mx.where(ctx_mask[:, None, None], s_ctx, -mx.inf)
    s_blk = mx.where(blk_mask, q @ kb.swapaxes(-1, -2), -mx.inf)  # [B, nkv, rep, m, b, b]
    p = mx.softmax(mx.concatenate([s_ctx, s_blk], axis=-1), axis=-1, precise=True)
    out = (p[..., :T].reshape(B, nkv, rep, m * b, T) @ vc[:, :, None]).reshape(B, nkv, rep, m, b, hd)
    out = out + p[..., T:] @ vb
    return out.transpose(0, 3, 4, 1, 2, 5).reshape(B, m, b, nh * hd)


def draft_train_forward(
    draft: DFlashDraft, block_embeddings: mx.array, features: mx.array, anchors: mx.array
) -> mx.array:
    """Final-normed draft hidden states for many blocks per sequence at once.

    block_embeddings: [B, m*b, H], the target embeddings of the m blocks
    [x_a, mask, ..., mask] concatenated; features: [B, T, k*H] target features
    of every position; anchors: [B, m] int positions of the blocks' first
    token. Equals, block by block, ``inject(features[:, :a])`` followed by
    ``draft(block)`` on a fresh cache: the same modules (``keys_values`` for
    K/V, the same norms, projections and RoPE at absolute positions).
    """
    B, T, _ = features.shape
    m = anchors.shape[1]
    b = block_embeddings.shape[1] // m
    ctx = draft.hidden_norm(draft.fc(features))
    offsets = anchors.reshape(-1)
    masks = {}
    scale = draft.config.input_embedding_scale
    h = block_embeddings if scale == 1.0 else block_embeddings * scale
    per_block = lambda t: t.reshape(B * m, b, -1)  # a DFlash2 conv runs inside each block
    for layer in draft.layers:
        attn = layer.self_attn
        key = (attn.sliding_window, attn.causal)
        if key not in masks:
            relative = mx.arange(b)
            masks[key] = (context_mask(anchors, T, b, attn.sliding_window),
                          visible(relative, relative, attn.sliding_window, attn.causal))
        kc, vc = attn.keys_values(ctx, 0)  # [B, nkv, T, hd] at positions 0..T-1

        def attend(x):  # x: [B*m, b, H]
            q = attn.q_norm(attn.q_proj(x).reshape(B * m, b, attn.n_heads, -1))
            q = attn.rope(q.transpose(0, 2, 1, 3), offset=offsets)  # [B*m, nh, b, hd]
            kb, vb = attn.keys_values(x, offsets)  # [B*m, nkv, b, hd] at anchor..anchor+b-1
            split = lambda t: t.reshape(B, m, *t.shape[1:])
            out = _block_attention(split(q), kc, vc, split(kb), split(vb), *masks[key], attn.scale)
            return attn.o_proj(out.reshape(B * m, b, -1))

        u = per_block(layer.input_layernorm(h))
        h = h + _wrapped(layer, "attention_conv", u, attend).reshape(h.shape)
        u = per_block(layer.post_attention_layernorm(h))
        h = h + _wrapped(layer, "mlp_conv", u, layer.mlp).reshape(h.shape)
    return draft.norm(h)


def _wrapped(layer, conv: str, u: mx.array, sublayer) -> mx.array:
    """sublayer(u), inside the layer's convolution where it has one (DFlash2)."""
    wrap = getattr(layer, conv, None)
    return sublayer(u) if wrap is None else wrap(u, sublayer)


def position_weights(block_size: int, gamma: float) -> mx.array:
    """exp(-(k-1)/gamma) for block positions k = 1..b-1."""
    k = mx.arange(1, block_size, dtype=mx.float32)
    return mx.exp(-(k - 1) / gamma)


def sample_anchors(rng: np.random.Generator, lo: np.ndarray, hi: np.ndarray, m: int, b: int) -> np.ndarray:
    """[B, m] anchors with lo <= a and a + b - 1 < hi, distinct where room allows."""
    out = np.empty((len(lo), m), np.int64)
    for r, (l, h) in enumerate(zip(lo, hi)):
        top = int(h) - b  # last valid anchor
        l = int(l)
        if top < l:  # too short: fall back to the earliest anchor with full labels
            l = top = max(int(h) - b, 0)
        span = top - l + 1
        if span >= m:
            out[r] = np.sort(rng.choice(span, size=m, replace=False)) + l
        else:
            out[r] = np.sort(rng.integers(0, span, size=m)) + l
    return out


class DraftObjective:
    """Batches (from the frozen target) and the weighted block loss."""

    def __init__(self, target: Target, config: DraftConfig, train: DraftTrainConfig, data, seed: int):
        self.target = target
        self.config = config
        self.train = train
        self.data = data
        self.seed = seed
        self.weights = position_weights(config.block_size, train.gamma)
        self.features = None
        if train.cache_features and isinstance(data, SequenceData):
            self.features = self._precompute()

    @property
    def feature_width(self) -> int:
        """Channels ``_features`` gives per position (k*H: the target's features)."""
        return self.config.feature_size

    def _features(self, tokens: mx.array) -> mx.array:
        return self.target.forward(tokens, None, self.config.target_layer_ids).features

    def _precompute(self) -> np.ndarray:
        """``_features`` of every sequence, once (float16, [N, seq_len, feature_width])."""
        n, T = len(self.data), self.train.seq_len
        out = np.zeros((n, T, self.feature_width), np.float16)
        t0 = time.perf_counter()
        step = max(self.train.batch_size, 1)
        for start in range(0, n, step):
            idx = np.arange(start, min(start + step, n))
            x, _, _ = self.data.rows(idx, T)
            f = self._features(mx.array(x)).astype(mx.float16)
            out[idx] = np.array(f)
            if (start // step) % 50 == 0:
                log(f"  target features {start + len(idx)}/{n} "
                     f"({(start + len(idx)) / (time.perf_counter() - t0):.1f} seq/s)")
        log(f"cached target features for {n} sequences ({out.nbytes / 2**30:.2f} GiB)")
        return out

    def batch(self, step: int, micro: int):
        cfg, b = self.train, self.config.block_size
        rng = np.random.default_rng([self.seed, step, micro])
        if self.features is not None:
            idx = self.data.sample_indices(rng, cfg.batch_size)
            x, lo, hi = self.data.rows(idx, cfg.seq_len)
        else:
            x, lo, hi = self.data.sample(rng, cfg.batch_size, cfg.seq_len)
        anchors = sample_anchors(rng, lo, hi, cfg.blocks_per_seq, b)
        if self.features is not None:
            feats = mx.array(self.features[idx]).astype(mx.float32)
        else:
            feats = self._features(mx.array(x))
        rows = np.arange(len(x))[:, None, None]
        idx_blk = anchors[:, :, None] + np.arange(b)[None, None, :]  # [B, m, b]
        tokens = x[rows, idx_blk]  # the blocks' true tokens: anchors, then the labels
        block = tokens.copy()
        block[:, :, 1:] = self.config.mask_token_id
        emb = self.target.embed(mx.array(block.reshape(len(x), -1)))
        anchors_mx = mx.array(anchors.astype(np.int32))
        mx.eval(feats, emb)
        return emb, feats, anchors_mx, mx.array(tokens), int(tokens[:, :, 1:].size)

    def block_rows(self, draft, emb, feats, anchors) -> tuple[mx.array, mx.array]:
        """(normed hidden [B, m, b-1, H], scaled logits [B, m, b-1, V]) of every
        block's rows 1..b-1: the logits the draft proposes from (and a DFlash2
        selector scores)."""
        B, m = anchors.shape
        hidden = draft_train_forward(draft, emb, feats, anchors)
        hidden = hidden.reshape(B, m, self.config.block_size, -1)[:, :, 1:]
        return hidden, draft.scale_logits(self.target.logits(hidden))

    def loss(self, draft, emb, feats, anchors, tokens):
        """The weighted block cross-entropy, plus ``selector_weight`` times the
        selector's loss for a DFlash2 draft (``dflash2.selector_loss``)."""
        hidden, logits = self.block_rows(draft, emb, feats, anchors)
        loss = block_loss(logits, tokens, self.weights)
        if isinstance(draft, DFlash2Draft) and self.train.selector_weight:
            loss = loss + self.train.selector_weight * selector_loss(draft, hidden, logits, tokens, self.weights)
        B, m = anchors.shape
        return loss, mx.array(float(B * m))


def block_loss(logits: mx.array, tokens: mx.array, weights: mx.array) -> mx.array:
    """Cross-entropy of rows 1..b-1 against the true continuation, weighted by
    block position and averaged over blocks. logits [..., b-1, V], tokens [..., b]."""
    ce = nn.losses.cross_entropy(logits, tokens[..., 1:], reduction="none")
    return (ce * weights).sum() / (weights.sum() * ce[..., 0].size)
