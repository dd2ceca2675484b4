"""The single-model worker: one thread owns every MLX array and call.

Requests wait in one first-in, first-out queue. Up to ``max_concurrency`` of
them decode at once as the rows of one batch (``batch.py``): between two
verify cycles the worker admits queued requests while a row is free (each is
prefilled alone, from the prefix cache's caches), then runs one cycle for
every row; a row that ends leaves the batch with its caches, which go to the
prefix cache. What cannot batch decodes one request at a time, each to its
end, through ``stream_generate``: a quantized KV cache (``kv``), an engine
whose generator is not the library's own (``server/distributed.py``) and
``max_concurrency == 1``; and a request with images, once the rows before
it end. Either way a request never waits behind one that arrived after it
(``--max-tokens-limit`` bounds how long one takes).

The worker streams events back to the request's asyncio loop. A cancelled
request (its client went away) gives its slot back at once and stops at the
next cycle boundary, which leaves its caches consistent for the prefix cache.
"""

import asyncio
import queue
import threading
import time
from typing import Optional, Union

import mlx.core as mx

from ..chat import encode
from ..errors import DFlashError
from ..generate import check_pair, stream_generate
from ..loading import load, load_draft
from ..targets import Target
from ..vision import with_images
from .batch import Rows
from .images import refusal
# a request and its events, which the routes and the distributed engine take from here
from .jobs import Delta, Event, Failed, Finished, Job, Request, Usage, internal  # noqa: F401
from .logprobs import picked
from .prefix_cache import PrefixCache, Resume
from .prefix_checkpoints import DEFAULT_INTERVAL
from .prefix_disk import DiskConfig, DiskTier, pair_key
from .stops import StopMatcher


class QueueFull(Exception):
    """More requests are waiting than ``--max-queue`` allows."""


class ShuttingDown(Exception):
    """The server is shutting down and takes no new request."""


SHUTTING_DOWN = "the server is shutting down; retry once it is back"
# requests decoded at once, as one batch, unless serve is told otherwise (--max-concurrency; its
# --help and docs/serve.md say the number too)
DEFAULT_MAX_CONCURRENCY = 8


class Engine:
    """Loads the pair on its worker thread and runs queued requests there."""

    generator = staticmethod(stream_generate)  # what decodes (server/distributed.py: the group's loop)

    def __init__(self, model: str, draft: str, block_size: Union[int, str, None] = "auto",
                 max_queue: int = 32, prefix_cache_bytes: int = 0, draft_vocab: Optional[int] = None,
                 kv: Optional[dict] = None, draft_dtype: str = "auto",
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY, prefix_disk: Optional[DiskConfig] = None,
                 prefix_interval: int = DEFAULT_INTERVAL):
        if max_concurrency < 1:
            raise DFlashError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.model_id, self.draft_id = model, draft
        self.draft_dtype = draft_dtype  # --draft-dtype: what the draft computes in
        self.kv = kv or {}  # every request's quantized KV cache: stream_generate's kv_bits, ...
        self.block_size = block_size
        self.draft_vocab = draft_vocab  # every request drafts over this many top-ranked ids
        self.max_queue = max_queue
        self.max_concurrency = max_concurrency  # asked for; ``width`` is what this engine runs
        self._solo = 0  # 1 while a request decodes alone (width 1)
        self.prefix_cache_bytes = prefix_cache_bytes
        self.prefix_disk = prefix_disk  # the prefix cache's disk tier (none without a RAM one)
        self.prefix_interval = prefix_interval  # hybrid targets' prompts are checkpointed every so many tokens
        self.started = int(time.time())
        self.stats: dict = {}  # replaced (never mutated) by the worker after each request
        # set by _load, on the worker thread:
        self.target: Optional[Target] = None
        self.draft = None
        self.tokenizer = None
        self.vocab_size = 0
        self.context_length: Optional[int] = None
        self.prefix_cache: Optional[PrefixCache] = None
        self.image_refusal: Optional[str] = None  # why requests with images are refused; None: they are taken
        self._queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._lock = threading.Lock()
        self._active = 0  # admitted and not yet released: waiting or decoding
        self._jobs: set[Job] = set()  # the admitted jobs, for shut_down
        self._closing = False
        self._ready = threading.Event()
        self._load_error: Optional[Exception] = None
        self._thread = threading.Thread(target=self._run, name="dflash-mlx-worker", daemon=True)
        self._rows: Optional[Rows] = None  # the batch (width > 1), set by _load

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
    def width(self) -> int:
        """Requests this engine decodes at once: ``max_concurrency``, or 1
        where requests cannot batch (a quantized KV cache, or a generator
        other than the library's own, as the distributed engine's)."""
        batches = not self.kv and self.generator is stream_generate
        return self.max_concurrency if batches else 1

    @property
    def active(self) -> int:
        """Requests admitted and not yet done: those decoding and those waiting."""
        return self._active

    @property
    def rows(self) -> int:
        """Requests decoding now."""
        return self._solo if self._rows is None else len(self._rows)

    @property
    def waiting(self) -> int:
        """Requests admitted and not yet taken up by the worker."""
        with self._lock:
            return sum(not job.started for job in self._jobs)

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a request; QueueFull if ``max_queue`` requests already wait
        beside the ``width`` decoding, ShuttingDown once ``shut_down`` was called."""
        job = Job(request, loop)
        with self._lock:
            if self._closing:
                raise ShuttingDown(SHUTTING_DOWN)
            if self._active >= self.width + self.max_queue:
                raise QueueFull(
                    f"the server is busy: {self.max_queue} requests are already waiting; retry later"
                )
            self._active += 1
            self._jobs.add(job)
        self._queue.put(job)
        return job

    def shut_down(self) -> None:
        """Take no new request and end every admitted one now with a 503
        error; those decoding stop at their next verify cycle."""
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
        self.image_refusal = refusal(self.target, self.generator is stream_generate)
        if self.width > 1:
            self._rows = Rows(self.target, self.draft, self.tokenizer, self.block_size, self.draft_vocab,
                              self.prefix_cache, self._end, self._cancelled)
        self._update_stats()

    def _load_target(self) -> tuple[Target, object]:
        """The target and its tokenizer (server/distributed.py loads it sharded)."""
        model, tokenizer = load(self.model_id)
        return Target(model), tokenizer

    def _prefix_cache(self) -> PrefixCache:
        disk = None if self.prefix_disk is None or not self.prefix_cache_bytes else DiskTier(
            self.prefix_disk, pair_key(self.model_id, self.draft_id, self.draft, self.tokenizer, self.kv))
        return PrefixCache(self.target, self.draft, self.prefix_cache_bytes, self.kv, disk, self.prefix_interval)

    def _stream(self, prompt: list[int], target: Optional[Target] = None, **kwargs):
        """``stream_generate`` over this engine's pair (``target``: the request's
        own, a ``VisionTarget`` where its prompt holds images), block size,
        drafting vocabulary and KV cache."""
        return self.generator(target or self.target, self.draft, self.tokenizer, prompt, block_size=self.block_size,
                              draft_vocab=self.draft_vocab, **self.kv, **kwargs)

    def _next_job(self) -> Optional[Job]:
        """The next queued job, waiting as long as it takes; None when the engine stops."""
        return self._queue.get()

    def _cancelled(self, job: Job) -> bool:
        """Whether the request decoding stops at this cycle boundary (its client went away)."""
        return job.cancelled.is_set()

    def _update_stats(self) -> None:
        self.stats = {
            "prefix_cache": self.prefix_cache.stats(),
            "memory_gb": {"active": mx.get_active_memory() / 1e9, "peak": mx.get_peak_memory() / 1e9},
        }

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            if self.prefix_cache is not None:
                self.prefix_cache.close()
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
        if self.width > 1:
            self._serve_batch()
        else:
            self._serve_alone()

    def _serve_alone(self) -> None:
        """Each request in turn, to its end."""
        while (job := self._next_job()) is not None:
            job.started = True
            self._alone(job)

    def _alone(self, job: Job) -> None:
        """Decode one request to its end."""
        try:
            if not job.cancelled.is_set():
                self._solo = 1
                self._generate(job)
        except DFlashError as e:
            job.emit(Failed(400, str(e)))
        except Exception as e:  # keep serving; the caches of this request are dropped
            job.emit(internal(e))
        finally:
            self._solo = 0
            self._release(job)
            self._update_stats()

    def _serve_batch(self) -> None:
        """Admit queued requests (first in, first out) while a row is free,
        run one cycle for every row, and again; with no row, wait for a
        request. Once told to stop, no request joins and the rows decode to
        their end."""
        rows, stopping = self._rows, False
        while True:
            if not rows:
                if stopping or (job := self._next_job()) is None:
                    return
                job.started = True
                self._admit(job)
            while not stopping and len(rows) < self.width:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                else:
                    job.started = True
                    self._admit(job)
            if rows:
                rows.cycle()

    def _admit(self, job: Job) -> None:
        """The job joins the batch; one with images, which the batch does not
        take, decodes alone once the rows before it have ended."""
        if not job.request.images:
            self._rows.admit(job)
            return
        while self._rows:
            self._rows.cycle()
        self._alone(job)

    def _end(self, job: Job, event: Optional[Event]) -> None:
        """A job the batch took is done: its last event, then its slot is free."""
        if event is not None:
            job.emit(event)
        self._release(job)
        self._update_stats()

    def _generate(self, job: Job) -> None:
        request = job.request
        target, prompt, key, marks = self.target, request.prompt, None, request.marks
        if request.images:  # expanded here, once: stream_generate gets the prompt and target it makes
            target, ids, _ = with_images(self.target, mx.array(prompt), request.images)
            # the last turn's start is a position in the unexpanded ids: not marked
            prompt, key, marks = ids.tolist(), target.key, []
        cache = self.prefix_cache
        resumed = cache.resume(key or prompt) if cache else Resume(None)
        context = resumed.context
        usage = Usage(len(prompt), len(context.tokens) if cache else 0, resumed.tier)
        stops = StopMatcher(request.stop)
        mark, checkpoints = cache.mark(context, prompt, self.tokenizer, marks, resumed.checkpoints,
                                       target) if cache else (0, [])
        finish, error = "cancelled", None
        responses = self._stream(prompt, target, max_tokens=request.max_tokens, context=context,
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
                if stopped or r.finish_reason:  # stream_generate says "error" where a grammar went no further
                    finish, error = ("stop", None) if stopped else (r.finish_reason, r.error)
                    break
                if self._cancelled(job):
                    break
        finally:
            responses.close()
        # only a request that ran to a cycle boundary leaves caches worth keeping
        if cache:
            cache.put(context, mark, checkpoints, key)
        job.emit(Finished(finish, usage, stops.matched, error))
