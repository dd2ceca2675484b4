"""DFlash over a target sharded with MLX distributed (docs/distributed.md).

Every rank of an ``mx.distributed`` group (started by ``mlx.launch``) loads
the target with mlx-lm's ``sharded_load`` (tensor parallel: each layer's
linears split across the ranks, summed inside the layer; or pipeline stages:
each rank a run of layers, ``targets/sharded.py``), loads the draft whole, and
runs the same decoding loop. The ranks reach the same decisions because
everything a decision depends on is the same on every rank: the collectives
give every rank the same hidden states, hence the same logits and features;
the sampler's seed and the adaptive block policy's cost curve,
the two inputs that could differ, are rank 0's, sent to the others before
the loop starts. Only rank 0 should print (``talks``).

A rank that dies surfaces on the others as the backend's error at their next
collective, re-raised here as one ``DFlashError`` line; a rank that hangs, or a
machine that vanishes without closing its connections, is caught by a
watchdog that ends the process with one line after ``timeout`` seconds
without a generated response.
"""

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Generator, Iterator, Optional

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import sharded_load

from . import validate
from .draft import DFlashDraft
from .errors import DFlashError
from .generate import GenerationResponse
from .generate import stream_generate as stream_generate_on_this_rank
from .loading import resolve
from .loop import cost_curve as costs
from .targets import PipelineTarget, Target, sharded_target

MODES = ("tensor", "pipeline")
TIMEOUT_S = 300.0  # seconds without a generated response before a rank gives up on the group
BACKEND_ERRORS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]")  # how MLX's distributed backends prefix their errors


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def init(mode: str = "tensor") -> mx.distributed.Group:
    """The group this process was launched into, for sharding ``mode``
    (one DFlashError line if the mode is unsupported or the process is alone)."""
    if mode not in MODES:
        raise DFlashError(f"--distributed must be one of {', '.join(MODES)}, got '{mode}'")
    group = mx.distributed.init()
    if group.size() < 2:
        raise DFlashError(
            "--distributed needs two or more processes started by mlx.launch "
            "(e.g. mlx.launch --backend ring --hostfile hosts.json -- dflash-mlx generate ...); this one is alone"
        )
    return group


def load(path_or_repo: str, group: mx.distributed.Group, mode: str = "tensor") -> tuple[Target, TokenizerWrapper]:
    """Load a target sharded over ``group`` with mlx-lm's ``sharded_load``:
    ``tensor`` parallel (the model's ``shard``) or ``pipeline`` stages."""
    path = resolve(path_or_repo, "target")
    groups = {"tensor_group": group} if mode == "tensor" else {"pipeline_group": group}
    try:
        model, tokenizer = sharded_load(str(path), **groups)
    except Exception as e:
        raise DFlashError(f"cannot load target '{path}' with {mode} parallelism over {group.size()} ranks: "
                          f"{_one_line(e)}") from None
    return sharded_target(model, group), tokenizer


def talks(group: Optional[mx.distributed.Group]) -> bool:
    """Whether this rank prints: rank 0, or a process that is not in a group."""
    return group is None or group.rank() == 0


@dataclass(frozen=True)
class Launch:
    """This process as one rank of a launched group, sharding targets by ``mode``."""

    group: mx.distributed.Group
    mode: str

    def load(self, path_or_repo: str) -> tuple[Target, TokenizerWrapper]:
        return load(path_or_repo, self.group, self.mode)

    def stream_generate(self, target: Target, draft: DFlashDraft, tokenizer, prompt, **kwargs):
        return stream_generate(target, draft, tokenizer, prompt, self.group, **kwargs)


@contextlib.contextmanager
def session(mode: Optional[str]) -> Iterator[Optional[Launch]]:
    """The command line's view of a launch: None for ``mode`` None (refused
    in a process mlx.launch started: its ranks would each run the whole model),
    else this rank's ``Launch``, with stdout and stderr silenced on every rank
    but rank 0 until the block ends (an error raised out of it is still
    printed by each rank's command, naming its rank)."""
    if mode is None:
        if "MLX_RANK" in os.environ:
            raise DFlashError("this process is a rank started by mlx.launch; pass --distributed tensor "
                              "(or pipeline) so the ranks share one target")
        yield None
        return
    launch = Launch(init(mode), mode)
    if talks(launch.group):
        yield launch
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        yield launch


class LostRank(DFlashError):
    """A rank of the group stopped, or its machine cannot be reached."""


@contextlib.contextmanager
def lost_rank_errors(group: mx.distributed.Group) -> Iterator[None]:
    """MLX's error for a peer that went away, as one ``LostRank`` line naming this rank."""
    try:
        yield
    except RuntimeError as e:
        if not str(e).startswith(BACKEND_ERRORS):
            raise
        raise LostRank(f"rank {group.rank()}: the distributed group lost a rank ({_one_line(e)}); "
                       "see the other ranks' output for why") from None


def broadcast(values: mx.array, group: mx.distributed.Group, stream=mx.cpu) -> mx.array:
    """Rank 0's ``values`` on every rank (the others pass any array of the same
    shape and dtype). ``stream``: the one whose queued collectives it must follow."""
    mine = values if group.rank() == 0 else mx.zeros_like(values)
    return mx.distributed.all_sum(mine, group=group, stream=stream)


def shared_seed(seed: Optional[int], group: mx.distributed.Group) -> int:
    """Rank 0's seed (drawn there when None), so every rank samples with the same keys."""
    if seed is None:
        seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
    return int(broadcast(mx.array(seed, dtype=mx.int64), group).item())


def shared_cost_curve(target: Target, draft: DFlashDraft, group: mx.distributed.Group,
                      curve: Optional[costs.CostCurve] = None) -> costs.CostCurve:
    """Rank 0's cost curve on every rank, so the adaptive block policy picks the
    same block everywhere: ``curve`` if given (the same sizes on every rank),
    else rank 0's cached one, else measured by all ranks together (one timed
    repeat per pass, and timed again where rank 0's timings say so, so every
    rank runs the same collectives) and cached by rank 0."""
    if curve is None:
        key = costs.cache_key(target, draft)
        key["distributed"] = f"{'pipeline' if isinstance(target, PipelineTarget) else 'tensor'} x{group.size()}"
        path = costs.cache_path(key)
        cached = costs.read_cached(path, key) if group.rank() == 0 else None
        if broadcast(mx.array(cached is not None), group).item():
            curve = cached
        else:
            curve = costs.measure(target, draft, tuple(key["sizes"]), budget_s=0.0,
                                  agree=lambda consistent: bool(broadcast(mx.array(consistent), group).item()))
            if group.rank() == 0:
                costs.write_cached(path, key, curve)
        sizes = tuple(key["sizes"])
    else:
        sizes = curve.sizes
    n = len(sizes)  # sent: target_s, draft_s, both context slopes (zeros for none), inject_s, context
    mine = [0.0] * (4 * n + 2)
    if curve is not None:
        mine = [*curve.target_s, *curve.draft_s, *(curve.target_slope or [0.0] * n),
                *(curve.draft_slope or [0.0] * n), curve.inject_s, curve.context]
    values = broadcast(mx.array(mine, dtype=mx.float32), group).tolist()
    column = lambda i: tuple(values[i * n : (i + 1) * n])  # noqa: E731
    return costs.CostCurve(sizes, column(0), column(1), int(values[-1]), column(2), column(3), values[-2])


class Watchdog:
    """Ends this process with one line on stderr when ``beat`` has not been
    called for ``timeout`` seconds: a collective waiting on a rank that hangs
    or a machine that vanished never returns, so nothing else could."""

    def __init__(self, timeout: float, rank: int):
        self.timeout, self.rank = timeout, rank
        self.last = time.monotonic()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def beat(self) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        while not self.stopped.wait(min(1.0, self.timeout / 4)):
            if time.monotonic() - self.last > self.timeout:
                print(f"error: rank {self.rank}: no progress from the distributed group in {self.timeout:g} s "
                      "(a rank stopped or its machine is unreachable); exiting", file=sys.__stderr__, flush=True)
                os._exit(1)

    def __enter__(self) -> "Watchdog":
        self.beat()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()


def stream_generate(target: Target, draft: DFlashDraft, tokenizer, prompt, group: mx.distributed.Group,
                    timeout: float = TIMEOUT_S, **kwargs) -> Generator[GenerationResponse, None, None]:
    """``dflash_mlx.stream_generate`` on one rank of ``group``; every rank
    calls it with the same arguments and gets the same responses. ``kwargs``
    are ``stream_generate``'s; a reduced drafting vocabulary (``draft_vocab``)
    is not supported here."""
    if kwargs.get("draft_vocab") is not None:
        raise DFlashError("--draft-vocab is not supported with --distributed; drop it to draft over the full vocabulary")
    with Watchdog(timeout, group.rank()) as watchdog, lost_rank_errors(group):
        kwargs["seed"] = shared_seed(kwargs.get("seed"), group)
        if kwargs.get("block_size", validate.AUTO) == validate.AUTO:
            kwargs["cost_curve"] = shared_cost_curve(target, draft, group, kwargs.get("cost_curve"))
        for response in stream_generate_on_this_rank(target, draft, tokenizer, prompt, **kwargs):
            watchdog.beat()
            yield response

