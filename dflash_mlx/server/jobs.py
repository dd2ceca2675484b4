"""A request as the worker takes it, and the events it sends back: its text
as it comes (``Delta``), then how it ended (``Finished``, with its ``Usage``)
or why it failed (``Failed``), through its ``Job``'s channel to the request's
asyncio loop."""

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Optional, Union

from .logprobs import Picked


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: dict  # stream_generate's sampling keyword arguments
    stop: list[str] = field(default_factory=list)
    logprobs: Optional[int] = None  # each token's log-probability with this many top alternatives; None: none
    marks: list[int] = field(default_factory=list)  # prompt positions to checkpoint at: a chat's last turn
    images: list = field(default_factory=list)  # vision.Image, one per image placeholder of the prompt


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose caches were reused, not prefilled
    cache_tier: Optional[str] = None  # where they came from: "ram", "disk", or None (none reused)
    completion_tokens: int = 0
    cycles: int = 0  # verify cycles
    accepted: int = 0  # drafted tokens the target accepted
    blocks: dict[int, int] = field(default_factory=dict)  # cycles per block size verified (1: a plain step)

    def to_dict(self) -> dict:
        """OpenAI's usage (the cached tokens' tier beside them), plus how DFlash
        served it: cycles, tokens per cycle, the block sizes used and whether
        any cycle drafted (``decoding``)."""
        tau = (self.accepted + self.cycles) / self.cycles if self.cycles else None
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens, "cache_tier": self.cache_tier},
            "cycles": self.cycles,
            "tokens_per_cycle": tau,
            "block_sizes": {str(b): n for b, n in sorted(self.blocks.items())},
            # "plain": every token came from the target alone (b = 1 steps), as without a draft
            "decoding": "speculative" if any(b > 1 for b in self.blocks) else "plain",
        }


@dataclass
class Delta:
    text: str
    logprobs: list[Picked] = field(default_factory=list)  # its tokens', when the request asked


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled" | "error" (the reply left its grammar: ``error``)
    usage: Usage
    stop_sequence: Optional[str] = None  # the request's stop string that ended it
    error: Optional[str] = None  # why a reply under ``response_format`` is not one its grammar accepts


@dataclass
class Failed:
    status: int
    message: str
    code: Optional[str] = None


Event = Union[Delta, Finished, Failed]


def internal(error: Exception) -> Failed:
    """An internal error's 500."""
    return Failed(500, f"internal error: {type(error).__name__}: {error}")


class Job:
    """One queued request and the channel its events come back on."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.released = False  # its queue slot was given back
        self.started = False  # the worker took it from the queue: decoding (or dropped, if cancelled)

    def emit(self, event: Event) -> None:
        """Hand an event to the request's loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass

    async def stream(self):
        """Events until the final one (Finished or Failed)."""
        while True:
            event = await self.events.get()
            yield event
            if not isinstance(event, Delta):
                return
