"""The DFlash draft network and its config (both checkpoint dialects; see
docs/architecture.md, "Drafting" and "Checkpoint formats").

The draft has no embedding and no LM head: it borrows the target's. Target
features are fused by ``fc`` + ``hidden_norm`` and injected as keys/values into
every layer's context cache; the block attends to [context ; block]. Block
positions are never left in the cache.

Which keys a block query sees (:func:`visible`, the reference's rule): on
``sliding_attention`` layers a query at absolute position t sees keys at
positions s with t - s < ``sliding_window`` and, being causal, s <= t;
``full_attention`` layers see every context and block position. A config's
explicit ``is_causal`` sets causality for every layer alike.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from .cache import DraftContextCache
from .injection import InjectionPlan
from ..errors import DFlashError
from ..kernels.registry import current_policy

SLIDING = "sliding_attention"
FULL = "full_attention"


def visible(query_positions: mx.array, key_positions: mx.array, window: Optional[int], causal: bool) -> mx.array:
    """Boolean [..., Lq, Lk]: whether the query at each absolute position sees
    the key at each absolute position (the window is per query, as z-lab's
    reference draft masks it)."""
    t, s = query_positions[..., :, None], key_positions[..., None, :]
    seen = (t - s < window) if window is not None else mx.ones(t.shape[:-1] + s.shape[-1:], dtype=mx.bool_)
    return seen & (s <= t) if causal else seen


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default: n ids spread evenly over target layers 1..L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [
        int(round(start + i * span / (num_draft_layers - 1)))
        for i in range(num_draft_layers)
    ]


@dataclass
class DraftConfig:
    """Everything the draft needs, parsed from either config dialect."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    num_target_layers: Optional[int]  # None: the config does not say (a speculators-format DSpark draft)
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    rope_theta: float
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)
    sliding_window: Optional[int] = None
    attention_bias: bool = False
    is_causal: Optional[bool] = None  # None: causal block attention on sliding layers only
    quantization: Optional[dict] = None
    output_multiplier: float = 1.0  # logits * this, then soft-capped when a cap is set
    input_embedding_scale: float = 1.0
    final_logit_softcapping: Optional[float] = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "DraftConfig":
        """Parse a z-lab (newer or older dialect) or converted MLX config."""
        dflash = cfg.get("dflash_config") or {}

        def need(key, source=cfg, where="config.json"):
            if key not in source:
                raise DFlashError(f"draft {where} has no '{key}' field")
            return source[key]

        n = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        num_target_layers = int(need("num_target_layers"))
        rope = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            rope_scaling = rope
        if "mask_token_id" not in dflash and "mask_token_id" not in cfg:
            raise DFlashError("draft config.json has no 'dflash_config.mask_token_id' field")
        layer_types = list(cfg.get("layer_types") or [FULL] * n)
        get = lambda key, default: dflash.get(key, cfg.get(key, default))  # dflash_config wins
        cap = get("final_logit_softcapping", None)
        config = cls(
            hidden_size=hidden,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            num_target_layers=num_target_layers,
            block_size=int(dflash.get("block_size", cfg.get("block_size", 16))),
            mask_token_id=int(dflash.get("mask_token_id", cfg.get("mask_token_id"))),
            target_layer_ids=[
                int(i)
                for i in dflash.get("target_layer_ids")
                or default_target_layer_ids(num_target_layers, n)
            ],
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e4))),  # Qwen3Config default
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            layer_types=layer_types,
            sliding_window=cfg.get("sliding_window"),
            attention_bias=bool(cfg.get("attention_bias", False)),
            is_causal=None if cfg.get("is_causal") is None else bool(cfg["is_causal"]),
            quantization=cfg.get("quantization"),
            output_multiplier=float(get("output_multiplier", 1.0)),
            input_embedding_scale=float(get("input_embedding_scale", 1.0)),
            final_logit_softcapping=None if cap is None else float(cap),
        )
        config.validate()
        return config

    def validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashError(
                f"draft config has {len(self.layer_types)} layer_types for "
                f"{self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - {SLIDING, FULL}
        if unknown:
            raise DFlashError(f"draft config has unknown layer_types {sorted(unknown)}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise DFlashError("draft config has sliding_attention layers but no sliding_window")
        if self.block_size < 2:
            raise DFlashError(f"draft config block_size is {self.block_size}; it must be >= 2")
        if not self.target_layer_ids:
            raise DFlashError("draft config has an empty target_layer_ids")

    def to_dict(self) -> dict[str, Any]:
        """The newer z-lab dialect, as converted drafts store it."""
        cfg = {
            "model_type": "qwen3",
            "architectures": ["DFlashDraftModel"],
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "num_target_layers": self.num_target_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rope_scaling": self.rope_scaling,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": self.target_layer_ids,
            },
        }
        if self.is_causal is not None:
            cfg["is_causal"] = self.is_causal
        if self.quantization is not None:
            cfg["quantization"] = self.quantization
        for key, default in (("output_multiplier", 1.0), ("input_embedding_scale", 1.0),
                             ("final_logit_softcapping", None)):
            if getattr(self, key) != default:
                cfg["dflash_config"][key] = getattr(self, key)
        return cfg

    def causal(self, layer_type: str) -> bool:
        """Whether a layer of this type masks later block positions."""
        return layer_type == SLIDING if self.is_causal is None else self.is_causal

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features: k * hidden_size."""
        return len(self.target_layer_ids) * self.hidden_size


def _context_keep(window: Optional[int]) -> Optional[int]:
    """Context positions a layer's block queries can still see: the last
    window - 1 on a sliding layer (the block's first query sees back to
    p - window + 1), all of them otherwise."""
    return None if window is None else window - 1


class DraftAttention(nn.Module):
    """Qwen3 attention whose keys/values are [injected context ; block]."""

    def __init__(self, config: DraftConfig, sliding_window: Optional[int], causal: bool):
        super().__init__()
        dim, hd = config.hidden_size, config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.scale = hd**-0.5
        self.sliding_window = sliding_window
        self.causal = causal
        bias = config.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            hd,
            config.rope_theta,
            False,
            config.rope_scaling,
            config.max_position_embeddings,
        )
        self._fused_heads = mx.compile(self._heads)

    def _heads(self, x: mx.array, weight: mx.array, eps: float, offset) -> mx.array:
        return self.rope(mx.fast.rms_norm(x, weight, eps).transpose(0, 2, 1, 3), offset=offset)

    def heads(self, x: mx.array, norm: nn.RMSNorm, offset) -> mx.array:
        """rope(norm(x)) over heads x [B, L, n, hd], as [B, n, L, hd] at
        positions offset.. (an int, or [B] per row), compiled so the norm's and
        the RoPE's fallback ops (about 40 graph nodes on CPU) fuse, where the
        RoPE is a plain one: it takes its offset as an array, so one trace
        serves every position (mlx-lm's scaled RoPEs may need an int)."""
        if type(self.rope) is not nn.RoPE:
            return self._heads(x, norm.weight, norm.eps, offset)
        return self._fused_heads(x, norm.weight, norm.eps, mx.array(offset, dtype=mx.int32))

    def keys_values(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        """K = rope(k_norm(k_proj x)) at positions offset.., V = v_proj x."""
        B, L, _ = x.shape
        k = self.heads(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1), self.k_norm, offset)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return k, v

    def __call__(self, x: mx.array, cache: DraftContextCache) -> mx.array:
        if hasattr(cache, "visible"):
            return self.rows(x, cache)
        B, L, _ = x.shape
        offset = cache.offset
        q = self.heads(self.q_proj(x).reshape(B, L, self.n_heads, -1), self.q_norm, offset)
        keys, values = cache.update_and_fetch(*self.keys_values(x, offset))
        cache.trim(L)  # the block is attended to, never kept
        start = self.first_visible(offset)
        keys, values = keys[..., start - cache.start :, :], values[..., start - cache.start :, :]
        mask = self.mask(offset, L, start)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def rows(self, x: mx.array, cache) -> mx.array:
        """A block per row of a batch whose context rows have their own lengths
        (``targets/rows.py``): each row's positions and mask are its own."""
        B, L, _ = x.shape
        offset = cache.offset  # [B]
        q = self.heads(self.q_proj(x).reshape(B, L, self.n_heads, -1), self.q_norm, offset)
        mask = cache.visible(L, self.sliding_window, self.causal)
        keys, values = cache.update_and_fetch(*self.keys_values(x, offset))
        cache.trim(L)  # the block is attended to, never kept
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def first_visible(self, offset: int) -> int:
        """The oldest key position any query of a block at ``offset`` can see."""
        return 0 if self.sliding_window is None else max(0, offset - self.sliding_window + 1)

    def mask(self, offset: int, L: int, start: int = 0):
        """The attention mask of a block of L queries at positions offset.. over
        the keys of positions start..offset+L-1, in the cheapest exact form."""
        window = self.sliding_window
        if window is None or offset + L - start <= window:  # the window excludes nothing
            return "causal" if self.causal and L > 1 else None
        return visible(mx.arange(offset, offset + L), mx.arange(start, offset + L), window, self.causal)


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig, layer_type: str):
        super().__init__()
        window = config.sliding_window if layer_type == SLIDING else None
        self.self_attn = DraftAttention(config, window, config.causal(layer_type))
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )

    def __call__(self, x: mx.array, cache: DraftContextCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """The draft network; tensor names match the z-lab checkpoints."""

    layer_class = DraftLayer

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self.layers = [self.layer_class(config, t) for t in config.layer_types]
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.injection_plan: Optional[InjectionPlan] = None  # see _injection
        self.vocab_ranking = None  # ids by corpus frequency, stored beside the draft (vocab.py)

    def make_cache(self) -> list[DraftContextCache]:
        """One context cache per layer; it only ever holds context positions, and
        on a sliding layer only those a block query can still see."""
        return [DraftContextCache(keep=_context_keep(layer.self_attn.sliding_window)) for layer in self.layers]

    def inject(self, features: mx.array, cache: list[DraftContextCache]) -> None:
        """Append target features [B, T, k*H] (the next T positions) to every layer's cache.

        One matmul projects K and V for all layers (the stacked weights of the
        draft's ``InjectionPlan``), then one kv_inject launch (or its MLX
        reference) applies every k_norm and RoPE. Layer by layer only for a
        RoPE the kernel does not implement (reported once, with the reason).
        """
        ctx = self.hidden_norm(self.fc(features))
        if hasattr(cache[0], "visible"):  # a batch's rows, each at its own offset
            for layer, c in zip(self.layers, cache):
                c.update_and_fetch(*layer.self_attn.keys_values(ctx, c.offset))
            return
        plan = self._injection()
        if plan.reason is not None or len({c.offset for c in cache}) > 1:
            for layer, c in zip(self.layers, cache):
                c.update_and_fetch(*layer.self_attn.keys_values(ctx, c.offset))
        else:
            keys, values = plan(ctx, cache[0].offset)
            for i, c in enumerate(cache):
                c.update_and_fetch(keys[i], values[i])
        for c in cache:
            c.compact()

    def _injection(self) -> InjectionPlan:
        """The injection plan, built on first use and again after new weights."""
        if self.injection_plan is None or not self.injection_plan.current(self):
            self.injection_plan = InjectionPlan(self)
            reason = self.injection_plan.reason
            if reason is not None:
                current_policy().warn_once(
                    f"kv_inject: {reason}",
                    f"dflash-mlx: KV injection runs layer by layer (the reference path): {reason}",
                )
        return self.injection_plan

    def __call__(self, block_embeddings: mx.array, cache: list[DraftContextCache]) -> mx.array:
        """Final-normed hidden states [B, b, H] for a block placed right after the context."""
        scale = self.config.input_embedding_scale
        h = block_embeddings if scale == 1.0 else block_embeddings * scale
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.norm(h)

    def scale_logits(self, logits: mx.array) -> mx.array:
        """z * output_multiplier, then cap * tanh(z / cap) when the config has a cap;
        -inf (an id a reduced drafting vocabulary leaves out) stays -inf."""
        config = self.config
        if config.output_multiplier != 1.0:
            logits = logits * config.output_multiplier
        cap = config.final_logit_softcapping
        if cap is None or cap <= 0:
            return logits
        return mx.where(logits == -mx.inf, logits, cap * mx.tanh(logits / cap))
