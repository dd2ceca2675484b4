"""Known target -> draft pairs (see docs/architecture.md), and turning the
``--model`` / ``--draft`` options into the pair to run."""

import json
import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Optional

from .errors import DFlashError


@dataclass(frozen=True)
class Draft:
    """A published draft, the chat mode it was trained on, and what its target is."""

    repo: str
    # enable_thinking for the target's chat template: what the draft's training
    # chats used, since acceptance collapses on the other mode. None: the
    # template has no thinking switch, so its default is left alone.
    enable_thinking: Optional[bool] = None
    model_type: str = ""  # the target's mlx-lm model_type
    params_b: float = 0.0  # the target's total parameters, in billions
    block_size: Optional[int] = None  # the trained block where published; None: the draft's config says
    unsupported: Optional[str] = None  # why dflash-mlx cannot run the target; None: it can


# Target hub id -> published z-lab draft. Quantized mlx-community conversions of
# a target (``mlx-community/<name>-4bit`` / ``-8bit``) use the same draft.
# The Qwen3 -b16 drafts were trained on non-thinking chats (thinking on cuts
# their acceptance from about 60% to 25%, z-lab/dflash issue 133); the
# Qwen3.5/3.6 drafts on thinking-mode output (with thinking off, tau falls from
# 9.5 to about 3, z-lab/dflash issue 60), which is also those templates' default.
# Parameter counts are the totals the targets' model cards state (the number in
# the name; gpt-oss 21B / 117B, Qwen3-Coder-Next 80B); block sizes are those of
# the drafts' published configs (docs/targets.md, "The registry").
KNOWN_PAIRS: dict[str, Draft] = {
    "Qwen/Qwen3-4B": Draft("z-lab/Qwen3-4B-DFlash-b16", False, "qwen3", 4.0, 16),
    "Qwen/Qwen3-8B": Draft("z-lab/Qwen3-8B-DFlash-b16", False, "qwen3", 8.2, 16),
    "Qwen/Qwen3.5-4B": Draft("z-lab/Qwen3.5-4B-DFlash", True, "qwen3_5", 4.0, 16),
    "Qwen/Qwen3.5-9B": Draft("z-lab/Qwen3.5-9B-DFlash", True, "qwen3_5", 9.0, 16),
    "Qwen/Qwen3.5-27B": Draft("z-lab/Qwen3.5-27B-DFlash", True, "qwen3_5", 27.0, 16),
    "Qwen/Qwen3.5-35B-A3B": Draft("z-lab/Qwen3.5-35B-A3B-DFlash", True, "qwen3_5_moe", 35.0, 16),
    "Qwen/Qwen3.5-122B-A10B": Draft("z-lab/Qwen3.5-122B-A10B-DFlash", True, "qwen3_5_moe", 122.0, 16),
    "Qwen/Qwen3.5-397B-A17B": Draft("z-lab/Qwen3.5-397B-A17B-DFlash", True, "qwen3_5_moe", 397.0, 16),
    "Qwen/Qwen3.6-27B": Draft("z-lab/Qwen3.6-27B-DFlash", True, "qwen3_5", 27.0, 16),
    "Qwen/Qwen3.6-35B-A3B": Draft("z-lab/Qwen3.6-35B-A3B-DFlash", True, "qwen3_5_moe", 35.0, 16),
    "meta-llama/Llama-3.1-8B-Instruct": Draft("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", None, "llama", 8.0),
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": Draft("z-lab/Qwen3-Coder-30B-A3B-DFlash", None, "qwen3_moe", 30.5),
    "openai/gpt-oss-20b": Draft("z-lab/gpt-oss-20b-DFlash", None, "gpt_oss", 21.0),
    "openai/gpt-oss-120b": Draft("z-lab/gpt-oss-120b-DFlash", None, "gpt_oss", 117.0),
    "Qwen/Qwen3-Coder-Next": Draft("z-lab/Qwen3-Coder-Next-DFlash", None, "qwen3_next", 80.0),
    "google/gemma-4-12B-it": Draft("z-lab/gemma4-12B-it-DFlash", None, "gemma4", 12.0, 16),
    "google/gemma-4-26B-A4B-it": Draft("z-lab/gemma-4-26B-A4B-it-DFlash", None, "gemma4", 26.0, 16),
    "google/gemma-4-31B-it": Draft("z-lab/gemma-4-31B-it-DFlash", None, "gemma4", 31.0, 16),
    # a DFlash2 draft (docs/dflash2.md); its training chat mode is not published
    "Qwen/Qwen3.8-27B": Draft("z-lab/Qwen3.8-27B-DFlash2", None, "qwen3_5", 27.0, 8),
}

# DSpark drafts (docs/dspark.md) for targets dflash-mlx runs: ``models`` lists
# them; one is a target's default draft only where the target has none above
# (Qwen3-14B and LiquidAI's LFM2.5 targets), else it runs with --draft. The block is
# the trained gamma. Their training chat mode is not published. LiquidAI's drafts
# and targets are those its model cards name (the MoE targets are mlx-lm's lfm2_moe);
# Red Hat's draft is in the speculators format, whose block_size is its gamma. Left
# out: the community Qwen3.6-27B draft (its packaging is not documented) and
# LFM2.5-VL-3B's (a vision target).
DSPARK_DRAFTS: dict[str, Draft] = {
    "Qwen/Qwen3-4B": Draft("deepseek-ai/dspark_qwen3_4b_block7", None, "qwen3", 4.0, 7),
    "Qwen/Qwen3-8B": Draft("deepseek-ai/dspark_qwen3_8b_block7", None, "qwen3", 8.2, 7),
    "Qwen/Qwen3-14B": Draft("deepseek-ai/dspark_qwen3_14b_block7", None, "qwen3", 14.8, 7),
    "google/gemma-4-12B-it": Draft("deepseek-ai/dspark_gemma4_12b_block7", None, "gemma4", 12.0, 7),
    "Qwen/Qwen3.6-35B-A3B": Draft("RedHatAI/Qwen3.6-35B-A3B-speculator.dspark", None, "qwen3_5_moe", 35.0, 8),
    "LiquidAI/LFM2.5-1.2B-Instruct": Draft("LiquidAI/LFM2.5-1.2B-Instruct-DSpark", None, "lfm2", 1.2, 9),
    "LiquidAI/LFM2.5-2.6B": Draft("LiquidAI/LFM2.5-2.6B-DSpark", None, "lfm2", 2.6, 9),
    "LiquidAI/LFM2.5-8B-A1B": Draft("LiquidAI/LFM2.5-8B-A1B-DSpark", None, "lfm2_moe", 8.0, 9),
    "LiquidAI/LFM2.5-24B-A2B": Draft("LiquidAI/LFM2.5-24B-A2B-DSpark", None, "lfm2_moe", 24.0, 9),
}
# every target's default draft: its DFlash draft where it has one
DEFAULT_DRAFTS = DSPARK_DRAFTS | KNOWN_PAIRS

_NO_ADAPTER = "no target adapter for mlx-lm's '{}' layers (target.SUPPORTED_MODEL_TYPES)"

# Published drafts whose targets dflash-mlx cannot run, with the reason:
# ``models`` lists them and ``--model`` names the reason instead of "unknown".
UNSUPPORTED_PAIRS: dict[str, Draft] = {
    "moonshotai/Kimi-K2.5": Draft("z-lab/Kimi-K2.5-DFlash", None, "kimi_k25", unsupported=(
        _NO_ADAPTER.format("kimi_k25") + ": DeepSeek-V3 multi-head latent attention")),
    "moonshotai/Kimi-K2.6": Draft("z-lab/Kimi-K2.6-DFlash", None, "kimi_k25", unsupported=(
        _NO_ADAPTER.format("kimi_k25") + ": DeepSeek-V3 multi-head latent attention")),
    "MiniMaxAI/MiniMax-M2.5": Draft("z-lab/MiniMax-M2.5-DFlash", None, "minimax_m2", unsupported=(
        _NO_ADAPTER.format("minimax_m2"))),
    "MiniMaxAI/MiniMax-M2.7": Draft("z-lab/MiniMax-M2.7-DFlash", None, "minimax_m2", unsupported=(
        _NO_ADAPTER.format("minimax_m2"))),
    "zai-org/GLM-5.1-FP8": Draft("z-lab/GLM-5.1-FP8-DFlash", None, "glm_moe_dsa", unsupported=(
        _NO_ADAPTER.format("glm_moe_dsa") + ": DeepSeek sparse attention, whose indexer picks keys per query")),
    "meta-models/Muse-Glimmer-30B": Draft("z-lab/Muse-Glimmer-30B-DFlash2", None, "muse_glimmer", unsupported=(
        _NO_ADAPTER.format("muse_glimmer"))),
}

# Bits per weight: bf16, and mlx-lm's affine 8-/4-bit quantization at group
# size 64 (a bf16 scale and bias per group add 0.5 bit).
BITS = {"bf16": 16.0, "8-bit": 8.5, "4-bit": 4.5}
MAX_MACHINES = 4  # the largest MLX distributed cluster ``fitting`` considers (docs/distributed.md)
# targets --distributed runs: mlx-lm's class has shard() (tensor) or pipeline() (docs/distributed.md)
DISTRIBUTED_FAMILIES = ("llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss")


def weights_gb(params_b: float, bits: float) -> float:
    """Approximate weight bytes, in GB (1e9), of ``params_b`` billion parameters."""
    return params_b * bits / 8


def memory_budget(info: dict) -> Optional[int]:
    """Bytes a model may take on the device ``info`` describes (``mx.device_info()``):
    Metal's recommended working set where given, else 3/4 of its memory."""
    if info.get("max_recommended_working_set_size"):
        return int(info["max_recommended_working_set_size"])
    return int(info["memory_size"]) * 3 // 4 if info.get("memory_size") else None


def fitting(params_b: float, budget: Optional[int], max_machines: int = MAX_MACHINES) -> str:
    """The widest weights (of ``BITS``) a target fits in ``budget`` bytes with
    10% to spare for caches and activations: "bf16", "8-bit", "4-bit"; else
    sharded over the fewest machines of that budget, up to ``max_machines``,
    e.g. "4-bit on 2 Macs" (``--distributed``); else "no"."""
    if budget is None:
        return "?"
    for machines in range(1, max_machines + 1):
        fits = [name for name, bits in BITS.items() if weights_gb(params_b, bits) * 1e9 * 1.1 <= machines * budget]
        if fits:
            return fits[0] if machines == 1 else f"{fits[0]} on {machines} Macs"
    return "no"


def listing(budget: Optional[int]) -> tuple[list[list[str]], list[list[str]]]:
    """Rows for ``dflash-mlx models``: (target, draft, thinking, block, size per
    ``BITS``, fits) of every runnable pair, and (target, draft, reason) of the others."""
    mode = {None: "template default", True: "thinking", False: "no thinking"}
    pairs = [[target, d.repo, mode[d.enable_thinking], str(d.block_size or "config"),
              *(f"{weights_gb(d.params_b, bits):.0f}" for bits in BITS.values()),
              fitting(d.params_b, budget, MAX_MACHINES if d.model_type in DISTRIBUTED_FAMILIES else 1)]
             for target, d in [*KNOWN_PAIRS.items(), *DSPARK_DRAFTS.items()]]
    return pairs, [[target, d.repo, d.unsupported] for target, d in UNSUPPORTED_PAIRS.items()]


# Other names the same targets go by (mlx-community renames some of them).
ALIASES: dict[str, str] = {
    "meta-llama-3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
}

_QUANT_SUFFIX = re.compile(r"-(?:mlx-)?(?:[2-8]bit|bf16|fp16|dwq|mxfp4)(?:-.*)?$", re.I)


def _key(name: str) -> str:
    return _QUANT_SUFFIX.sub("", PurePath(name.rstrip("/")).name).lower()


_BY_KEY = {_key(t): t for t in DEFAULT_DRAFTS} | ALIASES
_UNSUPPORTED_KEY = {_key(t): t for t in UNSUPPORTED_PAIRS}


def find(target: str) -> Optional[Draft]:
    """The registry entry for a target hub id, mlx-community quantization or
    local directory named like one; None when the target is unknown."""
    base = _BY_KEY.get(_key(target))
    return DEFAULT_DRAFTS[base] if base else None


def unsupported(target: str) -> Optional[str]:
    """Why a target with a published draft cannot run here (``UNSUPPORTED_PAIRS``); None otherwise."""
    base = _UNSUPPORTED_KEY.get(_key(target))
    return f"target '{target}' cannot run: {UNSUPPORTED_PAIRS[base].unsupported}" if base else None


def find_draft(target: str) -> Optional[str]:
    """The draft repo for a target (see ``find``); None when the target is unknown."""
    entry = find(target)
    return entry.repo if entry else None


@dataclass(frozen=True)
class Pair:
    """A target and a draft to run together (hub ids or local paths)."""

    target: str
    draft: str
    enable_thinking: Optional[bool] = None  # the registry's default for the target's chat template
    demo: bool = False  # the bundled demo pair, chosen because no --model was given


def resolve_pair(model: Optional[str], draft: Optional[str]) -> Pair:
    """--model and --draft as given, the registry's draft for --model, or with
    neither the bundled demo pair. The thinking default follows the target's
    registry entry whichever draft is used."""
    if model is None:
        if draft is not None:
            raise DFlashError("--draft needs --model (the target it was made for)")
        from .demo import demo_pair

        pair = demo_pair()
        return Pair(str(pair.target), str(pair.draft), demo=True)
    entry = find(model)
    if entry is None and unsupported(model):
        raise DFlashError(unsupported(model))
    if draft is None and entry is None:
        raise DFlashError(
            f"no known DFlash draft for target '{model}'; pass --draft, or use one of: "
            + ", ".join(DEFAULT_DRAFTS)
        )
    return Pair(model, draft or entry.repo, entry.enable_thinking if entry else None)


def read_config(path_or_repo: str, what: str) -> dict:
    """The config.json of a target or draft (local directory or hub id), fetching
    nothing else: cheap enough to check options against before loading weights."""
    from .loading import resolve

    path = resolve(path_or_repo, what, ["*.json"]) / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError:
        raise DFlashError(f"{what} '{path_or_repo}' has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(f"{what} config '{path}' is not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(config, dict):
        raise DFlashError(f"{what} config '{path}' is not a JSON object")
    return config
