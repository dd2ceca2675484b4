"""The arguments generate, stream_generate and batch_generate take from
mlx-lm: ``logits_processors`` are honoured exactly (greedy token for token
mlx-lm's generate_step with the same processors, at every acceptance length;
sampled, distributed as the processed target), an mlx-lm ``sampler`` and any
unknown keyword are one-line DFlashErrors, not TypeErrors."""

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from test_loop import OracleProposer
from test_sampling import exact_joint, model, pvalues, sample  # noqa: F401 (model: the fixture)
from test_tree_loop import run

from dflash_mlx import Target, batch_generate, generate, load_draft, stream_generate
from dflash_mlx.errors import DFlashError
from dflash_mlx.loop.decoder import SpeculativeDecoder
from dflash_mlx.loop.sampling import BlockSampler, SamplingParams

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64, 250, 3, 77]
TOKENS = 40


def recall(tokens: mx.array, logits: mx.array) -> mx.array:
    """The id (history length + first prompt id) mod V raised by the row's
    max minus its mean, to about the top: it reads the whole history, prompt
    included, and every token before the position."""
    vocab = logits.shape[-1]
    lift = logits.max(axis=-1, keepdims=True) - logits.mean(axis=-1, keepdims=True)
    return logits + lift * (mx.arange(vocab) == (tokens.size + tokens[0]) % vocab)


@pytest.fixture(scope="module")
def pair(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3_5"]))
    return model, tokenizer, load_draft(str(draft_dir("qwen3_5", block_size=8)))


def mlx_lm_greedy(model, processors, n=TOKENS, prompt=PROMPT) -> list[int]:
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=processors)]


def test_logits_processors_are_applied_as_mlx_lm_applies_them_at_every_acceptance_length(pair):
    model, _, _ = pair
    want = mlx_lm_greedy(model, [recall], TOKENS + 8)
    assert want != mlx_lm_greedy(model, None, TOKENS + 8), "the processor changes nothing: the test proves nothing"
    target = Target(model)
    for block_size, corrupt_at in [(2, None), (4, 0), (6, None), (6, 3)]:
        oracle = OracleProposer(len(PROMPT), want, corrupt_at, target.vocab_size)
        sampler = BlockSampler(SamplingParams(logits_processors=[recall]))
        decoder = SpeculativeDecoder(target, oracle, [0], block_size, sampler=sampler)
        out, accepted = run(decoder, PROMPT, TOKENS)
        assert out[:TOKENS] == want[:TOKENS], (block_size, corrupt_at)
        assert max(accepted) == (block_size - 1 if corrupt_at is None else corrupt_at)  # the drafts up to it


def test_generate_with_logits_processors_is_mlx_lm_greedy_with_them(pair):
    """After the penalties' processors, with a chain, a DDTree and in a batch."""
    model, tokenizer, draft = pair
    want = mlx_lm_greedy(model, make_logits_processors(repetition_penalty=1.3) + [recall])
    options = dict(max_tokens=TOKENS, repetition_penalty=1.3, logits_processors=[recall])
    for extra in (dict(block_size=4), dict(block_size="auto"), dict(block_size=4, tree_budget=5)):
        assert generate(model, draft, tokenizer, PROMPT, **options, **extra).tokens == want, extra
    other = PROMPT[3:]
    rows = batch_generate(model, draft, tokenizer, [PROMPT, other], block_size=4, **options)
    assert [r.tokens for r in rows] == [want, mlx_lm_greedy(model, make_logits_processors(repetition_penalty=1.3)
                                                            + [recall], prompt=other)]


def test_sampled_logprobs_are_mlx_lms_with_the_same_logits_processors(pair):
    """At temperature > 0 each token is drawn (by the lossless rule) from the
    target's processed distribution at its position: mlx-lm's own there."""
    model, tokenizer, draft = pair
    tokens, rows = [], []
    for r in stream_generate(model, draft, tokenizer, PROMPT, max_tokens=TOKENS, block_size=4, temperature=0.8,
                             seed=3, logprobs=True, logits_processors=[recall]):
        tokens += r.tokens
        rows += [r.logprobs[i] for i in range(len(r.tokens))]
    forced = iter(tokens + [0])
    want = [lp for _, lp in generate_step(mx.array(PROMPT), model, max_tokens=len(tokens), logits_processors=[recall],
                                          sampler=lambda _: mx.array([next(forced)]))]
    assert len(want) == len(rows) == TOKENS
    for i, (got, ref) in enumerate(zip(rows, want)):
        assert mx.allclose(got, ref, atol=1e-4).item(), f"token {i}"


class Processed:
    """``model`` whose last position's logits went through ``processor``
    after the ids before it: the target ``exact_joint`` enumerates."""

    def __init__(self, model, processor):
        self.model, self.processor = model, processor

    def __call__(self, ids: mx.array) -> mx.array:
        logits = self.model(ids)[:, -1]
        return mx.concatenate([self.processor(ids[i], logits[i : i + 1]) for i in range(ids.shape[0])])[:, None]


@pytest.mark.statistical
def test_samples_follow_the_processed_targets_distribution(model):  # noqa: F811 (the fixture)
    """300 runs are plenty: enumerated on this fixture, the (x1, x2) cells'
    noncentrality at 300 samples is about 260 with the processor left out,
    27,000 with its history one token short, 10^6 with a truncated one."""
    params = SamplingParams(temperature=1.0, logits_processors=[recall])
    tokens, accepted = sample(model, params, runs=300, positions=3)  # x2, x3 from verified blocks
    for position, p in pvalues(tokens, exact_joint(Processed(model, recall), params, depth=3)).items():
        assert p > 1e-3 / 3, f"{position} deviates from the processed target (p = {p:.2e})"
    assert (accepted >= 1).mean() > 0.2, "drafts must often be accepted for this to bite"


def one_line_error(call) -> str:
    with pytest.raises(DFlashError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message
    return message


def test_an_mlx_lm_sampler_is_refused_saying_what_to_pass(pair):
    model, tokenizer, draft = pair
    sampler = make_sampler(temp=0.7, top_p=0.9)
    for call in (lambda: generate(model, draft, tokenizer, PROMPT, sampler=sampler),
                 lambda: stream_generate(model, draft, tokenizer, PROMPT, sampler=sampler),
                 lambda: batch_generate(model, draft, tokenizer, [PROMPT], sampler=sampler),
                 lambda: batch_generate(model, draft, tokenizer, [PROMPT], sampling=[{"sampler": sampler}])):
        message = one_line_error(call)
        assert message.startswith("sampler is not accepted") and "temperature, top_p, top_k, min_p" in message


def test_unknown_keywords_are_one_line_errors_naming_the_accepted_ones(pair):
    model, tokenizer, draft = pair
    for name, call in [("generate()", lambda: generate(model, draft, tokenizer, PROMPT, max_token=4)),
                       ("stream_generate()", lambda: stream_generate(model, draft, tokenizer, PROMPT, max_token=4)),
                       ("batch_generate()", lambda: batch_generate(model, draft, tokenizer, [PROMPT], max_token=4))]:
        message = one_line_error(call)
        assert message.startswith(f"unknown arguments to {name}: max_token; the accepted ones are "), message
        assert all(f" {k}," in message for k in ("max_tokens", "temperature", "logits_processors")), message
    message = one_line_error(lambda: generate(model, draft, tokenizer, PROMPT, logits_processors=recall))
    assert message.startswith("logits_processors must be a list of functions")
