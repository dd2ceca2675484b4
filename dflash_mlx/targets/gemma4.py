"""Gemma 4 targets (mlx-lm's ``gemma4`` and ``gemma4_text``): one pass through the
decoder stack as ``Gemma4TextModel.__call__`` makes it, layer by layer.

- The embeddings are scaled by sqrt(hidden_size) (the model's ``embed_scale``),
  for the target's own pass and for the draft, which borrows them through
  ``Target.embed``.
- With ``hidden_size_per_layer_input`` > 0 every layer also takes its slice of
  the per-layer inputs, made once per pass from the token ids and the scaled
  embeddings by the model's own methods.
- The last ``num_kv_shared_layers`` layers own no cache: each attends over the
  keys, values and RoPE offset that the last owning layer of its type produced
  in the same pass, i.e. over that layer's cache just after its update. The
  model's ``make_cache`` makes caches for the owners only; rolling those back
  is all a rollback needs, and the sharing layers read the rolled-back state
  on the next pass.
- Sliding-window layers are attention layers with a window (``layer_kinds``).
- The logits are soft-capped, c·tanh(z/c) with c = ``final_logit_softcapping``
  (mlx-lm's own compiled ``logit_softcap``), for verification and for the draft
  (``Target.logits``).
"""

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma4_text import logit_softcap


class _Pass:
    """One pass's per-layer inputs and the (K/V, RoPE offset) each layer produced,
    which the layers sharing its K/V read."""

    def __init__(self, sources: list[int], per_layer: list[Optional[mx.array]]):
        self.sources = sources  # per layer: the layer whose K/V it attends over (itself if it owns a cache)
        self.per_layer = per_layer
        self.produced: list[tuple] = [(None, None)] * len(sources)

    def call(self, i: int, layer: nn.Module) -> Callable:
        def run(h: mx.array, mask, cache) -> mx.array:
            shared_kv, offset = self.produced[self.sources[i]]
            h, kv, offset = layer(h, mask, cache, per_layer_input=self.per_layer[i], shared_kv=shared_kv, offset=offset)
            self.produced[i] = (kv, offset)
            return h

        return run


class Gemma4Stack:
    """How a Gemma 4 pass enters, chains and leaves the decoder layers."""

    def __init__(self, text: nn.Module):
        self.inner = text.model
        self.softcap = text.args.final_logit_softcapping

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens) * self.inner.embed_scale

    def layer_calls(self, layers: list, tokens: mx.array, h: mx.array) -> list[Callable]:
        """Each layer as ``call(h, mask, cache) -> h`` for one pass over ``tokens``
        [B, T] whose scaled embeddings are ``h``."""
        inner, per_layer = self.inner, [None] * len(layers)
        if inner.hidden_size_per_layer_input:
            inputs = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(tokens))
            per_layer = [inputs[:, :, i, :] for i in range(len(layers))]
        one_pass = _Pass(inner.previous_kvs, per_layer)
        return [one_pass.call(i, layer) for i, layer in enumerate(layers)]

    def finish_logits(self, logits: mx.array) -> mx.array:
        return logits if self.softcap is None else logit_softcap(self.softcap, logits)
