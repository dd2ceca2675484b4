"""Tiny deterministic checkpoints in the real on-disk formats, built on the fly.

Targets are mlx-lm models saved with mlx-lm's own writers; drafts follow the
z-lab Hugging Face layout (docs/architecture.md, "Checkpoint formats"). Nothing
touches the network.
"""

import copy
import importlib
import itertools
import json
import string
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import save_config, save_model
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from dflash_mlx.targets import SUPPORTED_MODEL_TYPES as FAMILIES  # one checkpoint per supported family

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
MASK_TOKEN = "<mask>"  # always the last id, vocab_size - 1
# transformers' Qwen2/Qwen3.5 pre-tokenizer split.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = """
the quick brown fox jumps over lazy dog hello world what is capital of france
write short story about cat who and to in it you that he was for on are with
as his they be at one have this from or had by word but some we can out other
were all there when up use your how said an each she which do their time if
will way many then them would like so these her long make thing see him two
has look more day could go come did number sound no most people my know water
than call first may down side been now find any new work part take get place
""".split()

DRAFT_HEADS, DRAFT_KV_HEADS, DRAFT_HEAD_DIM, DRAFT_INTERMEDIATE = 4, 2, 16, 128

_BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attention_bias": False,
}
_FAMILY = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 6,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": 6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 4,
        "rope_theta": 1000000.0,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    "gpt_oss": {  # attention sinks, biases, alternating sliding/full layers, clamped-SwiGLU MoE
        "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 4,  # smaller than a 16-token verify block
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "tie_word_embeddings": False,
    },
    "qwen3_5": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": True,
    },
    "qwen3_5_moe": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "tie_word_embeddings": False,
    },
    "qwen3_next": {  # GatedDeltaNet with head-grouped qkvz/ba projections, gated attention, MoE + shared expert
        "architectures": ["Qwen3NextForCausalLM"],
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": True,
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
    },
    "gemma4": {  # text_config below: per-layer inputs and KV-shared layers on
        "architectures": ["Gemma4ForConditionalGeneration"],
        "tie_word_embeddings": True,
    },
    "gemma4_text": {  # the 26B-A4B/31B shape: MoE beside the MLP, K = V on full layers, no sharing
        "architectures": ["Gemma4ForCausalLM"],
        "tie_word_embeddings": True,
    },
    "lfm2": {  # LFM2's layout: short-convolution layers (window 2) with attention at 2 and 4; no head of its own
        "architectures": ["Lfm2ForCausalLM"],
        "num_hidden_layers": 6,
        "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "lfm2_moe": {  # LFM2-8B-A1B's layout: lfm2's layers, the first two feed-forwards dense, then sigmoid-routed MoE
        "architectures": ["Lfm2MoeForCausalLM"],
        "num_hidden_layers": 4,
        "layer_types": ["conv", "full_attention", "conv", "conv"],
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "num_dense_layers": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "use_expert_bias": True,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
}
# Gemma 4: sliding layers (window 4, smaller than a verify block) and full
# layers with a wider head and partial proportional RoPE; soft-capped logits.
_GEMMA4_TEXT = {
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "full_attention"] * 3,
    "sliding_window": 4,
    "global_head_dim": 32,
    "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0,
}
_GEMMA4_FAMILY_TEXT = {
    "gemma4": {  # layers 4 and 5 read the K/V of layers 2 and 3
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 512,
        "num_kv_shared_layers": 2,
    },
    "gemma4_text": {
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    },
}
_QWEN3_5_TEXT = {
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
    },
}
_QWEN3_5_MOE_TEXT = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True,
}

EMBED_STD = 0.1
FINAL_NORM = 16.0  # with EMBED_STD: logits of std ~13, i.e. peaked next-token distributions
LINEAR_STD = 0.2


def text_config(config: dict) -> dict:
    """The language-model part of a target config (``text_config`` for qwen3_5)."""
    return config.get("text_config", config)


def _byte_char(b: int) -> str:
    """GPT-2 byte-level symbol of byte ``b`` (valid for b <= 126)."""
    return chr(b) if 33 <= b <= 126 else chr(256 + b)


def _bpe_vocab(vocab_size: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Specials, ASCII byte symbols, then space-prefixed words grown one merge at a time."""
    vocab = SPECIAL_TOKENS + [_byte_char(b) for b in [10, *range(32, 127)]]
    merges, known = [], set(vocab)
    filler = ("".join(p) for n in (2, 3) for p in itertools.product(string.ascii_lowercase, repeat=n))
    for word in itertools.chain(WORDS, filler):
        piece = _byte_char(32)
        for ch in word:
            if len(vocab) >= vocab_size - 1:
                return vocab + [MASK_TOKEN], merges
            if piece + ch not in known:
                known.add(piece + ch)
                vocab.append(piece + ch)
                merges.append((piece, ch))
            piece += ch
    raise ValueError(f"vocab_size {vocab_size} is too large")


# Text with multi-byte UTF-8 (2-byte accents, 3-byte CJK, 4-byte emoji) for the trained tokenizer.
UTF8_CORPUS = [
    " ".join(WORDS[i : i + 12]) + " " + extra
    for i in range(0, len(WORDS), 12)
    for extra in ["café naïve résumé déjà vu", "中文 日本語 한국어 漢字", "emoji 🙂 🚀 🎉 👍🏽", "Ünïcödé ßtraße €100"]
]


def _trained_bpe(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained over ``UTF8_CORPUS``: specials, all 256 byte
    symbols, then merges, ``vocab_size - 1`` ids (``<mask>`` comes last)."""
    tok = Tokenizer(models.BPE())
    _set_pipeline(tok)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(UTF8_CORPUS, trainer)
    if tok.get_vocab_size() != vocab_size - 1:
        raise ValueError(f"vocab_size {vocab_size} is too large for the UTF-8 corpus")
    return tok


def _set_pipeline(tok: Tokenizer) -> None:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()


def write_tokenizer(path: Path, vocab_size: int, utf8: bool = False) -> None:
    """Write a byte-level BPE tokenizer with exactly ``vocab_size`` ids.

    The pipeline is the one transformers' Qwen3_5Tokenizer rebuilds from
    tokenizer.json (it ignores the file's own pipeline for qwen3_5 configs), so
    every family tokenizes alike. BOS is prepended; ``<mask>`` is the last id.
    By default every id decodes to non-empty ASCII text; with ``utf8`` the
    vocabulary is trained over ``UTF8_CORPUS`` and holds every byte, so ids
    can end inside a multi-byte character.
    """
    if utf8:
        tok = _trained_bpe(vocab_size)
    else:
        vocab, merges = _bpe_vocab(vocab_size)
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, merges))
        _set_pipeline(tok)
    tok.add_special_tokens(SPECIAL_TOKENS + [MASK_TOKEN])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "mask_token": MASK_TOKEN,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _target_config(family: str, overrides: dict) -> dict:
    """The Hugging Face style config.json of a tiny target."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    config = {"model_type": family, **copy.deepcopy(_FAMILY[family])}
    if family.startswith("gemma4"):
        text = {**_BASE, **copy.deepcopy(_GEMMA4_TEXT), **_GEMMA4_FAMILY_TEXT[family], **overrides}
        if family == "gemma4_text":
            return {**text, **config}
        text["model_type"] = "gemma4_text"
        return {**config, "vocab_size": text["vocab_size"], "text_config": text}
    if not family.startswith("qwen3_5"):
        return {**_BASE, **config, **overrides}
    text = {**_BASE, **copy.deepcopy(_QWEN3_5_TEXT), "model_type": family + "_text"}
    if family == "qwen3_5_moe":
        text.update(_QWEN3_5_MOE_TEXT)
    text = {**text, "tie_word_embeddings": config["tie_word_embeddings"], **overrides}
    config["tie_word_embeddings"] = text["tie_word_embeddings"]
    return {**config, "text_config": text}


def _init_weights(model, seed: int) -> None:
    """Overwrite every parameter with seeded values (norms near 1, final norm large)."""
    rng = np.random.default_rng(seed)
    params = []
    for name, p in sorted(tree_flatten(model.parameters())):
        if "embed_tokens" in name or "lm_head" in name:
            w = rng.normal(0.0, EMBED_STD, p.shape)
            w[[*range(len(SPECIAL_TOKENS)), -1]] *= 0.1  # specials and <mask>: rarely predicted
        elif name.endswith(("model.norm.weight", "model.embedding_norm.weight")):  # lfm2's final norm
            w = FINAL_NORM * (1.0 + 0.1 * rng.normal(size=p.shape))
        elif name.endswith(".bias"):
            w = rng.normal(0.0, 0.02, p.shape)
        elif name.endswith("A_log"):
            w = np.log(rng.uniform(1.0, 16.0, p.shape))
        elif p.ndim == 1:
            w = 1.0 + 0.1 * rng.normal(size=p.shape)
        elif "conv1d" in name:
            w = rng.normal(0.0, 0.5, p.shape)
        else:
            w = rng.normal(0.0, LINEAR_STD, p.shape)
        params.append((name, mx.array(w.astype(np.float32))))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())


def build_target(family: str, seed: int = 0, **overrides):
    """Build a tiny float32 mlx-lm target of ``family`` in memory: (model, config).

    ``overrides`` update the (text) config.
    """
    config = _target_config(family, overrides)
    arch = importlib.import_module(f"mlx_lm.models.{family}")
    # ModelArgs may edit nested dicts (qwen3_5 renames rope_type), so use a copy.
    model = arch.Model(arch.ModelArgs.from_dict(copy.deepcopy(config)))
    _init_weights(model, seed)
    return model, config


def write_target(path: Path, family: str, seed: int = 0, utf8: bool = False, **overrides) -> dict:
    """Save ``build_target(family, seed, **overrides)`` with mlx-lm's writers plus a tokenizer
    (``write_tokenizer``'s UTF-8 one with ``utf8``).

    ``mlx_lm.load(str(path))`` gives the same model back. Returns the config.
    """
    model, config = build_target(family, seed, **overrides)
    path = Path(path)
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    write_tokenizer(path, text_config(config)["vocab_size"], utf8)
    return config


# Tensors a multimodal qwen3_5 checkpoint carries beside the language model (name -> shape):
# a vision tower under mlx-vlm's and Hugging Face's names, and a multi-token-prediction head.
VISION_AND_MTP_TENSORS = {
    "vision_tower.blocks.0.attn.qkv.weight": (48, 16),
    "vision_tower.merger.mlp.0.weight": (64, 16),
    "model.visual.patch_embed.proj.weight": (16, 3, 2, 2, 2),
    "mtp.fc.weight": (64, 128),
    "mtp.layers.0.mlp.gate_proj.weight": (128, 64),
}


def write_vision_carrying_target(path: Path, family: str = "qwen3_5", seed: int = 0) -> dict:
    """``write_target`` plus ``VISION_AND_MTP_TENSORS`` in a second shard (listed in
    mlx-lm's index) and a ``vision_config``, as multimodal checkpoints (Qwen3.8)
    ship. Returns the config."""
    config = write_target(path, family, seed)
    path = Path(path)
    rng = np.random.default_rng(seed + 1)
    extra = {name: mx.array(rng.normal(0.0, 0.05, shape).astype(np.float32))
             for name, shape in VISION_AND_MTP_TENSORS.items()}
    mx.save_safetensors(str(path / "model-extra.safetensors"), extra, metadata={"format": "mlx"})
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: "model-extra.safetensors" for name in extra})
    index_path.write_text(json.dumps(index, indent=4))
    config.update(vision_config={"depth": 1, "hidden_size": 16, "out_hidden_size": 64}, image_token_id=3)
    (path / "config.json").write_text(json.dumps(config, indent=4))
    return config


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default ids, clamped to the target's layers and kept distinct if possible."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    ids = [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]
    for j in range(1, n):
        ids[j] = max(ids[j], ids[j - 1] + 1)
    for j in range(n):
        ids[j] = min(ids[j], L - n + j)
    return [min(max(i, 0), L - 1) for i in ids]


def draft_tensor_shapes(hidden_size: int, num_layers: int, num_features: int) -> dict:
    """Name -> shape of every tensor in a DFlash draft (11 per layer + 3)."""
    H, I, D = hidden_size, DRAFT_INTERMEDIATE, DRAFT_HEAD_DIM
    shapes = {}
    for i in range(num_layers):
        a, m = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        shapes.update({
            f"{a}.q_proj.weight": (DRAFT_HEADS * D, H),
            f"{a}.k_proj.weight": (DRAFT_KV_HEADS * D, H),
            f"{a}.v_proj.weight": (DRAFT_KV_HEADS * D, H),
            f"{a}.o_proj.weight": (H, DRAFT_HEADS * D),
            f"{a}.q_norm.weight": (D,),
            f"{a}.k_norm.weight": (D,),
            f"{m}.gate_proj.weight": (I, H),
            f"{m}.up_proj.weight": (I, H),
            f"{m}.down_proj.weight": (H, I),
            f"layers.{i}.input_layernorm.weight": (H,),
            f"layers.{i}.post_attention_layernorm.weight": (H,),
        })
    shapes.update({
        "fc.weight": (H, num_features * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    })
    return shapes


def write_draft(
    path: Path,
    target_config: dict,
    *,
    dialect: str = "new",
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
    omit: tuple[str, ...] = (),
) -> dict:
    """Write a z-lab style DFlash draft (config.json + model.safetensors) for a target.

    ``dialect`` is "new" (``dflash_config`` holds block_size, ``rope_parameters``)
    or "old" (flat block_size / rope_theta / rope_scaling). ``omit`` drops the
    named tensors. Returns the config.
    """
    if dialect not in ("new", "old"):
        raise ValueError(f"unknown dialect {dialect!r}")
    target = text_config(target_config)
    H, L, V = target["hidden_size"], target["num_hidden_layers"], target["vocab_size"]
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(L, num_layers)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "num_hidden_layers": num_layers,
        "num_attention_heads": DRAFT_HEADS,
        "num_key_value_heads": DRAFT_KV_HEADS,
        "head_dim": DRAFT_HEAD_DIM,
        "intermediate_size": DRAFT_INTERMEDIATE,
        "hidden_act": "silu",
        "vocab_size": V,
        "rms_norm_eps": 1e-6,
        "num_target_layers": L,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "torch_dtype": dtype,
    }
    dflash = {"mask_token_id": V - 1, "target_layer_ids": list(target_layer_ids)}
    if dialect == "new":
        config["dflash_config"] = {"block_size": block_size, **dflash}
        config["rope_parameters"] = {"rope_theta": 1000000.0, "rope_type": "default"}
    else:
        config["dflash_config"] = dflash
        config.update(block_size=block_size, rope_theta=1000000.0, rope_scaling=None)
    if layer_types is not None:
        config["layer_types"] = list(layer_types)
    if sliding_window is not None:
        config["sliding_window"] = sliding_window

    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in draft_tensor_shapes(H, num_layers, len(target_layer_ids)).items():
        if len(shape) == 1:
            w = 1.0 + 0.05 * rng.normal(size=shape)
        else:
            w = rng.normal(0.0, 0.05, shape)
        if name not in omit:
            weights[name] = mx.array(w.astype(np.float32)).astype(getattr(mx, dtype))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return config


def dflash2_tensor_shapes(hidden_size: int, num_layers: int, vocab_size: int,
                          kernel_size: int, group_size: int, rank: int) -> dict:
    """Name -> shape of the tensors DFlash2 adds to a DFlash draft, named as
    z-lab stores them (the two codebooks without ``.weight``)."""
    H, K, G = hidden_size, kernel_size, hidden_size // group_size
    shapes = {}
    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, K, H)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * K * G, H)
    shapes["candidate_selector.hidden_projection.weight"] = (rank, H)
    shapes["candidate_selector.predecessor_codebook"] = (vocab_size, rank)
    shapes["candidate_selector.successor_codebook"] = (vocab_size, rank)
    return shapes


def write_dflash2_draft(
    path: Path,
    target_config: dict,
    *,
    kernel_size: int = 2,
    group_size: int = 16,
    rank: int = 16,
    top_k: int = 4,
    output_multiplier: float | None = None,
    softcap: float | None = None,
    is_causal: bool | None = False,
    layout: str = "hf",
    codebook_std: float = 0.5,
    seed: int = 0,
    **draft_kwargs,
) -> dict:
    """Write a DFlash2 draft for a target: ``write_draft``'s v1 tensors plus
    ``dflash2_tensor_shapes``, ``architectures: ["DFlash2DraftModel"]`` and the
    DFlash2 keys in ``dflash_config``. ``layout`` "hf" is z-lab's; "mlx" is ours
    (codebooks with ``.weight``, the config as ``DFlash2Config.to_dict``).
    ``is_causal`` None leaves the key out; ``output_multiplier`` and ``softcap``
    go in ``dflash_config`` when given. Returns the config."""
    from dflash_mlx.draft import DFlash2Config

    if layout not in ("hf", "mlx"):
        raise ValueError(f"unknown layout {layout!r}")
    path = Path(path)
    config = write_draft(path, target_config, seed=seed, **draft_kwargs)
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"].update(conv_kernel_size=kernel_size, conv_group_size=group_size,
                                   selector_rank=rank, selector_top_k=top_k)
    if output_multiplier is not None:
        config["dflash_config"]["output_multiplier"] = output_multiplier
    if softcap is not None:
        config["dflash_config"]["final_logit_softcapping"] = softcap
    if is_causal is not None:
        config["is_causal"] = is_causal
    weights = dict(mx.load(str(path / "model.safetensors")))
    rng = np.random.default_rng(seed + 1)
    shapes = dflash2_tensor_shapes(config["hidden_size"], config["num_hidden_layers"], config["vocab_size"],
                                   kernel_size, group_size, rank)
    for name, shape in shapes.items():
        if name.endswith("base_kernel"):
            w = rng.normal(0.0, 0.3, shape)
            w[:, 0] += 1.0  # near the identity at offset 0: the sublayers still matter
        elif "codebook" in name:
            w = rng.normal(0.0, codebook_std, shape)
        else:
            w = rng.normal(0.0, 0.05, shape)
        weights[name] = mx.array(w.astype(np.float32)).astype(next(iter(weights.values())).dtype)
    if layout == "mlx":
        for name in ("predecessor_codebook", "successor_codebook"):
            key = f"candidate_selector.{name}"
            weights[f"{key}.weight"] = weights.pop(key)
        config = DFlash2Config.from_dict(config).to_dict()
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return config
