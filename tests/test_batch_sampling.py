"""Sampling in a batch (``loop/batch.py``): each row's tokens follow its own
target distribution, under its own settings, with another row beside it
that samples under other settings; and a wrong acceptance rule in one row
is caught by the same test (the rows' draws do not hide one another)."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from test_sampling import (ALPHA, BLOCK, POSITIONS, PROMPT, WRONG_RULES, HalfMassProposer, RuleSampler,
                           build_target, exact_joint, pvalues)

from test_batch import StatelessDrafter

from dflash_mlx import Target
from dflash_mlx.loop import BatchDecoder, BlockSampler, SamplingParams

RUNS = 800
ROWS = {  # each row's settings; row "b" also gets the plain-step-then-block schedule through the batch's
    "a": SamplingParams(temperature=1.0),
    "b": SamplingParams(temperature=0.7, top_k=4),
}


@pytest.fixture(scope="module")
def model():
    """test_sampling's tiny hybrid target (16-token vocabulary, spread distributions)."""
    model, _ = build_target("qwen3_5", vocab_size=16, seed=3, num_hidden_layers=2)
    inner = model.language_model.model
    inner.norm.weight = inner.norm.weight * 0.15
    return model


class HalfMassRows(StatelessDrafter):
    """Each row's drafts from test_sampling's HalfMassProposer (far from p on
    purpose), drawn by the row's own sampler."""

    def __init__(self, model, memo):
        self.proposers = {tag: HalfMassProposer(model, params, memo.setdefault(tag, {})) for tag, params in ROWS.items()}

    def propose(self, ys, block_size, rows):
        drafts = []
        for row, y in zip(rows, ys.tolist()):
            proposer = self.proposers[row.tag]
            proposer.history = list(row.tokens)
            logits = proposer.propose(mx.array([y]), block_size)
            drafted, q = row.sampler.draft(logits)
            drafts.append((drafted, q, mx.array(True)))
        return drafts


class Schedule:
    """A plain batched step first, then blocks of ``BLOCK``."""

    def __init__(self):
        self.blocks = [1]

    def choose(self, rows):
        return self.blocks.pop(0) if self.blocks else BLOCK

    def update(self, rows, block_size, accepted):
        pass


def sample_rows(model, make_sampler=BlockSampler):
    """{tag: tokens [RUNS, POSITIONS]} and the accepted drafts per row-cycle,
    every run a batch of both rows (row "a" with ``make_sampler``)."""
    target, memo = Target(model), {}
    drafter = HalfMassRows(model, memo)
    tokens = {tag: [] for tag in ROWS}
    accepted = []
    for seed in range(RUNS):
        decoder = BatchDecoder(target, None, Schedule(), drafter=drafter)
        out = {}
        for tag, params in ROWS.items():
            sampler = (make_sampler if tag == "a" else BlockSampler)(replace(params, seed=2 * seed + (tag == "b")))
            row, first = decoder.add(mx.array(PROMPT), sampler, tag=tag)
            out[tag] = [first]
        while min(len(t) for t in out.values()) < POSITIONS:
            for cycle in decoder.cycle():
                out[cycle.row.tag] += cycle.tokens
                accepted.append(cycle.accepted)
        for tag in ROWS:
            tokens[tag].append(out[tag][:POSITIONS])
    return {tag: np.array(t) for tag, t in tokens.items()}, np.array(accepted)


@pytest.mark.statistical
def test_each_row_follows_its_own_targets_distribution(model):
    tokens, accepted = sample_rows(model)
    for tag, params in ROWS.items():
        for position, p in pvalues(tokens[tag], exact_joint(model, params)).items():
            assert p > ALPHA, f"row {tag}: {position} deviates from the target (p = {p:.2e})"
    assert (accepted >= 1).mean() > 0.2, "drafts must often be accepted for this to bite"


@pytest.mark.statistical
def test_a_wrong_rule_in_one_row_is_caught(model):
    """The negative control: row "a" verifies with a wrong rule; its (x1, x2)
    pair fails the same test, while row "b" beside it still passes."""
    rule = WRONG_RULES["residual p, not max(p - q, 0)"]
    tokens, _ = sample_rows(model, lambda params: RuleSampler(params, rule))
    wrong = pvalues(tokens["a"], exact_joint(model, ROWS["a"]))
    assert min(wrong.values()) < 1e-6
    right = pvalues(tokens["b"], exact_joint(model, ROWS["b"]))
    assert min(right.values()) > ALPHA
