"""DDTree at temperature > 0: the generated tokens are distributed exactly as
the target's own sampling (chi-square against the distribution enumerated
from the target's forward passes, as the chain's test does), and the
plausible wrong rule, SpecInfer's min(1, p/q) with the draft's q on the
tree's fixed top-k children, is caught."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import test_sampling as chain
from test_sampling import model  # noqa: F401 (the fixture: a tiny hybrid with 16 ids, spread distributions)

from dflash_mlx import Target
from dflash_mlx.loop.sampling import BlockSampler, SamplingParams, warp
from dflash_mlx.tree import TreeDecoder

BLOCK, BUDGET, RUNS = 4, 6, 800
CONFIGS = {
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7-topk4": SamplingParams(temperature=0.7, top_k=4),
}
ALPHA = 1e-3 / (4 * len(CONFIGS))  # Bonferroni over the suite's chi-square tests


class DraftQTreeDecoder(TreeDecoder):
    """The wrong rule: at each node, children in order, accept c with
    min(1, p_res(c) / q(c)) for the draft's q at that depth, on rejection
    p_res <- norm(max(p_res - q, 0)); the bonus from the final residual."""

    def _queue_draft(self):
        logits = self.proposer.propose(self.pending, self.block_size)
        self.q = np.exp(np.array(warp(logits, self.sampler.params), dtype=np.float64))
        super()._queue_draft()

    def _choose(self, logits, tree):
        p_all = np.exp(np.array(warp(logits, self.sampler.params), dtype=np.float64))
        u = np.array(mx.random.uniform(shape=(len(tree), self.budget + 1), key=self.sampler._next_key()))
        kids = tree.children()
        choices = []
        for node in range(len(tree)):
            p = p_all[node]
            children = sorted(kids[node].values())
            q = self.q[tree.depths[node]] if children else None
            choice = None
            for j, child in enumerate(children):
                c = tree.tokens[child]
                if u[node, j] < min(1.0, p[c] / q[c]):
                    choice = c
                    break
                residual = np.maximum(p - q, 0)
                p = residual / residual.sum() if residual.sum() > 0 else p
            if choice is None:
                choice = min(int(np.searchsorted(np.cumsum(p / p.sum()), u[node, -1], side="right")), chain.V - 1)
            choices.append(choice)
        return choices


def sample(model, params, decoder=TreeDecoder, runs=RUNS, positions=chain.POSITIONS):
    """(tokens [runs, positions], accepted per cycle) from the tree loop."""
    target, memo = Target(model), {}
    tokens, accepted = [], []
    for seed in range(runs):
        proposer = chain.NoisyTargetProposer(model, params, memo)
        d = decoder(target, proposer, [0], BLOCK, BUDGET, sampler=BlockSampler(replace(params, seed=seed)))
        out = [d.prefill(mx.array(chain.PROMPT))]
        while len(out) < positions:
            cycle = d.cycle()
            out += cycle.tokens
            accepted.append(cycle.accepted)
        tokens.append(out[:positions])
    return np.array(tokens), np.array(accepted)


@pytest.mark.statistical
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tree_samples_follow_the_targets_distribution(model, name):
    params = CONFIGS[name]
    tokens, accepted = sample(model, params)
    assert (accepted >= 1).mean() > 0.3 and (accepted >= 2).mean() > 0.05, "the tree must be walked"
    for position, p in chain.pvalues(tokens, chain.exact_joint(model, params)).items():
        assert p > ALPHA, f"{name}: {position} deviates from the target (p = {p:.2e})"


@pytest.mark.statistical
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_draft_q_rule_on_fixed_children_is_caught(model, name):
    params = CONFIGS[name]
    tokens, _ = sample(model, params, DraftQTreeDecoder, positions=2)
    p = chain.pvalues(tokens, chain.exact_joint(model, params, depth=2))["x1,x2"]
    assert p < 1e-6, f"{name}: the draft-q rule not caught (p = {p:.2e})"


def test_a_seed_reproduces_the_tree_samples(model):
    params = CONFIGS["t1.0"]
    first, _ = sample(model, params, runs=3)
    again, _ = sample(model, params, runs=3)
    assert np.array_equal(first, again)
    assert len({tuple(row) for row in first}) > 1  # different seeds, different samples
