"""The speculative loop: lossless against mlx-lm, exact rollback at every
acceptance length, and the features the draft is handed."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache

from dflash_mlx import Target, generate, load_draft
from dflash_mlx.loop.decoder import DraftProposer, SpeculativeDecoder

FAMILIES = ["llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss"]
PROMPTS = [
    "the quick brown fox",
    "write a short story about a cat who",
    "hello",
]
NEAR_TIE = 1e-3  # logit gap below which float reassociation may flip an argmax


@pytest.fixture(scope="module")
def pairs(target_dirs, draft_dir):
    """family -> (target dir, draft dir); the draft has a sliding-window layer."""
    return {
        family: (
            target_dirs[family],
            draft_dir(
                family, "old" if family == "qwen3_5" else "new", block_size=16,
                layer_types=["sliding_attention", "full_attention"], sliding_window=5,
            ),
        )
        for family in FAMILIES
    }


@pytest.fixture(scope="module")
def loaded(pairs):
    """family -> (mlx-lm model, tokenizer, draft), all loaded from disk."""
    out = {}
    for family, (target_dir, draft_dir) in pairs.items():
        model, tokenizer = mlx_lm_load(str(target_dir))
        out[family] = (model, tokenizer, load_draft(str(draft_dir)))
    return out


def greedy_reference(model, prompt_ids, n):
    return [t for t, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n)]


def assert_same_or_near_tie(model, prompt_ids, got, want):
    """Token-identical, or the first divergence is a float near-tie of the target."""
    if got == want:
        return
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = model(mx.array(prompt_ids + want[:i])[None])[0, -1]
    gap = abs((logits[got[i]] - logits[want[i]]).item())
    assert gap < NEAR_TIE, f"diverged at token {i}: {got[i]} vs {want[i]}, logit gap {gap}"


def check_greedy_output(model, tokenizer, draft, prompt, block_size, max_tokens=48):
    """``generate`` at ``block_size`` gives mlx-lm's greedy continuation of
    ``prompt`` (or parts from it at a float near-tie), which is not degenerate."""
    ids = tokenizer.encode(prompt)
    want = greedy_reference(model, ids, max_tokens)
    res = generate(model, draft, tokenizer, prompt, max_tokens=max_tokens, block_size=block_size)
    assert len(set(want)) > 8, "fixture too degenerate to prove anything"
    assert_same_or_near_tie(model, ids, res.tokens, want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_greedy_output_is_mlx_lm_greedy_output(loaded, family, block_size):
    model, tokenizer, draft = loaded[family]
    eos = tokenizer.eos_token_id
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        want = greedy_reference(model, ids, 64)
        if eos in want:
            want = want[: want.index(eos)]
        res = generate(model, draft, tokenizer, prompt, max_tokens=64, block_size=block_size)
        assert len(set(want)) > 8, "fixture too degenerate to prove anything"
        assert_same_or_near_tie(model, ids, res.tokens, want)
        assert res.finish_reason == ("length" if len(want) == 64 else "stop")
        assert sum(res.acceptance_lengths) >= len(res.tokens) - 1


class OracleProposer:
    """Proposes the target's own greedy continuation, corrupted at one index."""

    def __init__(self, prompt_len, continuation, corrupt_at, vocab_size):
        self.position = 0
        self.prompt_len = prompt_len
        self.continuation = continuation
        self.corrupt_at = corrupt_at
        self.vocab_size = vocab_size

    def observe(self, features, tokens):
        self.position += tokens.size

    def propose(self, y, block_size):
        start = self.position - self.prompt_len + 1  # index of d_1 in the continuation
        tokens = list(self.continuation[start : start + block_size - 1])
        if self.corrupt_at is not None:
            tokens[self.corrupt_at] = (tokens[self.corrupt_at] + 1) % self.vocab_size
        return one_hot_logits(tokens, self.vocab_size)


def one_hot_logits(tokens, vocab_size):
    """Logits whose argmax is each of ``tokens``."""
    return (mx.arange(vocab_size)[None] == mx.array(tokens)[:, None]).astype(mx.float32)


def feed_right_padded(target, cache, block, keep):
    """Feed ``block`` [b] as mlx-lm feeds a right-padded batch row of length
    ``keep``: recurrent caches are told the length (ArraysCache.prepare: the
    state stops there, the conv window ends there), attention caches drop the
    padding. The pass has the verify pass's shape [1, b] and tokens, so every
    kept row goes through the same kernels with the same batching (a BLAS may
    round a row differently when the matrix has another number of rows)."""
    recurrent = [c for c in cache if isinstance(c, ArraysCache)]
    for c in recurrent:
        c.prepare(lengths=[keep])
    target.forward(block[None], cache, [0])
    for c in recurrent:
        c.finalize()
    for c in cache:
        if not isinstance(c, ArraysCache):
            c.trim(block.size - keep)


def assert_caches_identical(got, want):
    for i, (c, w) in enumerate(zip(got, want)):
        if isinstance(c, KVCache):
            assert c.offset == w.offset, f"layer {i} offset"
            arrays = zip(c.keys_and_values(), w.keys_and_values())
        else:  # GatedDeltaNet: conv window and recurrent state
            arrays = zip(c.cache, w.cache)
        for a, b in arrays:
            assert a.shape == b.shape and mx.array_equal(a, b).item(), f"layer {i}"


def check_rollback_at_every_acceptance_length(model, tokenizer, block_size: int) -> None:
    """For every acceptance length (0..block_size-1 and full), two oracle cycles:
    each accepts exactly that many tokens, keeps the output on mlx-lm's greedy
    continuation, and leaves the cache bit-identical to one fed the same chunks
    with only the accepted tokens kept (mlx-lm's right padding)."""
    target = Target(model)
    prompt = tokenizer.encode("the quick brown fox")
    continuation = greedy_reference(model, prompt, 3 * block_size + 2)
    for corrupt_at in [*range(block_size - 1), None]:
        expected_accept = block_size - 1 if corrupt_at is None else corrupt_at
        oracle = OracleProposer(len(prompt), continuation, corrupt_at, target.vocab_size)
        decoder = SpeculativeDecoder(target, oracle, [0], block_size, prefill_step_size=3)
        out = [decoder.prefill(mx.array(prompt))]
        reference = target.make_cache()
        for start in range(0, len(prompt), 3):  # the decoder's prefill chunks
            target.forward(mx.array(prompt[start : start + 3])[None], reference, [0])
        for _ in range(2):
            block = mx.concatenate([decoder.pending, decoder.drafted])
            cycle = decoder.cycle()
            assert cycle.accepted == expected_accept
            out += cycle.tokens
            assert out == continuation[: len(out)]
            feed_right_padded(target, reference, block, cycle.accepted + 1)
            assert_caches_identical(decoder.cache, reference)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gpt_oss"])
@pytest.mark.parametrize("block_size", [5, 16])
def test_rollback_at_every_acceptance_length(loaded, family, block_size):
    """Exact rollback whatever BLAS MLX uses."""
    model, tokenizer, _ = loaded[family]
    check_rollback_at_every_acceptance_length(model, tokenizer, block_size)


class RecordingProposer(DraftProposer):
    def __init__(self, draft, target):
        super().__init__(draft, target)
        self.seen = []

    def observe(self, features, tokens):
        self.seen.append(features)
        super().observe(features, tokens)


class Passthrough(nn.Module):
    def __init__(self, like):
        super().__init__()
        self.is_linear = getattr(like, "is_linear", False)
        self.use_sliding = getattr(like, "use_sliding", False)

    def __call__(self, x, *args, **kwargs):
        return x


def layer_output_uncached(target_dir, tokens, layer_id):
    """Output of one target layer from mlx-lm's own uncached forward, by
    cutting a fresh copy of the model after that layer."""
    model, _ = mlx_lm_load(str(target_dir))
    inner = getattr(model, "language_model", model).model
    layers = inner.layers
    for j in range(layer_id + 1, len(layers)):
        layers[j] = Passthrough(layers[j])
    inner.norm = Passthrough(inner.norm)
    return inner(mx.array(tokens)[None])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_features_handed_to_the_draft_are_the_layer_outputs(loaded, pairs, family):
    model, tokenizer, draft = loaded[family]
    target = Target(model)
    proposer = RecordingProposer(draft, target)
    decoder = SpeculativeDecoder(target, proposer, draft.config.target_layer_ids, 4, prefill_step_size=3)
    prompt = tokenizer.encode("write a short story about a cat who")
    out = [decoder.prefill(mx.array(prompt))]
    for _ in range(6):
        out += decoder.cycle().tokens
    features = mx.concatenate(proposer.seen, axis=1)
    committed = prompt + out[:-1]
    assert features.shape[1] == len(committed)
    H = target.hidden_size
    for k, layer_id in enumerate(draft.config.target_layer_ids):
        want = layer_output_uncached(pairs[family][0], committed, layer_id)
        got = features[..., k * H : (k + 1) * H]
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item(), f"layer {layer_id}"


def check_recording_forward_matches_the_plain_forward(model, tokenizer) -> None:
    """Hidden states, features and recurrent states of a recording pass are
    bit-identical to a plain pass's, and the pass records something."""
    target = Target(model)
    tokens = mx.array(tokenizer.encode("the quick brown fox jumps over the lazy dog"))[None]
    caches = [target.make_cache(), target.make_cache()]
    for cache in caches:
        target.forward(tokens[:, :4], cache, [1])
    plain = target.forward(tokens[:, 4:], caches[0], [1])
    recorded = target.forward(tokens[:, 4:], caches[1], [1], record=True)
    assert mx.array_equal(plain.hidden, recorded.hidden)
    assert mx.array_equal(plain.features, recorded.features)
    assert any(r is not None for r in recorded.records)
    for a, b in zip(*caches):
        if not isinstance(a, KVCache):  # every array of a recurrent layer's cache
            assert all(mx.array_equal(x, y).item() for x, y in zip(a.cache, b.cache))


def test_recording_forward_matches_the_plain_forward(loaded):
    """The GatedDeltaNet path that records for rollback computes exactly what
    mlx-lm's own layer computes."""
    model, tokenizer, _ = loaded["qwen3_5"]
    check_recording_forward_matches_the_plain_forward(model, tokenizer)
