"""The order of a benchmark's runs: every prompt and repeat runs the baseline
and DFlash at each block size back to back, in an order that alternates."""

from dataclasses import dataclass
from typing import Optional

BASELINE = "baseline"
DFLASH = "dflash"


@dataclass(frozen=True)
class Step:
    """One timed run: a prompt, a repeat, and an arm (baseline or DFlash at a block size)."""

    prompt: int
    repeat: int
    arm: str
    block_size: Optional[int] = None

    @property
    def label(self) -> str:
        return BASELINE if self.arm == BASELINE else f"{DFLASH} b={self.block_size}"


def schedule(n_prompts: int, repeats: int, block_sizes: list[int]) -> list[Step]:
    """Every (repeat, prompt) unit runs the baseline and each block size back to
    back; consecutive units reverse the order, so neither side always goes first.
    Repeats are the outer loop, so a repeat sees every prompt before the next starts."""
    steps = []
    unit = 0
    for r in range(repeats):
        for p in range(n_prompts):
            arms = [Step(p, r, BASELINE)] + [Step(p, r, DFLASH, b) for b in block_sizes]
            steps += arms if unit % 2 == 0 else arms[::-1]
            unit += 1
    return steps
