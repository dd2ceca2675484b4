"""The decoding loop: the speculative decoder and its proposers
(``decoder.py``), the block sampler (``sampling.py``), block verification
(``verify.py``) over the acceptance rules in plain MLX (``acceptance.py``),
several requests at once (``batch.py``, its block size in ``batch_policy.py``),
and each cycle's block size (``block_policy.py``) from the pair's measured
cost curve (``cost_curve.py``) and the watch on its drift (``drift_watch.py``).
Modules outside this folder use what is named here; ``acceptance`` (the rules
the verification kernels are proven against) and ``cost_curve`` (the curve's
measurement and on-disk cache) are named as modules.

``acceptance`` is imported first: the kernels use it while ``draft/`` loads,
which ``decoder.py`` needs, so the package imports this folder before ``draft/``."""

from . import acceptance
from . import cost_curve
from .batch import BatchDecoder, Row, RowCycle
from .batch_policy import BatchBlock, FixedRows, batch_policy
from .block_policy import AdaptiveBlock, BlockPolicy, FixedBlock
from .draft_rows import DraftRows
from .decoder import (NON_FINITE, ContextCache, Cycle, DFlash2Proposer, DraftProposer, Proposer, SpeculativeDecoder,
                      prefill_chunks, propose_block, proposer_for, sound_logits)
from .drift_watch import DriftWatch, Watched, times_for
from .sampling import BlockSampler, SamplingParams

__all__ = [
    "acceptance", "cost_curve", "BatchDecoder", "DraftRows", "Row", "RowCycle", "BatchBlock", "FixedRows",
    "batch_policy", "AdaptiveBlock", "BlockPolicy", "FixedBlock",
    "NON_FINITE", "ContextCache", "Cycle", "DFlash2Proposer", "DraftProposer", "Proposer", "SpeculativeDecoder",
    "prefill_chunks", "propose_block", "proposer_for", "sound_logits", "DriftWatch", "Watched", "times_for",
    "BlockSampler", "SamplingParams",
]
