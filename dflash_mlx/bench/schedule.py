"""The arms of a benchmark and the order of its runs: every prompt and repeat
runs the baseline and each DFlash arm back to back, in an order that alternates."""

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

BASELINE = "baseline"
DFLASH = "dflash"


class Arm(NamedTuple):
    """A DFlash arm: its block size, for a DDTree the tree's node budget (None:
    the chain of the block) and, for the auto chain of a DSpark draft with a
    confidence head, whether it verifies by the confidence schedule (None: no
    schedule could run)."""

    block_size: Union[int, str]
    tree_budget: Optional[int] = None
    confidence_schedule: Optional[bool] = None

    @classmethod
    def of(cls, record: dict) -> "Arm":
        """The arm of a run, pair or summary side of the report."""
        return cls(record["block_size"], record.get("tree_budget"), record.get("confidence_schedule"))

    @property
    def key(self) -> str:
        """Its name in the report: ``16`` or ``auto`` (a chain; ``auto-unscheduled``
        without the confidence schedule), ``tree32@16`` (a tree)."""
        if self.tree_budget is not None:
            return f"tree{self.tree_budget}@{self.block_size}"
        return f"{self.block_size}{'-unscheduled' if self.confidence_schedule is False else ''}"

    @property
    def label(self) -> str:
        """Its name in tables: ``b=16``, ``B=32 b=16``, ``b=auto sched`` / ``b=auto unsched``."""
        chain = f"b={self.block_size}" + {True: " sched", False: " unsched", None: ""}[self.confidence_schedule]
        return chain if self.tree_budget is None else f"B={self.tree_budget} {chain}"


def arms(block_sizes: list, tree_budgets: Optional[list[int]] = None, tree_block: Optional[int] = None,
         schedules: Optional[list[bool]] = None) -> list[Arm]:
    """The chain at each block size (auto's once per value of ``schedules``,
    the confidence schedule on or off, where given), then a tree of each budget at ``tree_block``."""
    chains = [Arm(b, None, s) for b in block_sizes for s in (schedules if b == "auto" and schedules else [None])]
    return chains + [Arm(tree_block, t) for t in tree_budgets or []]


@dataclass(frozen=True)
class Step:
    """One timed run: a prompt, a repeat, and an arm (the baseline, or DFlash's
    chain or tree at a block size)."""

    prompt: int
    repeat: int
    arm: str
    block_size: Optional[int] = None
    tree_budget: Optional[int] = None
    confidence_schedule: Optional[bool] = None

    @property
    def label(self) -> str:
        if self.arm == BASELINE:
            return BASELINE
        name = DFLASH if self.tree_budget is None else "ddtree"
        return f"{name} {Arm(self.block_size, self.tree_budget, self.confidence_schedule).label}"


def schedule(n_prompts: int, repeats: int, dflash_arms: list[Arm]) -> list[Step]:
    """Every (repeat, prompt) unit runs the baseline and each DFlash arm back to
    back; consecutive units reverse the order, so neither side always goes first.
    Repeats are the outer loop, so a repeat sees every prompt before the next starts."""
    steps = []
    unit = 0
    for r in range(repeats):
        for p in range(n_prompts):
            units = [Step(p, r, BASELINE)] + [Step(p, r, DFLASH, *a) for a in dflash_arms]
            steps += units if unit % 2 == 0 else units[::-1]
            unit += 1
    return steps
