"""DDTree construction: the budget's best prefixes, parents first, from the
draft's per-position log-probabilities."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.tree.build import Tree, build_tree, draft_tree, top_candidates


def brute_force_scores(logprobs: np.ndarray) -> dict[tuple, float]:
    """Score of every prefix of length 1..b-1 (summed in position order)."""
    positions, vocab = logprobs.shape
    scores = {}
    for depth in range(1, positions + 1):
        for prefix in itertools.product(range(vocab), repeat=depth):
            s = 0.0
            for d, t in enumerate(prefix):
                s += float(logprobs[d, t])
            scores[prefix] = s
    return scores


def prefixes(tree: Tree) -> list[tuple]:
    return [tuple(tree.tokens[i] for i in tree.path(n)[1:]) for n in range(1, len(tree))]


def random_logprobs(seed, positions, vocab):
    logits = np.random.default_rng(seed).normal(size=(positions, vocab)) * 2
    return mx.array(logits.astype(np.float32))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("positions,vocab", [(1, 5), (3, 3), (4, 4), (5, 2)])
@pytest.mark.parametrize("budget", [1, 2, 5, 16, 40])
def test_the_tree_is_the_budgets_best_prefixes(seed, positions, vocab, budget):
    logits = random_logprobs(seed, positions, vocab)
    tree = draft_tree(7, logits, budget)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    scores = brute_force_scores(logprobs)
    best = sorted(scores.values(), reverse=True)[: min(budget, len(scores))]
    got = prefixes(tree)
    assert len(got) == len(set(got)) == len(best)  # budget respected, no prefix twice
    assert np.allclose(sorted((scores[p] for p in got), reverse=True), best, atol=1e-6)
    # pops come out best first
    assert [scores[p] for p in got] == sorted((scores[p] for p in got), reverse=True)
    assert tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0
    for n in range(1, len(tree)):
        assert 0 <= tree.parents[n] < n  # parents precede children
        assert tree.depths[n] == tree.depths[tree.parents[n]] + 1 == len(got[n - 1])
        assert tree.depths[n] <= positions


def test_a_prefix_beyond_the_budget_is_not_taken():
    # position 1 is certain, position 2 split: budget 2 takes [a] and [a, b]
    logprobs = mx.log(mx.array([[0.9, 0.1, 1e-9], [0.2, 0.8, 1e-9]]))
    tree = draft_tree(0, logprobs, 2)
    assert prefixes(tree) == [(0,), (0, 1)]
    assert tree.children() == [{0: 1}, {1: 2}, {}]
    assert tree.path(2) == [0, 1, 2]


def test_top_candidates_are_the_sorted_top_k_on_the_device():
    logits = random_logprobs(0, 3, 50)
    values, tokens = top_candidates(logits, 8)
    assert values.shape == tokens.shape == (3, 8)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    want = np.argsort(-logprobs, axis=-1)[:, :8]
    assert np.array_equal(np.array(tokens), want)
    assert np.allclose(np.array(values), np.take_along_axis(logprobs, want, axis=-1), atol=1e-6)
    # k never exceeds the vocabulary
    assert top_candidates(logits[:, :5], 32)[0].shape == (3, 5)


def test_build_tree_takes_ranked_candidates_from_the_host():
    values = [[-0.1, -3.0], [-0.2, -0.5]]
    tokens = [[4, 9], [2, 6]]
    tree = build_tree(1, values, tokens, 4)
    assert tree.tokens == [1, 4, 2, 6, 9]
    assert tree.parents == [-1, 0, 1, 1, 0]
    assert tree.depths == [0, 1, 2, 2, 1]
