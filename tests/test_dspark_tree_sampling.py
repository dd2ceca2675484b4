"""A DDTree built from a DSpark draft's Markov head, at temperature > 0: each
node's children are the top candidates of z = U_d + W2 W1[x] after the node's
own token x, and the tokens generated are distributed as the target's own
(the chi-square test of test_sampling.py against the target's enumerated
distribution). The control: the same trees verified by SpecInfer's
min(1, p/q) with q the warp of that z (the distribution the children were
ranked by, though they were not drawn from it) is caught by the same test."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import Target
from dflash_mlx.loop.sampling import BlockSampler, warp
from dflash_mlx.tree import TreeDecoder
from test_dspark_sampling import PARAMS, draft, source, walk_proposer  # noqa: F401 (fixtures)
from test_sampling import BLOCK, PROMPT, V, exact_joint, model, pvalues  # noqa: F401 (model: the fixture)

pytestmark = pytest.mark.statistical

BUDGET, RUNS, POSITIONS = 6, 200, 3
ALPHA = 1e-3 / 3  # Bonferroni over the chi-square tests of the good run


class DraftQTreeDecoder(TreeDecoder):
    """The wrong rule: at each node, its children in order, accept child c with
    min(1, p_res(c) / q(c)), q the warp of z after the node's token; on
    rejection p_res <- norm(max(p_res - q, 0)); the bonus from the last residual."""

    def _choose(self, logits, tree):
        p_all = np.exp(np.array(warp(logits, self.sampler.params), dtype=np.float64))
        u = np.array(mx.random.uniform(shape=(len(tree), self.budget + 1), key=self.sampler._next_key()))
        kids, choices = tree.children(), []
        for node in range(len(tree)):
            p, children = p_all[node], sorted(kids[node].values())
            if children:
                z = self.proposer.z(tree.depths[node], tree.tokens[node])
                q = np.exp(np.array(warp(z, self.sampler.params), dtype=np.float64))[0]
            choice = None
            for j, child in enumerate(children):
                c = tree.tokens[child]
                if u[node, j] < (1.0 if q[c] == 0 else min(1.0, p[c] / q[c])):
                    choice = c
                    break
                residual = np.maximum(p - q, 0)
                p = residual / residual.sum() if residual.sum() > 0 else p
            if choice is None:
                choice = min(int(np.searchsorted(np.cumsum(p / p.sum()), u[node, -1], side="right")), V - 1)
            choices.append(choice)
        return choices


def recording(make):
    """The DSpark proposer factory, its ``tree_rows`` keeping the cycle's z for the control."""

    def factory(model, params, memo):
        proposer = make(model, params, memo)
        rows = proposer.tree_rows

        def tree_rows(y, block_size):
            logits, proposer.z = rows(y, block_size)
            return logits, proposer.z

        proposer.tree_rows = tree_rows
        return proposer

    return factory


def sample(model, draft, decoder=TreeDecoder, runs=RUNS, positions=POSITIONS):
    """(tokens [runs, positions], accepted per cycle, trees) from the tree loop
    with the real DSpark proposer (test_dspark_sampling's, steered so that trees
    are walked deep), its draft trained at BLOCK - 1, so trees BLOCK - 1 deep."""
    target, memo, make = Target(model), {}, recording(walk_proposer(draft))
    tokens, accepted, trees = [], [], []
    for seed in range(runs):
        d = decoder(target, make(model, PARAMS, memo), [0], BLOCK, BUDGET,
                    sampler=BlockSampler(replace(PARAMS, seed=seed)))
        out = [d.prefill(mx.array(PROMPT))]
        while len(out) < positions:
            build = d.build
            d.build = lambda root, budget, build=build: trees.append(build(root, budget)) or trees[-1]
            cycle = d.cycle()
            out += cycle.tokens
            accepted.append(cycle.accepted)
        tokens.append(out[:positions])
    return np.array(tokens), np.array(accepted), trees


def test_tree_samples_follow_the_targets_distribution(model, draft):
    tokens, accepted, trees = sample(model, draft)
    assert (accepted >= 1).mean() > 0.3 and (accepted >= 2).mean() > 0.05, "the tree must be walked"
    # the Markov head shapes the trees: the best child (the first placed) of two nodes at depth 1
    # differs, which per-depth logits alone could not give
    assert any(len({t.tokens[min(kids.values())] for n, kids in enumerate(t.children())
                    if t.depths[n] == 1 and kids}) > 1 for t in trees)
    for position, p in pvalues(tokens, exact_joint(model, PARAMS, depth=POSITIONS)).items():
        assert p > ALPHA, f"{position} deviates from the target (p = {p:.2e})"


def test_the_draft_q_rule_on_the_markov_tree_is_caught(model, draft):
    """The x3 test, with as many runs as the test above, rejects it at p < 1e-6
    (runs are seeded, so the outcome is fixed: p is about 1e-8)."""
    tokens, _, _ = sample(model, draft, DraftQTreeDecoder)
    p = pvalues(tokens, exact_joint(model, PARAMS, depth=POSITIONS))["x3"]
    assert p < 1e-6, f"the draft-q rule not caught (p = {p:.2e})"
