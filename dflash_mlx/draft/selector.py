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
        """C_j: the top-k ids [n, k] of each row of logits [n, V], unordered
        (a choice, so no gradient flows through it when training)."""
        k = min(self.top_k, logits.shape[-1])
        return mx.stop_gradient(mx.argpartition(-logits, k - 1, axis=-1)[:, :k])

    def prepare(self, hidden: mx.array, logits: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(C [n, k], z over C [n, k], e_j * S[c] [n, k, R]) from normed hidden
        [n, H] and scaled logits [n, V]: what every row's scores need but the
        previous token."""
        candidates = self.candidates(logits)
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        e = self.hidden_projection(hidden).astype(mx.float32)
        edges = self.successor_codebook(candidates).astype(mx.float32) * e[:, None]
        return candidates, unary, edges

    def scores(self, prepared: tuple[mx.array, mx.array, mx.array], j: int, prev: mx.array) -> mx.array:
        """s_j over C_j [k], row j following token prev [1]."""
        _, unary, edges = prepared
        return unary[j] + edges[j] @ self.predecessor_codebook(prev)[0].astype(mx.float32)

    def walk(self, hidden: mx.array, logits: mx.array, anchor: mx.array, temperature: float = 0.0,
             key: Optional[mx.array] = None) -> tuple[mx.array, Optional[mx.array]]:
        """(drafted [n] int32, q [n, V] float32 log-probabilities or None at T = 0)
        from hidden [n, H] and scaled logits [n, V] of rows 1..n, after anchor [1]."""
        n, V = logits.shape
        prepared = self.prepare(hidden, logits)
        candidates = prepared[0]
        keys = mx.random.split(key, n) if temperature > 0 else None
        prev, path, rows = anchor.reshape(1), [], []
        for j in range(n):
            scores = self.scores(prepared, j, prev)
            if temperature > 0:
                logq = scores / temperature
                logq = logq - mx.logsumexp(logq)
                rows.append(logq)
                slot = mx.random.categorical(logq, key=keys[j])
            else:
                slot = mx.argmax(scores)
            prev = candidates[j, slot].reshape(1)
            path.append(prev)
        drafted = mx.concatenate(path).astype(mx.int32)
        if temperature == 0:
            return drafted, None
        return drafted, scatter(candidates, mx.stack(rows), V)


    def transitions(self, hidden: mx.array, logits: mx.array, anchor: mx.array) -> tuple[mx.array, mx.array]:
        """(C [n, k], log-probs [n, k, k]) for a tree: entry [j, s, c] is
        log softmax_c s_j(c) after the parent in slot s of C_{j-1} (row 0: after
        the anchor, the same in every slot)."""
        candidates, unary, edges = self.prepare(hidden, logits)
        k = candidates.shape[1]
        parents = mx.concatenate([mx.broadcast_to(anchor.reshape(1, 1), (1, k)).astype(candidates.dtype),
                                  candidates[:-1]])
        P = self.predecessor_codebook(parents).astype(mx.float32)  # [n, k parents, R]
        scores = unary[:, None, :] + P @ edges.transpose(0, 2, 1)
        return candidates, scores - mx.logsumexp(scores, axis=-1, keepdims=True)


def scatter(candidates: mx.array, logq: mx.array, vocab_size: int) -> mx.array:
    """Log-probabilities over C [n, k] as rows over the vocabulary [n, V] (-inf outside C)."""
    q = mx.full((candidates.shape[0], vocab_size), -mx.inf, dtype=mx.float32)
    return mx.put_along_axis(q, candidates, logq, axis=-1)
