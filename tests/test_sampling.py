"""Lossless sampling: the generated tokens are distributed exactly as the
target's own sampling, checked against the distribution enumerated from the
target's forward passes; the two plausible wrong acceptance rules are caught
with overwhelming power; rejection sampling accepts more than sample-and-match;
seeds reproduce."""

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
from dflash_mlx.loop.decoder import SpeculativeDecoder
from dflash_mlx.loop.sampling import BlockSampler, SamplingParams, warp
from dflash_mlx.loop.verify import sampled_verify

V = 16
PROMPT = [3, 7, 1, 9, 4, 12]
BLOCK = 4
POSITIONS = 4  # x1 comes from prefill; x2..x4 from verified blocks
RUNS = 800
CONFIGS = {
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7-topk4": SamplingParams(temperature=0.7, top_k=4),
    "topp0.9": SamplingParams(temperature=1.0, top_p=0.9),
}
# 4 chi-square tests per config; Bonferroni keeps the suite's false-failure rate <= 1e-3
ALPHA = 1e-3 / (4 * len(CONFIGS))


@pytest.fixture(scope="module")
def model():
    """A tiny hybrid target (a GatedDeltaNet layer, then an attention layer)
    with a 16-token vocabulary and spread next-token distributions (at t1.0
    about 2.2 nats, the top token 40% on average), for a wrong rule to show."""
    model, _ = build_target("qwen3_5", vocab_size=V, seed=3, num_hidden_layers=2)
    inner = model.language_model.model
    inner.norm.weight = inner.norm.weight * 0.15
    return model


class NoisyTargetProposer:
    """q_i: the target's own logits along its greedy path from y, flattened by
    0.8. Close to p but never equal, so blocks are often accepted deep."""

    def __init__(self, model, params, memo):
        self.model = model
        self.memo = memo  # context -> proposal, shared across runs (it is deterministic)
        self.history = []

    def observe(self, features, tokens):
        self.history += tokens.tolist()

    def propose(self, y, block_size):
        context = tuple(self.history + y.tolist())
        if (context, block_size) not in self.memo:
            seq, rows = list(context), []
            for _ in range(block_size - 1):
                row, token = self.row(seq)
                rows.append(row)
                seq.append(token)
            self.memo[context, block_size] = mx.stack(rows)
        return self.memo[context, block_size]

    def row(self, seq):
        """(proposal logits after ``seq``, the token the next row follows)."""
        logits = self.model(mx.array(seq)[None])[0, -1]
        return 0.8 * logits, mx.argmax(logits).item()


class HalfMassProposer(NoisyTargetProposer):
    """q_i: the target's own logits, kept only on its 2nd, 3rd, ... most likely
    tokens (after warping) until those hold half its mass: after the sampler's
    warping, q_i is p_i restricted to that set S_i and renormalized. Row i+1
    follows the most likely token of S_i. (Far from p on purpose: see
    ``test_wrong_acceptance_rules_are_caught``.)"""

    def __init__(self, model, params, memo):
        super().__init__(model, params, memo)
        self.params = params

    def row(self, seq):
        logits = self.model(mx.array(seq)[None])[0, -1]
        p = np.exp(np.array(warp(logits, self.params), dtype=np.float64))
        order = [v for v in np.argsort(-p, kind="stable") if p[v] > 0]
        kept = order[1:2]
        for v in order[2:]:
            if p[kept].sum() >= 0.5:
                break
            kept.append(v)
        kept = kept or order[:1]  # p is one token: propose it
        outside = np.full(V, -np.inf, dtype=np.float32)
        outside[kept] = 0.0
        return logits + mx.array(outside), int(kept[0])


def block_rule(accept, residual):
    """A verification rule from its two choices, in NumPy, for the wrong rules
    below: d_i is accepted while u_i < accept(p_i(d_i), q_i(d_i)); after a
    rejection the next token is drawn from residual(p_a, q_a) (from p_a when
    that has no mass), after a fully accepted block from p_b."""

    def verify(p, q, drafted, u):
        a = 0
        while a < drafted.size and u[a] < accept(p[a, drafted[a]], q[a, drafted[a]]):
            a += 1
        w = residual(p[a], q[a]) if a < drafted.size else p[a]
        w = w if w.sum() > 0 else p[a]
        return a, min(int(np.searchsorted(np.cumsum(w / w.sum()), u[-1], side="right")), V - 1)

    return verify


WRONG_RULES = {
    "residual p, not max(p - q, 0)": block_rule(lambda p, q: p / q, lambda p, q: p),
    "accept if u < p, not u q < p": block_rule(lambda p, q: p, lambda p, q: np.maximum(p - q, 0)),
}


class RuleSampler(BlockSampler):
    """The library's sampler with its verification replaced by ``rule``."""

    def __init__(self, params, rule):
        super().__init__(params)
        self.rule = rule

    def verify(self, logits, drafted, q):
        p = np.exp(np.array(warp(logits, self.params), dtype=np.float64))
        u = np.array(mx.random.uniform(shape=(drafted.size + 1,), key=self._next_key()))
        accepted, token = self.rule(p, np.exp(np.array(q, dtype=np.float64)), np.array(drafted), u)
        return mx.array([accepted]), mx.array([token], dtype=mx.int32)


class SampleMatchSampler(BlockSampler):
    """The lossless 'sample both and compare' rule (acceptance sum p*q)."""

    def verify(self, logits, drafted, q):
        choices = mx.random.categorical(warp(logits, self.params), key=self._next_key())
        accepted = mx.cumprod(drafted == choices[:-1]).sum()
        return accepted[None], choices[accepted][None]


def sample(model, params, make_sampler=BlockSampler, proposer=HalfMassProposer, runs=RUNS,
           positions=POSITIONS, make_target=Target, block=lambda: BLOCK):
    """(tokens [runs, positions], accepted per cycle) from the real loop, each
    run's block (or policy) made by ``block()``."""
    target, memo = make_target(model), {}
    tokens, accepted = [], []
    for seed in range(runs):
        sampler = make_sampler(replace(params, seed=seed))
        decoder = SpeculativeDecoder(target, proposer(model, params, memo), [0], block(), sampler=sampler)
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
    marginal = lambda *keep: joint.sum(axis=tuple(j for j in range(joint.ndim) if j not in keep))
    tests = {"x1,x2": [0, 1], "x2,x3": [1, 2], "x3": [2], "x4": [3]}
    return {name: chi2_pvalue(tokens[:, cols], marginal(*cols))
            for name, cols in tests.items() if max(cols) < tokens.shape[1]}


@pytest.mark.statistical
@pytest.mark.parametrize("name", list(CONFIGS))
def test_samples_follow_the_targets_distribution(model, name):
    params = CONFIGS[name]
    tokens, accepted = sample(model, params)
    for position, p in pvalues(tokens, exact_joint(model, params)).items():
        assert p > ALPHA, f"{name}: {position} deviates from the target (p = {p:.2e})"
    assert (accepted >= 1).mean() > 0.2, "drafts must often be accepted for this to bite"


class PlainThenBlock:
    """Two plain target steps (x2, x3), then blocks of ``BLOCK`` (x4 on)."""

    def __init__(self):
        self.blocks = [1, 1]  # the first is asked for after the prefill

    def choose(self, context=0, left=None):
        return self.blocks.pop(0) if self.blocks else BLOCK

    def update(self, block_size, accepted):
        pass


@pytest.mark.statistical
@pytest.mark.parametrize("name", list(CONFIGS))
def test_plain_steps_follow_the_targets_distribution(model, name):
    """A plain step (b = 1, the adaptive block's fallback) draws the target's
    own token from its warped distribution, and blocks after plain steps stay lossless."""
    params = CONFIGS[name]
    tokens, _ = sample(model, params, block=PlainThenBlock)
    for position, p in pvalues(tokens, exact_joint(model, params)).items():
        assert p > ALPHA, f"{name}: {position} deviates from the target (p = {p:.2e})"


@pytest.mark.statistical
@pytest.mark.parametrize("rule", list(WRONG_RULES))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_wrong_acceptance_rules_are_caught(model, name, rule):
    """The (x1, x2) test above, run on a wrong rule, rejects it with p < 1e-6.

    Power: a wrong rule moves the (x1, x2) cell probabilities from P to P',
    and Pearson's statistic over N samples is then about noncentral
    chi-square with df = cells - 1 and noncentrality N * sum (P' - P)^2 / P.
    With q = p restricted to a set S of mass s (the proposer), per context x1:
    - residual p instead of max(p - q, 0) gives P'(v) = p(v) (1 + [v in S] - s),
      a chi-square divergence of s (1 - s): 1/4 at s = 1/2, the most any q can
      give this bug (it is m^2/p summed minus beta^2 <= beta - beta^2, m = min(p, q));
      S skips the top token so that s stays near 1/2 when that one holds half;
    - accepting with u < p accepts an S token with probability p(v) instead of
      min(1, p/q) = s, so S tokens come out p(v)^2 / s instead of p(v), the
      rest (from the residual) scaled up to compensate: far off when S holds
      several tokens (one token of mass s is accepted with s either way),
      which is why S does not stop at the 2nd token.
    Enumerated on this fixture (pooling cells as chi2_pvalue does), N = 800
    gives noncentralities of at least 162 (df 19) for the first bug and 249
    (df 7) for the second in every config: each is missed at p < 1e-6 with
    probability below 1e-8. The wrong runs stop after x2 (the statistic needs
    nothing more).
    """
    params = CONFIGS[name]
    tokens, _ = sample(model, params, lambda p: RuleSampler(p, WRONG_RULES[rule]), positions=2)
    p = pvalues(tokens, exact_joint(model, params, depth=2))["x1,x2"]
    assert p < 1e-6, f"{name}: {rule} not caught (p = {p:.2e})"


@pytest.mark.statistical
def test_rejection_sampling_accepts_more_than_sample_and_match(model):
    params = CONFIGS["t1.0"]
    _, rejection = sample(model, params, proposer=NoisyTargetProposer, runs=150, positions=8)
    _, matching = sample(model, params, SampleMatchSampler, NoisyTargetProposer, runs=150, positions=8)
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
