"""Long contexts (issue 32): a plain step does the target work of mlx-lm's own
step and defers the draft's share to one batch; the prefill hands a sliding
draft only the rows its windows can still see; the adaptive policy prices the
context, and probes within their budget. Work is counted, never timed."""

import io
import math

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from dflash_mlx import Target, generate, load_draft
from dflash_mlx.loop.block_policy import (PROBE_BUDGET, PROBE_EVERY, PROBE_FIRST_BUDGET, PROBE_SHARE, PROBE_WARMUP,
                                          AdaptiveBlock, FixedBlock)
from dflash_mlx.loop.cost_curve import CostCurve
from dflash_mlx.loop.decoder import ContextCache, DraftProposer, SpeculativeDecoder, prefill_chunks, proposer_for
from test_loop import greedy_reference

PROMPT = [3, 17, 5, 9, 22, 41, 7, 13, 2, 30, 11, 8, 19, 27, 4, 16, 6, 25, 14, 33]


class CountedLayer:
    """A target layer that counts its calls and the rows each call feeds."""

    def __init__(self, layer, log):
        self.layer, self.log = layer, log

    def __getattr__(self, name):
        return getattr(self.__dict__["layer"], name)

    def __call__(self, h, *args, **kwargs):
        self.log.append(h.shape[1])
        return self.layer(h, *args, **kwargs)


def counted_model(path):
    """mlx-lm's model with every layer counted; returns (model, per-layer call logs)."""
    model, _ = mlx_lm_load(str(path))
    layers = model.language_model.model.layers if hasattr(model, "language_model") else model.model.layers
    logs = [[] for _ in layers]
    layers[:] = [CountedLayer(layer, log) for layer, log in zip(layers, logs)]
    return model, logs


class CountingProposer(DraftProposer):
    """The real draft proposer, counting the positions of each injection and the draft passes."""

    def __init__(self, draft, target):
        super().__init__(draft, target)
        self.injected, self.passes = [], 0

    def observe(self, features, tokens):
        self.injected.append(tokens.size)
        super().observe(features, tokens)

    def block_hidden(self, y, block_size):
        self.passes += 1
        return super().block_hidden(y, block_size)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_plain_step_runs_the_targets_layers_as_mlx_lms_step_does(target_dirs, draft_dir, family):
    """At b = 1 every layer runs once per token on that token alone, through the
    layer's own forward (a recording GatedDeltaNet pass would bypass it), as in
    mlx-lm's generate_step; the draft never runs, and the plain steps'
    positions reach its context cache in one batch when generation ends."""
    n = 12
    draft = load_draft(str(draft_dir(family, block_size=4)))
    theirs, their_logs = counted_model(target_dirs[family])
    want = [t for t, _ in generate_step(mx.array(PROMPT), theirs, max_tokens=n)]
    ours, our_logs = counted_model(target_dirs[family])
    target = Target(ours)
    proposer = CountingProposer(draft, target)
    decoder = SpeculativeDecoder(target, proposer, draft.config.target_layer_ids, FixedBlock(1))
    got = [decoder.prefill(mx.array(PROMPT))]
    prefill_calls = [len(log) - 1 for log in our_logs]  # the prefill queued the first step
    while len(got) < n:
        got += decoder.cycle().tokens
    decoder.close()
    assert got == want
    steps = [log[count:] for log, count in zip(our_logs, prefill_calls)]
    assert all(step == [1] * len(step) for step in steps)  # one token per call, every step
    assert all(len(step) == len(steps[0]) >= n - 1 for step in steps)  # every layer, every step
    their_steps = [log[1:] for log in their_logs]  # after mlx-lm's prompt pass
    assert all(t == [1] * len(t) for t in their_steps) and len(steps[0]) <= len(their_steps[0])
    assert proposer.passes == 0
    assert proposer.injected == [len(PROMPT) - 1, 1, len(steps[0])]  # the prompt, then one batch of the steps
    assert all(c.offset == len(PROMPT) + len(steps[0]) for c in proposer.cache)


def test_prefill_chunks_feed_the_last_token_alone_as_mlx_lm_does():
    assert prefill_chunks(0, 10, 4) == [(0, 4), (4, 8), (8, 9), (9, 10)]
    assert prefill_chunks(0, 9, 4) == [(0, 4), (4, 8), (8, 9)]
    assert prefill_chunks(3, 4, 4) == [(3, 4)]
    assert prefill_chunks(0, 1, 4) == [(0, 1)]


def test_the_prefill_feeds_each_layer_every_prompt_row_once_in_mlx_lms_chunks(target_dirs, draft_dir):
    step = 8
    draft = load_draft(str(draft_dir("qwen3_5", block_size=4)))
    theirs, their_logs = counted_model(target_dirs["qwen3_5"])
    next(generate_step(mx.array(PROMPT), theirs, max_tokens=1, prefill_step_size=step))
    ours, our_logs = counted_model(target_dirs["qwen3_5"])
    target = Target(ours)
    proposer = CountingProposer(draft, target)
    SpeculativeDecoder(target, proposer, draft.config.target_layer_ids, 4, prefill_step_size=step).prefill(
        mx.array(PROMPT))
    assert all(log == [8, 8, 3, 1] for log in our_logs)  # mlx-lm's chunks, the last token alone
    assert all(o == t[:4] for o, t in zip(our_logs, their_logs))
    assert proposer.passes == 1 and proposer.injected == [8, 8, 3, 1]  # the first block queued after the token


def evaluated(array) -> bool:
    """Whether MLX has computed ``array``: an evaluated array's graph is itself alone."""
    dot = io.StringIO()
    mx.export_to_dot(dot, array)
    return "->" not in dot.getvalue()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_the_prefill_never_runs_the_last_layer_on_a_chunk_before_the_last_token(target_dirs, draft_dir, family):
    """As mlx-lm's prefill evaluates only the caches, the layers past the last
    cached projection never run on the earlier chunks; only the last token's
    pass makes hidden states."""
    draft = load_draft(str(draft_dir(family, block_size=4)))
    model, _ = mlx_lm_load(str(target_dirs[family]))
    target = Target(model)
    assert max(draft.config.target_layer_ids) < target.num_layers - 1
    outputs = []
    last = target.layers[-1]
    target.layers = target.layers[:-1] + [lambda *args: outputs.append(last(*args)) or outputs[-1]]
    decoder = SpeculativeDecoder(target, proposer_for(draft, target), draft.config.target_layer_ids,
                                 FixedBlock(4), prefill_step_size=8)
    decoder.prefill(mx.array(PROMPT))
    assert [o.shape[1] for o in outputs] == [8, 8, 3, 1]
    assert [evaluated(o) for o in outputs] == [False, False, False, True]


def test_plain_steps_are_injected_in_one_batch_before_the_next_draft_pass(target_dirs, draft_dir):
    model, _ = mlx_lm_load(str(target_dirs["qwen3"]))
    target, draft = Target(model), load_draft(str(draft_dir("qwen3", block_size=4)))

    class Scripted:
        blocks = [1, 1, 1, 1, 4, 4]

        def choose(self, context=0, left=None):
            return self.blocks.pop(0)

        def update(self, block_size, accepted):
            pass

    proposer = CountingProposer(draft, target)
    decoder = SpeculativeDecoder(target, proposer, draft.config.target_layer_ids, Scripted())
    decoder.prefill(mx.array(PROMPT))
    for _ in range(4):
        decoder.cycle()
    assert proposer.injected == [len(PROMPT) - 1, 1, 4] and proposer.passes == 1  # batched right before the pass
    assert all(c.offset == len(PROMPT) + 4 for c in proposer.cache)


@pytest.mark.parametrize("kept", [False, True])
def test_the_last_plain_steps_reach_the_draft_only_where_a_caller_keeps_the_caches(target_dirs, draft_dir, kept):
    """Plain steps' positions wait for the draft's next pass; at the end of a
    generation they are injected only into a ``ContextCache`` the caller
    holds (its next prompt drafts from them), never into caches nobody keeps."""
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    target, draft = Target(model), load_draft(str(draft_dir("qwen3", block_size=4)))
    injected, inject = [], draft.inject
    draft.inject = lambda features, cache: (injected.append(features.shape[1]), inject(features, cache))[1]
    context = ContextCache(target.make_cache(), draft.make_cache()) if kept else None
    dear = CostCurve((1, 16), (1.0, 16.0), (0.0, 100.0))  # every cycle a plain step, and no probe in 6
    got = generate(target, draft, tokenizer, PROMPT, max_tokens=6, context=context, cost_curve=dear)
    assert got.tokens == greedy_reference(model, PROMPT, 6) and set(got.block_sizes) == {1}
    if kept:
        assert sum(injected) == len(context.tokens) > len(PROMPT)
        assert all(c.offset == len(context.tokens) for c in context.draft)
    else:
        assert injected == [len(PROMPT) - 1, 1]  # the prompt's chunk and its last token, nothing after


@pytest.mark.parametrize("step", [5, 64])
def test_prefill_hands_a_sliding_draft_only_the_rows_its_windows_see(target_dirs, draft_dir, step):
    window = 4  # a block query sees the last window - 1 = 3 context positions
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    draft = load_draft(str(draft_dir("qwen3", block_size=4, layer_types=["sliding_attention"] * 2,
                                     sliding_window=window)))
    target = Target(model)
    proposer = CountingProposer(draft, target)
    decoder = SpeculativeDecoder(target, proposer, draft.config.target_layer_ids, 4, prefill_step_size=step)
    decoder.prefill(mx.array(PROMPT))
    assert sum(proposer.injected) == window - 1
    assert all(c.offset == len(PROMPT) and c.start == len(PROMPT) - (window - 1) for c in proposer.cache)
    everything = proposer_for(draft, target)  # every prompt row injected
    out = target.forward(mx.array(PROMPT)[None], target.make_cache(), draft.config.target_layer_ids)
    everything.observe(out.features, mx.array(PROMPT))
    y = decoder.pending
    assert mx.allclose(proposer.propose(y, 4), everything.propose(y, 4), rtol=1e-5, atol=1e-5)
    got = generate(target, draft, tokenizer, PROMPT, block_size=4, max_tokens=16, prefill_step_size=step)
    assert got.tokens == greedy_reference(model, PROMPT, 16)


def test_a_full_attention_draft_gets_every_prompt_row(target_dirs, draft_dir):
    model, _ = mlx_lm_load(str(target_dirs["qwen3"]))
    draft = load_draft(str(draft_dir("qwen3", block_size=4, layer_types=["sliding_attention", "full_attention"],
                                     sliding_window=4)))
    target = Target(model)
    proposer = CountingProposer(draft, target)
    SpeculativeDecoder(target, proposer, draft.config.target_layer_ids, 4, prefill_step_size=6).prefill(
        mx.array(PROMPT))
    assert proposer.injected == [6, 6, 6, 1, 1]


# a verify pass costs 1 + b/10 plus 0.001 per context token; the draft pass
# 0.2 + b/50 plus 0.004 per context token (its full attention over the context)
CONTEXTUAL = CostCurve((1, 2, 16), (1.0, 1.1, 2.5), (0.0, 0.24, 0.52), 0,
                       (0.001, 0.001, 0.001), (0.0, 0.004, 0.004))


def test_the_curve_prices_the_context():
    assert CONTEXTUAL.target(2, 1000) == pytest.approx(2.1) and CONTEXTUAL.draft(2, 1000) == pytest.approx(4.24)
    assert CONTEXTUAL.cycle_seconds(1, 1000) == pytest.approx(2.0)  # no draft pass at b = 1
    assert CONTEXTUAL.target(4) == CONTEXTUAL.target(4, 0)  # no context: as measured


def test_the_policy_speculates_less_as_the_context_grows():
    short, long = AdaptiveBlock(CONTEXTUAL, 16, prior=0.85), AdaptiveBlock(CONTEXTUAL, 16, prior=0.85)
    assert short.choose(64) > 1
    assert long.choose(4096) == 1  # the draft's attention over the context outweighs its tokens
    for b in (1, 2, 8):  # rates at the rounded-down context
        assert long.cycle_seconds(b) == CONTEXTUAL.cycle_seconds(b, 4096)


def test_a_plain_step_is_priced_with_the_injection_of_its_position():
    """Every plain step's position reaches the draft when it next runs: with
    that counted, a block that barely loses to a bare target step wins."""
    bare = CostCurve((1, 2), (1.0, 1.9), (0.0, 0.1))  # b = 2 makes 1.75 tokens (the prior) in 2.0 s
    assert AdaptiveBlock(bare, 2).choose() == 1
    # a plain step at 1.9 s: b = 2 promises 66% more, past the prior's 50% margin
    assert AdaptiveBlock(CostCurve((1, 2), (1.0, 1.9), (0.0, 0.1), inject_s=0.9), 2).choose() == 2


def test_probes_cost_at_most_their_budget_of_the_plain_steps():
    """A probe costs its draft pass (nothing is verified): probes come no
    closer than ``PROBE_EVERY`` plain steps, and their draft passes take at
    most ``PROBE_BUDGET`` of the plain steps' time, beside the few that come
    sooner: those in the first ``PROBE_WARMUP`` tokens, and those while their
    spacing doubles up to the budget's (8, 16, 32, 64: 100 steps here)."""
    curve = CostCurve((1, 16), (1.0, 4.0), (0.0, 1.0))  # a draft pass costs about a third of a plain step
    policy = AdaptiveBlock(curve, 4)
    chosen, probes, spent = [], [], 0.0
    for i in range(2000):
        b = policy.choose(i)  # one token a plain step
        chosen.append(b)
        policy.update(b, 0)
        probe = policy.probe() if b == 1 else 0
        if probe:
            probes.append(i)
            spent += curve.draft(probe)
            policy.probed(probe, [0.0])
    assert len(probes) > 10 and min(j - i for i, j in zip(probes, probes[1:])) >= PROBE_EVERY
    backing_off = math.ceil(math.log2(curve.draft(4) / PROBE_BUDGET / PROBE_EVERY))  # probes before the budget's spacing
    backing_off += PROBE_WARMUP // PROBE_EVERY  # and those in the warm-up
    assert spent <= (PROBE_BUDGET * curve.cycle_seconds(1) * chosen.count(1) + backing_off * curve.draft(4)) * 1.05
    cheap = AdaptiveBlock(CostCurve((1, 2), (1.0, 1.6), (0.0, 0.005)), 2)  # a cheap draft: the floor applies
    assert cheap.probe_interval(2) == PROBE_EVERY


def test_a_probe_waits_while_too_few_tokens_are_left_to_repay_it():
    """A due probe is drafted only where at least its block plus
    ``PROBE_EVERY`` tokens are left to generate (or the caller set no limit)."""
    curve = CostCurve((1, 16), (1.0, 8.0), (0.0, 0.2))  # a cheap draft: its share of what is left is no bar
    policy = AdaptiveBlock(curve, 4)
    for _ in range(PROBE_EVERY - 1):
        assert policy.choose(0, left=1000) == 1 and policy.probe() == 0
    block = policy.best(low=2)
    for left in (1, block + PROBE_EVERY - 1):
        assert policy.choose(0, left=left) == 1 and policy.probe() == 0  # still due, not taken
    assert policy.choose(0, left=block + PROBE_EVERY) == 1 and policy.probe() == block
    unlimited = AdaptiveBlock(curve, 4)
    assert [unlimited.choose() == 1 and unlimited.probe() for _ in range(PROBE_EVERY)][-1] == block


def test_a_probe_waits_while_it_would_take_more_than_its_share_of_the_steps_left():
    """A due probe whose draft pass costs a plain step (so due once it is
    ``PROBE_FIRST_BUDGET`` of the plain steps before it) is drafted only where
    it takes at most ``PROBE_SHARE`` of the plain steps left: 50 of them."""
    curve = CostCurve((1, 16), (1.0, 4.0), (0.0, 1.0))
    policy = AdaptiveBlock(curve, 4)
    for _ in range(math.ceil(1.0 / PROBE_FIRST_BUDGET) - 1):
        assert policy.choose(0, left=1000) == 1 and policy.probe() == 0
    block = policy.best(low=2)
    assert policy.probe_loss(block) == pytest.approx(1.0 * PROBE_SHARE * 50)
    assert policy.choose(0, left=49) == 1 and policy.probe() == 0  # still due, not taken
    assert policy.choose(0, left=51) == 1 and policy.probe() == block


@pytest.mark.parametrize("draft_s, max_tokens, probes",
                         [(0.3, 12, []), (0.3, 40, [7, 8]), (1.0, 40, []), (1.0, 60, []), (1.0, 80, [16])])
def test_a_short_generation_drafts_no_probe_it_cannot_repay(target_dirs, draft_dir, draft_s, max_tokens, probes):
    """With plain steps the curve's choice, the probe due 8 steps in is
    drafted in a 40-token generation (its plain steps are injected for it),
    and after it found nothing one more 8 steps on (in the first 16 tokens a
    probe that finds nothing does not back the next off), and not in a 12-token
    one; where its draft pass costs a plain step, it is due 17 steps in (its
    loss 6% of the steps before it), and drafted neither in a 40-token nor in
    a 60-token generation (more than 2% of the 42 steps left) but in an
    80-token one, alone (the next would take more than 2% of those left); the
    output is mlx-lm's either way."""
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    target, draft = Target(model), load_draft(str(draft_dir("qwen3", block_size=4)))
    injected, inject = [], draft.inject
    draft.inject = lambda features, cache: (injected.append(features.shape[1]), inject(features, cache))[1]
    dear = CostCurve((1, 16), (1.0, 16.0), (0.0, draft_s))  # every cycle a plain step
    got = generate(target, draft, tokenizer, PROMPT, max_tokens=max_tokens, cost_curve=dear)
    assert got.tokens == greedy_reference(model, PROMPT, max_tokens) and set(got.block_sizes) == {1}
    probed = injected[2:]  # past the prompt's chunk and its last token: a probe's catch-up
    assert probed == probes  # each probe's catch-up: the plain steps since the one before


def test_nothing_is_queued_after_the_last_token_the_caller_takes(target_dirs, draft_dir):
    """max_tokens = 1: the prefill's token is all, so no plain step or draft
    follows it (a caller's kept caches hold the prompt alone); with 3, a
    fixed block of 4 is cut to the 2 tokens left."""
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    target, draft = Target(model), load_draft(str(draft_dir("qwen3", block_size=4)))
    context = ContextCache(target.make_cache(), draft.make_cache())
    got = generate(target, draft, tokenizer, PROMPT, max_tokens=1, context=context, block_size=4)
    assert got.tokens == greedy_reference(model, PROMPT, 1) and context.tokens == PROMPT
    assert all(c.offset == len(PROMPT) for c in context.draft)
    got = generate(target, draft, tokenizer, PROMPT, max_tokens=3, block_size=4)
    assert got.tokens == greedy_reference(model, PROMPT, 3) and got.block_sizes[0] == 2
    assert all(b <= 2 for b in got.block_sizes)


def test_speculation_on_the_prior_alone_waits_for_room_to_recover():
    """Before any outcome, a block the prior favours is drafted only where
    at least it plus ``PROBE_EVERY`` tokens are left; once outcomes are
    learned, the estimate is trusted whatever is left."""
    free = CostCurve((1, 16), (1.0, 1.0), (0.0, 0.001))  # every block costs about a plain step
    assert AdaptiveBlock(free, 4).choose(0, left=4 + PROBE_EVERY) == 4
    assert AdaptiveBlock(free, 4).choose(0) == 4  # no limit given
    guessing = AdaptiveBlock(free, 4)
    assert guessing.choose(0, left=4 + PROBE_EVERY - 1) == 1
    learned = AdaptiveBlock(free, 4)
    learned.update(4, 3)
    assert learned.choose(0, left=3) == 4  # the decoder then cuts it to the 3 tokens left
