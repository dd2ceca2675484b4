"""Targets sharded over an ``mx.distributed`` group by mlx-lm.

Tensor parallel (``model.shard(group)``, mlx-lm's ``sharded_load``): every
rank holds every layer with its linears split across the group, and each
layer sums its partial outputs with ``all_sum`` inside its own forward, so the
adapter's layer-by-layer loop runs unchanged and every rank ends each layer
with the same full hidden state. Only the head may be split over the
vocabulary (qwen3_5 with untied embeddings): its logits are gathered here, as
the model's own ``__call__`` gathers them.

Pipeline parallel (``model.model.pipeline(group)``, mlx-lm's pipeline
stages: the last rank runs the first layers, rank 0 the last): each rank runs
its own layers, receiving the hidden state from the rank before it and
sending it on, as the model's ``__call__`` does. The tapped layers' features
then live on different ranks, and only rank 0 has the final hidden state, so
one ``all_sum`` per pass (each rank contributing its own slots, zeros
elsewhere: exact) gives every rank both, and every rank computes the same
logits with its own copy of the head.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import gather_last_axis

from .adapter import Target


class TensorParallelTarget(Target):
    """A target whose layers mlx-lm's ``shard()`` split over ``group``."""

    def __init__(self, model: nn.Module, group: mx.distributed.Group):
        super().__init__(model)
        self.group = group
        text = getattr(model, "language_model", model)
        self.head_group = getattr(text, "sharding_group", None)  # set when the head is split over the vocabulary

    def head_logits(self, hidden: mx.array) -> mx.array:
        out = super().head_logits(hidden)
        return out if self.head_group is None else gather_last_axis(out, self.head_group)


def sharded_target(model: nn.Module, group: mx.distributed.Group) -> Target:
    """The target of a model sharded over ``group`` by mlx-lm (``shard`` or ``pipeline``)."""
    inner = getattr(model, "language_model", model).model
    if getattr(inner, "pipeline_size", 1) > 1:
        return PipelineTarget(model, group)
    return TensorParallelTarget(model, group)


class PipelineTarget(Target):
    """A target split into pipeline stages by mlx-lm's ``pipeline(group)``:
    this rank holds layers ``first_layer`` .. ``first_layer + len(layers) - 1``,
    and every pass over them (the chain's, the tree's) starts with
    ``stage_input`` and ends with ``stage_output``."""

    def __init__(self, model: nn.Module, group: mx.distributed.Group):
        super().__init__(model)  # self.layers, kinds and caches: this rank's stage only
        self.group = group
        self.rank, self.size = self.inner.pipeline_rank, self.inner.pipeline_size
        self.first_layer = self.inner.start_idx

    @property
    def num_layers(self) -> int:
        return self.args.num_hidden_layers

    def stage_input(self, h: mx.array) -> mx.array:
        """The hidden state the stage before this one (the rank after it) hands on."""
        if self.rank < self.size - 1:
            h = mx.distributed.recv_like(h, self.rank + 1, group=self.group)
        return h

    def stage_output(self, h: mx.array, wanted: dict, layer_ids: list[int]) -> tuple[mx.array, mx.array]:
        """Hand ``h`` on, then one collective that gives every rank the features
        at ``layer_ids`` (each stage's own, zeros elsewhere) and the final hidden state."""
        if self.rank != 0:
            h = mx.depends(mx.zeros_like(h), mx.distributed.send(h, self.rank - 1, group=self.group))
        zeros = mx.zeros_like(h)
        parts = [zeros if wanted.get(i) is None else wanted[i] for i in layer_ids] + [h]
        gathered = mx.distributed.all_sum(mx.concatenate(parts, axis=-1), group=self.group)
        # queued now, so that every rank runs its passes' sends, receives and sums in
        # program order (ranks hold different graphs, which MLX might otherwise order differently)
        mx.async_eval(gathered)
        width = h.shape[-1]
        return gathered[..., -width:], gathered[..., : -width]
