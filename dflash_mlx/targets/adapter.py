"""Target adapter: one mlx-lm model instance, run layer by layer.

It reuses the instance's own modules (no patching of mlx-lm classes) to return
logits-ready hidden states plus the features at ``target_layer_ids``, and it
rolls every cache back exactly after a partially accepted block. How each
layer runs and rolls back is its layer kind's business (``layer_kinds.py``):
attention caches are trimmed; GatedDeltaNet layers go back to a state the
verify pass went through, from what it recorded (``gated_delta.py``); LFM2's
short convolutions take their window from the recorded input (``short_conv.py``). How a
family's pass enters, chains and leaves its layers is its stack's business:
most call ``layer(h, mask, cache)`` on the embeddings (``PlainStack``); Gemma 4
scales the embeddings, feeds per-layer inputs, shares K/V across layers and
soft-caps the logits (``gemma4.py``).

On a quantized target the verify pass (``forward(..., record=True)``) and the
logits of up to 32 rows run their quantized matmuls through the block-verify
kernel where it is active (``verify_matmuls.py``): this instance's
``QuantizedLinear`` layers are swapped for the duration of the pass only.
"""

import contextlib
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..errors import DFlashError
from . import gemma4
from .layer_kinds import layer_kinds
from .verify_matmuls import VerificationMatmuls, quantized_matmul

SUPPORTED_MODEL_TYPES = (
    "llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss", "qwen3_next", "gemma4", "gemma4_text",
    "lfm2", "lfm2_moe",
)
FINAL_NORMS = {"lfm2": "embedding_norm", "lfm2_moe": "embedding_norm"}  # model type -> final norm, where not ``norm``


@dataclass(frozen=True)
class PlainStack:
    """A pass that calls ``layer(h, mask, cache)`` on the token embeddings and
    takes the head's output as the logits."""

    text: nn.Module  # the language model: ``model`` (the layers' owner) and ``args``

    def embed(self, tokens: mx.array) -> mx.array:
        return self.text.model.embed_tokens(tokens)

    def layer_calls(self, layers: list, tokens: mx.array, h: mx.array) -> list:
        return layers

    def finish_logits(self, logits: mx.array) -> mx.array:
        return logits


STACKS = {"gemma4": gemma4.Gemma4Stack, "gemma4_text": gemma4.Gemma4Stack}  # model type -> stack; else PlainStack


@dataclass
class Forward:
    """What one target pass returns: final-normed hidden states and features."""

    hidden: mx.array  # [B, T, H], after the final norm
    features: mx.array  # [B, T, k*H], outputs of the target_layer_ids layers
    records: Optional[list] = None  # per layer: what its kind needs to roll back, or None


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
        try:
            self.kinds = layer_kinds(self.inner, self.layers)
        except DFlashError as e:
            raise DFlashError(f"target '{model_type}': {e}") from None
        self.args = text.args
        # a model with no head of its own (lfm2) reads its logits through the embedding
        tied = getattr(text.args, "tie_word_embeddings", False) or not hasattr(text, "lm_head")
        self.lm_head = self.inner.embed_tokens.as_linear if tied else text.lm_head
        self.head_module = self.inner.embed_tokens if tied else text.lm_head  # holds the head's weights
        self.stack = STACKS.get(model_type, PlainStack)(text)
        self.final_norm = getattr(self.inner, FINAL_NORMS.get(model_type, "norm"))  # before the head
        self.verify_matmuls = VerificationMatmuls(model)  # with target.verify_matmuls(): one verify pass

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
        """The embeddings the target's first layer takes (and the draft borrows)."""
        return self.stack.embed(tokens)

    first_layer = 0  # the index of ``layers[0]`` in the model (a pipeline stage: its start)

    def stage_input(self, h: mx.array) -> mx.array:
        """What this process's first layer takes, given the embeddings (a pipeline
        stage: the hidden state the stage before it hands on)."""
        return h

    def stage_output(self, h: mx.array, wanted: dict, layer_ids: list[int]) -> tuple[mx.array, mx.array]:
        """(the last layer's hidden state, the features at ``layer_ids``) after
        this process's layers left ``h`` and ``wanted`` (layer index -> output)."""
        return h, mx.concatenate([wanted[i] for i in layer_ids], axis=-1)

    def make_cache(self) -> list:
        """The model's own cache list, each entry as its layer kind runs on it
        (a rotating cache of a sliding layer becomes a plain one; a cache that
        cannot roll back is refused). A model whose last layers read earlier
        layers' K/V (Gemma 4) makes caches for the owning layers only: the
        list is shorter than the layers, and only those caches roll back."""
        make = getattr(self.model, "make_cache", None)
        cache = make() if make else [KVCache() for _ in self.layers]
        return [kind.cache(c) for kind, c in zip(self.kinds, cache)]

    def forward(
        self,
        tokens: mx.array,
        cache: Optional[list],
        layer_ids: list[int],
        record: bool = False,
    ) -> Forward:
        """Run tokens [B, T] through the target, capturing features at ``layer_ids``.

        With ``record=True`` (block verification) each layer also returns what
        its kind needs for ``rollback``.
        """
        cache = list(cache or []) + [None] * (self.num_layers - len(cache or []))  # layers owning none: None
        h = self.embed(tokens)
        masks = {}
        for kind, c in zip(self.kinds, cache):
            if kind.name not in masks:
                masks[kind.name] = kind.mask(h, c)
        wanted = {i: None for i in layer_ids}
        records = [None] * self.num_layers
        layers = self.stack.layer_calls(self.layers, tokens, h)
        h = self.stage_input(h)
        with self.verify_matmuls() if record else contextlib.nullcontext():
            for i, (layer, kind, c) in enumerate(zip(layers, self.kinds, cache)):
                h, records[i] = kind(layer, h, masks[kind.name], c, record)
                if self.first_layer + i in wanted:
                    wanted[self.first_layer + i] = h
        h, features = self.stage_output(h, wanted, layer_ids)
        return Forward(self.final_norm(h), features, records if record else None)

    def embed_rows(self, tokens: mx.array) -> mx.array:
        """The embedding table's rows, before any scale the model's pass applies
        (for a draft whose config gives its own ``input_embedding_scale``)."""
        return self.inner.embed_tokens(tokens)

    def head_logits(self, hidden: mx.array) -> mx.array:
        """The head's output, before any soft cap the model applies (for a draft
        whose config gives its own ``final_logit_softcapping``)."""
        out = None
        if isinstance(self.head_module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            out = quantized_matmul(hidden, self.head_module)  # None where the kernel does not run
        return self.lm_head(hidden) if out is None else out

    def logits(self, hidden: mx.array) -> mx.array:
        """The model's logits from final-normed hidden states (soft-capped where
        the model caps them), for verification and for the draft."""
        return self.stack.finish_logits(self.head_logits(hidden))

    def rollback_rows(self, cache: list, forward: Forward, keeps: list[int]) -> None:
        """Per row r of a batch's caches (``rows.py``), keep the first
        ``keeps[r]`` tokens of the recorded block."""
        block = forward.hidden.shape[1]
        for kind, c, rec in zip(self.kinds, cache, forward.records):
            kind.rollback_rows(c, rec, keeps, block)

    def rollback(self, cache: list, forward: Forward, keep: int) -> None:
        """Leave ``cache`` exactly as if only the first ``keep`` tokens of the
        recorded block had been fed."""
        block = forward.hidden.shape[1]
        if keep == block:
            return
        for kind, c, rec in zip(self.kinds, cache, forward.records):  # layers that own a cache
            kind.rollback(c, rec, keep, block)
