"""Requests decoding at once: the server's rows of one ``BatchDecoder`` (``loop/batch.py``).

``Rows`` makes a job's request a row (prefilled alone, from the prefix
cache's caches), runs one verify cycle for every row, and hands each row's
committed tokens to its reply as ``stream_generate`` and the engine's
``_generate`` do for a request alone: EOS ends it unemitted, ``max_tokens``
after exactly that many, a stop string where it starts; its logprobs and its
usage. A row that ends, its client gone included (at a cycle boundary its
caches are consistent), leaves the batch with its caches, which go to the
prefix cache. The engine (``engine.py``) owns the queue, the slots and the
worker thread that calls this.
"""

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable, Optional, Union

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit

from ..chat import encode
from ..draft import subset_head
from ..errors import DFlashError
from ..generate import CLEAR_CACHE_EVERY, drained, ending, request_sampler
from ..loop import BatchDecoder, BlockSampler, Row, SamplingParams, batch_policy
from .jobs import Delta, Event, Failed, Finished, Job, Usage, internal
from .logprobs import picked
from .prefix_cache import PrefixCache
from .stops import StopMatcher


@dataclass
class Live:
    """A request decoding as a row of the batch, and its reply so far."""

    job: Job
    row: Row
    mark: int  # the prefix cache's mark and checkpoints of its prompt, for ``put``
    checkpoints: list
    usage: Usage
    stops: StopMatcher
    detokenizer: object  # its own streaming detokenizer


class Rows:
    """The batch's rows, by job. ``end(job, event)`` is called once per job
    taken, with its last event (None: it was dropped, cancelled before it
    started); ``cancelled(job)`` says whether its client went away."""

    def __init__(self, target, draft, tokenizer, block_size: Union[int, str, None], draft_vocab: Optional[int],
                 prefix_cache: PrefixCache, end: Callable[[Job, Optional[Event]], None],
                 cancelled: Callable[[Job], bool]):
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.prefix_cache, self.end, self.cancelled = prefix_cache, end, cancelled
        self.eos = set(tokenizer.eos_token_ids)
        self.head = None if draft_vocab is None else subset_head(target, draft.vocab_ranking, draft_vocab)
        with self.on_stream():  # one row through a batch of its own: a target whose caches cannot be rows fails here
            trial = BatchDecoder(target, draft, 2, head=self.head)
            row, _ = trial.add(mx.array(encode(tokenizer, "hello")), BlockSampler(SamplingParams()), 3)
            trial.cycle()
            trial.remove(row)
        self.policy = batch_policy(target, draft, block_size)  # as measured, before any row: each batch's start
        self.decoder = self._fresh()
        self.live: dict[Job, Live] = {}
        self.cycles = 0

    def __len__(self) -> int:
        return len(self.live)

    def _fresh(self) -> BatchDecoder:
        """An empty batch whose policy has learned nothing yet: a request that
        finds no other decoding runs as it would alone (``stream_generate``'s
        policy is new for every request too), whatever ran before it."""
        return BatchDecoder(self.target, self.draft, copy.deepcopy(self.policy), head=self.head)

    @contextlib.contextmanager
    def on_stream(self):
        """The context the batch's MLX work runs in, as ``stream_generate``'s."""
        with wired_limit(self.target.model, [generation_stream]), mx.stream(generation_stream), \
                drained(generation_stream):
            yield

    def admit(self, job: Job) -> None:
        """Prefill the job's request alone (past what the prefix cache holds of
        it) and make it a row; a cancelled job is dropped, and a request that
        cannot run fails alone."""
        if job.cancelled.is_set():
            self.end(job, None)
            return
        request = job.request
        if not self.live:
            self.decoder = self._fresh()
        try:  # before the prefix cache gives up an entry for it
            sampler = request_sampler(self.tokenizer, self.target.vocab_size, **request.sampling)
        except DFlashError as e:
            self.end(job, Failed(400, str(e)))
            return
        try:
            with self.on_stream():
                resumed = self.prefix_cache.resume(request.prompt)
                context = resumed.context
                usage = Usage(len(request.prompt), len(context.tokens), resumed.tier)
                mark, checkpoints = self.prefix_cache.mark(context, request.prompt, self.tokenizer, request.marks,
                                                           resumed.checkpoints)
        except Exception as e:  # the batch is untouched
            self.end(job, Failed(400, str(e)) if isinstance(e, DFlashError) else internal(e))
            return
        try:
            with self.on_stream():
                row, first = self.decoder.add(mx.array(request.prompt), sampler, request.max_tokens, context,
                                              logprobs=request.logprobs is not None, tag=job)
                live = Live(job, row, mark, checkpoints, usage, StopMatcher(request.stop),
                            self.tokenizer.detokenizer)
                self.live[job] = live
                finish = self._feed(live, [first])
                if finish:
                    self._leave(live, finish)
        except Exception as e:  # it may have been half-way into the batch's caches
            if job not in self.live:
                self.end(job, internal(e))
            self._fail(e)

    def cycle(self) -> None:
        """One verify cycle for every row; rows that end leave the batch."""
        try:
            with self.on_stream():
                for cycle in self.decoder.cycle():
                    live = self.live[cycle.row.tag]
                    if cycle.error:  # this row cannot go on; the others can
                        self.decoder.remove(live.row)
                        self._end(live, Failed(400, cycle.error))
                        continue
                    finish = self._feed(live, cycle.tokens, cycle.accepted, self.decoder.block_size)
                    if finish:
                        self._leave(live, finish)
        except Exception as e:
            self._fail(e)
            return
        self.cycles += 1
        if self.cycles % CLEAR_CACHE_EVERY == 0:  # as stream_generate frees it every so many tokens
            mx.clear_cache()

    def _feed(self, live: Live, tokens: list[int], accepted: Optional[int] = None, block: int = 0) -> Optional[str]:
        """Hand a row's newly committed ``tokens`` to its reply, as one
        response of ``stream_generate`` reaches ``_generate`` (a cycle's when
        ``accepted`` is given, else the prefill's first token). Returns how
        it finished ("cancelled": its client went away), or None while it goes on."""
        request, usage = live.job.request, live.usage
        if accepted is not None:
            usage.cycles += 1
            usage.accepted += accepted
            usage.blocks[block] = usage.blocks.get(block, 0) + 1
        emitted, finish = [], None
        for token in tokens:
            if token in self.eos:
                finish = "stop"
                break
            emitted.append(token)
            if usage.completion_tokens + len(emitted) == request.max_tokens:
                finish = "length"
                break
        for token in emitted:
            live.detokenizer.add_token(token)
        if finish:
            live.detokenizer.finalize()
        usage.completion_tokens += len(emitted)
        text, stopped = live.stops.feed(live.detokenizer.last_segment)
        if finish and not stopped:
            text += live.stops.flush()
        logprobs = live.row.logprobs  # [n, V] at the row's last n tokens
        picks = [] if request.logprobs is None or logprobs is None else picked(
            logprobs[: len(emitted)], emitted, request.logprobs)
        if text or picks:
            live.job.emit(Delta(text, picks))
        if stopped or finish:
            return "stop" if stopped else finish
        return "cancelled" if self.cancelled(live.job) else None

    def _leave(self, live: Live, finish: str) -> None:
        """The row leaves the batch; its caches go to the prefix cache."""
        context = self.decoder.remove(live.row)
        mx.eval([c.state for c in context.target + context.draft])  # its own arrays, not views of the batch's
        self.prefix_cache.put(context, live.mark, live.checkpoints)
        # a reply that ended at EOS, not at a stop string, says "error" where it stopped short of its grammar
        finish, error = ending(finish, live.row.sampler) if live.stops.matched is None else (finish, None)
        self._end(live, Finished(finish, live.usage, live.stops.matched, error))

    def _end(self, live: Live, event: Event) -> None:
        del self.live[live.job]
        self.end(live.job, event)

    def _fail(self, error: Exception) -> None:
        """Every row fails with a 500 error and the batch starts afresh (its
        caches are dropped); the worker goes on serving."""
        for live in list(self.live.values()):
            self._end(live, internal(error))
        self.decoder = self._fresh()
