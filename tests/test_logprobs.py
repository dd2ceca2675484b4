"""Log-probabilities of the emitted tokens (``stream_generate(logprobs=True)``):
equal to what mlx-lm's ``generate_step`` yields for the same tokens and
settings, whichever way a token was committed (prefill, an accepted draft, the
target's own token after a verify pass, a plain step, a DDTree path)."""

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from test_loop import OracleProposer

from dflash_mlx import Target, load_draft, stream_generate
from dflash_mlx.loop.decoder import SpeculativeDecoder

PROMPT = "the quick brown fox"
# a verify pass computes b positions at once (a DDTree or a GatedDeltaNet recurrence in another
# order), mlx-lm one at a time: up to 3e-4 apart in float32 with OpenBLAS on one machine, 1.6e-3
# on another (the hybrid target, OpenBLAS choosing its kernels by CPU); a wrong row is O(1) off
ATOL = 5e-3


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def pair(request, target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs[request.param]))
    return model, tokenizer, load_draft(str(draft_dir(request.param, block_size=4)))


def mlx_lm_logprobs(model, prompt: list[int], tokens: list[int], **processors) -> mx.array:
    """[len(tokens), V]: generate_step's logprobs when it emits ``tokens``
    (its sampler is made to pick them, so any temperature's tokens can be checked)."""
    forced = iter(tokens)

    def sampler(logprobs):  # called once more than it emits: generate_step works one token ahead
        return mx.array([next(forced, 0)])

    steps = generate_step(mx.array(prompt), model, max_tokens=len(tokens), sampler=sampler,
                          logits_processors=make_logits_processors(**processors))
    return mx.stack([logprobs for _, logprobs in steps])


def emitted(responses) -> tuple[list[int], mx.array, list]:
    responses = list(responses)
    tokens = [t for r in responses for t in r.tokens]
    rows = mx.concatenate([r.logprobs for r in responses if r.tokens])
    return tokens, rows, responses


@pytest.mark.parametrize("block_size", [2, 4])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 3},
                                      {"temperature": 0.7, "top_p": 0.9, "seed": 1,
                                       "repetition_penalty": 1.3, "logit_bias": {5: 2.0}}])
def test_equal_to_mlx_lm_for_the_same_tokens(pair, block_size, sampling):
    model, tokenizer, draft = pair
    prompt = tokenizer.encode(PROMPT)
    tokens, rows, responses = emitted(stream_generate(model, draft, tokenizer, prompt, max_tokens=24,
                                                      block_size=block_size, logprobs=True, **sampling))
    assert len(tokens) == 24 and rows.shape == (24, Target(model).vocab_size)
    assert all(r.logprobs.shape[0] == len(r.tokens) for r in responses)
    processors = {k: sampling[k] for k in ("repetition_penalty", "logit_bias") if k in sampling}
    want = mlx_lm_logprobs(model, prompt, tokens, **processors)
    assert mx.allclose(rows, want, atol=ATOL).item()
    if not sampling:  # greedy: the emitted tokens are the most likely ones
        assert mx.array_equal(mx.argmax(rows, axis=-1), mx.array(tokens)).item()


@pytest.mark.parametrize("block_size", [1, 4])
def test_accepted_drafts_and_plain_steps_carry_their_rows(pair, block_size):
    """Drafts steered onto the target's continuation are accepted b - 1 at a
    time: each accepted token's row is the verify pass's row before it; at
    b = 1 every token comes from a plain target step."""
    model, tokenizer, _ = pair
    target, prompt = Target(model), tokenizer.encode(PROMPT)
    continuation = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=2 + 5 * block_size)]
    decoder = SpeculativeDecoder(target, OracleProposer(len(prompt), continuation, None, target.vocab_size),
                                 [0], block_size)
    decoder.keep_logprobs = True
    tokens, rows = [decoder.prefill(mx.array(prompt))], [decoder.logprobs]
    for _ in range(4):
        cycle = decoder.cycle()
        assert cycle.accepted == block_size - 1
        tokens += cycle.tokens
        rows.append(decoder.logprobs)
    assert tokens == continuation[: 1 + 4 * block_size]
    assert mx.allclose(mx.concatenate(rows), mlx_lm_logprobs(model, prompt, tokens), atol=ATOL).item()


def test_a_tree_path_carries_its_nodes_rows(pair):
    model, tokenizer, draft = pair
    prompt = tokenizer.encode(PROMPT)
    tokens, rows, _ = emitted(stream_generate(model, draft, tokenizer, prompt, max_tokens=16, tree_budget=6,
                                              temperature=0.8, seed=2, logprobs=True))
    assert mx.allclose(rows, mlx_lm_logprobs(model, prompt, tokens), atol=ATOL).item()


def test_off_by_default(pair):
    model, tokenizer, draft = pair
    responses = list(stream_generate(model, draft, tokenizer, PROMPT, max_tokens=6, block_size=4))
    assert all(r.logprobs is None for r in responses)
