"""Published models for ``bench --predict --preset``: their configs (weights
never needed) and the speedup measured on them, to check the cost model against."""

from typing import Optional


def _qwen35_text(hidden, layers, inter, heads, kv, linear_v, **extra) -> dict:
    return {"model_type": "qwen3_5_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": 256, "vocab_size": 248320, "rms_norm_eps": 1e-6,
            "linear_num_key_heads": 16, "linear_num_value_heads": linear_v,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4, "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
            **extra}


def _qwen35(text: dict, tied: bool, moe: bool = False, quant: Optional[dict] = None) -> dict:
    text = {**text, "tie_word_embeddings": tied}
    cfg = {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "tie_word_embeddings": tied,
           "torch_dtype": "bfloat16", "text_config": text}
    if moe:
        cfg["text_config"]["model_type"] = "qwen3_5_moe_text"
    if quant:
        cfg["quantization"] = quant
    return cfg


def _z_lab_draft(hidden: int, inter: int, target_layers: int, layers: int = 6, features: int = 5) -> dict:
    return {"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": inter, "vocab_size": 248320,
            "num_target_layers": target_layers, "torch_dtype": "bfloat16",
            "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"],
            "sliding_window": 4096,
            "dflash_config": {"block_size": 16, "mask_token_id": 248077,
                              "target_layer_ids": [1 + i * (target_layers - 4) // (features - 1)
                                                   for i in range(features)]},
            "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"}}


Q4 = {"group_size": 64, "bits": 4}
_MOE = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True}

# name -> (target config, draft config, published speedup at 1024 tokens on an
# M5 Max (bstnxbt/dflash-mlx 0.1.4, greedy, block 16), tau assumed for it)
# Target shapes: THUDM/slime scripts/models (27B, 35B-A3B, 4B), Qwen3.5-9B from its
# published architecture (32 layers, 4096/12288, 16/4 heads of 256, GDN 16 key /
# 32 value heads of 128; 8.95 B parameters, which the built model reproduces).
# Draft shapes are assumptions: six z-lab layers of the target's width (the
# published drafts' layout, see docs/architecture.md), 32 x 128 heads, 5 target features; the 9B's (1.24 B parameters) matches the
# ~1.3 GiB Q8_0 export of z-lab/Qwen3.5-9B-DFlash, the 35B-A3B's 8192-wide MLP its
# 905 MB bf16 checkpoint.
PRESETS: dict[str, tuple[dict, dict, Optional[float], float]] = {
    "qwen3.5-4b": (_qwen35(_qwen35_text(2560, 32, 9216, 16, 4, 32), tied=True),
                   _z_lab_draft(2560, 9216, 32), 3.40, 7.7),
    "qwen3.5-9b": (_qwen35(_qwen35_text(4096, 32, 12288, 16, 4, 32), tied=False),
                   _z_lab_draft(4096, 12288, 32), 4.37, 7.5),
    "qwen3.5-27b-4bit": (_qwen35(_qwen35_text(5120, 64, 17408, 24, 4, 48), tied=False, quant=Q4),
                         _z_lab_draft(5120, 17408, 64), 2.37, 7.5),
    "qwen3.5-35b-a3b-4bit": (_qwen35(_qwen35_text(2048, 40, 512, 16, 2, 32, **_MOE), tied=False,
                                     moe=True, quant=Q4),
                             _z_lab_draft(2048, 8192, 40), 1.76, 7.5),
}
