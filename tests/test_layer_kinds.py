"""Layer kinds: every target layer runs and rolls back through its kind, and a
cache is accepted by what it can do (mlx-lm's ``is_trimmable``), not its type."""

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, QuantizedKVCache, RotatingKVCache

from dflash_mlx import DFlashError, Target, load_draft
from dflash_mlx.loop.decoder import SpeculativeDecoder
from dflash_mlx.targets.gated_delta import GATED_DELTA
from dflash_mlx.targets.layer_kinds import Attention


@pytest.fixture(scope="module")
def llama(target_dirs, draft_dir):
    model, tokenizer = mlx_lm_load(str(target_dirs["llama"]))
    return model, tokenizer, load_draft(str(draft_dir("llama")))


def test_kinds_per_family(target_dirs):
    kinds = {}
    for family in ("qwen3", "qwen3_5", "gpt_oss", "qwen3_next", "gemma4"):
        model, _ = mlx_lm_load(str(target_dirs[family]))
        kinds[family] = Target(model).kinds
    assert {k.name for k in kinds["qwen3"]} == {"full_attention"}
    assert GATED_DELTA in kinds["qwen3_5"] and Attention("full_attention") in kinds["qwen3_5"]
    assert [k.name for k in kinds["gpt_oss"]] == ["sliding_attention", "full_attention"] * 2
    assert kinds["gpt_oss"][0].window == 4
    assert kinds["qwen3_next"] == [GATED_DELTA, Attention("full_attention")] * 2  # the same recurrence as qwen3_5
    assert kinds["gemma4"] == [Attention("sliding_attention", 4), Attention("full_attention")] * 3  # each layer's type


@pytest.mark.parametrize("make, name", [
    (lambda: ArraysCache(2), "ArraysCache"),  # not trimmable
    (lambda: RotatingKVCache(max_size=8), "rotating KV cache"),  # on a full-attention layer
])
def test_a_cache_that_cannot_roll_back_is_refused_by_name(llama, make, name):
    model = llama[0]
    model.make_cache = lambda: [make() for _ in model.layers]  # this instance only
    try:
        with pytest.raises(DFlashError, match=name):
            Target(model).make_cache()
    finally:
        del model.make_cache


def test_a_trimmable_cache_of_another_type_rolls_back_at_every_length(tmp_path):
    """mlx-lm's QuantizedKVCache is trimmable: accepted, and with an oracle
    proposer cut short at every position the output is mlx-lm's own greedy
    generation with the same caches, and the caches hold exactly what was committed."""
    from checkpoints import write_target
    from test_loop import OracleProposer

    write_target(tmp_path / "target", "llama", num_hidden_layers=2, head_dim=32)
    model, tokenizer = mlx_lm_load(str(tmp_path / "target"))
    model.make_cache = lambda: [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
    target = Target(model)
    assert all(type(c) is QuantizedKVCache for c in target.make_cache())
    prompt = tokenizer.encode("the quick brown fox")
    block = 6
    continuation = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=3 * block + 2)]
    for corrupt_at in [*range(block - 1), None]:
        oracle = OracleProposer(len(prompt), continuation, corrupt_at, target.vocab_size)
        decoder = SpeculativeDecoder(target, oracle, [0], block)
        out = [decoder.prefill(mx.array(prompt))]
        for _ in range(2):
            cycle = decoder.cycle()
            assert cycle.accepted == (block - 1 if corrupt_at is None else corrupt_at)
            out += cycle.tokens
            assert out == continuation[: len(out)]
            assert all(c.offset == len(prompt) + len(out) - 1 for c in decoder.cache)
