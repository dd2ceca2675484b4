"""Published models for ``bench --predict --preset``: their configs (weights
never needed) and the speedup measured on them, to check the cost model against."""

from typing import Optional

from ..draft import default_target_layer_ids


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


def _draft(hidden: int, inter: int, target_layers: int, layers: int, target_layer_ids: list[int], *,
           heads: int = 32, kv_heads: int = 8, vocab: int = 248320, mask: int = 248077, block: int = 16,
           window: int = 4096, full_last: bool = True, rope_theta: float = 1e7, **extra) -> dict:
    """A z-lab draft config.json: Qwen3 layers of 128-wide heads, sliding but
    (with ``full_last``) the last; ``extra`` goes to ``dflash_config``."""
    types = ["sliding_attention"] * (layers - int(full_last)) + ["full_attention"] * int(full_last)
    return {"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": 128, "intermediate_size": inter, "vocab_size": vocab,
            "num_target_layers": target_layers, "torch_dtype": "bfloat16",
            "layer_types": types, "sliding_window": window,
            "dflash_config": {"block_size": block, "mask_token_id": mask,
                              "target_layer_ids": target_layer_ids, **extra},
            "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"}}


def _z_lab_draft(hidden: int, inter: int, target_layers: int, layers: int = 6, features: int = 5) -> dict:
    return _draft(hidden, inter, target_layers, layers, default_target_layer_ids(target_layers, features))


def _dflash2(draft: dict, kernel: int, group: int, rank: int, top_k: int) -> dict:
    """A DFlash2 draft config: ``draft`` with the convolution and selector keys
    (docs/dflash2.md, "Config"); every layer sliding, the block bidirectional."""
    cfg = {**draft, "architectures": ["DFlash2DraftModel"], "is_causal": False,
           "layer_types": ["sliding_attention"] * draft["num_hidden_layers"]}
    cfg["dflash_config"] = {**draft["dflash_config"], "conv_kernel_size": kernel, "conv_group_size": group,
                            "selector_rank": rank, "selector_top_k": top_k}
    return cfg


def _gemma4_text(hidden, layers, inter, heads, kv, global_kv, window, **extra) -> dict:
    return {"model_type": "gemma4", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
            "text_config": {
                "model_type": "gemma4_text", "hidden_size": hidden, "num_hidden_layers": layers,
                "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
                "num_global_key_value_heads": global_kv, "head_dim": 256, "global_head_dim": 512,
                "vocab_size": 262144, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
                "sliding_window": window, "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
                "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6),
                "rope_parameters": {
                    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
                    "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
                **extra}}


def _qwen3_next(hidden, layers, heads, kv, vocab, **extra) -> dict:
    return {"model_type": "qwen3_next", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 5120, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": 256, "vocab_size": vocab, "rms_norm_eps": 1e-6,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 262144,
            "rope_theta": 5e6, "partial_rotary_factor": 0.25, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", **extra}


def _qwen3(hidden, layers, inter, heads, tied) -> dict:
    """A Qwen3 dense config.json (8 KV heads of 128, vocabulary 151936)."""
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden,
            "num_hidden_layers": layers, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "max_position_embeddings": 40960, "tie_word_embeddings": tied,
            "torch_dtype": "bfloat16"}


def _dspark(target: dict, target_layer_ids: list[int], gamma: int = 7, rank: int = 256) -> dict:
    """A DeepSpec DSpark draft config.json: the target's config with five
    full-attention layers and DeepSpec's keys (docs/dspark.md); ``num_anchors``
    (training only) is a placeholder."""
    return {**target, "architectures": ["Qwen3DSparkModel"], "num_hidden_layers": 5,
            "num_target_layers": target["num_hidden_layers"], "layer_types": ["full_attention"] * 5,
            "tie_word_embeddings": False, "block_size": gamma, "mask_token_id": 151669,
            "target_layer_ids": target_layer_ids, "num_anchors": 512, "enable_confidence_head": True,
            "confidence_head_with_markov": True, "markov_rank": rank, "markov_head_type": "vanilla"}


_QWEN3 = {"4b": _qwen3(2560, 36, 9728, 32, True), "8b": _qwen3(4096, 36, 12288, 32, False),
          "14b": _qwen3(5120, 40, 17408, 40, False)}
Q4 = {"group_size": 64, "bits": 4}
_MOE = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True}

# name -> (target config, draft config, published speedup at 1024 tokens on an
# M5 Max (bstnxbt/dflash-mlx 0.1.4, greedy, block 16) or None, tau assumed at the
# draft's trained block size)
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
    # Qwen3.8-27B is model_type qwen3_5; its DFlash2 draft's published tensors (H 5120,
    # 32 query / 8 KV heads of 128, MLP 17408, kernel_projection 1280 x 5120 so K 2 and
    # gs 16, codebooks 248320 x 256 so R 256; block 8) are those tests/test_dflash2_convert.py
    # expects. Assumed: the target has Qwen3.5-27B's shapes (its width and vocabulary
    # agree), the draft 5 layers reading 5 features, top-k 16 candidates, window 2048,
    # tau 6 at its block of 8. No published measurement on a Mac.
    "qwen3.8-27b": (_qwen35(_qwen35_text(5120, 64, 17408, 24, 4, 48), tied=False),
                    _dflash2(_draft(5120, 17408, 64, 5, default_target_layer_ids(64, 5), block=8, window=2048),
                             kernel=2, group=16, rank=256, top_k=16), None, 6.0),
    # google/gemma-4-31B-it text config (60 layers, 5376 wide, MLP 21504, 32 heads; sliding
    # layers 16 KV heads of 256 over a window of 1024, every sixth layer full with 4 KV heads
    # of 512 and K = V; vocabulary 262144, tied head, softcap 30) as the Core AI port's card
    # (huggingface.co/mlboydaisuke/Gemma-4-31B-CoreAI) and apxml.com/models/gemma-4-31b
    # (heads, KV heads, MLP) give it; 30.7 B parameters, which the built model reproduces. Draft
    # z-lab/gemma-4-31B-it-DFlash as its Q8_0 GGUF card (huggingface.co/Lucebox/
    # gemma-4-31B-it-DFlash-GGUF) gives it: 5 layers of 5376, 64 query / 8 KV heads of 128,
    # MLP 10752, window 2048, softcap 30, RoPE theta 1e6, target_layer_ids
    # [1, 12, 23, 35, 46, 57] of 60, block 16, mask 4; 1.63 GB at Q8_0, 53% of bf16.
    # The issue gives 4 sliding layers then 1 full. tau 6 at b=16 is assumed.
    "gemma-4-31b": (_gemma4_text(5376, 60, 21504, 32, 16, 4, 1024, attention_k_eq_v=True,
                                 use_double_wide_mlp=False, num_kv_shared_layers=0,
                                 hidden_size_per_layer_input=0, enable_moe_block=False),
                    _draft(5376, 10752, 60, 5, [1, 12, 23, 35, 46, 57], heads=64, vocab=262144, mask=4,
                           window=2048, rope_theta=1e6, final_logit_softcapping=30.0), None, 6.0),
    # Qwen/Qwen3-Coder-Next (qwen3_next) from Qwen's model card (huggingface.co/Qwen/
    # Qwen3-Coder-Next, also mirrored in the nerdpudding/llama_cpp repository) and its GGUF
    # metadata on ollama.com/library/qwen3-coder-next: 48 layers of 2048, 3 Gated DeltaNet
    # (16 key / 32 value heads of 128, conv 4) then 1 gated attention (16 query / 2 KV heads
    # of 256, RoPE over 64 dims, theta 5e6); dense MLP 5120; 512 experts of 512, 10 routed and
    # 1 shared of 512. Vocabulary 151936 (Qwen3-Next's; the card's 80 B total against 79 B
    # non-embedding is its two 151936 x 2048 tables); the built model has 79.7 B parameters.
    # Draft z-lab/Qwen3-Coder-Next-DFlash: 8 layers of 2048 (llama.cpp's DFlash loader test
    # asserts both). Assumed: z-lab's 32 x 128 query / 8 KV heads, MLP 6144, 5 features at
    # the published default ids for 48 layers, block 16; tau 7 at b=16. At 4 bits (about
    # 45 GB), as a Mac holds it.
    # Qwen/Qwen3.5-397B-A17B: 60 layers of 4096 in 15 x (3 Gated DeltaNet + 1 gated attention),
    # attention 32 query / 2 KV heads of 256, Gated DeltaNet 16 key / 64 value heads of 128, 512
    # experts of 1024 (10 routed, 1 shared), as Qwen's model card gives it (hidden size, heads, KV
    # heads, head size and experts also on pcpartguide.com/local-llms/qwen-3.5-397b-a17b); the built
    # model has 396.3 B parameters, 223 GB at mlx-lm's 4 bits. Too large for one Mac: the preset
    # for --predict --machines (two M3 Ultras of 512 GB hold it). Draft z-lab/Qwen3.5-397B-A17B-DFlash,
    # assumed: z-lab's six layers of the target's width, MLP 12288, block 16; tau 7.5 assumed.
    "qwen3.5-397b-a17b-4bit": (_qwen35(_qwen35_text(4096, 60, 1024, 32, 2, 64, num_experts=512,
                                                    num_experts_per_tok=10, moe_intermediate_size=1024,
                                                    shared_expert_intermediate_size=1024, norm_topk_prob=True),
                                       tied=False, moe=True, quant=Q4),
                               _z_lab_draft(4096, 12288, 60), None, 7.5),
    # DeepSeek's DSpark drafts (deepseek-ai/dspark_qwen3_{4b,8b,14b}_block7, gamma 7, so b = 8):
    # Qwen3-4B/8B/14B's published configs; each draft is its target's config with 5 layers,
    # rank-256 vanilla Markov head and a confidence head reading [h ; W1[x]] (NVIDIA-NeMo/RL's
    # fixture of the 8B draft's tensor shapes; docs/dspark.md). With the copies of the target's
    # embedding and head that the checkpoints carry (dropped on load, as here), the built
    # drafts are the hub's 2.79 GB (4B) and 4.74 GB (8B) in bf16. tau 5 at b=8 is assumed:
    # no measurement of these drafts is published for a Mac.
    "qwen3-4b-dspark": (_QWEN3["4b"], _dspark(_QWEN3["4b"], [1, 9, 17, 25, 33]), None, 5.0),
    "qwen3-8b-dspark": (_QWEN3["8b"], _dspark(_QWEN3["8b"], [1, 9, 17, 25, 33]), None, 5.0),
    "qwen3-14b-dspark": (_QWEN3["14b"], _dspark(_QWEN3["14b"], [1, 10, 19, 28, 37]), None, 5.0),
    "qwen3-coder-next-4bit": (_qwen3_next(2048, 48, 16, 2, 151936, num_experts=512, num_experts_per_tok=10,
                                          moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                          norm_topk_prob=True, quantization=Q4),
                              _draft(2048, 6144, 48, 8, default_target_layer_ids(48, 5), vocab=151936,
                                     mask=151669, rope_theta=5e6), None, 7.0),
}
