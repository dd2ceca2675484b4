"""Several requests at once (``loop/batch.py``): every row's output is its solo
output, rows joining and leaving mid-flight, exact per-row rollback at every
combination of acceptance lengths, masks that hide rejected tails, and
sampling that keeps the target's distribution per row."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import ArraysCache, KVCache
from test_loop import assert_same_or_near_tie, greedy_reference

from dflash_mlx import DFlashError, Target, batch_generate, generate, load_draft
from dflash_mlx.loop import BatchDecoder, BlockSampler, SamplingParams
from dflash_mlx.loop.decoder import ContextCache, SpeculativeDecoder
from dflash_mlx.targets import RowKVCache

FAMILIES = ["llama", "qwen3", "qwen3_5", "qwen3_5_moe", "gemma4"]
PROMPTS = ["the quick brown fox", "hello", "write a short story about a cat who", "a b c d e f g h i j k"]
LIMITS = [24, 9, 17, 30]  # rows leave at different cycles


@pytest.fixture(scope="module")
def loaded(target_dirs, draft_dir):
    """family -> (mlx-lm model, tokenizer, draft); the draft has a sliding-window layer."""
    out = {}
    for family in FAMILIES:
        model, tokenizer = mlx_lm_load(str(target_dirs[family]))
        path = draft_dir(family, block_size=8, layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                         **({"target_layer_ids": [1, 4]} if family == "gemma4" else {}))
        out[family] = (model, tokenizer, load_draft(str(path)))
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [4, 8])
def test_every_row_is_its_solo_run_with_rows_joining_and_leaving(loaded, family, block_size):
    model, tokenizer, draft = loaded[family]
    results = batch_generate(model, draft, tokenizer, PROMPTS, max_tokens=LIMITS, block_size=block_size,
                             max_concurrency=3)  # the fourth joins when the first row leaves
    assert [r.prompt_tokens for r in results] == [len(tokenizer.encode(p)) for p in PROMPTS]
    for prompt, limit, result in zip(PROMPTS, LIMITS, results):
        solo = generate(model, draft, tokenizer, prompt, max_tokens=limit, block_size=block_size)
        assert result.tokens == solo.tokens
        assert result.finish_reason == solo.finish_reason
        ids = tokenizer.encode(prompt)
        want = greedy_reference(model, ids, limit)
        eos = tokenizer.eos_token_id
        want = want[: want.index(eos)] if eos in want else want
        assert_same_or_near_tie(model, ids, result.tokens, want)


class StatelessDrafter:
    """A drafter that keeps no draft context: its proposals come from the rows
    alone (``BatchDecoder(drafter=...)``'s interface, beside ``DraftRows``)."""

    def solo(self, cache):
        return self

    def observe(self, features, *rest):
        pass

    def rows_of(self, caches):
        return None

    def join(self, rows):
        pass

    def leave(self, r, kept, unobserved=None):
        return None if unobserved is None else []


class RowOracle(StatelessDrafter):
    """Proposes each row's greedy continuation (known in advance), corrupted
    so that row r accepts exactly ``plan[r]`` drafts in the next cycle."""

    def __init__(self, continuations: dict, vocab_size: int):
        self.continuations = continuations  # tag -> the full greedy sequence (prompt + continuation)
        self.vocab_size = vocab_size
        self.plan: dict = {}  # tag -> drafts to accept this cycle (b-1: all)

    def propose(self, ys, block_size, rows):
        drafts = []
        for row in rows:
            seq = self.continuations[row.tag]
            start = len(row.tokens) + 1  # the index of d_1
            tokens = list(seq[start : start + block_size - 1])
            a = self.plan[row.tag]
            if a < block_size - 1:
                tokens[a] = (tokens[a] + 1) % self.vocab_size
            drafts.append((mx.array(tokens, dtype=mx.int32), None, mx.array(True)))
        return drafts


def solo_caches(target, tokens):
    """The caches of ``tokens`` fed to the target alone, one verify-shaped pass at a time is not needed:
    a prefill of exactly those tokens."""
    cache = target.make_cache()
    target.forward(mx.array(tokens)[None], cache, [0])
    return cache


def assert_row_caches_equal(extracted: list, reference: list):
    for got, want in zip(extracted, reference):
        if isinstance(want, ArraysCache):
            for g, w in zip(got.cache, want.cache):
                assert g.shape == w.shape
                assert mx.allclose(g, w, atol=1e-4, rtol=1e-4).item()
        else:
            assert got.offset == want.offset
            n = want.offset
            gk, gv, wk, wv = (a[..., :n, :] for a in (got.keys, got.values, want.keys, want.values))
            assert mx.allclose(gk, wk, atol=1e-4, rtol=1e-4).item() and mx.allclose(gv, wv, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_is_exact_per_row_at_every_combination_of_acceptance_lengths(loaded, family):
    model, tokenizer, draft = loaded[family]
    target = Target(model)
    block = 4
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    cycles = list(itertools.product(range(block), repeat=2))  # (a_0, a_1) in 0..b-1: b-1 is the full block
    length = sum(max(a) for a in cycles) + 2 * len(cycles) + 4
    continuations = {i: p + greedy_reference(model, p, length) for i, p in enumerate(prompts)}
    oracle = RowOracle(continuations, target.vocab_size)
    decoder = BatchDecoder(target, draft, block, drafter=oracle)
    rows = [decoder.add(mx.array(p), BlockSampler(SamplingParams()), tag=i)[0] for i, p in enumerate(prompts)]
    for plan in cycles:
        oracle.plan = dict(enumerate(plan))
        for row, a, cycle in zip(rows, plan, decoder.cycle()):
            assert cycle.accepted == a
            assert row.tokens + [row.pending] == continuations[row.tag][: len(row.tokens) + 1]
        for r, row in enumerate(rows):  # each row's caches hold exactly its committed tokens
            extracted = [c.extract(r) for c in decoder.cache]
            assert_row_caches_equal(extracted, solo_caches(target, row.tokens))


def test_a_rejected_tail_is_never_attended():
    """Slots past a row's length hold its rejected drafts; poisoned with large
    values, they must not change any row's attention."""
    B, H, D = 2, 2, 8
    keys = mx.random.normal((B, H, 6, D), key=mx.random.key(0))
    values = mx.random.normal((B, H, 6, D), key=mx.random.key(1))
    cache = RowKVCache(keys, values, lengths=[6, 6])
    cache.trim_rows([3, 1])  # row 0 keeps 3 positions, row 1 keeps 5
    cache.keys[0, :, 3:] = 1e3
    cache.values[0, :, 3:] = 1e3
    new_k = mx.random.normal((B, H, 2, D), key=mx.random.key(2))
    new_v = mx.random.normal((B, H, 2, D), key=mx.random.key(3))
    q = mx.random.normal((B, H, 2, D), key=mx.random.key(4))
    mask = cache.visible(2)
    k, v = cache.update_and_fetch(new_k, new_v)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
    for r, n in enumerate([3, 5]):
        want_k = mx.concatenate([keys[r : r + 1, :, :n], new_k[r : r + 1]], axis=2)
        want_v = mx.concatenate([values[r : r + 1, :, :n], new_v[r : r + 1]], axis=2)
        want = mx.fast.scaled_dot_product_attention(q[r : r + 1], want_k, want_v, scale=D**-0.5, mask="causal")
        assert mx.allclose(out[r : r + 1], want, atol=1e-5).item()
    assert cache.lengths == [5, 7]


def test_a_row_leaves_with_caches_that_continue_alone(loaded):
    model, tokenizer, draft = loaded["qwen3_5"]
    target = Target(model)
    decoder = BatchDecoder(target, draft, 4)
    ids = [mx.array(tokenizer.encode(p)) for p in PROMPTS[:3]]
    rows = [decoder.add(p, BlockSampler(SamplingParams()), tag=i)[0] for i, p in enumerate(ids)]
    for _ in range(3):
        decoder.cycle()
    row = rows[1]
    context = decoder.remove(row)
    assert context.tokens == row.tokens and len(decoder.rows) == 2
    assert [c.offset for c in context.draft] == [len(row.tokens)] * len(context.draft)
    # continued alone from the caches it left with: the same tokens as a solo run of the whole prompt
    prompt = row.tokens + [row.pending]
    more = generate(model, draft, tokenizer, prompt, max_tokens=12, block_size=4, context=context)
    alone = generate(model, draft, tokenizer, prompt, max_tokens=12, block_size=4)
    assert more.tokens == alone.tokens


def test_batch_generate_refuses_bad_input_in_one_line(loaded):
    model, tokenizer, draft = loaded["llama"]
    with pytest.raises(DFlashError, match="unknown arguments"):
        batch_generate(model, draft, tokenizer, ["a"], tempreature=0.5)
    with pytest.raises(DFlashError, match="one max_tokens"):
        batch_generate(model, draft, tokenizer, ["a", "b"], max_tokens=[3])
    with pytest.raises(DFlashError, match="max_concurrency"):
        batch_generate(model, draft, tokenizer, ["a"], max_concurrency=0)


@pytest.fixture(scope="module")
def demo():
    """The bundled pair: a qwen3_5 hybrid target and its trained DFlash2 draft (drafts are often accepted)."""
    from dflash_mlx import load
    from dflash_mlx.demo import demo_pair

    pair = demo_pair()
    model, tokenizer = load(str(pair.target))
    return model, tokenizer, load_draft(str(pair.draft)), pair.load_prompts()[:5]


def test_dflash2_rows_accept_their_own_prefixes_and_equal_their_solo_runs(demo):
    model, tokenizer, draft, prompts = demo
    limits = [40, 12, 33, 25, 40]
    results = batch_generate(model, draft, tokenizer, prompts, max_tokens=limits, block_size=8, max_concurrency=3)
    for prompt, limit, result in zip(prompts, limits, results):
        solo = generate(model, draft, tokenizer, prompt, max_tokens=limit, block_size=8)
        assert result.tokens == solo.tokens
        same = first_block_mismatch(result, solo)  # the same drafts, accepted alike, while the blocks agree
        assert same > 0 and result.acceptance_lengths[:same] == solo.acceptance_lengths[:same]
    accepted = [a - 1 for r in results for a in r.acceptance_lengths]
    assert max(accepted) >= 4 and min(accepted) == 0, "rows must accept different prefixes for this to bite"


def first_block_mismatch(result, solo) -> int:
    """The first cycle whose block differs between a batch's row and its solo
    run (the batch drafts up to the tokens its longest row has left; a row
    alone stops drafting at its own)."""
    pairs = list(zip(result.block_sizes, solo.block_sizes))
    return next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))


def test_sampled_rows_with_seeds_equal_their_solo_runs_while_their_blocks_agree(demo):
    """At temperature > 0 a row draws with its own key, in the order a solo run
    draws: with the same seed, the same tokens as alone for as long as the
    row's blocks are the ones it would use alone."""
    model, tokenizer, draft, prompts = demo
    sampling = [{"temperature": 0.8, "seed": 11}, {"temperature": 1.0, "top_p": 0.9, "seed": 5},
                {"temperature": 0.6, "top_k": 20, "seed": 7}]
    limits = [30, 20, 26]
    results = batch_generate(model, draft, tokenizer, prompts[:3], max_tokens=limits, block_size=6,
                             sampling=sampling)
    for prompt, limit, extra, result in zip(prompts, limits, sampling, results):
        solo = generate(model, draft, tokenizer, prompt, max_tokens=limit, block_size=6, **extra)
        cycles = first_block_mismatch(result, solo)
        emitted = 1 + sum(result.acceptance_lengths[:cycles])
        assert emitted >= 12, "too few tokens compared to prove anything"
        assert result.tokens[:emitted] == solo.tokens[:emitted]
    assert len({tuple(r.tokens) for r in results}) == 3


def test_each_row_keeps_its_own_processors_grammar_and_limit(loaded):
    """Greedy rows with a repetition penalty, a logit bias and a grammar, each
    beside the others: every row is its solo run under its own settings."""
    model, tokenizer, draft = loaded["qwen3"]
    limits = [20, 15, 25, 12]
    plain = batch_generate(model, draft, tokenizer, PROMPTS, max_tokens=limits, block_size=4)
    sampling = [{"repetition_penalty": 1.5, "repetition_context_size": 8},
                {"logit_bias": {plain[1].tokens[2]: -100.0}},
                {"response_format": {"type": "regex", "regex": "[a-z ]{3,40}"}},
                {}]
    results = batch_generate(model, draft, tokenizer, PROMPTS, max_tokens=limits, block_size=4, sampling=sampling)
    for prompt, limit, extra, result in zip(PROMPTS, limits, sampling, results):
        solo = generate(model, draft, tokenizer, prompt, max_tokens=limit, block_size=4, **extra)
        assert result.tokens == solo.tokens and result.finish_reason == solo.finish_reason
    assert all(a.tokens != b.tokens for a, b in zip(results[:3], plain))  # every setting changed its row
    assert results[3].tokens == plain[3].tokens


class NonFiniteForOneRow(RowOracle):
    """Row 0's draft logits are not finite in the second cycle."""

    def propose(self, ys, block_size, rows):
        drafts = super().propose(ys, block_size, rows)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            drafted, q, _ = drafts[0]
            drafts[0] = (drafted, q, mx.array(False))
        return drafts


def test_a_row_whose_draft_is_not_finite_fails_alone(loaded):
    model, tokenizer, draft = loaded["llama"]
    target = Target(model)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    continuations = {i: p + greedy_reference(model, p, 30) for i, p in enumerate(prompts)}
    oracle = NonFiniteForOneRow(continuations, target.vocab_size)
    oracle.plan = {0: 3, 1: 2}
    decoder = BatchDecoder(target, draft, 4, drafter=oracle)
    rows = [decoder.add(mx.array(p), BlockSampler(SamplingParams()), tag=i)[0] for i, p in enumerate(prompts)]
    decoder.cycle()
    failed, other = decoder.cycle()
    assert failed.error and "non-finite" in failed.error and failed.tokens == []
    assert other.error is None and other.accepted == 2
    context = decoder.remove(rows[0])
    assert context.tokens == continuations[0][: len(context.tokens)]  # its caches hold only target tokens
    for _ in range(3):
        (cycle,) = decoder.cycle()
        assert cycle.accepted == 2
    assert rows[1].tokens + [rows[1].pending] == continuations[1][: len(rows[1].tokens) + 1]


def test_rows_draft_over_a_reduced_vocabulary(loaded):
    """``draft_vocab`` batches: every row drafts over the same top-N head and
    equals its solo run with the same ``draft_vocab``."""
    model, tokenizer, draft = loaded["llama"]
    draft.vocab_ranking = np.arange(model.args.vocab_size, dtype=np.int32)[::-1].copy()
    try:
        from dflash_mlx.draft import subset_head

        target = Target(model)
        decoder = BatchDecoder(target, draft, 4, head=subset_head(target, draft.vocab_ranking, 64))
        for p in PROMPTS[:3]:
            decoder.add(mx.array(tokenizer.encode(p)), BlockSampler(SamplingParams()))
        ys = mx.array([r.pending for r in decoder.rows])
        drafted = mx.stack([d for d, _, _ in decoder.drafter.propose(ys, 4, decoder.rows)])
        assert (drafted >= model.args.vocab_size - 64).all().item()  # only the 64 top-ranked ids are drafted
        results = batch_generate(model, draft, tokenizer, PROMPTS[:3], max_tokens=16, block_size=4, draft_vocab=64)
        for prompt, result in zip(PROMPTS, results):
            assert result.tokens == generate(model, draft, tokenizer, prompt, max_tokens=16, block_size=4,
                                             draft_vocab=64).tokens
    finally:
        draft.vocab_ranking = None


class ProbeOnce:
    """Plain steps only, with one probe of ``block`` due at the first step."""

    def __init__(self, block):
        self.due, self.outcomes = block, []

    def choose(self, rows):
        return 1

    def probe(self):
        due, self.due = self.due, 0
        return due

    def probed(self, block_size, rows):
        self.outcomes.append((block_size, sorted(rows)))

    def update(self, rows, block_size, accepted):
        pass


def test_a_probe_is_judged_per_row_against_its_own_plain_steps(loaded):
    model, tokenizer, draft = loaded["qwen3_5"]
    target = Target(model)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    continuations = {i: p + greedy_reference(model, p, 20) for i, p in enumerate(prompts)}
    oracle = RowOracle(continuations, target.vocab_size)
    oracle.plan = {0: 3, 1: 1, 2: 0}  # row 0's probe drafts are all right, row 1's first, row 2's none
    policy = ProbeOnce(4)
    decoder = BatchDecoder(target, draft, policy, drafter=oracle)
    emitted = {i: [decoder.add(mx.array(p), BlockSampler(SamplingParams()), tag=i)[1]] for i, p in enumerate(prompts)}
    for _ in range(5):
        for cycle in decoder.cycle():
            emitted[cycle.row.tag] += cycle.tokens
    assert policy.outcomes == [(4, [[0.0], [1.0, 0.0], [1.0, 1.0, 1.0]])]
    for i, tokens in emitted.items():  # the probe changed no output: plain steps are the target's own
        assert len(tokens) == 6 and tokens == continuations[i][len(prompts[i]) :][:6]


class ProbeLater(ProbeOnce):
    """Plain steps only, with one probe of ``block`` due when ``after`` plain steps have been asked for."""

    def __init__(self, block, after):
        super().__init__(0)
        self.block, self.asked = block, -after

    def probe(self):
        self.asked += 1
        return self.block if self.asked == 0 else 0


def test_a_probe_drafted_while_a_plain_step_runs_ahead_is_judged_from_the_token_after_it(loaded):
    """Mid-run, the next plain step (and the probe drafted from its token) is
    queued before the step in flight is read: that step's token is the one the
    probe was drafted from, not one it predicts, so it must not judge it."""
    model, tokenizer, draft = loaded["llama"]
    target = Target(model)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    continuations = {i: p + greedy_reference(model, p, 24) for i, p in enumerate(prompts)}
    oracle = RowOracle(continuations, target.vocab_size)
    oracle.plan = {0: 3, 1: 1}
    policy = ProbeLater(4, after=3)
    decoder = BatchDecoder(target, draft, policy, drafter=oracle)
    for i, p in enumerate(prompts):
        decoder.add(mx.array(p), BlockSampler(SamplingParams()), tag=i)
    for _ in range(10):
        decoder.cycle()
    assert policy.outcomes == [(4, [[1.0, 0.0], [1.0, 1.0, 1.0]])]


def test_a_row_leaving_mid_probe_leaves_the_others_outcome(loaded):
    model, tokenizer, draft = loaded["llama"]
    target = Target(model)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    continuations = {i: p + greedy_reference(model, p, 20) for i, p in enumerate(prompts)}
    oracle = RowOracle(continuations, target.vocab_size)
    oracle.plan = {0: 3, 1: 2}
    policy = ProbeOnce(4)
    decoder = BatchDecoder(target, draft, policy, drafter=oracle)
    rows = [decoder.add(mx.array(p), BlockSampler(SamplingParams()), tag=i)[0] for i, p in enumerate(prompts)]
    decoder.cycle()
    decoder.remove(rows[0])  # before its probe is judged whole
    for _ in range(3):
        decoder.cycle()
    assert policy.outcomes == [(4, [[1.0, 1.0, 0.0]])]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_plain_steps_queued_ahead_survive_rows_joining_and_leaving(loaded, family):
    """Plain batched steps are queued before the caller reads the last one;
    rows that join or leave meanwhile change no row's tokens, and a row that
    leaves with a step in flight takes caches that continue exactly."""
    model, tokenizer, draft = loaded[family]
    results = batch_generate(model, draft, tokenizer, PROMPTS, max_tokens=LIMITS, block_size=1, max_concurrency=2)
    for prompt, limit, result in zip(PROMPTS, LIMITS, results):
        ids = tokenizer.encode(prompt)
        want = greedy_reference(model, ids, limit)
        eos = tokenizer.eos_token_id
        assert_same_or_near_tie(model, ids, result.tokens, want[: want.index(eos)] if eos in want else want)
    target = Target(model)
    decoder = BatchDecoder(target, draft, 1)
    rows = [decoder.add(mx.array(tokenizer.encode(p)), BlockSampler(SamplingParams()))[0] for p in PROMPTS[:3]]
    for _ in range(4):
        decoder.cycle()
    assert decoder.queued is not None, "a plain step must be in flight for this to bite"
    context = decoder.remove(rows[1])
    prompt = context.tokens + [7]
    more = generate(model, draft, tokenizer, prompt, max_tokens=10, block_size=4, context=context)
    assert more.tokens == generate(model, draft, tokenizer, prompt, max_tokens=10, block_size=4).tokens


class Scripted:
    """The batch's blocks from a list (then plain steps)."""

    def __init__(self, blocks):
        self.blocks = list(blocks)

    def choose(self, rows):
        return self.blocks.pop(0) if self.blocks else 1

    def update(self, rows, block_size, accepted):
        pass


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_every_fed_position_reaches_each_rows_draft_context_once_and_in_order(loaded, family):
    """Plain steps' features wait per row; a row joining between them, blocks
    drafted after them and a row leaving with some still waiting: each row's
    draft context ends holding the features of exactly its fed tokens, as a
    prefill of those tokens would inject them."""
    model, tokenizer, draft = loaded[family]
    target = Target(model)
    decoder = BatchDecoder(target, draft, Scripted([1, 1, 1, 1, 1, 4, 1, 1, 4, 1, 1]))
    first, _ = decoder.add(mx.array(tokenizer.encode(PROMPTS[0])), BlockSampler(SamplingParams()))
    for _ in range(2):
        decoder.cycle()
    second, _ = decoder.add(mx.array(tokenizer.encode(PROMPTS[2])), BlockSampler(SamplingParams()))
    for _ in range(9):
        decoder.cycle()
    assert first.unobserved and second.unobserved, "features must still wait when the rows leave"
    for row in (second, first):
        context = decoder.remove(row)
        alone = draft.make_cache()
        out = target.forward(mx.array(context.tokens)[None], target.make_cache(), draft.config.target_layer_ids)
        draft.inject(out.features, alone)
        for got, want in zip(context.draft, alone):
            assert got.offset == want.offset == len(context.tokens)
            n = min(got.held, want.held)
            for a, b in zip(got.state, want.state):
                assert mx.allclose(a[..., -n:, :], b[..., -n:, :], atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma4"])
def test_requests_prefilled_together_are_each_prefilled_as_alone(loaded, family):
    """``add_many``: prompts of different lengths, one of them continuing a
    context that holds its first tokens, in right-padded chunks of 3: each
    row's first token, logprobs and caches are its solo prefill's, and so are
    the tokens it decodes after."""
    model, tokenizer, draft = loaded[family]
    target = Target(model)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    first_part = BatchDecoder(target, draft, 4)
    held = first_part.remove(first_part.add(mx.array(prompts[2][:5]), BlockSampler(SamplingParams()))[0])
    assert held.tokens == prompts[2][:5]
    decoder = BatchDecoder(target, draft, 4, prefill_step_size=3)
    arrivals = [{"prompt": mx.array(p), "sampler": BlockSampler(SamplingParams(repetition_penalty=1.3)),
                 "max_tokens": 12, "logprobs": True, "tag": i, **({"context": held} if i == 2 else {})}
                for i, p in enumerate(prompts)]
    joined = decoder.add_many(arrivals)
    for r, ((row, first), prompt) in enumerate(zip(joined, prompts)):
        alone = BatchDecoder(target, draft, 4, prefill_step_size=3)
        solo_row, solo_first = alone.add(mx.array(prompt), BlockSampler(SamplingParams(repetition_penalty=1.3)),
                                         logprobs=True)
        assert first == solo_first and row.tokens == prompt
        assert mx.allclose(row.logprobs, solo_row.logprobs, atol=1e-4).item()
        assert_row_caches_equal([c.extract(r) for c in decoder.cache], [c.extract(0) for c in alone.cache])
        for got, want in zip(decoder.drafter.proposer.cache, alone.drafter.proposer.cache):
            g, w = got.row(r), want.row(0)
            assert g[2] + g[0].shape[2] == w[2] + w[0].shape[2] == len(prompt)  # every position, once
            n = min(g[0].shape[2], w[0].shape[2])
            assert mx.allclose(g[0][..., -n:, :], w[0][..., -n:, :], atol=1e-4).item()
    emitted = {i: [first] for i, (_, first) in enumerate(joined)}
    for _ in range(8):
        for cycle in decoder.cycle():
            emitted[cycle.row.tag] += cycle.tokens
    for i, prompt in enumerate(prompts):
        solo = generate(model, draft, tokenizer, prompt, max_tokens=12, block_size=4, repetition_penalty=1.3)
        assert emitted[i][: len(solo.tokens)] == solo.tokens[: len(emitted[i])]
