"""``bench --predict --concurrency``: the cost model (``cost_model``) with a
batch dimension. N requests decode together, by plain batched steps (one
target pass over [N, 1]) or by DFlash cycles (one draft pass over the rows'
blocks, one verify pass over [N, b]); a pass reads the weights once for all
rows, each row's KV cache and recurrent state apart, and does every row's FLOPs."""

from dataclasses import asdict, dataclass

from ..errors import DFlashError
from .chips import Chip
from .cost_model import DraftProfile, Pass, TargetProfile


def batch_forward(target: TargetProfile, rows: int, tokens: int, context: int, logits_rows: int,
                  state_moves: int = 2) -> Pass:
    """One target pass over ``rows`` requests of ``tokens`` positions each, each
    at ``context`` positions of its own: the weights (dense layers, the LM head,
    the experts all the rows' tokens route to) are read once for every row;
    each row's embedding rows, KV cache and recurrent state are its own; every
    row's tokens cost their FLOPs."""
    one = target.forward(tokens, context, logits_rows, state_moves)
    shared = target.dense_bytes + (target.head_bytes if logits_rows else 0.0)
    own = one.bytes - shared - target.expert_bytes * target.experts_touched(tokens)
    return Pass(shared + target.expert_bytes * target.experts_touched(rows * tokens) + rows * own, rows * one.flops)


def batch_draft(draft: DraftProfile, target: TargetProfile, rows: int, block: int, context: int, inject: float,
                head_share: float = 1.0) -> Pass:
    """The draft's pass over ``rows`` blocks: its weights and the borrowed LM
    head read once, each row's context, embeddings and selector its own."""
    one = draft.forward(target, block, context, inject, head_share)
    shared = draft.layer_bytes + head_share * target.head_bytes
    return Pass(shared + rows * (one.bytes - shared), rows * one.flops)


@dataclass
class BatchPrediction:
    chip: str
    rows: int
    block_size: int
    tau: float
    context: int
    ar_tps: float  # aggregate: every row's tokens per second of plain batched steps
    dflash_tps: float  # aggregate: every row's tau tokens per second of batched cycles
    speedup: float  # overlap roofline (optimistic)
    speedup_serial: float  # memory + compute without overlap (pessimistic)
    step_ms: float
    draft_ms: float
    verify_ms: float
    step_bound: str
    verify_bound: str

    def to_dict(self) -> dict:
        return asdict(self)


def predict_batch(target: TargetProfile, draft: DraftProfile, chip: Chip, tau: float, block_size: int, rows: int,
                  context: int = 1024, overhead_ms: float = 0.0, neural: bool = False,
                  head_share: float = 1.0) -> BatchPrediction:
    """``predict`` with a batch dimension: ``rows`` requests decoded together,
    by plain batched steps (one pass over [rows, 1]) or by DFlash cycles (one
    draft pass over the rows' blocks, one verify pass over [rows, b]), every
    row accepting ``tau`` tokens per cycle. A verify pass reads the weights
    once for all rows, so while rows x b tokens stay under the chip's ridge
    point it costs about one step; past it, it costs FLOPs in proportion to
    rows x b while the plain step (rows tokens) may still be reading weights,
    and the speedup falls towards tau / b."""
    if block_size < 2:
        raise DFlashError(f"block_size must be at least 2, got {block_size}")
    if not 1.0 <= tau <= block_size:
        raise DFlashError(f"tau must lie in [1, block_size={block_size}], got {tau:g}")
    if rows < 1:
        raise DFlashError(f"rows must be at least 1, got {rows}")
    over = overhead_ms / 1e3
    step = batch_forward(target, rows, 1, context, 1)
    verify = batch_forward(target, rows, block_size, context, block_size)
    drafting = batch_draft(draft, target, rows, block_size, context, tau, head_share)
    times = {}
    for overlap in (True, False):
        times[overlap] = (step.seconds(chip, overlap, neural) + over,
                          verify.seconds(chip, overlap, neural) + drafting.seconds(chip, overlap, neural) + 2 * over)
    (t_step, t_cycle), (s_step, s_cycle) = times[True], times[False]
    return BatchPrediction(
        chip=chip.name, rows=rows, block_size=block_size, tau=tau, context=context,
        ar_tps=rows / t_step, dflash_tps=rows * tau / t_cycle,
        speedup=tau * t_step / t_cycle, speedup_serial=tau * s_step / s_cycle,
        step_ms=1e3 * t_step, draft_ms=1e3 * drafting.seconds(chip, True, neural) + overhead_ms,
        verify_ms=1e3 * verify.seconds(chip, True, neural) + overhead_ms,
        step_bound=step.bound(chip, neural), verify_bound=verify.bound(chip, neural))
