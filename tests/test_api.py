"""stream_generate / generate behaviour around the loop: stopping, prompt
kinds, streamed text, and errors raised before any generation."""

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.models import gpt2

from dflash_mlx import DFlashError, Target, generate, load_draft, stream_generate


@pytest.fixture(scope="module")
def pair(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["qwen3"]))
    return model, tokenizer, load_draft(str(draft_dir("qwen3", block_size=4)))


def reference(model, tokenizer, prompt, n):
    ids = mx.array(tokenizer.encode(prompt))
    return [t for t, _ in generate_step(ids, model, max_tokens=n)]


def test_stops_at_eos_without_emitting_it_or_anything_after(pair):
    model, tokenizer, draft = pair
    want = reference(model, tokenizer, "the quick brown fox", 40)
    stop_at = next(i for i in range(5, 40) if want[i] not in want[:i])
    tokenizer.add_eos_token(want[stop_at])
    try:
        res = generate(model, draft, tokenizer, "the quick brown fox", max_tokens=40)
    finally:
        tokenizer.eos_token_ids.discard(want[stop_at])
    assert res.tokens == want[:stop_at]
    assert res.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 33])
def test_stops_at_exactly_max_tokens(pair, max_tokens):
    model, tokenizer, draft = pair
    res = generate(model, draft, tokenizer, "hello", max_tokens=max_tokens, block_size=16)
    assert res.tokens == reference(model, tokenizer, "hello", max_tokens)
    assert res.finish_reason == "length"


def test_prompt_may_be_text_ids_or_array_and_text_streams(pair):
    model, tokenizer, draft = pair
    ids = tokenizer.encode("write a short story")
    runs = [
        generate(model, draft, tokenizer, p, max_tokens=20)
        for p in ("write a short story", ids, mx.array(ids))
    ]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    assert runs[0].text == tokenizer.decode(runs[0].tokens).lstrip(" ")  # mlx-lm drops one leading space
    responses = list(stream_generate(model, draft, tokenizer, ids, max_tokens=20))
    assert [t for r in responses for t in r.tokens] == runs[0].tokens
    assert responses[0].accepted == 0 and responses[-1].finish_reason == "length"
    assert all(r.finish_reason is None for r in responses[:-1])
    assert responses[-1].generation_tokens == 20 and responses[-1].prompt_tokens == len(ids)
    assert responses[-1].peak_memory > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": 0.7, "top_p": 0.0}, "top_p must be in"),
        ({"max_tokens": 0}, "max_tokens must be positive"),
        ({"block_size": 1}, "block_size must be at least 2"),
        ({"block_size": 0}, "block_size must be at least 2"),
        ({"prompt": ""}, "prompt is empty"),
    ],
)
def test_bad_arguments_raise_before_generating(pair, kwargs, message):
    model, tokenizer, draft = pair
    kwargs = {"prompt": "hello"} | kwargs
    with pytest.raises(DFlashError, match=message):
        next(stream_generate(model, draft, tokenizer, **kwargs))


def test_unsupported_model_type_is_named():
    args = gpt2.ModelArgs(
        model_type="gpt2", n_ctx=64, n_embd=32, n_head=2, n_layer=1,
        n_positions=64, layer_norm_epsilon=1e-5, vocab_size=64,
    )
    with pytest.raises(DFlashError, match="'gpt2' is not supported"):
        Target(gpt2.Model(args))


def test_sliding_window_layers_get_a_trimmable_cache_and_stay_lossless(tmp_path):
    """mlx-lm gives a llama's sliding layers a RotatingKVCache, which cannot be
    trimmed once it wraps; the adapter swaps in a KVCache and masks the window."""
    from checkpoints import write_draft, write_target
    from mlx_lm.models.cache import KVCache

    config = write_target(
        tmp_path / "target", "llama", num_hidden_layers=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    write_draft(tmp_path / "draft", config)
    model, tokenizer = mlx_lm_load(str(tmp_path / "target"))
    assert all(type(c) is KVCache for c in Target(model).make_cache())
    draft = load_draft(str(tmp_path / "draft"))
    prompt = "write a short story about a cat who"
    want = reference(model, tokenizer, prompt, 48)  # mlx-lm, with its rotating cache
    assert generate(model, draft, tokenizer, prompt, max_tokens=48, block_size=8).tokens == want


def test_unsupported_cache_type_is_named(pair):
    from mlx_lm.models.cache import QuantizedKVCache

    model, _, _ = pair
    model.make_cache = lambda: [QuantizedKVCache() for _ in model.layers]  # this instance only
    try:
        with pytest.raises(DFlashError, match="QuantizedKVCache"):
            Target(model).make_cache()
    finally:
        del model.make_cache
