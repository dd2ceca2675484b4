"""Gemma 4 images (mlx-vlm's ``gemma4``), placed as mlx-vlm places them.

- The chat template writes one ``<|image|>`` per image; it becomes
  ``<|image>``, one ``<|image|>`` per soft token of the image, ``<image|>``
  (mlx-vlm's ``Gemma4Processor``).
- The tower's pooled patches, projected by ``embed_vision``, replace those
  rows' embeddings (after the text embeddings' sqrt(hidden_size) scale,
  which the features do not get).
- The per-layer inputs of a pass holding image rows are made from the ids
  with every image, audio and video id set to 0 and from the embeddings with
  the features in place.
- Positions are the text's: Gemma 4 rotates every row at its index.
- With ``use_bidirectional_attention: "vision"`` in the text config, the
  rows of one image attend to each other both ways in every layer (sliding
  layers too, past their window); everything else stays causal
  (``ImagePrompt.spans``, ``target.py``).
"""

import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn


class GemmaVision:
    """A Gemma 4 checkpoint's vision tower, its projection and its image processor."""

    def __init__(self, vlm: nn.Module, path: Path, text: nn.Module):
        from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4Processor

        config = vlm.config
        self.tower = vlm.vision_tower
        self.project = vlm.embed_vision
        self.image_token_id = config.image_token_id
        self.bounds = (config.boi_token_id, config.eoi_token_id)
        self.zeroed = [t for t in (config.image_token_id, config.audio_token_id, config.video_token_id) if t is not None]
        self.bidirectional = config.text_config.use_bidirectional_attention == "vision"
        with warnings.catch_warnings():  # its audio feature extractor warns about unused mel filters
            warnings.simplefilter("ignore")
            self.processor = Gemma4Processor.from_pretrained(str(path)).image_processor

    def encode(self, pixels: list) -> tuple[mx.array, list[int], None]:
        """(features [N, H] of every image in order, soft tokens per image, None)."""
        out, counts = self.processor(pixels)
        values = out["pixel_values"]
        values = [mx.array(v) for v in values] if isinstance(values, list) else mx.array(values)
        return self.project(self.tower(values))[0], counts, None

    def expand(self, ids: list[int], rows: list[int]) -> list[int]:
        """The prompt with each image's placeholder as its soft tokens between the image's bounds."""
        begin, end = self.bounds
        out, images = [], iter(rows)
        for token in ids:
            out.extend([begin, *[token] * next(images), end] if token == self.image_token_id else [token])
        return out

    def layer_tokens(self, tokens: mx.array) -> mx.array:
        """The ids the per-layer inputs of a pass holding image rows are made from."""
        for token in self.zeroed:
            tokens = mx.where(tokens == token, 0, tokens)
        return tokens
