"""Lossless sampling: the generated tokens are distributed exactly as the
target's own sampling, checked against the distribution enumerated from the
target's forward passes; a wrong acceptance rule is caught; rejection sampling
accepts more than sample-and-match; seeds reproduce."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from scipy.stats import chisquare, ttest_ind

from checkpoints import build_target
from dflash_mlx import Target, generate, load_draft
from dflash_mlx.decoder import SpeculativeDecoder
from dflash_mlx.sampling import BlockSampler, SamplingParams, warp
from dflash_mlx.verify import sampled_verify

V = 16
PROMPT = [3, 7, 1, 9, 4, 12]
BLOCK = 4
POSITIONS = 4  # x1 comes from prefill; x2..x4 lie inside the first verified block
RUNS = 1200
CONFIGS = {
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7-topk4": SamplingParams(temperature=0.7, top_k=4),
    "topp0.9": SamplingParams(temperature=1.0, top_p=0.9),
}
# 4 chi-square tests per config; Bonferroni keeps the suite's false-failure rate <= 1e-3
ALPHA = 1e-3 / (4 * len(CONFIGS))


@pytest.fixture(scope="module")
def model():
    """A tiny hybrid (GatedDeltaNet) target with a 16-token vocabulary and
    next-token entropies around 1-1.6 nats."""
    model, _ = build_target("qwen3_5", vocab_size=V, seed=3)
    inner = model.language_model.model
    inner.norm.weight = inner.norm.weight * 0.25
    return model


class NoisyTargetProposer:
    """q_i: the target's own logits along its greedy path from y, flattened by
    0.8. Close to p but never equal, so blocks are often accepted deep."""

    def __init__(self, model, memo):
        self.model = model
        self.memo = memo  # context -> proposal, shared across runs (it is deterministic)
        self.history = []

    def observe(self, features, tokens):
        self.history += tokens.tolist()

    def propose(self, y, block_size):
        context = tuple(self.history + y.tolist())
        if context not in self.memo:
            seq, rows = list(context), []
            for _ in range(block_size - 1):
                logits = self.model(mx.array(seq)[None])[0, -1]
                rows.append(0.8 * logits)
                seq.append(mx.argmax(logits).item())
            self.memo[context] = mx.stack(rows)
        return self.memo[context]


class ArgmaxMatchSampler(BlockSampler):
    """WRONG on purpose: accepts a draft iff it is the target's argmax."""

    def verify(self, logits, drafted, q):
        p = warp(logits, self.params)
        accepted = mx.cumprod(drafted == mx.argmax(p[:-1], axis=-1)).sum()
        row = p[accepted]
        return accepted[None], mx.random.categorical(row, key=self._next_key())[None]


class SampleMatchSampler(BlockSampler):
    """The lossless 'sample both and compare' rule (acceptance sum p*q)."""

    def verify(self, logits, drafted, q):
        choices = mx.random.categorical(warp(logits, self.params), key=self._next_key())
        accepted = mx.cumprod(drafted == choices[:-1]).sum()
        return accepted[None], choices[accepted][None]


def sample(model, params, sampler_class=BlockSampler, runs=RUNS, positions=POSITIONS):
    """(tokens [runs, positions], accepted per cycle) from the real loop."""
    target, memo = Target(model), {}
    tokens, accepted = [], []
    for seed in range(runs):
        sampler = sampler_class(replace(params, seed=seed))
        decoder = SpeculativeDecoder(target, NoisyTargetProposer(model, memo), [0], BLOCK, sampler=sampler)
        out = [decoder.prefill(mx.array(PROMPT))]
        while len(out) < positions:
            cycle = decoder.cycle()
            out += cycle.tokens
            accepted.append(cycle.accepted)
        tokens.append(out[:positions])
    return np.array(tokens), np.array(accepted)


def exact_joint(model, params, depth=POSITIONS):
    """P(x1..x_depth) [V]*depth, enumerated from the target's forward passes."""
    prefixes, probs = [[]], np.ones(1)
    for _ in range(depth):
        logits = model(mx.array([PROMPT + p for p in prefixes]))[:, -1]
        cond = np.exp(np.array(warp(logits, params), dtype=np.float64))
        probs = (probs[:, None] * cond).reshape(-1)
        prefixes = [p + [v] for p in prefixes for v in range(V)]
    return probs.reshape([V] * depth)


def chi2_pvalue(observed_tokens, probs):
    """Goodness of fit of samples (rows of category indices) to ``probs``."""
    flat = np.ravel_multi_index(observed_tokens.T, probs.shape)
    counts = np.bincount(flat, minlength=probs.size).astype(float)
    probs = probs.reshape(-1) / probs.sum()
    assert counts[probs == 0].sum() == 0, "sampled a token outside the target's support"
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return chisquare(obs[keep], exp[keep]).pvalue


def pvalues(tokens, joint):
    marginal = lambda i: joint.sum(axis=tuple(j for j in range(joint.ndim) if j != i))
    return {
        "x2": chi2_pvalue(tokens[:, [1]], marginal(1)),
        "x3": chi2_pvalue(tokens[:, [2]], marginal(2)),
        "x4": chi2_pvalue(tokens[:, [3]], marginal(3)),
        "x2,x3": chi2_pvalue(tokens[:, [1, 2]], joint.sum(axis=(0, 3))),
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_samples_follow_the_targets_distribution(model, name):
    params = CONFIGS[name]
    tokens, accepted = sample(model, params)
    assert (accepted >= 2).mean() > 0.2, "blocks must often be accepted deep for this to bite"
    for position, p in pvalues(tokens, exact_joint(model, params)).items():
        assert p > ALPHA, f"{name}: {position} deviates from the target (p = {p:.2e})"


def test_a_wrong_acceptance_rule_is_caught(model):
    params = CONFIGS["t1.0"]
    tokens, _ = sample(model, params, ArgmaxMatchSampler, runs=600)
    assert min(pvalues(tokens, exact_joint(model, params)).values()) < ALPHA


def test_rejection_sampling_accepts_more_than_sample_and_match(model):
    params = CONFIGS["t1.0"]
    _, rejection = sample(model, params, runs=150, positions=8)
    _, matching = sample(model, params, SampleMatchSampler, runs=150, positions=8)
    print(f"mean accepted per cycle: rejection {rejection.mean():.3f}, sample-and-match {matching.mean():.3f}")
    assert rejection.mean() > matching.mean()
    assert ttest_ind(rejection, matching, alternative="greater").pvalue < 1e-6


def test_sampled_verify_edge_cases():
    V3 = mx.log(mx.array([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]]))
    drafted = mx.array([[2, 0]])
    for seed in range(20):  # p(d_1) = 0: always rejected, residual excludes nothing else
        a, nxt = sampled_verify(V3, mx.log(mx.array([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])), drafted, mx.random.key(seed))
        assert a.item() == 0 and nxt.item() in (0, 1)
    for seed in range(20):  # p == q: always accepted, bonus from the last row
        a, nxt = sampled_verify(V3, V3[:, :2], mx.array([[1, 2]]), mx.random.key(seed))
        assert a.item() == 2


def test_seed_reproduces_and_different_seeds_differ(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    draft = load_draft(str(draft_dir("qwen3", block_size=4)))
    run = lambda seed: generate(model, draft, tokenizer, "hello", max_tokens=24, temperature=1.0, seed=seed).tokens
    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_repetition_penalty_matches_mlx_lm_greedy(target_dirs, draft_dir):
    """Each block position is penalized with the history plus the drafted tokens
    before it, exactly as one-token-at-a-time decoding does."""
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3_5"]))
    draft = load_draft(str(draft_dir("qwen3_5", block_size=8)))
    ids = tokenizer.encode("the quick brown fox")
    processors = make_logits_processors(repetition_penalty=1.5, repetition_context_size=8)
    want = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=48, logits_processors=processors)]
    got = generate(model, draft, tokenizer, ids, max_tokens=48, repetition_penalty=1.5,
                   repetition_context_size=8).tokens
    plain = generate(model, draft, tokenizer, ids, max_tokens=48).tokens
    assert got == want[: len(got)] and len(got) == 48
    assert got != plain  # the penalty changed the output, so the check bites
