"""Known target -> draft pairs (DESIGN.md §3), for ``--draft`` defaults."""

import re
from pathlib import PurePath
from typing import Optional

# Target hub id -> published z-lab draft. Quantized mlx-community conversions of
# a target (``mlx-community/<name>-4bit`` / ``-8bit``) use the same draft.
KNOWN_PAIRS: dict[str, str] = {
    "Qwen/Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",
    "Qwen/Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16",
    "Qwen/Qwen3.5-4B": "z-lab/Qwen3.5-4B-DFlash",
    "Qwen/Qwen3.5-9B": "z-lab/Qwen3.5-9B-DFlash",
    "Qwen/Qwen3.5-27B": "z-lab/Qwen3.5-27B-DFlash",
    "Qwen/Qwen3.5-35B-A3B": "z-lab/Qwen3.5-35B-A3B-DFlash",
    "Qwen/Qwen3.6-27B": "z-lab/Qwen3.6-27B-DFlash",
    "Qwen/Qwen3.6-35B-A3B": "z-lab/Qwen3.6-35B-A3B-DFlash",
    "meta-llama/Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    "openai/gpt-oss-20b": "z-lab/gpt-oss-20b-DFlash",
    "openai/gpt-oss-120b": "z-lab/gpt-oss-120b-DFlash",
}

# Other names the same targets go by (mlx-community renames some of them).
ALIASES: dict[str, str] = {
    "meta-llama-3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
}

_QUANT_SUFFIX = re.compile(r"-(?:mlx-)?(?:[2-8]bit|bf16|fp16|dwq|mxfp4)(?:-.*)?$", re.I)


def _key(name: str) -> str:
    return _QUANT_SUFFIX.sub("", PurePath(name.rstrip("/")).name).lower()


_BY_KEY = {_key(t): t for t in KNOWN_PAIRS} | ALIASES


def find_draft(target: str) -> Optional[str]:
    """The draft repo for a target hub id, mlx-community quantization or local
    directory named like one; None when the target is unknown."""
    base = _BY_KEY.get(_key(target))
    return KNOWN_PAIRS[base] if base else None
