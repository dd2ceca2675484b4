"""The synthetic checkpoints load through mlx-lm and follow the documented draft layout."""

import json

import mlx.core as mx
import mlx_lm
import pytest
from checkpoints import FAMILIES, build_target
from mlx.utils import tree_flatten


@pytest.mark.parametrize("family", FAMILIES)
def test_target_round_trips_through_mlx_lm(family, target_dirs):
    model, tokenizer, config = mlx_lm.load(str(target_dirs[family]), return_config=True)
    reference, _ = build_target(family)
    loaded = dict(tree_flatten(model.parameters()))
    expected = dict(tree_flatten(reference.parameters()))
    assert loaded.keys() == expected.keys()
    assert all(mx.array_equal(loaded[k], expected[k]).item() for k in expected)

    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    assert len(set(ids)) >= 8
    x = mx.array([ids])
    assert mx.array_equal(model(x), reference(x)).item()

    vocab_size = config.get("text_config", config)["vocab_size"]
    assert len(tokenizer.get_vocab()) == vocab_size
    assert tokenizer.convert_tokens_to_ids("<mask>") == vocab_size - 1
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids("</s>")}
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello world"}], add_generation_prompt=True
    )
    assert chat[0] == tokenizer.bos_token_id
    assert chat[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert all(tokenizer.decode([i]) for i in range(vocab_size))


def _expected_shapes(n, H=64, k=2):
    shapes = {"fc.weight": (H, k * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(n):
        a, m = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        shapes |= {
            f"{a}.q_proj.weight": (64, H), f"{a}.k_proj.weight": (32, H),
            f"{a}.v_proj.weight": (32, H), f"{a}.o_proj.weight": (H, 64),
            f"{a}.q_norm.weight": (16,), f"{a}.k_norm.weight": (16,),
            f"{m}.gate_proj.weight": (128, H), f"{m}.up_proj.weight": (128, H),
            f"{m}.down_proj.weight": (H, 128),
            f"layers.{i}.input_layernorm.weight": (H,),
            f"layers.{i}.post_attention_layernorm.weight": (H,),
        }
    return shapes


@pytest.mark.parametrize(
    "family,dialect,dtype,layer_ids",
    [("qwen3", "new", "float32", [1, 3]), ("qwen3_5", "old", "bfloat16", [1, 2])],
)
def test_draft_layout(family, dialect, dtype, layer_ids, draft_dir):
    path = draft_dir(family, dialect, dtype=dtype)
    weights, metadata = mx.load(str(path / "model.safetensors"), return_metadata=True)
    assert metadata == {"format": "pt"}
    assert len(weights) == 11 * 2 + 3
    assert {k: tuple(v.shape) for k, v in weights.items()} == _expected_shapes(2)
    assert all(v.dtype == getattr(mx, dtype) for v in weights.values())

    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    dflash = config["dflash_config"]
    assert dflash["target_layer_ids"] == layer_ids
    assert dflash["mask_token_id"] == 511
    if dialect == "new":
        assert dflash["block_size"] == 8 and config["rope_parameters"]["rope_theta"] == 1e6
    else:
        assert config["block_size"] == 8 and "block_size" not in dflash
        assert config["rope_theta"] == 1e6 and config["rope_scaling"] is None

    omitted = draft_dir(family, dialect, omit=("fc.weight",))
    assert "fc.weight" not in mx.load(str(omitted / "model.safetensors"))
