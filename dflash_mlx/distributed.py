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
without a generated response. Under mlx.launch, which ends every rank with
SIGTERM once one has failed or was killed, a rank says so in one line
(``Launcher``); an error every rank hits alike is printed by rank 0 only.
"""

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Generator, Iterator, NoReturn, Optional

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
GRACE_S = 10.0  # how long a rank other than 0 leaves rank 0 to report an error every rank hit
BACKEND_ERRORS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]")  # how MLX's distributed backends prefix their errors
INDEX = "model.safetensors.index.json"


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def end(message: str) -> NoReturn:
    """One ``error:`` line on the process's own stderr, then exit 1 at once (from any thread)."""
    print(f"error: {message}", file=sys.__stderr__, flush=True)
    os._exit(1)


def launched_rank() -> int:
    """This process's rank as mlx.launch numbered it (MLX_RANK; 0 when not set)."""
    return int(os.environ.get("MLX_RANK", "0"))


class LostRank(DFlashError):
    """A rank of the group stopped, or its machine cannot be reached."""


@contextlib.contextmanager
def lost_rank_errors(group: Optional[mx.distributed.Group]) -> Iterator[None]:
    """MLX's error for a peer that went away, as one ``LostRank`` line naming this rank."""
    try:
        yield
    except RuntimeError as e:
        if not str(e).startswith(BACKEND_ERRORS):
            raise
        rank = launched_rank() if group is None else group.rank()
        raise LostRank(f"rank {rank}: the distributed group lost a rank ({_one_line(e)}); "
                       "see the other ranks' output for why") from None


def init(mode: str = "tensor", timeout: float = TIMEOUT_S) -> mx.distributed.Group:
    """The group this process was launched into, for sharding ``mode`` (one
    DFlashError line if the mode is unsupported, the process is alone, or a
    rank cannot be reached; the watchdog's after ``timeout`` s waiting for one)."""
    if mode not in MODES:
        raise DFlashError(f"--distributed must be one of {', '.join(MODES)}, got '{mode}'")
    with Watchdog(timeout, launched_rank()), lost_rank_errors(None):
        group = mx.distributed.init()
    if group.size() < 2:
        raise DFlashError(
            "--distributed needs two or more processes started by mlx.launch "
            "(e.g. mlx.launch --backend ring --hostfile hosts.json -- dflash-mlx generate ...); this one is alone"
        )
    return group


@contextlib.contextmanager
def indexed(path: Path) -> Iterator[Path]:
    """``path`` if it has a weight index (which file holds which tensor: mlx-lm's
    pipeline loading reads it), else a temporary folder of links to its files
    plus the index built from its weight files' names (a single-file checkpoint's
    case); the user's folder is left as it is."""
    if (path / INDEX).exists():
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="dflash-mlx-indexed-") as folder:
        for entry in path.iterdir():
            Path(folder, entry.name).symlink_to(entry.resolve())
        weights = {name: file.name for file in sorted(path.glob("model*.safetensors"))
                   for name in mx.load(str(file))}  # lazy: names only, no weights read
        Path(folder, INDEX).write_text(json.dumps({"weight_map": weights}))
        yield Path(folder)


def load(path_or_repo: str, group: mx.distributed.Group, mode: str = "tensor") -> tuple[Target, TokenizerWrapper]:
    """Load a target sharded over ``group`` with mlx-lm's ``sharded_load``:
    ``tensor`` parallel (the model's ``shard``) or ``pipeline`` stages
    (``indexed``: also from a checkpoint without a weight index)."""
    path = resolve(path_or_repo, "target")
    groups = {"tensor_group": group} if mode == "tensor" else {"pipeline_group": group}
    with lost_rank_errors(group):
        try:
            with indexed(path) if mode == "pipeline" else contextlib.nullcontext(path) as folder:
                model, tokenizer = sharded_load(str(folder), **groups)
        except Exception as e:
            if str(e).startswith(BACKEND_ERRORS):
                raise
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


class Launcher:
    """This rank's side of how mlx.launch ends a run: once a rank exits non-zero
    or is killed, it sends SIGTERM to every other rank and waits for it to exit.
    On SIGTERM this rank ends with one line saying the group lost a rank; a thread
    reads the signal (from the signal wakeup fd), so a main thread waiting inside
    MLX on the lost rank cannot delay it. A rank other than 0 first leaves its
    main thread ``GRACE_S`` to end on an error every rank hit, which rank 0 prints."""

    def __init__(self, rank: int):
        self.rank = rank
        self.terminated = threading.Event()

    def _on_sigterm(self, *_) -> None:
        pass  # the thread reading the wakeup fd acts on it

    def _watch(self, read: int) -> None:
        while byte := os.read(read, 1):
            if byte[0] == signal.SIGTERM and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                self.terminated.set()
                time.sleep(GRACE_S if self.rank else 0.0)
                end(f"rank {self.rank}: the distributed group lost a rank (mlx.launch sent SIGTERM: another rank "
                    "exited with an error or was killed); see its output for why, and launch again")
        os.close(read)

    def __enter__(self) -> "Launcher":
        read, self.write = os.pipe()
        os.set_blocking(self.write, False)
        self.handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.wakeup = signal.set_wakeup_fd(self.write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        signal.set_wakeup_fd(self.wakeup)
        signal.signal(signal.SIGTERM, self.handler)
        os.close(self.write)

    def leave_to_rank_0(self, message: str) -> NoReturn:
        """This rank (not 0) hit an error that rank 0 hits too, and prints: exit 1
        silently once mlx.launch ends this rank, which it does when rank 0 exits;
        print it here only if nothing ended this rank in ``GRACE_S``."""
        if self.terminated.wait(GRACE_S):
            os._exit(1)
        end(f"rank {self.rank}: {message}")


def report(message: str) -> None:
    """The command line's ``error:`` line, once per launch: on a rank of
    mlx.launch other than 0, ``Launcher.leave_to_rank_0`` (the command line's
    own errors come before the ranks join, and are every rank's)."""
    if launched_rank() != 0:
        with Launcher(launched_rank()) as launcher:
            launcher.leave_to_rank_0(message)
    print(f"error: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def session(mode: Optional[str]) -> Iterator[Optional[Launch]]:
    """The command line's view of a launch: None for ``mode`` None (refused
    in a process mlx.launch started: its ranks would each run the whole model),
    else this rank's ``Launch``, with stdout and stderr silenced on every rank
    but rank 0 until the block ends. Errors are printed once: rank 0's by the
    command; on another rank, a lost rank at once (``end``) and any other error,
    which every rank hits alike, by rank 0 (``Launcher.leave_to_rank_0``)."""
    if mode is None:
        if "MLX_RANK" in os.environ:
            raise DFlashError("this process is a rank started by mlx.launch; pass --distributed tensor "
                              "(or pipeline) so the ranks share one target")
        yield None
        return
    with Launcher(launched_rank()) as launcher:
        try:
            launch = Launch(init(mode), mode)
            if talks(launch.group):
                yield launch
                return
            with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), \
                    contextlib.redirect_stderr(devnull):
                yield launch
        except DFlashError as e:
            if launcher.rank == 0:
                raise
            if isinstance(e, LostRank):
                end(str(e))
            launcher.leave_to_rank_0(str(e))


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
                end(f"rank {self.rank}: no progress from the distributed group in {self.timeout:g} s "
                    "(a rank stopped or its machine is unreachable); exiting")

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

