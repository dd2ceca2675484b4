"""Lossless sampling on the newer target families (docs/targets.md): a tiny
Gemma 4 target with per-layer inputs, KV-shared layers and soft-capped logits,
and a tiny Qwen3-Next target. The generated tokens follow the target's own
distribution (test_sampling.py's enumeration from mlx-lm's forward and its
chi-square tests, with its far-from-p proposer so that rejections, residual
draws and every rollback length occur), on the chain and, for Gemma 4, the
DDTree; on Gemma 4 the same test rejects verification that applies the cap
twice or not at all."""

import mlx.core as mx
import pytest
import test_sampling as chain
import test_tree_sampling as tree
from checkpoints import build_target

from dflash_mlx import Target
from dflash_mlx.loop.sampling import SamplingParams

pytestmark = pytest.mark.statistical

RUNS = 300
PARAMS = {"gemma4": SamplingParams(temperature=1.0), "qwen3_next": SamplingParams(temperature=0.7, top_k=4)}
ALPHA = 1e-3 / (4 * (len(PARAMS) + 1))  # Bonferroni over this file's chi-square tests
CAP = 6.0


def spread_gemma4():
    """Gemma 4 with a 16-token vocabulary (layers 4 and 5 read layers 2 and 3's
    K/V; per-layer inputs on), its final norm scaled so the raw logits have std
    about 5 (up to 20) and a cap of 6: the cap shapes every distribution (the
    published 30, scaled down with the logits)."""
    model, _ = build_target("gemma4", vocab_size=chain.V, seed=3, final_logit_softcapping=CAP)
    inner = model.language_model.model
    assert inner.hidden_size_per_layer_input > 0 and inner.previous_kvs == [0, 1, 2, 3, 2, 3]
    inner.norm.weight = inner.norm.weight * 0.5
    return model


def spread_qwen3_next():
    """Qwen3-Next (GatedDeltaNet, attention, GatedDeltaNet, attention; MoE) with
    a 16-token vocabulary, about 2.2 nats, the top token 33% on average."""
    model, _ = build_target("qwen3_next", vocab_size=chain.V, seed=3)
    model.model.norm.weight = model.model.norm.weight * 0.1
    return model


@pytest.fixture(scope="module")
def models():
    return {"gemma4": spread_gemma4(), "qwen3_next": spread_qwen3_next()}


@pytest.mark.parametrize("family", list(PARAMS))
def test_samples_follow_the_targets_distribution(models, family):
    model, params = models[family], PARAMS[family]
    tokens, accepted = chain.sample(model, params, runs=RUNS)
    for position, p in chain.pvalues(tokens, chain.exact_joint(model, params)).items():
        assert p > ALPHA, f"{family}: {position} deviates from the target (p = {p:.2e})"
    assert (accepted >= 1).mean() > 0.2, "drafts must often be accepted for this to bite"
    assert set(accepted) >= set(range(chain.BLOCK)), "every rollback length must occur"


def test_tree_samples_follow_the_targets_distribution_on_gemma4(models):
    """DDTree at T > 0 (test_tree_sampling's loop and proposer): every node's
    draw comes from capped logits of a tree pass in which the sharing layers
    attend over their owners' K/V of the same pass."""
    model, params = models["gemma4"], PARAMS["gemma4"]
    tokens, accepted = tree.sample(model, params, runs=RUNS * 2 // 3)
    assert (accepted >= 2).mean() > 0.2, "the tree must be walked"
    for position, p in chain.pvalues(tokens, chain.exact_joint(model, params)).items():
        assert p > ALPHA, f"{position} deviates from the target (p = {p:.2e})"


class CapTwice(Target):
    def logits(self, hidden: mx.array) -> mx.array:
        return self.stack.finish_logits(super().logits(hidden))


class NoCap(Target):
    def logits(self, hidden: mx.array) -> mx.array:
        return self.head_logits(hidden)


@pytest.mark.parametrize("wrong", [CapTwice, NoCap], ids=["cap twice", "no cap"])
def test_a_wrong_cap_is_caught(models, wrong):
    """Verification (and the prefill's first token) on wrongly capped logits:
    the (x1, x2) test, on a third of the runs of the test above, rejects it at
    p < 1e-6. Runs are seeded, so the outcome is fixed: p is about 3e-11 with
    the cap applied twice and 4e-16 without it (2e-16 and 6e-23 at 150 runs).
    Applying it twice is the subtle one: c tanh(tanh(z/c)) moves a saturated
    logit by at most 0.24 c, so it shows only where the cap saturates."""
    model, params = models["gemma4"], PARAMS["gemma4"]
    tokens, _ = chain.sample(model, params, runs=RUNS // 3, positions=2, make_target=wrong)
    p = chain.pvalues(tokens, chain.exact_joint(model, params, depth=2))["x1,x2"]
    assert p < 1e-6, f"{wrong.__name__} not caught (p = {p:.2e})"
