"""What training a DFlash2 draft adds to v1's (docs/training.md, "DFlash2
drafts"): its starting weights and the candidate selector's loss.

The selector's loss for block row j (position j + 1) is the cross-entropy of
the target's token x_{j+1} among the row's candidates C_j = top-k(z_j) under
the scores the selector walks with::

    s_j(c) = z_j(c) + sum_r P[x_j, r] * e_j[r] * S[c, r],   c in C_j

with the previous token teacher-forced: x_j, the target's own token (the
anchor for j = 0). Rows whose x_{j+1} is not in C_j are left out: the walk can
never propose that token, whatever the selector scores, and the block loss
already raises its logit until it enters the top k. Scoring it as an extra
candidate would train transitions on pairs the walk never meets. Rows are
weighted like the block loss (exp(-(k-1)/gamma) at block position k).
"""

import mlx.core as mx

from ..draft import DFlash2Draft, DraftConfig, DSparkDraft, network_class

CODEBOOK_INIT_STD = 0.02  # the transition starts near zero: s_j is about z_j


def initial_draft(config: DraftConfig):
    """A freshly initialised draft of the config's architecture. A DFlash2
    draft starts as its v1 network: every convolution the identity (static tap
    1 at offset 0, no dynamic taps), and small codebooks, so the selector
    starts from the block's own logits and training is as stable as v1's.
    A DSpark draft's Markov head starts with W2 = 0, so its walk starts from
    the block's own logits too (z_k = U_k; W1 learns once W2 moves)."""
    draft = network_class(config)(config)
    if isinstance(draft, DSparkDraft) and draft.markov_head is not None:
        w2 = draft.markov_head.markov_w2
        w2.weight = mx.zeros_like(w2.weight)
    if isinstance(draft, DFlash2Draft):
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0].add(1.0)
                conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)
        selector = draft.candidate_selector
        for book in (selector.predecessor_codebook, selector.successor_codebook):
            book.weight = CODEBOOK_INIT_STD * mx.random.normal(book.weight.shape)
    mx.eval(draft.parameters())
    return draft


def selector_loss(draft: DFlash2Draft, hidden: mx.array, logits: mx.array, tokens: mx.array,
                  weights: mx.array) -> mx.array:
    """Weighted mean cross-entropy of the target's token among each row's
    candidates. hidden [..., b-1, H] (normed) and logits [..., b-1, V] (scaled,
    as the selector sees them) of block rows 1..b-1; tokens [..., b], the
    block's true tokens (anchor first); weights [b-1] per block position."""
    selector = draft.candidate_selector
    V, R = logits.shape[-1], selector.hidden_projection.weight.shape[0]
    candidates, unary, edges = selector.prepare(hidden.reshape(-1, hidden.shape[-1]), logits.reshape(-1, V))
    prev = selector.predecessor_codebook(tokens[..., :-1].reshape(-1)).astype(mx.float32)  # [n, R]
    scores = unary + (edges @ prev.reshape(-1, R, 1))[..., 0]  # [n, k]
    label = tokens[..., 1:].reshape(-1, 1)
    present = candidates == label
    found = present.any(axis=-1)
    picked = mx.where(present, scores, 0.0).sum(axis=-1)
    ce = mx.logsumexp(scores, axis=-1) - picked
    w = mx.broadcast_to(weights, tokens[..., 1:].shape).reshape(-1) * found
    return (ce * w).sum() / mx.maximum(w.sum(), 1e-9)

