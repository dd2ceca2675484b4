"""The layer of Gemma 4's DSpark packaging (``Gemma4DSparkModel``): the block
attends to [context ; block] through a Gemma 4 full-attention layer
(docs/dspark.md, "Packagings").

- The head width is the config's ``global_head_dim``. With
  ``attention_k_eq_v`` there is no ``v_proj``: V is ``k_proj``'s output
  through a weightless RMS norm (``v_norm``), over ``num_global_key_value_heads``;
  otherwise V is ``v_norm(v_proj x)``. K is ``k_norm(k_proj x)``, then RoPE.
- The attention scale is 1 (``q_norm`` and ``k_norm`` set the logits' scale),
  and the RoPE is that of Gemma 4's full-attention layers (proportional, over
  a part of the head).
- Each layer norms around both sublayers ("sandwich" norms), runs a gelu (tanh)
  MLP, and multiplies its output by ``layer_scalar``.

The block's embeddings (scaled by sqrt(H)) and the soft-capped logits are the
target's own, as for every draft (``loop/decoder.py``'s ``DraftProposer``).
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma3_text import MLP
from mlx_lm.models.gemma4_text import RMSNormNoScale

from .model import DraftAttention, DraftConfig


class Gemma4DraftAttention(DraftAttention):
    """A Gemma 4 full-attention layer's attention over [context ; block]."""

    def __init__(self, config: DraftConfig):
        super().__init__(config, sliding_window=None, causal=False)
        self.scale = 1.0
        self.k_eq_v = config.attention_k_eq_v
        if self.k_eq_v:
            del self.v_proj
        self.v_norm = RMSNormNoScale(config.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """K = rope(k_norm(k_proj x)), V = v_norm(k_proj x) (K = V) or v_norm(v_proj x)."""
        B, L, _ = x.shape
        raw = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        values = raw if self.k_eq_v else self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        keys = self.rope(self.k_norm(raw).transpose(0, 2, 1, 3), offset=offset)
        return keys, self.v_norm(values).transpose(0, 2, 1, 3)


class Gemma4DraftLayer(nn.Module):
    """Attention and MLP, each between its own pre- and post-norm, then ``layer_scalar``."""

    def __init__(self, config: DraftConfig, layer_type: str):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4DraftAttention(config)
        self.mlp = MLP(hidden, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, cache) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar
