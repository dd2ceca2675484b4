"""Targets sharded over an ``mx.distributed`` group by mlx-lm.

Tensor parallel (``model.shard(group)``, mlx-lm's ``sharded_load``): every
rank holds every layer with its linears split across the group, and each
layer sums its partial outputs with ``all_sum`` inside its own forward, so the
adapter's layer-by-layer loop runs unchanged and every rank ends each layer
with the same full hidden state. Only the head may be split over the
vocabulary (qwen3_5 with untied embeddings): its logits are gathered here, as
the model's own ``__call__`` gathers them.

Pipeline parallel (``model.model.pipeline(group)``) moves the hidden state
from rank to rank inside the model's ``__call__``; the adapter's loop over
layers would not, so it is refused (``tensor_parallel_target``).
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import gather_last_axis

from ..errors import DFlashError
from .adapter import Target


class TensorParallelTarget(Target):
    """A target whose layers mlx-lm's ``shard()`` split over ``group``."""

    def __init__(self, model: nn.Module, group: mx.distributed.Group):
        super().__init__(model)
        self.group = group
        text = getattr(model, "language_model", model)
        self.head_group = getattr(text, "sharding_group", None)  # set when the head is split over the vocabulary

    def logits(self, hidden: mx.array) -> mx.array:
        out = super().logits(hidden)
        return out if self.head_group is None else gather_last_axis(out, self.head_group)


def tensor_parallel_target(model: nn.Module, group: mx.distributed.Group) -> TensorParallelTarget:
    """The target of a model already sharded by ``model.shard(group)``."""
    inner = getattr(getattr(model, "language_model", model), "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:
        raise DFlashError("a pipeline-sharded target cannot run layer by layer; load it with tensor parallelism")
    return TensorParallelTarget(model, group)
