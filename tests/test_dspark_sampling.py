"""Lossless sampling with a DSpark draft: its drafts come from the Markov walk,
each x_k drawn from q_k, the sampler's warp (temperature and top-k) of
z_k = U_k + W2 W1[x_{k-1}] over the full vocabulary, and that same q_k is what
rejection sampling is given. The generated tokens follow the target's own
distribution (test_sampling.py's enumeration and chi-square test), and the same
test rejects the plausible wrong q: the warp of the base logits U_k without the
Markov term. A speculators-format draft over a reduced vocabulary (q zero
outside its ids) is lossless too. (A q left untruncated is not a control here: the steered z_k
holds so little mass outside its top k that 200 runs cannot tell, p = 0.37.)"""

import json

import mlx.core as mx
import pytest

from dflash_mlx import Target, load_draft
from dflash_mlx.loop.decoder import DSparkProposer
from dflash_mlx.loop.sampling import SamplingParams, warp
from test_dspark import write_dspark_draft
from test_dspark_packaging import write_speculators
from test_sampling import BLOCK, V, build_target, exact_joint, model, pvalues, sample  # noqa: F401 (model: the fixture)

pytestmark = pytest.mark.statistical

PARAMS = SamplingParams(temperature=1.0, top_k=3)  # q is truncated like p
ALPHA = 1e-3 / 3  # Bonferroni over the three chi-square tests
RUNS = 200
POSITIONS = 3  # x1 from the prefill, x2 and x3 from the walk's first two rows
STEER = 2.0  # weight of the target logits added to the draft's base logits


KEPT = [i for i in range(V) if i % 5]  # the reduced vocabulary: 12 of the 16 ids


@pytest.fixture(scope="module")
def source(tmp_path_factory, model):
    """A DSpark draft for the test_sampling target (gamma = BLOCK - 1), its
    Markov term about as large as the logits, so that the walk's path moves q."""
    _, config = build_target("qwen3_5", vocab_size=V, seed=3, num_hidden_layers=2)
    path = tmp_path_factory.mktemp("dspark-sampling") / "draft"
    write_dspark_draft(path, model, config, gamma=BLOCK - 1, rank=4, markov_std=1.5, target_layer_ids=[0], seed=5)
    assert json.loads((path / "config.json").read_text())["block_size"] == BLOCK - 1
    return path


@pytest.fixture(scope="module")
def draft(source):
    return load_draft(str(source))


@pytest.fixture(scope="module")
def reduced(source):
    """The same draft in the speculators format, drafting over ``KEPT`` only."""
    write_speculators(source, source.parent / "speculators", KEPT)
    return load_draft(str(source.parent / "speculators"))


def walk_proposer(draft, wrong=None):
    """A factory for test_sampling.sample: the real DSpark proposer and walk
    (``draft_block``), or one that draws the same drafts but hands verification
    a wrong q. Each block's hidden states and base logits (deterministic given
    the context) are shared across runs through ``memo``, computed on a miss
    from a fresh context cache injected with every committed position, and
    steered towards the target (its logits along its greedy path from y
    added) so that blocks are often accepted deep; the walk runs every time."""

    class Proposer(DSparkProposer):
        def __init__(self, draft, target, memo):
            super().__init__(draft, target)
            self.memo, self.history, self.features, self.base = memo, [], [], self.head
            self.head = lambda hidden: self.rows[1]  # the memoized, steered base logits

        def observe(self, features, tokens):
            self.history += tokens.tolist()
            self.features.append(features)

        def visible_rows(self):
            return None  # every position, re-injected from the start below

        def block_hidden(self, y, block_size):
            context = (tuple(self.history + y.tolist()), block_size)
            if context not in self.memo:
                self.cache = self.draft.make_cache()
                super().observe(mx.concatenate(self.features, axis=1), None)
                hidden = super().block_hidden(y, block_size)
                seq, steer = list(context[0]), []
                for _ in range(block_size - 1):
                    row = self.target.model(mx.array(seq)[None])[0, -1]
                    steer.append(row)
                    seq.append(mx.argmax(row).item())
                self.memo[context] = hidden, self.base(hidden) + STEER * mx.stack(steer)
            self.rows = self.memo[context]
            return self.rows[0]

        def draft_block(self, y, block_size, sampler):
            drafted, q = super().draft_block(y, block_size, sampler)
            return (drafted, q) if wrong is None else (drafted, warp(self.rows[1], sampler.params))

    targets = {}  # one Target per model, shared by the runs
    return lambda model, params, memo: Proposer(draft, targets.setdefault(id(model), Target(model)), memo)


@pytest.mark.parametrize("vocabulary", ["full", "reduced"])
def test_samples_follow_the_targets_distribution(model, draft, reduced, vocabulary):
    chosen = draft if vocabulary == "full" else reduced
    tokens, accepted = sample(model, PARAMS, proposer=walk_proposer(chosen), runs=RUNS, positions=POSITIONS)
    for position, p in pvalues(tokens, exact_joint(model, PARAMS, depth=POSITIONS)).items():
        assert p > ALPHA, f"{position} deviates from the target (p = {p:.2e})"
    assert (accepted >= 1).mean() > 0.4, "drafts must often be accepted for this to bite"


def test_a_q_without_the_markov_term_is_caught(model, draft):
    """The x3 test, with as many runs as the test above, rejects the warp of U_k
    alone at p < 1e-6 on this fixture (runs are seeded, so the outcome is
    fixed: p is about 3e-10)."""
    tokens, _ = sample(model, PARAMS, proposer=walk_proposer(draft, "no Markov term"), runs=RUNS, positions=POSITIONS)
    p = pvalues(tokens, exact_joint(model, PARAMS, depth=POSITIONS))["x3"]
    assert p < 1e-6, f"a q without the Markov term is not caught (p = {p:.2e})"
