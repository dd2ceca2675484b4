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
    """A published draft and the chat mode it was trained on."""

    repo: str
    # enable_thinking for the target's chat template: what the draft's training
    # chats used, since acceptance collapses on the other mode. None: the
    # template has no thinking switch, so its default is left alone.
    enable_thinking: Optional[bool] = None


# Target hub id -> published z-lab draft. Quantized mlx-community conversions of
# a target (``mlx-community/<name>-4bit`` / ``-8bit``) use the same draft.
# The Qwen3 -b16 drafts were trained on non-thinking chats (thinking on cuts
# their acceptance from about 60% to 25%, z-lab/dflash issue 133); the
# Qwen3.5/3.6 drafts on thinking-mode output (with thinking off, tau falls from
# 9.5 to about 3, z-lab/dflash issue 60), which is also those templates' default.
KNOWN_PAIRS: dict[str, Draft] = {
    "Qwen/Qwen3-4B": Draft("z-lab/Qwen3-4B-DFlash-b16", enable_thinking=False),
    "Qwen/Qwen3-8B": Draft("z-lab/Qwen3-8B-DFlash-b16", enable_thinking=False),
    "Qwen/Qwen3.5-4B": Draft("z-lab/Qwen3.5-4B-DFlash", enable_thinking=True),
    "Qwen/Qwen3.5-9B": Draft("z-lab/Qwen3.5-9B-DFlash", enable_thinking=True),
    "Qwen/Qwen3.5-27B": Draft("z-lab/Qwen3.5-27B-DFlash", enable_thinking=True),
    "Qwen/Qwen3.5-35B-A3B": Draft("z-lab/Qwen3.5-35B-A3B-DFlash", enable_thinking=True),
    "Qwen/Qwen3.6-27B": Draft("z-lab/Qwen3.6-27B-DFlash", enable_thinking=True),
    "Qwen/Qwen3.6-35B-A3B": Draft("z-lab/Qwen3.6-35B-A3B-DFlash", enable_thinking=True),
    "meta-llama/Llama-3.1-8B-Instruct": Draft("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": Draft("z-lab/Qwen3-Coder-30B-A3B-DFlash"),
    "openai/gpt-oss-20b": Draft("z-lab/gpt-oss-20b-DFlash"),
    "openai/gpt-oss-120b": Draft("z-lab/gpt-oss-120b-DFlash"),
    "Qwen/Qwen3-Coder-Next": Draft("z-lab/Qwen3-Coder-Next-DFlash"),
    "google/gemma-4-26B-A4B-it": Draft("z-lab/gemma-4-26B-A4B-it-DFlash"),
    "google/gemma-4-31B-it": Draft("z-lab/gemma-4-31B-it-DFlash"),
    # a DFlash2 draft (docs/dflash2.md); its training chat mode is not published
    "Qwen/Qwen3.8-27B": Draft("z-lab/Qwen3.8-27B-DFlash2"),
}

# Other names the same targets go by (mlx-community renames some of them).
ALIASES: dict[str, str] = {
    "meta-llama-3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
}

_QUANT_SUFFIX = re.compile(r"-(?:mlx-)?(?:[2-8]bit|bf16|fp16|dwq|mxfp4)(?:-.*)?$", re.I)


def _key(name: str) -> str:
    return _QUANT_SUFFIX.sub("", PurePath(name.rstrip("/")).name).lower()


_BY_KEY = {_key(t): t for t in KNOWN_PAIRS} | ALIASES


def find(target: str) -> Optional[Draft]:
    """The registry entry for a target hub id, mlx-community quantization or
    local directory named like one; None when the target is unknown."""
    base = _BY_KEY.get(_key(target))
    return KNOWN_PAIRS[base] if base else None


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
    if draft is None and entry is None:
        raise DFlashError(
            f"no known DFlash draft for target '{model}'; pass --draft, or use one of: "
            + ", ".join(KNOWN_PAIRS)
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
