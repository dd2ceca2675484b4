"""Qwen3.5 / 3.6 / 3.8 images (mlx-vlm's ``qwen3_5`` and ``qwen3_5_moe``).

- One ``<|image_pad|>`` per image in the templated prompt becomes t·h·w / m²
  of them (the image's patch grid, merged m×m by the tower).
- The tower's outputs replace those rows' token embeddings.
- Attention layers rotate queries and keys with multimodal RoPE: every text
  position has (p, p, p), an image's rows (t, h, w) over its grid, and the
  text after an image continues from the largest position before it plus
  one, so every later position p is its index plus ``delta`` (<= 0). mlx-vlm's
  ``get_rope_index`` makes the positions and mlx-vlm's attention applies
  them, over the mlx-lm layer's own projections and norms (shared, not
  copied); GatedDeltaNet layers take no positions and run as for text.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

SHARED = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")  # an attention's weights


class QwenVision:
    """A Qwen3.5-family checkpoint's vision tower and image processor."""

    def __init__(self, vlm: nn.Module, path: Path, text: nn.Module):
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor, _qwen_vl_image_kwargs

        self.tower = vlm.vision_tower
        self.language = vlm.language_model  # for get_rope_index and its attention modules
        self.image_token_id = vlm.config.image_token_id
        self.processor = Qwen3VLImageProcessor(**_qwen_vl_image_kwargs(str(path)))
        self.merge = vlm.config.vision_config.spatial_merge_size
        self.attention = {}  # layer index -> mlx-vlm attention over the mlx-lm layer's weights
        for i, (ours, theirs) in enumerate(zip(text.layers, self.language.model.layers)):
            if not getattr(ours, "is_linear", True):
                theirs.self_attn.update_modules({name: getattr(ours.self_attn, name) for name in SHARED})
                self.attention[i] = theirs.self_attn

    def encode(self, pixels: list) -> tuple[mx.array, list[int], mx.array]:
        """(features [N, H] of every image in order, rows per image, grids [n, 3])."""
        out = self.processor(pixels)
        grids = mx.array(out["image_grid_thw"])
        values = mx.array(out["pixel_values"]).astype(self.tower.patch_embed.proj.weight.dtype)
        features, _ = self.tower(values, grids)
        rows = [int(t * h * w) // self.merge**2 for t, h, w in grids.tolist()]
        return features, rows, grids

    def expand(self, ids: list[int], rows: list[int]) -> list[int]:
        """The prompt with each image's one placeholder repeated for its rows."""
        out, images = [], iter(rows)
        for token in ids:
            out.extend([token] * next(images) if token == self.image_token_id else [token])
        return out

    def positions(self, ids: mx.array, grids: mx.array) -> tuple[mx.array, int]:
        """(RoPE positions [3, P] of the expanded prompt, the delta of every later position)."""
        positions, delta = self.language.get_rope_index(ids[None], grids)
        return positions[:, 0], int(delta.reshape(-1)[0].item())

    def layer_tokens(self, tokens: mx.array) -> mx.array:
        return tokens

    def layer_calls(self, calls: list, layers: list, positions: mx.array) -> list:
        """The pass's calls, attention layers at ``positions`` [3, T]."""
        return [self._at(layers[i], self.attention[i], positions) if i in self.attention else call
                for i, call in enumerate(calls)]

    @staticmethod
    def _at(layer: nn.Module, attention: nn.Module, positions: mx.array):
        def run(h: mx.array, mask, cache) -> mx.array:  # mlx-lm's DecoderLayer, at the given positions
            h = h + attention(layer.input_layernorm(h), mask, cache, position_ids=positions[:, None])
            return h + layer.mlp(layer.post_attention_layernorm(h))

        return run
