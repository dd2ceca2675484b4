"""The single-model worker: one thread owns every MLX array and call.

Requests wait in one first-in, first-out queue and decode one at a time, each
to its end (``--max-tokens-limit`` bounds how long that is), so a request
never waits behind one that arrived after it. The worker streams events back
to the request's asyncio loop. A cancelled request (its client went away)
gives its queue slot back at once and stops at the next verify cycle, which
leaves the decoder caches consistent for the prefix cache.
"""

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import mlx.core as mx

from ..chat import encode
from ..errors import DFlashError
from ..generate import check_pair, stream_generate
from ..loading import load, load_draft
from ..targets import Target
from .logprobs import Picked, picked
from .prefix_cache import PrefixCache
from .stops import StopMatcher


class QueueFull(Exception):
    """More requests are waiting than ``--max-queue`` allows."""


class ShuttingDown(Exception):
    """The server is shutting down and takes no new request."""


SHUTTING_DOWN = "the server is shutting down; retry once it is back"


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: dict  # stream_generate's sampling keyword arguments
    stop: list[str] = field(default_factory=list)
    logprobs: Optional[int] = None  # each token's log-probability with this many top alternatives; None: none


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose caches were reused, not prefilled
    completion_tokens: int = 0
    cycles: int = 0  # verify cycles
    accepted: int = 0  # drafted tokens the target accepted
    blocks: dict[int, int] = field(default_factory=dict)  # cycles per block size verified (1: a plain step)

    def to_dict(self) -> dict:
        """OpenAI's usage, plus how DFlash served it: cycles, tokens per cycle,
        the block sizes used and whether any cycle drafted (``decoding``)."""
        tau = (self.accepted + self.cycles) / self.cycles if self.cycles else None
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
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
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: Usage
    stop_sequence: Optional[str] = None  # the request's stop string that ended it


@dataclass
class Failed:
    status: int
    message: str
    code: Optional[str] = None


Event = Union[Delta, Finished, Failed]


class Job:
    """One queued request and the channel its events come back on."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.released = False  # its queue slot was given back

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


class Engine:
    """Loads the pair on its worker thread and runs queued requests there."""

    generator = staticmethod(stream_generate)  # what decodes (server/distributed.py: the group's loop)

    def __init__(self, model: str, draft: str, block_size: Union[int, str, None] = "auto",
                 max_queue: int = 32, prefix_cache_bytes: int = 0, draft_vocab: Optional[int] = None,
                 kv: Optional[dict] = None, draft_dtype: str = "auto"):
        self.model_id, self.draft_id = model, draft
        self.draft_dtype = draft_dtype  # --draft-dtype: what the draft computes in
        self.kv = kv or {}  # every request's quantized KV cache: stream_generate's kv_bits, ...
        self.block_size = block_size
        self.draft_vocab = draft_vocab  # every request drafts over this many top-ranked ids
        self.max_queue = max_queue
        self.prefix_cache_bytes = prefix_cache_bytes
        self.started = int(time.time())
        self.stats: dict = {}  # replaced (never mutated) by the worker after each request
        # set by _load, on the worker thread:
        self.target: Optional[Target] = None
        self.draft = None
        self.tokenizer = None
        self.vocab_size = 0
        self.context_length: Optional[int] = None
        self.prefix_cache: Optional[PrefixCache] = None
        self._queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._lock = threading.Lock()
        self._active = 0  # admitted and not yet released: waiting or decoding
        self._jobs: set[Job] = set()  # the admitted jobs, for shut_down
        self._closing = False
        self._ready = threading.Event()
        self._load_error: Optional[Exception] = None
        self._thread = threading.Thread(target=self._run, name="dflash-mlx-worker", daemon=True)

    def start(self) -> None:
        """Start the worker and wait until the pair is loaded (DFlashError if it cannot be)."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._thread.join()  # ended: exiting with MLX still tearing it down aborts
            raise self._load_error

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    @property
    def active(self) -> int:
        """Requests admitted and not yet done: the one decoding and those waiting."""
        return self._active

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a request; QueueFull if ``max_queue`` requests already wait,
        ShuttingDown once ``shut_down`` was called."""
        job = Job(request, loop)
        with self._lock:
            if self._closing:
                raise ShuttingDown(SHUTTING_DOWN)
            if self._active > self.max_queue:
                raise QueueFull(
                    f"the server is busy: {self.max_queue} requests are already waiting; retry later"
                )
            self._active += 1
            self._jobs.add(job)
        self._queue.put(job)
        return job

    def shut_down(self) -> None:
        """Take no new request and end every admitted one now with a 503
        error; the one decoding stops at its next verify cycle."""
        with self._lock:
            self._closing = True
            jobs = list(self._jobs)
        for job in jobs:
            job.emit(Failed(503, SHUTTING_DOWN, "server_shutting_down"))
            self.cancel(job)

    def cancel(self, job: Job) -> None:
        """Give the job's slot back now; the worker drops or stops it."""
        job.cancelled.set()
        self._release(job)

    def _release(self, job: Job) -> None:
        with self._lock:
            if not job.released:
                job.released = True
                self._active -= 1
                self._jobs.discard(job)

    def _load(self) -> None:
        self.target, self.tokenizer = self._load_target()
        self.draft = load_draft(self.draft_id, dtype=self.draft_dtype)
        check_pair(self.target, self.draft)
        self.vocab_size = self.target.vocab_size
        self.context_length = getattr(self.target.args, "max_position_embeddings", None)
        # one cycle through the whole pipeline: a bad option fails here, not in every request
        for _ in self._stream(encode(self.tokenizer, "hello"), max_tokens=2):
            pass
        self.prefix_cache = self._prefix_cache()
        self._update_stats()

    def _load_target(self) -> tuple[Target, object]:
        """The target and its tokenizer (server/distributed.py loads it sharded)."""
        model, tokenizer = load(self.model_id)
        return Target(model), tokenizer

    def _prefix_cache(self) -> PrefixCache:
        return PrefixCache(self.target, self.draft, self.prefix_cache_bytes, self.kv)

    def _stream(self, prompt: list[int], **kwargs):
        """``stream_generate`` over this engine's pair, block size, drafting vocabulary and KV cache."""
        return self.generator(self.target, self.draft, self.tokenizer, prompt, block_size=self.block_size,
                              draft_vocab=self.draft_vocab, **self.kv, **kwargs)

    def _next_job(self) -> Optional[Job]:
        """The next queued job, waiting as long as it takes; None when the engine stops."""
        return self._queue.get()

    def _cancelled(self, job: Job) -> bool:
        """Whether the request decoding stops at this cycle boundary (its client went away)."""
        return job.cancelled.is_set()

    def _update_stats(self) -> None:
        self.stats = {
            "prefix_cache": {"entries": len(self.prefix_cache.entries), "bytes": self.prefix_cache.nbytes},
            "memory_gb": {"active": mx.get_active_memory() / 1e9, "peak": mx.get_peak_memory() / 1e9},
        }

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # MLX's streams of this thread go with it, while the interpreter is
            # whole: torn down at exit instead, they abort the process now and
            # then ("terminate called without an active exception")
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            self._load()
        except Exception as e:  # reported by start() in the caller's thread
            self._load_error = e if isinstance(e, DFlashError) else DFlashError(str(e))
            return
        finally:
            self._ready.set()
        while (job := self._next_job()) is not None:
            try:
                if not job.cancelled.is_set():
                    self._generate(job)
            except DFlashError as e:
                job.emit(Failed(400, str(e)))
            except Exception as e:  # keep serving; the caches of this request are dropped
                job.emit(Failed(500, f"internal error: {type(e).__name__}: {e}"))
            finally:
                self._release(job)
                self._update_stats()

    def _generate(self, job: Job) -> None:
        request = job.request
        context = self.prefix_cache.take(request.prompt)
        usage = Usage(len(request.prompt), cached_tokens=len(context.tokens))
        stops = StopMatcher(request.stop)
        mark, snapshot = self.prefix_cache.mark(context, request.prompt, self.tokenizer)
        finish = "cancelled"
        responses = self._stream(request.prompt, max_tokens=request.max_tokens, context=context,
                                 logprobs=request.logprobs is not None, **request.sampling)
        try:
            for i, r in enumerate(responses):
                if i > 0:
                    usage.cycles += 1
                    usage.accepted += r.accepted
                    usage.blocks[r.block_size] = usage.blocks.get(r.block_size, 0) + 1
                usage.completion_tokens += len(r.tokens)
                text, stopped = stops.feed(r.text)
                if r.finish_reason and not stopped:
                    text += stops.flush()
                picks = [] if r.logprobs is None else picked(r.logprobs, r.tokens, request.logprobs)
                if text or picks:
                    job.emit(Delta(text, picks))
                if stopped or r.finish_reason:
                    finish = "stop" if stopped else r.finish_reason
                    break
                if self._cancelled(job):
                    break
        finally:
            responses.close()
        # only a request that ran to a cycle boundary leaves caches worth keeping
        self.prefix_cache.put(context, mark, snapshot)
        job.emit(Finished(finish, usage, stops.matched))
