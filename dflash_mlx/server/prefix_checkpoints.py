"""Checkpoints of recurrent states where prompts diverge, for the prefix cache.

GatedDeltaNet states cannot be cut back, so a hybrid target's entry can be
resumed only where its states were saved while its prompt was prefilled.
Besides the end of the prompt but its last token, the prefix cache saves
them at the start of the chat template's last turn (what two agents with
one system prompt and tools share, ``last_turn_start``) and every
``interval`` tokens inside long prompts, so a prompt that leaves a stored
one anywhere resumes from the nearest checkpoint at or before the point
where they part.
"""

from dataclasses import dataclass
from typing import Optional

from .errors import APIError
from .prompts import chat_ids
from .schemas import ChatRequest

DEFAULT_INTERVAL = 2048  # a checkpoint every this many prompt tokens (the prefill's own chunk size)


@dataclass
class Checkpoint:
    position: int  # prompt tokens the states hold
    states: list  # per target layer: an ArraysCache's arrays at ``position``, else None


def common_prefix(a: list[int], b: list[int]) -> int:
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; by halves, each compared at C speed
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def resumable(tokens: list[int], prompt: list[int], positions: list[int], recurrent: bool) -> int:
    """Tokens of ``prompt`` that caches holding ``tokens`` (recurrent states,
    if any, checkpointed at ``positions``) hold after a rollback, at least
    one prompt token left to prefill."""
    n = common_prefix(tokens, prompt[: len(prompt) - 1])
    if n != len(tokens) and recurrent:
        n = max((p for p in positions if p <= n), default=0)
    return n


def positions(end: int, held: int, interval: int, marks: list[int]) -> list[int]:
    """Where a prompt prefilled from ``held`` tokens to ``end`` (all of it but
    its last token) is checkpointed, ascending: at ``marks`` and every
    ``interval`` tokens (0: none) past ``held``, and at ``end``."""
    every = range(interval, end, interval) if interval > 0 else []
    return sorted({p for p in [*marks, *every] if held < p < end} | {end})


def nbytes(checkpoints: list[Checkpoint]) -> int:
    return sum(a.nbytes for c in checkpoints for layer in c.states for a in layer or [] if a is not None)


def last_turn_start(tokenizer, body: ChatRequest, ids: list[int], enable_thinking: Optional[bool]) -> Optional[int]:
    """Where the chat's last message starts in its prompt ``ids``: as far as
    the messages before it, through the same template, agree with ``ids``
    (system, tools and history); None for a single message."""
    if len(body.messages) < 2:
        return None
    earlier = body.model_copy(update={"messages": body.messages[:-1]})
    try:
        return common_prefix(chat_ids(tokenizer, earlier, enable_thinking), ids) or None
    except APIError:  # the template refuses the shorter conversation
        return None
