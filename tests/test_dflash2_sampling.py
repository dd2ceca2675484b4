"""Lossless sampling with a DFlash2 draft: its drafts come from the selector's
walk, and rejection sampling is given the walk's sparse q (q = 0 outside each
row's k candidates). The generated tokens follow the target's own
distribution (test_sampling.py's enumeration and chi-square test), and the
same test rejects the two plausible wrong q's: the full-vocabulary softmax of
the logits, and q rows scored along the per-row argmax walk instead of the
sampled path."""

import json

import mlx.core as mx
import pytest

from checkpoints import write_dflash2_draft
from dflash_mlx import Target, load_draft
from dflash_mlx.loop.decoder import DFlash2Proposer
from dflash_mlx.draft.selector import scatter
from dflash_mlx.loop.sampling import SamplingParams
from test_sampling import BLOCK, V, build_target, exact_joint, model, pvalues, sample  # noqa: F401 (model: the fixture)

pytestmark = pytest.mark.statistical

# the target's p warped by top-k too (q never is): drafts outside p's support are always rejected
PARAMS = SamplingParams(temperature=1.0, top_k=4)
ALPHA = 1e-3 / 4  # Bonferroni over the four chi-square tests
RUNS = 400
STEER = 2.0  # weight of the target logits added to the draft's


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A DFlash2 draft for it: k = 4 of 16 candidates, a transition strong
    enough that the walk's path changes the q rows."""
    _, config = build_target("qwen3_5", vocab_size=V, seed=3, num_hidden_layers=2)
    path = tmp_path_factory.mktemp("dflash2-sampling")
    write_dflash2_draft(path, config, block_size=BLOCK, target_layer_ids=[0], top_k=4, codebook_std=1.5,
                        layer_types=["sliding_attention"] * 2, sliding_window=8, seed=5)
    return load_draft(str(path))


def selector_proposer(draft, wrong=None):
    """A factory for test_sampling.sample: the real DFlash2 proposer, or one
    that draws the same drafts but hands verification a wrong q. The draft's
    logits are steered towards the target (its logits along its greedy path
    from y are added), so that blocks are often accepted deep. These rows
    (deterministic given the context) are shared across runs through
    ``memo``, computed on a miss from a fresh context cache injected with
    every committed position; the walk runs every time."""

    class Proposer(DFlash2Proposer):
        def __init__(self, draft, target, memo):
            super().__init__(draft, target)
            self.memo, self.history, self.features = memo, [], []

        def observe(self, features, tokens):
            self.history += tokens.tolist()
            self.features.append(features)

        def visible_rows(self):
            return None  # every position, re-injected from the start below

        def _rows(self, y, block_size):
            context = (tuple(self.history + y.tolist()), block_size)
            if context not in self.memo:
                self.cache = self.draft.make_cache()
                super().observe(mx.concatenate(self.features, axis=1), None)
                hidden, logits = super()._rows(y, block_size)
                seq, steer = list(context[0]), []
                for _ in range(block_size - 1):
                    row = self.target.model(mx.array(seq)[None])[0, -1]
                    steer.append(row)
                    seq.append(mx.argmax(row).item())
                self.memo[context] = hidden, logits + STEER * mx.stack(steer)
            return self.memo[context]

        def draft_block(self, y, block_size, sampler):
            drafted, q = super().draft_block(y, block_size, sampler)
            if wrong is None:
                return drafted, q
            hidden, logits = self._rows(y, block_size)
            T = sampler.params.temperature
            if wrong == "full softmax":
                return drafted, logits / T - mx.logsumexp(logits / T, axis=-1, keepdims=True)
            selector = self.draft.candidate_selector  # "argmax walk": rows scored after each row's argmax
            candidates, scores = selector.scores(hidden, logits, y)
            slot, rows = 0, []
            for j in range(block_size - 1):
                s = scores[j, slot] / T
                rows.append(s - mx.logsumexp(s))
                slot = mx.argmax(s).item()
            return drafted, scatter(candidates, mx.stack(rows), logits.shape[-1])

    targets = {}  # one Target per model, shared by the runs
    return lambda model, params, memo: Proposer(draft, targets.setdefault(id(model), Target(model)), memo)


def test_samples_follow_the_targets_distribution(model, draft):
    tokens, accepted = sample(model, PARAMS, proposer=selector_proposer(draft), runs=RUNS)
    for position, p in pvalues(tokens, exact_joint(model, PARAMS)).items():
        assert p > ALPHA, f"{position} deviates from the target (p = {p:.2e})"
    assert (accepted >= 1).mean() > 0.4, "drafts must often be accepted for this to bite"


@pytest.mark.parametrize("wrong", ["full softmax", "argmax walk"])
def test_wrong_q_is_caught(model, draft, wrong):
    """The (x2, x3) test, with as many runs as the test above, rejects each
    wrong q at p < 1e-6 on this fixture (runs are seeded, so the outcome is
    fixed: p is about 1e-60 for the softmax and 1e-26 for the argmax walk;
    with half the runs the walk's was only 4e-5). x3 is needed: the argmax walk's
    first row is the true one (both follow the anchor); its second is not."""
    tokens, _ = sample(model, PARAMS, proposer=selector_proposer(draft, wrong), runs=RUNS, positions=3)
    p = pvalues(tokens, exact_joint(model, PARAMS, depth=3))["x2,x3"]
    assert p < 1e-6, f"{wrong} not caught (p = {p:.2e})"
