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

Not modelled: kernel launch and host synchronization per pass, attention and
recurrence kernels below peak, and the lower efficiency of small matmuls; the
README compares the result with published measurements.
"""

from __future__ import annotations

import copy
import importlib
import math
from dataclasses import asdict, dataclass
from typing import Optional

from .errors import DFlashError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Chip:
    name: str
    gpu_cores: int
    bandwidth_gbs: float  # unified memory bandwidth, GB/s (vendor figure)
    fp32_tflops: float  # GPU shader FP32 peak; the matmul rate used (Apple GPUs run fp16 at the fp32 rate)
    neural_tflops: Optional[float]  # M5: the claimed GPU Neural Accelerator rate (used with neural=True)
    source: str

    def matmul_tflops(self, neural: bool = False) -> float:
        return self.neural_tflops if neural and self.neural_tflops else self.fp32_tflops


_APPLE_M1 = "Apple M1-family launch figures (TFLOPS and GB/s), tabulated at akunu.prabod.rathnayaka.me/part1/ch05-chip-generations.html"
_APPLE_M2 = "Apple M2-family launch figures: 100/200/400/800 GB/s; 3.6/6.8/13.6/27.2 TFLOPS (apple.com Mac Pro page: M2 Ultra 76-core 27.2 TFLOPS)"
_HMC = "bandwidth: Apple launch figures; FP32 = cores x 128 ALUs x 2 x GPU clock, clocks as listed by hmc-tech.com (M3 1398 MHz, M4 1578 MHz, M4 Max 1678 MHz)"
_M5 = ("bandwidth: Apple newsroom, M5 153 GB/s (Oct 2025), M5 Pro 307 GB/s, M5 Max 614 GB/s (Mar 2026); "
       "FP32 assumed at the M4 Max clock (unpublished); Neural Accelerator rate = 4x the M4 counterpart "
       "per Apple's 'over 4x peak GPU compute for AI', used only with --neural-accelerators")


def _fp32(cores: int, mhz: float) -> float:
    return round(cores * 128 * 2 * mhz / 1e6, 2)


CHIPS: tuple[Chip, ...] = (
    Chip("M1", 8, 68.25, 2.6, None, _APPLE_M1),
    Chip("M1 Pro", 16, 200, 5.2, None, _APPLE_M1),
    Chip("M1 Max", 32, 400, 10.4, None, _APPLE_M1),
    Chip("M1 Ultra", 64, 800, 21.0, None, _APPLE_M1),
    Chip("M2", 10, 100, 3.6, None, _APPLE_M2),
    Chip("M2 Pro", 19, 200, 6.8, None, _APPLE_M2),
    Chip("M2 Max", 38, 400, 13.6, None, _APPLE_M2),
    Chip("M2 Ultra", 76, 800, 27.2, None, _APPLE_M2),
    Chip("M3", 10, 100, _fp32(10, 1398), None, _HMC),
    Chip("M3 Pro", 18, 150, _fp32(18, 1398), None, _HMC),
    Chip("M3 Max", 40, 400, _fp32(40, 1398), None, _HMC),
    Chip("M3 Ultra", 80, 819, _fp32(80, 1398), None, _HMC),
    Chip("M4", 10, 120, _fp32(10, 1578), None, _HMC),
    Chip("M4 Pro", 20, 273, _fp32(20, 1578), None, _HMC),
    Chip("M4 Max", 40, 546, _fp32(40, 1678), None, _HMC),
    Chip("M5", 10, 153, _fp32(10, 1678), 4 * _fp32(10, 1578), _M5),
    Chip("M5 Pro", 20, 307, _fp32(20, 1678), 4 * _fp32(20, 1578), _M5),
    Chip("M5 Max", 40, 614, _fp32(40, 1678), 4 * _fp32(40, 1678), _M5),
)


def find_chips(names: Optional[list[str]]) -> list[Chip]:
    if not names:
        return list(CHIPS)
    by_name = {c.name.lower().replace(" ", ""): c for c in CHIPS}
    out = []
    for name in names:
        chip = by_name.get(name.lower().replace(" ", "").replace("-", ""))
        if chip is None:
            raise DFlashError(f"unknown chip '{name}'; known: " + ", ".join(c.name for c in CHIPS))
        out.append(chip)
    return out


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

    def forward(self, tokens: int, context: int, logits_rows: int) -> Pass:
        nbytes = (self.dense_bytes + tokens * self.embed_row_bytes
                  + self.expert_bytes * self.experts_touched(tokens)
                  + self.kv_bytes_per_pos * (context + tokens) + 2 * self.state_bytes)
        if logits_rows:
            nbytes += self.head_bytes
        flops = (tokens * (self.dense_flops + self.expert_flops + self.state_flops)
                 + logits_rows * self.head_flops
                 + tokens * self.attn_flops_per_pos * (context + tokens / 2))
        return Pass(nbytes, flops)


@dataclass
class DraftProfile:
    """Per-cycle costs of a DFlash draft (it borrows the target's embedding and LM head)."""

    params: int
    layer_bytes: float  # every draft weight
    layer_flops: float  # per block token
    inject_flops: float  # per injected context position (fc, then K/V of every layer)
    kv_bytes_per_pos: float
    attn_flops_per_pos: float
    window: Optional[int] = None  # sliding window of the sliding layers, if all are sliding
    weight_bytes: float = 0.0

    def forward(self, target: TargetProfile, block: int, context: int, inject: float) -> Pass:
        seen = context if self.window is None else min(context, self.window)
        nbytes = (self.layer_bytes + target.head_bytes + block * target.embed_row_bytes
                  + self.kv_bytes_per_pos * (seen + inject))
        flops = (block * self.layer_flops + (block - 1) * target.head_flops
                 + inject * self.inject_flops + block * self.attn_flops_per_pos * (seen + block))
        return Pass(nbytes, flops)


# ---------------------------------------------------------------- from configs

def _text(config: dict) -> dict:
    return config.get("text_config", config)


def _dtype_bytes(config: dict, dtype: Optional[str]) -> int:
    name = dtype or config.get("torch_dtype") or config.get("dtype") or _text(config).get("dtype") or "bfloat16"
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


def target_profile(config: dict, dtype: Optional[str] = None) -> TargetProfile:
    """Costs of a target from its config.json (weights are never read)."""
    model = _build_target(config)
    text = _text(config)
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
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            kv_dims += shape[0]
        if name.endswith("self_attn.k_proj.weight"):
            attn_layers += 1
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
        kv_bytes_per_pos=kv_dims * nbytes, attn_flops_per_pos=4.0 * heads * head_dim * attn_layers,
        state_bytes=4.0 * state * linear_layers, state_flops=7.0 * state * linear_layers,
        weight_bytes=sum(size(n, s) for n, s in shapes.items()),
    )


def draft_profile(config: dict, dtype: Optional[str] = None) -> DraftProfile:
    """Costs of a DFlash draft from its config.json (either dialect)."""
    from .draft import SLIDING, DFlashDraft, DraftConfig

    cfg = DraftConfig.from_dict(config)
    model = DFlashDraft(cfg)
    nbytes = _dtype_bytes(config, dtype)
    shapes, quantizable, _ = _lazy_modules(model)
    size = _sizer(config.get("quantization"), nbytes, quantizable)
    layer_f = inject_f = 0.0
    for name, shape in shapes.items():
        if len(shape) < 2:
            continue
        n = math.prod(shape)
        if name.startswith("fc."):
            inject_f += 2 * n
        else:
            layer_f += 2 * n
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                inject_f += 2 * n
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim * cfg.num_hidden_layers * nbytes
    all_sliding = cfg.layer_types and all(t == SLIDING for t in cfg.layer_types)
    total = sum(size(n, s) for n, s in shapes.items())
    return DraftProfile(
        params=int(sum(math.prod(s) for s in shapes.values())),
        layer_bytes=total, layer_flops=layer_f, inject_flops=inject_f, kv_bytes_per_pos=kv,
        attn_flops_per_pos=4.0 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers,
        window=int(cfg.sliding_window) if all_sliding else None, weight_bytes=total,
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

    def to_dict(self) -> dict:
        return asdict(self)


def predict(target: TargetProfile, draft: DraftProfile, chip: Chip, tau: float, block_size: int,
            context: int = 1024, overhead_ms: float = 0.0, neural: bool = False) -> Prediction:
    """Expected autoregressive and DFlash decode speed on ``chip``."""
    if block_size < 2:
        raise DFlashError(f"block_size must be at least 2, got {block_size}")
    if not 1.0 <= tau <= block_size:
        raise DFlashError(f"tau must lie in [1, block_size={block_size}], got {tau:g}")
    over = overhead_ms / 1e3
    step = target.forward(1, context, 1)
    verify = target.forward(block_size, context, block_size)
    drafting = draft.forward(target, block_size, context, tau)
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
        verify_bound=verify.bound(chip, neural),
    )


# ---------------------------------------------------------------- published models (README check)

def _qwen35_text(hidden, layers, inter, heads, kv, linear_v, **extra) -> dict:
    return {"model_type": "qwen3_5_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": 256, "vocab_size": 248320, "rms_norm_eps": 1e-6,
            "linear_num_key_heads": 16, "linear_num_value_heads": linear_v,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4, "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
            **extra}


def _qwen35(text: dict, tied: bool, moe: bool = False, quant: Optional[dict] = None) -> dict:
    text = {**text, "tie_word_embeddings": tied}
    cfg = {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "tie_word_embeddings": tied,
           "torch_dtype": "bfloat16", "text_config": text}
    if moe:
        cfg["text_config"]["model_type"] = "qwen3_5_moe_text"
    if quant:
        cfg["quantization"] = quant
    return cfg


def _z_lab_draft(hidden: int, inter: int, target_layers: int, layers: int = 6, features: int = 5) -> dict:
    return {"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": inter, "vocab_size": 248320,
            "num_target_layers": target_layers, "torch_dtype": "bfloat16",
            "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"],
            "sliding_window": 4096,
            "dflash_config": {"block_size": 16, "mask_token_id": 248077,
                              "target_layer_ids": [1 + i * (target_layers - 4) // (features - 1)
                                                   for i in range(features)]},
            "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"}}


Q4 = {"group_size": 64, "bits": 4}
_MOE = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True}

# name -> (target config, draft config, published speedup at 1024 tokens on an
# M5 Max (bstnxbt/dflash-mlx 0.1.4, DESIGN.md §7), tau assumed for it)
# Target shapes: THUDM/slime scripts/models (27B, 35B-A3B, 4B), Qwen3.5-9B from its
# published architecture (32 layers, 4096/12288, 16/4 heads of 256, GDN 16 key /
# 32 value heads of 128; 8.95 B parameters, which the built model reproduces).
# Draft shapes are assumptions: six z-lab layers of the target's width (DESIGN.md
# §3), 32 x 128 heads, 5 target features; the 9B's (1.24 B parameters) matches the
# ~1.3 GiB Q8_0 export of z-lab/Qwen3.5-9B-DFlash, the 35B-A3B's 8192-wide MLP its
# 905 MB bf16 checkpoint.
PRESETS: dict[str, tuple[dict, dict, Optional[float], float]] = {
    "qwen3.5-4b": (_qwen35(_qwen35_text(2560, 32, 9216, 16, 4, 32), tied=True),
                   _z_lab_draft(2560, 9216, 32), 3.40, 7.7),
    "qwen3.5-9b": (_qwen35(_qwen35_text(4096, 32, 12288, 16, 4, 32), tied=False),
                   _z_lab_draft(4096, 12288, 32), 4.37, 7.5),
    "qwen3.5-27b-4bit": (_qwen35(_qwen35_text(5120, 64, 17408, 24, 4, 48), tied=False, quant=Q4),
                         _z_lab_draft(5120, 17408, 64), 2.37, 7.5),
    "qwen3.5-35b-a3b-4bit": (_qwen35(_qwen35_text(2048, 40, 512, 16, 2, 32, **_MOE), tied=False,
                                     moe=True, quant=Q4),
                             _z_lab_draft(2048, 8192, 40), 1.76, 7.5),
}
