"""The bundled demo pair: a tiny trained Qwen3.5-hybrid code model and its
trained DFlash draft, shipped inside the package so DFlash runs offline.

The target (GatedDeltaNet + attention, mlx-lm's ``qwen3_5``) was pretrained on
the Python standard library's own source (PSF licence) with a byte-level BPE
tokenizer trained by ``tokenizers``; the draft was trained with
``dflash-mlx train`` on the target's own greedy continuations. Reproduce both
with ``examples/make_demo_pair.py``.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import DFlashError

DEMO_DIR = Path(__file__).resolve().parent / "demo_pair"


@dataclass(frozen=True)
class DemoPair:
    target: Path  # mlx-lm model directory (config, weights, tokenizer)
    draft: Path  # DFlash draft directory (MLX layout)
    prompts: Path  # JSONL of held-out prompts ({"prompt": ...}) neither model trained on

    def load_prompts(self) -> list[str]:
        return [json.loads(line)["prompt"] for line in self.prompts.read_text().splitlines() if line.strip()]


def demo_pair() -> DemoPair:
    """Paths of the bundled pair; raises DFlashError if the install lacks it."""
    pair = DemoPair(DEMO_DIR / "target_model", DEMO_DIR / "draft", DEMO_DIR / "heldout_prompts.jsonl")
    for path in (pair.target, pair.draft):
        if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
            raise DFlashError(
                f"the bundled demo pair is missing from '{DEMO_DIR}'; reinstall dflash-mlx "
                "or rebuild it with examples/make_demo_pair.py"
            )
    return pair
