"""DFlash2's candidate selector: each drafted row's top-k tokens rescored by a
low-rank transition from the token chosen before it, walked left to right
from the anchor. See docs/dflash2.md, "Candidate selector".

For row j (block position j + 1) with scaled logits z_j and normed hidden
state h_j, candidates C_j = top-k(z_j), e_j = hidden_projection(h_j) and::

    s_j(c) = z_j(c) + sum_r P[prev_j, r] * e_j[r] * S[c, r],   c in C_j

with prev_0 the anchor y and prev_{j+1} = d_j. At temperature 0, d_j is the
argmax of s_j over C_j; above, d_j ~ q_j = softmax(s_j / T) over C_j (q_j is 0
outside C_j), and that sparse q is what rejection sampling must be given.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..top_k import top_k_ids

CODEBOOKS = ("predecessor_codebook", "successor_codebook")


class CandidateSelector(nn.Module):
    """P (predecessor) and S (successor) codebooks [V, R], and hidden_projection [R, H]."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)

    def candidates(self, logits: mx.array) -> mx.array:
        """C_j: the top-k ids [..., n, k] of each row of logits [..., n, V],
        unordered (a choice, so no gradient flows through it when training)."""
        return mx.stop_gradient(top_k_ids(logits, min(self.top_k, logits.shape[-1])))

    def prepare(self, hidden: mx.array, logits: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(C [..., n, k], z over C [..., n, k], e_j * S[c] [..., n, k, R]) from
        normed hidden [..., n, H] and scaled logits [..., n, V]: what every
        row's scores need but the previous token."""
        candidates = self.candidates(logits)
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        e = self.hidden_projection(hidden).astype(mx.float32)
        edges = self.successor_codebook(candidates).astype(mx.float32) * e[..., None, :]
        return candidates, unary, edges

    def scores(self, hidden: mx.array, logits: mx.array, anchor: mx.array) -> tuple[mx.array, mx.array]:
        """(C [n, k], scores [n, k, k]): entry [j, s, c] is s_j(c) after the
        parent in slot s of C_{j-1} (row 0: after the anchor, the same in every
        slot). One batched product for every row and parent, so a walk only
        picks rows. With a leading batch (hidden [B, n, H], logits [B, n, V],
        anchor [B]) every block's, each after its own anchor."""
        candidates, unary, edges = self.prepare(hidden, logits)
        lead, k = candidates.shape[:-2], candidates.shape[-1]
        first = mx.broadcast_to(anchor.reshape(*lead, 1, 1), (*lead, 1, k)).astype(candidates.dtype)
        parents = mx.concatenate([first, candidates[..., :-1, :]], axis=-2)
        P = self.predecessor_codebook(parents).astype(mx.float32)  # [..., n, k parents, R]
        return candidates, unary[..., None, :] + P @ mx.swapaxes(edges, -1, -2)

    def walk(self, hidden: mx.array, logits: mx.array, anchor: mx.array, temperature: float = 0.0,
             key: Optional[mx.array] = None) -> tuple[mx.array, Optional[mx.array]]:
        """(drafted [n] int32, q [n, V] float32 log-probabilities or None at T = 0)
        from hidden [n, H] and scaled logits [n, V] of rows 1..n, after anchor [1]."""
        if temperature == 0:
            return self.greedy_walk(hidden[None], logits[None], anchor)[0], None
        n, V = logits.shape
        candidates, scores = self.scores(hidden, logits, anchor)
        k = candidates.shape[1]
        scores = scores / temperature
        rows_by_parent = (scores - mx.logsumexp(scores, axis=-1, keepdims=True)).reshape(n * k, k)
        keys = mx.random.split(key, n)
        slot, slots, rows = mx.array(0), [], []
        for j in range(n):
            row = rows_by_parent[j * k + slot]  # after the token chosen in row j - 1
            slot = mx.random.categorical(row, key=keys[j])
            slots.append(slot)
            rows.append(row)
        drafted = mx.take_along_axis(candidates, mx.stack(slots)[:, None], axis=1)[:, 0].astype(mx.int32)
        return drafted, scatter(candidates, mx.stack(rows), V)

    def greedy_walk(self, hidden: mx.array, logits: mx.array, anchors: mx.array) -> mx.array:
        """drafted [B, n] int32: the walk at T = 0 of B blocks at once, from
        hidden [B, n, H] and scaled logits [B, n, V], block r after anchors[r];
        each block's drafts are the ones its walk alone chooses."""
        candidates, scores = self.scores(hidden, logits, anchors)
        B, n, k = candidates.shape
        rows_by_parent = scores.reshape(B * n * k, k)
        slot, slots = mx.zeros((B,), dtype=mx.uint32), []
        for j in range(n):  # block r's row j after its slot of row j - 1: r * n * k + j * k + slot
            at = mx.array([(r * n + j) * k for r in range(B)], dtype=mx.uint32)
            slot = mx.argmax(rows_by_parent[at + slot], axis=-1)
            slots.append(slot)
        return mx.take_along_axis(candidates, mx.stack(slots, axis=1)[..., None], axis=-1)[..., 0].astype(mx.int32)

    def transitions(self, hidden: mx.array, logits: mx.array, anchor: mx.array) -> tuple[mx.array, mx.array]:
        """(C [n, k], log-probs [n, k, k]) for a tree: ``scores`` as log softmax
        over each parent's k children."""
        candidates, scores = self.scores(hidden, logits, anchor)
        return candidates, scores - mx.logsumexp(scores, axis=-1, keepdims=True)


def scatter(candidates: mx.array, logq: mx.array, vocab_size: int) -> mx.array:
    """Log-probabilities over C [n, k] as rows over the vocabulary [n, V] (-inf outside C)."""
    q = mx.full((candidates.shape[0], vocab_size), -mx.inf, dtype=mx.float32)
    return mx.put_along_axis(q, candidates, logq, axis=-1)
