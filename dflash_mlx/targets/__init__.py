"""The target adapter: an mlx-lm model run layer by layer (``adapter.py``),
exact rollback per layer kind (``layer_kinds.py``; GatedDeltaNet in
``gated_delta.py`` and ``gated_delta_steps.py``, LFM2's short convolution in
``short_conv.py``), Gemma 4's pass
(``gemma4.py``), the quantized verify matmuls (``verify_matmuls.py``) and the
load-time forward check (``forward_check.py``), and the caches of a batch
whose rows have lengths of their own (``rows.py``). Modules outside this folder use what is named here."""

from .adapter import SUPPORTED_MODEL_TYPES, Forward, Target
from .forward_check import check_forward
from .gated_delta import GatedDelta, project, split_qkv, sum_heads
from .gated_delta_steps import CHECKPOINT_EVERY, steps
from .layer_kinds import Attention
from .rows import RowKVCache, extend_rows
from .short_conv import ShortConv
from .sharded import PipelineTarget, TensorParallelTarget, sharded_target

__all__ = [
    "SUPPORTED_MODEL_TYPES", "Forward", "Target", "check_forward", "GatedDelta", "project", "split_qkv", "sum_heads",
    "CHECKPOINT_EVERY", "steps", "Attention", "ShortConv", "RowKVCache", "extend_rows", "PipelineTarget",
    "TensorParallelTarget", "sharded_target",
]
