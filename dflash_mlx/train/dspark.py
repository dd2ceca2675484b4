"""What training a DSpark draft changes (docs/training.md, "DSpark drafts"):
its block and its loss (its start: ``dflash2.initial_draft``).

The block is [x_0, m, ..., m], gamma = ``block_size - 1`` ids with the anchor
x_0 as prediction slot 0: slot k-1 predicts x_k, k = 1..gamma, exactly as
``DSparkDraft.block_ids`` lays it out at inference. With the previous token
teacher-forced (x_{k-1} the data's own token, the anchor for k = 1)::

    z_k = U_k + W2 W1[x_{k-1}],   q_k = softmax(z_k)
    p_k = softmax(the target's logits at the position before x_k)
    c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b)

and the loss per block position is DSpark's::

    0.1 * CE(x_k | q_k) + 0.9 * |q_k - p_k|_1 + BCE(c_k, 1 - |q_k - p_k|_1 / 2)

1 - |q - p|_1 / 2 is the chance that rejection sampling accepts a draft from
q against p, so c_k learns the per-position acceptance P(x_k accepted | x_1..x_{k-1}
accepted), the quantity the inference schedule multiplies into survival
chances (``ConfidenceSchedule``); that target is a stop-gradient constant.
Positions are weighted exp(-(k-1)/gamma_w) with ``DraftTrainConfig.gamma``
as gamma_w, as the block loss weights them (the DSpark paper uses 4 at a
block of 7; ``--gamma 4`` gives its weighting), and averaged over blocks.
The target's embedding and head are borrowed and frozen, as for every draft.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..draft import DSparkDraft
from .objective import DraftObjective, draft_train_forward

CE_WEIGHT, L1_WEIGHT = 0.1, 0.9


def confidence_logits(draft: DSparkDraft, hidden: mx.array, previous: mx.array) -> mx.array:
    """The confidence head's pre-sigmoid logits [...] (``DSparkDraft.confidence``
    is their sigmoid) from hidden [..., H] and the tokens x_{k-1} [...]."""
    return draft.confidence_head.proj(draft.confidence_features(hidden, previous))[..., 0].astype(mx.float32)


def dspark_loss(draft: DSparkDraft, hidden: mx.array, logits: mx.array, tokens: mx.array,
                teacher: mx.array, weights: mx.array) -> mx.array:
    """The weighted DSpark loss, averaged over blocks. hidden [..., g, H]
    (normed) and logits U [..., g, V] (scaled) of every slot; tokens [..., g+1],
    the block's true tokens (anchor first); teacher [..., g, V], the target's
    logits predicting tokens 1..g; weights [g] per block position."""
    previous, labels = tokens[..., :-1], tokens[..., 1:]
    z = logits.astype(mx.float32)
    if draft.markov_head is not None:
        z = z + draft.markov_head(previous).astype(mx.float32)
    log_q = z - mx.logsumexp(z, axis=-1, keepdims=True)
    ce = -mx.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
    p = mx.stop_gradient(mx.softmax(teacher.astype(mx.float32), axis=-1, precise=True))
    l1 = mx.abs(mx.exp(log_q) - p).sum(axis=-1)
    loss = CE_WEIGHT * ce + L1_WEIGHT * l1
    if draft.confidence_head is not None:
        accept = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
        c = confidence_logits(draft, hidden, previous)
        loss = loss + nn.losses.binary_cross_entropy(c, accept, with_logits=True, reduction="none")
    return (loss * weights).sum() / (weights.sum() * loss[..., 0].size)


class DSparkObjective(DraftObjective):
    """Batches of gamma-wide anchor-first blocks with the target's logits at
    each slot (the teacher p), and the DSpark loss. Cached features keep the
    target's final-normed hidden states beside them, from which p is computed."""

    @property
    def feature_width(self) -> int:
        return self.config.feature_size + self.target.hidden_size

    def _features(self, tokens: mx.array) -> mx.array:
        out = self.target.forward(tokens, None, self.config.target_layer_ids)
        return mx.concatenate([out.features, out.hidden.astype(out.features.dtype)], axis=-1)

    def batch(self, step: int, micro: int):
        emb, both, anchors, tokens, n = super().batch(step, micro)
        B, m = anchors.shape
        b, split = self.config.block_size, self.config.feature_size
        emb = emb.reshape(B, m, b, -1)[:, :, :-1].reshape(B, m * (b - 1), -1)  # [x_0, mask x (gamma-1)]
        feats, final = both[..., :split], both[..., split:]
        rows = np.array(anchors)[:, :, None] + np.arange(b - 1)  # the positions before tokens 1..gamma
        at = final[mx.arange(B)[:, None, None], mx.array(rows)]  # [B, m, gamma, H]
        teacher = self.target.logits(at)
        mx.eval(emb, feats, teacher)
        return emb, feats, anchors, tokens, teacher, n

    def loss(self, draft, emb, feats, anchors, tokens, teacher):
        B, m = anchors.shape
        hidden = draft_train_forward(draft, emb, feats, anchors).reshape(B, m, self.config.block_size - 1, -1)
        logits = draft.scale_logits(self.target.logits(hidden))
        return dspark_loss(draft, hidden, logits, tokens, teacher, self.weights), mx.array(float(B * m))
