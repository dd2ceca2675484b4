"""``dflash-mlx bench --predict``: the expected DFlash speedup on Apple M-series
chips from bytes moved and FLOPs, with no generation run.

Per forward pass the time is a roofline over the chip's memory bandwidth and
matmul rate (``overlap``: the larger of bytes/bandwidth and FLOPs/rate) or, as
a pessimistic bound, their sum (``serial``: no overlap of memory and compute).

- An autoregressive step is one target pass over 1 token.
- A DFlash cycle is one draft pass over the b-token block (draft weights plus
  the target's LM head, which the draft borrows, for b-1 logits rows; the
  injection of the tau new context positions) plus one target pass over b tokens.
- It emits tau tokens, so speedup = tau * t_step / (t_draft + t_verify).
- A DFlash2 draft's pass also runs its candidate selector over the b-1 rows:
  a top-k over each row's V logits, gathers of k + 1 codebook rows of rank R
  per row (the codebooks are never read whole) and the walk's scoring
  (``DraftProfile.selector``); its conv-wrapped layers are priced like any
  weights (the kernel projections as matmuls, the taps as 2 FLOPs each a token).
- A DSpark draft's pass runs its backbone over its trained block (gamma
  tokens, whatever b), the LM head over the b-1 drafted rows, then its heads
  over those rows one after another (``DraftProfile.heads``): per position the
  Markov head gathers one W1 row (r weights) and multiplies by W2 [V, r], read
  whole each step (the sequential steps share no read), and z_k = U_k + W2 W1[x]
  is read and written over V; the confidence head is one [H + r] dot a row.
- A DDTree cycle of budget B drafts the same b-token block, then verifies the
  pending token and the B nodes in one target pass over B+1 positions (B+1
  logits rows). Its GatedDeltaNet kernel (``gdn_tree_verify``) steps each
  node's state from its parent's on chip, reading the context state once and
  writing no state; the commit then replays the accepted path (a read and a
  write): one state read more than the chain's pass. tau is then the tree's
  tokens per cycle, at most b (the tree is b-1 deep).

What a pass reads: every weight once (embeddings only for the rows looked up,
the LM head once however many rows), the KV cache of the attention layers over
the context, the recurrent state of GatedDeltaNet layers (read and written),
and for MoE layers the experts the pass's tokens route to: k of E for one
token, E * (1 - (1 - k/E)^T) expected for T tokens routed independently, which
is why verification costs MoE targets more than dense ones. FLOPs are 2 per
matmul weight per token plus attention over the context.

Sizes come from the configs alone: the mlx-lm model class (and the DFlash draft
class) is built with lazy, never-evaluated parameters and every tensor's shape
is counted, quantized ones at bits/8 plus one scale and one bias per group.

Not modelled: kernel launch and host synchronization per pass (and the
selector walk's b-1 dependent steps), attention and
recurrence kernels below peak, the lower efficiency of small matmuls, and the
tree's construction on the host; docs/benchmarks.md ("Predicted speedup") compares
the result with published measurements.
"""

import copy
import importlib
import math
from dataclasses import asdict, dataclass
from typing import Optional

from ..errors import DFlashError
from .chips import Chip

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Pass:
    """Bytes read (or written) and FLOPs of one forward pass."""

    bytes: float
    flops: float

    def seconds(self, chip: Chip, overlap: bool = True, neural: bool = False) -> float:
        t_mem = self.bytes / (chip.bandwidth_gbs * 1e9)
        t_math = self.flops / (chip.matmul_tflops(neural) * 1e12)
        return max(t_mem, t_math) if overlap else t_mem + t_math

    def bound(self, chip: Chip, neural: bool = False) -> str:
        t_mem = self.bytes / (chip.bandwidth_gbs * 1e9)
        return "memory" if t_mem >= self.flops / (chip.matmul_tflops(neural) * 1e12) else "compute"


@dataclass
class TargetProfile:
    """Per-pass costs of a target, from its config."""

    params: int
    dense_bytes: float  # read by every pass: all weights but embeddings, LM head and experts
    dense_flops: float  # per token
    head_bytes: float
    head_flops: float  # per logits row
    embed_row_bytes: float  # per token looked up
    expert_bytes: float = 0.0  # one expert, summed over the MoE layers
    expert_flops: float = 0.0  # per token: the k routed experts over all MoE layers
    num_experts: int = 0
    experts_per_token: int = 0
    kv_bytes_per_pos: float = 0.0  # K and V of every attention layer, per context position
    attn_flops_per_pos: float = 0.0  # per query token and context position
    state_bytes: float = 0.0  # recurrent state of every GatedDeltaNet layer
    state_flops: float = 0.0  # per token
    weight_bytes: float = 0.0  # all weights as stored

    def experts_touched(self, tokens: int) -> float:
        if not self.num_experts:
            return 0.0
        E, k = self.num_experts, self.experts_per_token
        return E * (1.0 - (1.0 - k / E) ** tokens)

    def forward(self, tokens: int, context: int, logits_rows: int, state_moves: int = 2) -> Pass:
        """One pass over ``tokens`` positions that reads or writes the recurrent
        states whole ``state_moves`` times (a sequence: read, then written)."""
        nbytes = (self.dense_bytes + tokens * self.embed_row_bytes
                  + self.expert_bytes * self.experts_touched(tokens)
                  + self.kv_bytes_per_pos * (context + tokens) + state_moves * self.state_bytes)
        if logits_rows:
            nbytes += self.head_bytes
        flops = (tokens * (self.dense_flops + self.expert_flops + self.state_flops)
                 + logits_rows * self.head_flops
                 + tokens * self.attn_flops_per_pos * (context + tokens / 2))
        return Pass(nbytes, flops)


@dataclass
class DraftProfile:
    """Per-cycle costs of a DFlash draft (it borrows the target's embedding and LM head);
    a DFlash2 draft (``selector_top_k`` > 0) adds its candidate selector."""

    params: int
    layer_bytes: float  # every draft weight a pass reads whole (not a DFlash2 draft's codebooks)
    layer_flops: float  # per block token
    inject_flops: float  # per injected context position (fc, then K/V of every layer)
    kv_bytes_per_pos: float
    attn_flops_per_pos: float
    window: Optional[int] = None  # sliding window of the sliding layers, if all are sliding
    weight_bytes: float = 0.0
    architecture: str = "v1"  # or "dflash2", "dspark"
    vocab: int = 0
    selector_top_k: int = 0
    selector_rank: int = 0
    selector_flops: float = 0.0  # per drafted row: hidden_projection
    codebook_row_bytes: float = 0.0  # one row of one codebook, as stored
    logit_bytes: float = 2.0
    trained_tokens: Optional[int] = None  # a DSpark draft's pass: always its trained block of gamma tokens
    markov_rank: int = 0
    markov_rows: int = 0  # W2's rows: the drafting vocabulary
    markov_w2_bytes: float = 0.0  # W2 [V, r] as stored
    markov_row_bytes: float = 0.0  # one W1 row as stored
    confidence_width: int = 0  # H + r (H without the Markov input); 0: no confidence head
    confidence_bytes: float = 0.0

    def heads(self, rows: int) -> Pass:
        """A DSpark draft's Markov walk and confidence head over ``rows`` drafted
        positions, one after another: per position one W1 row gathered, W2 read
        whole and multiplied (2 V r FLOPs), U_k read and z_k written over V (an
        add and the argmax's comparison each); one confidence dot of H + r a row."""
        nbytes = rows * (self.markov_row_bytes + self.markov_w2_bytes + 2 * self.markov_rows * self.logit_bytes)
        flops = rows * (2.0 * self.markov_rows * self.markov_rank + 2.0 * self.markov_rows)
        if not self.markov_rank:
            nbytes = flops = 0.0
        return Pass(nbytes + self.confidence_bytes, flops + rows * 2.0 * self.confidence_width)

    def selector(self, rows: int) -> Pass:
        """The candidate selector over ``rows`` drafted rows: the top-k reads each
        row's V logits (one comparison each); the scores gather each row's k
        successor rows and the k predecessor rows of its parents (the anchor's
        for row 0), and score every parent-candidate pair (e_j * S[c]: kR, then
        each dot with P[parent]: 2k^2 R)."""
        if not self.selector_top_k:
            return Pass(0.0, 0.0)
        k, R = self.selector_top_k, self.selector_rank
        nbytes = rows * (self.vocab * self.logit_bytes + 2 * k * self.codebook_row_bytes)
        flops = rows * (self.vocab + self.selector_flops + (k + 2.0 * k * k) * R)
        return Pass(nbytes, flops)

    def forward(self, target: TargetProfile, block: int, context: int, inject: float,
                head_share: float = 1.0) -> Pass:
        """One draft pass over ``block`` positions; ``head_share``: the fraction
        of the LM head's rows it multiplies by (a reduced drafting vocabulary)."""
        seen = context if self.window is None else min(context, self.window)
        selector, heads = self.selector(block - 1), self.heads(block - 1)
        tokens = self.trained_tokens or block
        nbytes = (self.layer_bytes + head_share * target.head_bytes + tokens * target.embed_row_bytes
                  + self.kv_bytes_per_pos * (seen + inject) + selector.bytes + heads.bytes)
        flops = (tokens * self.layer_flops + (block - 1) * head_share * target.head_flops
                 + inject * self.inject_flops + tokens * self.attn_flops_per_pos * (seen + tokens)
                 + selector.flops + heads.flops)
        return Pass(nbytes, flops)


# ---------------------------------------------------------------- from configs

def text_config(config: dict) -> dict:
    """The text model's part of a (possibly multimodal) config."""
    return config.get("text_config", config)


def context_length(config: dict) -> Optional[int]:
    """The target's context length (``max_position_embeddings``), None if its config gives none."""
    return (config.get("text_config") or config).get("max_position_embeddings")


def _dtype_bytes(config: dict, dtype: Optional[str]) -> int:
    name = dtype or config.get("torch_dtype") or config.get("dtype") or text_config(config).get("dtype") or "bfloat16"
    return DTYPE_BYTES.get(str(name).replace("torch.", ""), 2)


def _lazy_modules(model) -> tuple[dict, set, dict]:
    """(name -> shape of every parameter, names of quantizable modules, module by name)."""
    from mlx.utils import tree_flatten

    shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    modules = dict(model.named_modules())
    quantizable = {name for name, m in modules.items() if hasattr(m, "to_quantized")}
    return shapes, quantizable, modules


def _sizer(quantization: Optional[dict], dtype_bytes: int, quantizable: set):
    """Function (param name, shape) -> bytes as stored."""

    def size(name: str, shape: tuple) -> float:
        n = math.prod(shape)
        module, _, leaf = name.rpartition(".")
        q = quantization
        if isinstance(q, dict) and module in q:
            q = q[module] if isinstance(q[module], dict) else None
        if (q and leaf == "weight" and module in quantizable and len(shape) >= 2
                and shape[-1] % int(q.get("group_size", 64)) == 0):
            bits, group = int(q.get("bits", 4)), int(q.get("group_size", 64))
            return n * bits / 8 + 2 * dtype_bytes * n / group  # packed + scale + bias per group
        return n * dtype_bytes

    return size


def _build_target(config: dict):
    config = copy.deepcopy(config)
    try:
        from mlx_lm.utils import _get_classes as get_classes  # what mlx_lm.load uses
    except ImportError:  # pragma: no cover - older/newer mlx-lm
        def get_classes(config):
            arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
            return arch.Model, arch.ModelArgs
    try:
        model_class, args_class = get_classes(config=config)
        return model_class(args_class.from_dict(config))
    except Exception as e:
        raise DFlashError(f"cannot build the target from its config: {' '.join(str(e).split())}") from None


def target_profile(config: dict, dtype: Optional[str] = None,
                   kv: Optional[tuple[int, int]] = None) -> TargetProfile:
    """Costs of a target from its config.json (weights are never read). ``kv``
    (bits, group size): the KV cache is quantized as mlx-lm's QuantizedKVCache
    stores it, ``bits`` per element plus a scale and a bias per group in the
    cache's dtype."""
    model = _build_target(config)
    text = text_config(config)
    nbytes = _dtype_bytes(config, dtype)
    shapes, quantizable, _ = _lazy_modules(model)
    size = _sizer(config.get("quantization") or text.get("quantization"), nbytes, quantizable)
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    num_experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    k = int(text.get("num_experts_per_tok") or 0)

    dense_b = dense_f = head_b = expert_b = expert_f = embed_b = 0.0
    kv_dims = attn_layers = linear_layers = 0
    has_head = any("lm_head" in n for n in shapes)
    for name, shape in shapes.items():
        b = size(name, shape)
        n = math.prod(shape)
        if "embed_tokens" in name:
            embed_b += b
            if not has_head:
                head_b += b
        elif "lm_head" in name:
            head_b += b
        elif "switch_mlp" in name and num_experts:
            expert_b += b / num_experts
            expert_f += 2 * n / num_experts * k if len(shape) >= 2 else 0
        else:
            dense_b += b
            dense_f += 2 * n if len(shape) >= 2 else 0
        if name.endswith("self_attn.k_proj.weight"):
            # the cache holds K and V; a layer with K = V (no v_proj, Gemma 4's full
            # layers) still caches its values apart
            attn_layers += 1
            kv_dims += shape[0] * (1 + int(name.replace("k_proj", "v_proj") not in shapes))
        if name.endswith("self_attn.v_proj.weight"):
            kv_dims += shape[0]
        if name.endswith("linear_attn.A_log"):
            linear_layers += 1
    heads = int(text.get("num_attention_heads", 1))
    head_dim = int(text.get("head_dim") or hidden // heads)
    state = (int(text.get("linear_num_value_heads", 0)) * int(text.get("linear_value_head_dim", 0))
             * int(text.get("linear_key_head_dim", 0)))
    return TargetProfile(
        params=int(sum(math.prod(s) for s in shapes.values())),
        dense_bytes=dense_b, dense_flops=dense_f,
        head_bytes=head_b, head_flops=2.0 * vocab * hidden,
        embed_row_bytes=embed_b / vocab,
        expert_bytes=expert_b, expert_flops=expert_f, num_experts=num_experts, experts_per_token=k,
        kv_bytes_per_pos=kv_dims * (nbytes if kv is None else kv[0] / 8 + 2 * nbytes / kv[1]),
        attn_flops_per_pos=4.0 * heads * head_dim * attn_layers,
        state_bytes=4.0 * state * linear_layers, state_flops=7.0 * state * linear_layers,
        weight_bytes=sum(size(n, s) for n, s in shapes.items()),
    )


def draft_profile(config: dict, dtype: Optional[str] = None) -> DraftProfile:
    """Costs of a DFlash, DFlash2 or DSpark draft from its config.json."""
    from ..draft import SLIDING, DFlash2Config, DSparkConfig, draft_classes

    network, parse = draft_classes(config)
    cfg = parse.from_dict(config)
    model = network(cfg)
    nbytes = _dtype_bytes(config, dtype)
    shapes, quantizable, _ = _lazy_modules(model)
    size = _sizer(config.get("quantization"), nbytes, quantizable)
    layer_f = inject_f = selector_f = codebook_b = heads_b = 0.0
    for name, shape in shapes.items():
        if name.startswith(("markov_head.", "confidence_head.")):  # priced per drafted row: heads()
            heads_b += size(name, shape)
            continue
        if name.startswith("candidate_selector."):
            if name.endswith("_codebook.weight"):  # gathered by row, never read whole
                codebook_b += size(name, shape)
            elif len(shape) >= 2:
                selector_f += 2 * math.prod(shape)
            continue
        if len(shape) < 2:
            continue
        n = math.prod(shape)
        if name.startswith("fc."):
            inject_f += 2 * n
        else:
            # a matmul weight: 2 FLOPs a token; a DFlash2 base_kernel [2, K, H]: its two
            # convolutions' K taps per channel, a multiply and an add each, also 2 a token
            layer_f += 2 * n
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                inject_f += 2 * n
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim * cfg.num_hidden_layers * nbytes
    all_sliding = cfg.layer_types and all(t == SLIDING for t in cfg.layer_types)
    total = sum(size(n, s) for n, s in shapes.items())
    dflash2, dspark = isinstance(cfg, DFlash2Config), isinstance(cfg, DSparkConfig)
    w1, w2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
    confidence = [name for name in shapes if name.startswith("confidence_head.")]
    heads = dict(
        trained_tokens=cfg.block_size - 1, markov_rank=cfg.markov_rank,
        markov_rows=shapes[w2][0] if w2 in shapes else 0,
        markov_w2_bytes=size(w2, shapes[w2]) if w2 in shapes else 0.0,
        markov_row_bytes=size(w1, shapes[w1]) / shapes[w1][0] if w1 in shapes else 0.0,
        confidence_width=shapes["confidence_head.proj.weight"][-1] if confidence else 0,
        confidence_bytes=sum(size(n, shapes[n]) for n in confidence)) if dspark else {}
    return DraftProfile(
        params=int(sum(math.prod(s) for s in shapes.values())),
        layer_bytes=total - codebook_b - heads_b, layer_flops=layer_f, inject_flops=inject_f, kv_bytes_per_pos=kv,
        attn_flops_per_pos=4.0 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers,
        window=int(cfg.sliding_window) if all_sliding else None, weight_bytes=total,
        architecture="dflash2" if dflash2 else "dspark" if dspark else "v1", vocab=cfg.vocab_size,
        selector_top_k=cfg.selector_top_k if dflash2 else 0,
        selector_rank=cfg.selector_rank if dflash2 else 0,
        selector_flops=selector_f, codebook_row_bytes=codebook_b / (2 * cfg.vocab_size),
        logit_bytes=nbytes, **heads,
    )


# ---------------------------------------------------------------- tau and the prediction

def geometric_alpha(tau: float, block_size: int) -> float:
    """Per-position acceptance a with tau = (1 - a^b) / (1 - a) (i.i.d. positions)."""
    if tau <= 1.0:
        return 0.0
    if tau >= block_size:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        value = block_size if mid == 1.0 else (1 - mid**block_size) / (1 - mid)
        lo, hi = (mid, hi) if value < tau else (lo, mid)
    return (lo + hi) / 2


def tau_at(block_size: int, tau: float, measured_block: int,
           position_acceptance: Optional[list[float]] = None) -> float:
    """tau at another block size: from the measured per-position acceptance
    (P(a >= i), i = 1..b0-1) where the block is not longer, else from the
    i.i.d. (geometric) fit to the measured tau."""
    if position_acceptance is not None and block_size <= measured_block:
        return 1.0 + sum(position_acceptance[: block_size - 1])
    if block_size == measured_block:
        return tau
    a = geometric_alpha(tau, measured_block)
    return float(block_size) if a >= 1.0 else (1 - a**block_size) / (1 - a)


@dataclass
class Prediction:
    chip: str
    block_size: int
    tau: float
    context: int
    ar_tps: float
    dflash_tps: float
    speedup: float  # overlap roofline (optimistic)
    speedup_serial: float  # memory + compute without overlap (pessimistic)
    step_ms: float
    draft_ms: float
    verify_ms: float
    verify_bound: str
    tree_budget: Optional[int] = None  # a DDTree's node budget; None: the chain

    def to_dict(self) -> dict:
        return asdict(self)


def predict(target: TargetProfile, draft: DraftProfile, chip: Chip, tau: float, block_size: int,
            context: int = 1024, overhead_ms: float = 0.0, neural: bool = False,
            tree_budget: Optional[int] = None, head_share: float = 1.0) -> Prediction:
    """Expected autoregressive and DFlash decode speed on ``chip``: the chain of
    ``block_size``, or with ``tree_budget`` B a DDTree of B nodes b-1 deep;
    the draft multiplies by ``head_share`` of the LM head's rows."""
    if block_size < 2:
        raise DFlashError(f"block_size must be at least 2, got {block_size}")
    if not 1.0 <= tau <= block_size:
        raise DFlashError(f"tau must lie in [1, block_size={block_size}], got {tau:g}")
    over = overhead_ms / 1e3
    step = target.forward(1, context, 1)
    if tree_budget is None:
        verify = target.forward(block_size, context, block_size)
    else:
        verify = target.forward(tree_budget + 1, context, tree_budget + 1, state_moves=3)
    drafting = draft.forward(target, block_size, context, tau, head_share)
    times = {}
    for overlap in (True, False):
        t_step = step.seconds(chip, overlap, neural) + over
        t_cycle = verify.seconds(chip, overlap, neural) + drafting.seconds(chip, overlap, neural) + 2 * over
        times[overlap] = (t_step, t_cycle)
    (t_step, t_cycle), (s_step, s_cycle) = times[True], times[False]
    return Prediction(
        chip=chip.name, block_size=block_size, tau=tau, context=context,
        ar_tps=1 / t_step, dflash_tps=tau / t_cycle,
        speedup=tau * t_step / t_cycle, speedup_serial=tau * s_step / s_cycle,
        step_ms=1e3 * t_step, draft_ms=1e3 * drafting.seconds(chip, True, neural) + overhead_ms,
        verify_ms=1e3 * verify.seconds(chip, True, neural) + overhead_ms,
        verify_bound=verify.bound(chip, neural), tree_budget=tree_budget,
    )
