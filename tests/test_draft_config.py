"""Draft config.json fields left out take the defaults of the reference, Hugging
Face's Qwen3Config (the published drafts are Qwen3-style models)."""

import pytest
from transformers import Qwen3Config

from dflash_mlx import DFlashDraft, DraftConfig

CONFIG = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=48, vocab_size=64, num_target_layers=4,
    dflash_config={"block_size": 4, "mask_token_id": 63, "target_layer_ids": [1]},
)


@pytest.mark.parametrize("rope", [{}, {"rope_parameters": {"rope_type": "default"}}],
                         ids=["no rope fields", "rope_parameters without rope_theta"])
def test_rope_theta_defaults_to_the_qwen3_reference(rope):
    want = Qwen3Config().rope_parameters["rope_theta"]
    config = DraftConfig.from_dict({**CONFIG, **rope})
    assert config.rope_theta == want
    assert DFlashDraft(config).layers[0].self_attn.rope.base == want
