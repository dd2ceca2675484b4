"""stream_generate / generate behaviour around the loop: stopping, prompt
kinds, streamed text, and errors raised before any generation."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.models import gpt2

from dflash_mlx import DFlashError, Target, generate, load_draft, stream_generate
from dflash_mlx.validate import UntrainedBlockWarning


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
    with pytest.warns(UntrainedBlockWarning, match="above the draft's trained block size 4"):
        res = generate(model, draft, tokenizer, "hello", max_tokens=max_tokens, block_size=8)
    assert res.tokens == reference(model, tokenizer, "hello", max_tokens)
    assert res.finish_reason == "length"


def test_prompt_may_be_text_ids_or_array_and_text_streams(pair):
    model, tokenizer, draft = pair
    ids = tokenizer.encode("write a short story")
    runs = [
        generate(model, draft, tokenizer, p, max_tokens=20)
        for p in ("write a short story", ids, mx.array(ids), np.array(ids), np.array(ids, np.uint16))
    ]
    assert all(r.tokens == runs[0].tokens for r in runs)
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
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": 0.7, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": float("nan")}, "top_p must be a finite number"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_k": 2.0}, "top_k must be an integer"),
        ({"max_tokens": 0}, "max_tokens must be positive"),
        ({"max_tokens": 5.5}, "max_tokens must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"prefill_step_size": 0}, "prefill_step_size must be positive"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"repetition_context_size": 0}, "repetition_context_size must be positive"),
        ({"presence_penalty": float("inf")}, "presence_penalty must be a finite number"),
        ({"frequency_penalty": "1"}, "frequency_penalty must be a finite number"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"seed": 2**64}, "seed must be below 18446744073709551616"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"block_size": 1}, "block_size must be at least 2"),
        ({"block_size": 0}, "block_size must be at least 2"),
        ({"block_size": 2.5}, "block_size must be an integer"),
        ({"block_size": True}, "block_size must be an integer"),
        ({"block_size": 9}, r"block_size must be at most 8 \(2x the draft's trained block size 4\)"),
        ({"block_size": 100000}, "block_size must be at most 8"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "   "}, "prompt is empty"),
        ({"prompt": "caf\udcc3"}, "prompt is not valid UTF-8"),
        ({"prompt": []}, "prompt is empty"),
        ({"prompt": [999999]}, r"prompt token ids must lie in \[0, 512\), got 999999"),
        ({"prompt": [-1, 5]}, r"prompt token ids must lie in \[0, 512\), got -1"),
        ({"prompt": [5, 512]}, "got 512"),
        ({"prompt": [5, 2**70]}, f"got {2**70}"),
        ({"prompt": np.array([5, 2**64 - 1], np.uint64)}, f"got {2**64 - 1}"),
        ({"prompt": [1.5, 2.7]}, "prompt token ids must be integers, got 1.5"),
        ({"prompt": [True, 5]}, "prompt token ids must be integers, got True"),
        ({"prompt": np.array([1.5, 2.0])}, "prompt token ids must be integers, got an array of float64"),
        ({"prompt": mx.array([1.0, 2.0])}, "prompt token ids must be integers"),
        ({"prompt": np.array([[5, 6], [7, 8]])}, r"prompt must be one sequence of token ids, got shape \(2, 2\)"),
        ({"prompt": mx.array([700, 5])}, r"must lie in \[0, 512\)"),
        ({"logit_bias": {600: 1.0}}, "logit_bias token id must be below 512"),
        ({"logit_bias": {-2: 1.0}}, "logit_bias token id must be >= 0"),
        ({"logit_bias": {1.5: 1.0}}, "logit_bias token id must be an integer"),
        ({"logit_bias": {5: float("nan")}}, r"logit_bias\[5\] must be a finite number"),
        ({"logit_bias": [5]}, "logit_bias must be a dict"),
    ],
)
def test_bad_arguments_raise_before_generating(pair, kwargs, message):
    model, tokenizer, draft = pair
    kwargs = {"prompt": "hello"} | kwargs
    with pytest.raises(DFlashError, match=message):
        next(stream_generate(model, draft, tokenizer, **kwargs))


def test_block_above_the_trained_size_warns_and_stays_lossless(pair):
    model, tokenizer, draft = pair
    with pytest.warns(UntrainedBlockWarning, match="block_size 6 is above the draft's trained block size 4"):
        res = generate(model, draft, tokenizer, "hello world", max_tokens=12, block_size=6)
    assert res.tokens == reference(model, tokenizer, "hello world", 12)


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
