"""Target adapter: one mlx-lm model instance, run layer by layer.

It reuses the instance's own modules (no patching of mlx-lm classes) to return
logits-ready hidden states plus the features at ``target_layer_ids``, and it
rolls every cache back exactly after a partially accepted block:

- attention ``KVCache`` layers are trimmed; a sliding-window layer whose model
  asks for a ``RotatingKVCache`` (gpt-oss) gets a plain ``KVCache`` instead, with
  the window applied by its mask: the same attention, and exactly trimmable;
- GatedDeltaNet (``ArraysCache``) layers are restored from what the verify pass
  recorded, replaying only the accepted steps (see ``gated_delta.py``).

On a quantized target the verify pass (``forward(..., record=True)``) and the
logits of up to 32 rows run their quantized matmuls through the block-verify
kernel where it is active (``kernels.qmm``): this instance's ``QuantizedLinear``
layers are swapped for the duration of the pass only, and put back after it.
"""

import contextlib
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from . import gated_delta
from .errors import DFlashError
from .kernels import qmm

_nothing = contextlib.nullcontext

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss")
SUPPORTED_CACHES = (KVCache, ArraysCache)


def _layer_kinds(inner: nn.Module, layers: list) -> list[str]:
    """'linear' (GatedDeltaNet), 'sliding' or 'full' attention, per layer."""
    types = getattr(inner, "layer_types", None) or [None] * len(layers)  # gpt-oss names them
    return [
        "linear" if getattr(layer, "is_linear", False)
        else "sliding" if getattr(layer, "use_sliding", False) or kind == "sliding_attention"
        else "full"
        for layer, kind in zip(layers, types)
    ]


@dataclass
class Forward:
    """What one target pass returns: final-normed hidden states and features."""

    hidden: mx.array  # [B, T, H], after the final norm
    features: mx.array  # [B, T, k*H], outputs of the target_layer_ids layers
    records: Optional[list] = None  # per layer: a GatedDeltaRecord or None


class Target:
    """An mlx-lm model instance seen as a DFlash target."""

    def __init__(self, model: nn.Module):
        model_type = getattr(model, "model_type", type(model).__module__)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise DFlashError(
                f"target model type '{model_type}' is not supported; supported: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        self.model = model
        self.model_type = model_type
        text = getattr(model, "language_model", model)
        self.inner = text.model
        self.layers = model.layers
        self.kinds = _layer_kinds(self.inner, self.layers)
        self.sliding_window = getattr(self.inner, "sliding_window", None) or getattr(
            self.inner, "window_size", None
        )
        if "sliding" in self.kinds and not self.sliding_window:
            raise DFlashError(f"target '{model_type}' has sliding-window layers but no window size")
        self.args = text.args
        tied = getattr(text.args, "tie_word_embeddings", False)
        self.lm_head = self.inner.embed_tokens.as_linear if tied else text.lm_head
        self._head_module = self.inner.embed_tokens if tied else text.lm_head
        self._verify_matmuls: Optional[qmm.VerificationMatmuls] = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size  # not the weight's width: quantized weights are packed

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def make_cache(self) -> list:
        """The model's own cache list, checked for types we can roll back; a
        ``RotatingKVCache`` of a sliding layer becomes a ``KVCache`` (the mask
        applies the window)."""
        make = getattr(self.model, "make_cache", None)
        cache = make() if make else [KVCache() for _ in self.layers]
        cache = [
            KVCache() if type(c) is RotatingKVCache and kind == "sliding" and c.keep == 0 else c
            for c, kind in zip(cache, self.kinds)
        ]
        for c in cache:
            if type(c) not in SUPPORTED_CACHES:
                raise DFlashError(
                    f"target cache type '{type(c).__name__}' cannot be rolled back; "
                    "supported: KVCache (attention) and ArraysCache (GatedDeltaNet)"
                )
        return cache

    def _masks(self, h: mx.array, cache: list) -> dict:
        first = {}
        for kind, c in zip(self.kinds, cache):
            first.setdefault(kind, c)
        masks = {}
        for kind, c in first.items():
            if kind == "linear":
                masks[kind] = create_ssm_mask(h, c)
            elif kind == "sliding":
                masks[kind] = create_attention_mask(h, c, window_size=self.sliding_window)
            else:
                masks[kind] = create_attention_mask(h, c)
        return masks

    def forward(
        self,
        tokens: mx.array,
        cache: Optional[list],
        layer_ids: list[int],
        record: bool = False,
    ) -> Forward:
        """Run tokens [B, T] through the target, capturing features at ``layer_ids``.

        With ``record=True`` (block verification) GatedDeltaNet layers also keep
        what ``rollback`` needs.
        """
        cache = cache if cache is not None else [None] * self.num_layers
        h = self.embed(tokens)
        masks = self._masks(h, cache)
        wanted = {i: None for i in layer_ids}
        records = [None] * self.num_layers if record else None
        with self.verifying() if record else _nothing():
            for i, (layer, kind, c) in enumerate(zip(self.layers, self.kinds, cache)):
                if record and kind == "linear":
                    h, records[i] = gated_delta.recording_layer(layer, h, masks[kind], c)
                else:
                    h = layer(h, masks[kind], c)
                if i in wanted:
                    wanted[i] = h
        features = mx.concatenate([wanted[i] for i in layer_ids], axis=-1)
        return Forward(self.inner.norm(h), features, records)

    def verifying(self):
        """Context manager for a verify pass: this instance's quantized linears
        use the block-verify matmul kernel inside it (nothing changes where the
        kernel cannot run)."""
        if self._verify_matmuls is None:
            self._verify_matmuls = qmm.VerificationMatmuls(self.model)
        return self._verify_matmuls()

    def logits(self, hidden: mx.array) -> mx.array:
        if isinstance(self._head_module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            out = qmm.quantized_matmul(hidden, self._head_module)
            if out is not None:
                if "bias" in self._head_module:
                    out = out + self._head_module["bias"]
                return out
        return self.lm_head(hidden)

    def rollback(self, cache: list, forward: Forward, keep: int) -> None:
        """Leave ``cache`` exactly as if only the first ``keep`` tokens of the
        recorded block had been fed."""
        block = forward.hidden.shape[1]
        if keep == block:
            return
        for c, rec in zip(cache, forward.records):
            if rec is not None:
                gated_delta.restore(c, rec, keep)
            else:
                c.trim(block - keep)
