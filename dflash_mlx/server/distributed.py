"""``dflash-mlx serve --distributed``: one server over a target sharded across
the ranks of an ``mx.distributed`` group (docs/distributed.md).

Rank 0 owns the HTTP socket and the queue, as a single-process server does.
Before it decodes a request it sends the request to the other ranks (a
header, then the request as JSON bytes, each an ``all_sum`` to which the
others add zeros); they ``follow``, running the same engine code on the same
token ids, so every rank runs the same collectives in the same order and
reaches the same decisions. The one decision only rank 0 can make, stopping
at a cycle boundary because the client went away or the server is shutting
down, is sent at every cycle boundary. A prefix cache entry counts the
group's largest share of its bytes, so every rank keeps and evicts the same
entries. When rank 0's worker ends it sends the end, and the followers return.
While idle, rank 0 sends a heartbeat every ``heartbeat`` seconds, so that every
wait on another rank is bounded: a rank that stops ends the server (rank 0
answers the request it was decoding with a 503 and shuts down; the followers
exit with one line), and a rank that hangs, or whose machine vanished, is
caught by the watchdog after ``timeout`` seconds (``distributed.Watchdog``).
"""

import dataclasses
import json
import os
import queue
import signal
from typing import Optional, Union

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from ..distributed import TIMEOUT_S, Launch, LostRank, Watchdog, broadcast, lost_rank_errors
from ..errors import DFlashError
from .engine import Engine, Failed, Job, Request
from .prefix_cache import PrefixCache

REQUEST, END, ALIVE = 1, 2, 3  # what rank 0 sends
HEARTBEAT_S = 30.0  # how often an idle rank 0 tells the followers it is there


def exchange(group: mx.distributed.Group, kind: int = 0, payload: bytes = b"") -> tuple[int, bytes]:
    """Rank 0's ``kind`` and ``payload`` on every rank (the others pass nothing)."""
    header = broadcast(mx.array([kind, len(payload)], dtype=mx.int64), group).tolist()
    kind, n = int(header[0]), int(header[1])
    if n == 0:
        return kind, b""
    mine = np.frombuffer(payload, dtype=np.uint8) if group.rank() == 0 else np.zeros(n, dtype=np.uint8)
    return kind, bytes(np.array(broadcast(mx.array(mine), group), copy=False))


def encode_request(request: Request) -> bytes:
    return json.dumps(dataclasses.asdict(request)).encode()


def decode_request(payload: bytes) -> Request:
    request = Request(**json.loads(payload))
    bias = request.sampling.get("logit_bias")
    if bias is not None:  # JSON keys are strings
        request.sampling["logit_bias"] = {int(k): v for k, v in bias.items()}
    return request


class FollowedJob(Job):
    """A request rank 0 sent: decoded here for the collectives, answered by rank 0."""

    def __init__(self, request: Request):
        super().__init__(request, loop=None)

    def emit(self, event) -> None:
        pass


class GroupPrefixCache(PrefixCache):
    """A prefix cache whose entries count the group's largest share of their
    bytes (pipeline stages hold different layers), so all ranks decide alike."""

    def __init__(self, target, draft, budget_bytes: int, group: mx.distributed.Group):
        super().__init__(target, draft, budget_bytes)
        self.group = group

    def size(self, context, snapshot) -> int:
        mine = mx.array(super().size(context, snapshot), dtype=mx.int64)
        return int(mx.distributed.all_max(mine, group=self.group, stream=mx.cpu).item())


class GroupEngine(Engine):
    """The server's engine on one rank of ``launch``: rank 0 serves
    (``start``), the others ``follow``."""

    def __init__(self, launch: Launch, model: str, draft: str, block_size: Union[int, str, None] = "auto",
                 max_queue: int = 32, prefix_cache_bytes: int = 0, draft_vocab: Optional[int] = None,
                 draft_dtype: str = "auto", timeout: float = TIMEOUT_S, heartbeat: float = HEARTBEAT_S):
        super().__init__(model, draft, block_size, max_queue, prefix_cache_bytes, draft_vocab, draft_dtype=draft_dtype)
        self.launch = launch
        self.group = launch.group
        self.generator = launch.stream_generate
        self.timeout, self.heartbeat = timeout, heartbeat
        self.lost: Optional[str] = None  # why the group broke, once it has

    def _exchange(self, kind: int = 0, payload: bytes = b"") -> tuple[int, bytes]:
        """``exchange``, bounded by the watchdog; LostRank if a rank went away."""
        with Watchdog(self.timeout, self.group.rank()), lost_rank_errors(self.group):
            return exchange(self.group, kind, payload)

    def _lose(self, error: LostRank, job: Optional[Job] = None) -> None:
        """Rank 0 after losing a rank: answer ``job`` with a 503 and shut the server down."""
        self.lost = str(error)
        if job is not None:
            job.emit(Failed(503, f"the server lost a machine of its distributed group: {error}",
                            "distributed_group_lost"))
        self.shut_down()
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn shuts the server down; serve() then fails with self.lost

    def _next_job(self) -> Optional[Job]:
        while self.lost is None:
            try:
                return self._queue.get(timeout=self.heartbeat)
            except queue.Empty:
                try:
                    self._exchange(ALIVE)
                except LostRank as e:
                    self._lose(e)
        return self._queue.get()  # what is left, each cancelled by shut_down, then stop's None

    def _load_target(self):
        return self.launch.load(self.model_id)

    def _prefix_cache(self) -> PrefixCache:
        return GroupPrefixCache(self.target, self.draft, self.prefix_cache_bytes, self.group)

    def _cancelled(self, job: Job) -> bool:
        # on the stream the decoding queues its passes on, so that it follows their collectives
        flag = broadcast(mx.array(job.cancelled.is_set()), self.group, stream=generation_stream)
        return bool(flag.item())

    def _generate(self, job: Job) -> None:
        """Rank 0: send the request to the followers, then decode it with them."""
        try:
            self._exchange(REQUEST, encode_request(job.request))
            with lost_rank_errors(self.group):
                super()._generate(job)
        except LostRank as e:
            self._lose(e, job)

    def _serve(self) -> None:
        try:
            super()._serve()
        finally:
            if self.prefix_cache is not None and self.lost is None:  # loaded, and the group still whole
                try:
                    self._exchange(END)
                except LostRank:  # stopping anyway; the followers end on their own error
                    pass

    def follow(self) -> None:
        """Ranks other than 0: load the pair with rank 0, then decode every
        request rank 0 sends until it sends the end (LostRank if a rank stops)."""
        with lost_rank_errors(self.group):
            self._load()
        while (message := self._exchange())[0] != END:
            if message[0] != REQUEST:  # a heartbeat
                continue
            try:
                with lost_rank_errors(self.group):
                    super()._generate(FollowedJob(decode_request(message[1])))
            except LostRank:
                raise
            except DFlashError:  # the request's own fault: rank 0 hit it too and answered it
                pass
