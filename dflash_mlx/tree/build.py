"""DDTree construction: the B most likely prefixes of one draft block, as a tree.

One draft forward gives a distribution per block position (d_1 .. d_{b-1}),
each independent of the tokens before it. A prefix (t_1 .. t_d) scores
sum_i log q_i(t_i); the tree is the ``budget`` best-scoring prefixes, found
best-first: per position the top k = min(budget, V) tokens are taken on the
device, sorted, and a heap on the host pops the best open prefix, then pushes
its next sibling (same parent, next-ranked token) and its first child (one
position deeper, top-ranked token). Both score no higher than the popped node,
so pops come out in score order and every node's parent is popped before it.
A DFlash2 draft's candidates depend on the parent's token (its selector's
transitions): ``build_transition_tree`` runs the same heap with each node's
children ranked by the row for that token. A DSpark draft's Markov head gives
each node's children a distribution of their own, z after the node's token:
``build_node_tree`` ranks the top k of that row on the device per expanded node.

Index 0 of a ``Tree`` is the root: the pending token y (already chosen, not
drafted). Nodes 1..n follow in pop order, so parents precede children.
"""

import heapq
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..top_k import ranked_top_k


@dataclass
class Tree:
    tokens: list[int]  # [n+1]: the root token, then each node's token
    parents: list[int]  # [n+1]: index of each node's parent; -1 for the root
    depths: list[int]  # [n+1]: 0 for the root, d for a node drafting position d

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[dict[int, int]]:
        """Per node: token -> index of the child carrying it."""
        kids: list[dict[int, int]] = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]][self.tokens[i]] = i
        return kids

    def path(self, node: int) -> list[int]:
        """Indices from the root to ``node``, both included."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]


def top_candidates(logprobs: mx.array, budget: int) -> tuple[mx.array, mx.array]:
    """Per position, the k = min(budget, V) best (log-probs, tokens), best first:
    two [b-1, k] arrays computed on the device."""
    k = min(budget, logprobs.shape[-1])
    logprobs = logprobs.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    return ranked_top_k(logprobs, k)


def build_tree(root: int, values: list[list[float]], tokens: list[list[int]], budget: int) -> Tree:
    """The ``budget`` best prefixes under per-position ranked candidates
    (``values[d][r]`` the log-prob of ``tokens[d][r]``, descending in r)."""
    slots = [list(range(len(v))) for v in values]
    return _best_first(root, len(values), lambda d, parent_slot: (values[d], tokens[d], slots[d]), budget)


def build_transition_tree(root: int, candidates: list[list[int]], logprobs: list[list[list[float]]],
                          budget: int) -> Tree:
    """The ``budget`` best prefixes when a node's children depend on its token
    (DFlash2's selector): ``candidates[d]`` are depth d+1's k tokens and
    ``logprobs[d][s][c]`` the log-prob of candidate c after the parent in slot s
    of ``candidates[d-1]`` (any s at d = 0: the root)."""
    ranked = {}

    def rank(d: int, parent_slot: int):
        if (d, parent_slot) not in ranked:
            row = logprobs[d][parent_slot]
            order = sorted(range(len(row)), key=lambda c: -row[c])
            ranked[d, parent_slot] = [row[c] for c in order], [candidates[d][c] for c in order], order
        return ranked[d, parent_slot]

    return _best_first(root, len(candidates), rank, budget)


def build_node_tree(root: int, z: Callable[[int, int], mx.array], depth_limit: int, budget: int) -> Tree:
    """The ``budget`` best prefixes when a node's children are the top
    candidates of logits that depend on its token: ``z(d, token)`` [1, V] for
    depth d+1 after a parent carrying ``token`` (the root's at d = 0)."""
    ranked = {}

    def rank(d: int, parent_token: int):
        parent_token = root if d == 0 else parent_token
        if (d, parent_token) not in ranked:
            values, tokens = top_candidates(z(d, parent_token), budget)
            tokens = tokens[0].tolist()
            ranked[d, parent_token] = values[0].tolist(), tokens, tokens
        return ranked[d, parent_token]

    return _best_first(root, depth_limit, rank, budget)


def _best_first(root: int, depth_limit: int, rank, budget: int) -> Tree:
    """Best-first over prefixes; ``rank(d, parent_slot)`` gives depth d+1's
    candidates after a parent in that slot: (log-probs descending, tokens, slots)."""
    tree = Tree([root], [-1], [0])
    first = rank(0, 0)[0] if depth_limit else []
    # entries: (-score, tie-break counter, depth index, rank, parent, parent's score, parent's slot)
    heap = [(-first[0], 0, 0, 0, 0, 0.0, 0)] if first else []
    pushed = 1
    while heap and len(tree) <= budget:
        neg, _, d, r, parent, base, parent_slot = heapq.heappop(heap)
        values, tokens, slots = rank(d, parent_slot)
        score, node = -neg, len(tree)
        tree.tokens.append(tokens[r])
        tree.parents.append(parent)
        tree.depths.append(d + 1)
        if r + 1 < len(values):
            heapq.heappush(heap, (-(base + values[r + 1]), pushed, d, r + 1, parent, base, parent_slot))
            pushed += 1
        if d + 1 < depth_limit:
            child = rank(d + 1, slots[r])[0]
            heapq.heappush(heap, (-(score + child[0]), pushed, d + 1, 0, node, score, slots[r]))
            pushed += 1
    return tree


def draft_tree(root: int, logprobs: mx.array, budget: int) -> Tree:
    """The tree of ``budget`` nodes after ``root`` from draft log-probs [b-1, V]."""
    values, tokens = top_candidates(logprobs, budget)
    return build_tree(root, values.tolist(), tokens.tolist(), budget)


def walk(tree: Tree, choices: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance: from the root, move to the child carrying the target's
    choice at the current node while there is one. Returns (the path's indices,
    root first, and the target's choice at its end: the bonus token)."""
    kids, node = tree.children(), 0
    while choices[node] in kids[node]:
        node = kids[node][choices[node]]
    return tree.path(node), choices[node]
