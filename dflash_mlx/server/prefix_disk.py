"""The prefix cache's disk tier: entries that outlive the server process.

Every entry the RAM prefix cache keeps (``prefix_cache.py``) is also written,
in the background, to one safetensors file by mlx-lm's ``save_prompt_cache``:
the target's caches as they are (attention K/V, quantized K/V with
``--kv-bits``, GatedDeltaNet and convolution states), the recurrent states
of each checkpoint (``prefix_checkpoints.py``: one ``ArraysCache`` per
checkpoint and recurrent layer, in that order) and each draft layer's
injected context (a ``KVCache`` of the layer's buffer and the positions it
holds). Its metadata, one JSON string, holds the layout version, the pair's
key, every token the caches hold, where the prompt ends, the recurrent
layers and the checkpoints' positions, and where each draft layer's context
starts.

Files live in ``DIR/<pair>/``, ``<pair>`` a hash of the pair's key (target
and draft: id, the directory they load from and its files' names and sizes;
the chat template, the draft's dtype, the KV quantization, ``LAYOUT``), one
file per token list, named by a hash of it. On a RAM miss (or where a file
holds more of the prompt than RAM does) the prefix cache loads the best file,
checks its key and its token list exactly and promotes it to RAM.

A file is written to a temporary name in its folder, then renamed, under an
exclusive ``fcntl.flock`` on ``DIR/.lock`` that also covers eviction: the
least recently used files (modification time, refreshed on each use) go
first until every pair's files in ``DIR`` fit the byte budget. Servers
sharing ``DIR`` take turns; where the lock cannot be had the tier only
reads, after one warning. A file that cannot be read, is truncated, or was
written for another layout or pair is removed with one warning line, and the
request is served from scratch.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import re
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
from huggingface_hub import try_to_load_from_cache
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import ArraysCache, KVCache, load_prompt_cache, save_prompt_cache

from ..loop import ContextCache, cost_curve
from ..precision import dtype_name
from .prefix_checkpoints import Checkpoint

LAYOUT = 2  # what an entry holds and how; a file of another layout is removed
SUFFIX = ".safetensors"
META = "dflash_mlx"  # the metadata key (save_prompt_cache stores it as "0.dflash_mlx")
NAME = re.compile(r"[0-9a-f]{32}\.safetensors")  # an entry; its temporary file is "." + NAME + ".<pid>.tmp" + SUFFIX
TEMPORARY = re.compile(r"\.[0-9a-f]{32}\.safetensors\.\d+\.tmp\.safetensors")
FOLDER = re.compile(r"[0-9a-f]{16}")
PENDING = 4  # entries waiting to be written; more are not written
DEFAULT_GB = 16.0


def default_directory() -> Path:
    """``~/.cache/dflash-mlx/prefix-cache`` (under ``$XDG_CACHE_HOME`` where set)."""
    return cost_curve.cache_dir() / "prefix-cache"


@dataclass(frozen=True)
class DiskConfig:
    directory: Path
    budget_bytes: int


@dataclass
class Stored:
    """A file of the tier as its index knows it, from its header alone."""

    path: Path
    tokens: list[int]
    prompt_len: int  # where its prompt ends
    recurrent: bool  # the target has layers that cannot be trimmed
    checkpoints: list[int]  # where its recurrent states were checkpointed
    nbytes: int


def _digest(obj, n: int) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:n]


def entry_name(tokens: list[int]) -> str:
    """The file name of the entry holding ``tokens``."""
    return _digest(tokens, 32) + SUFFIX


def _identity(path_or_repo: str) -> dict:
    """A model's id, the directory it loads from and its files' names and
    sizes: what tells one revision from another."""
    path = Path(path_or_repo).expanduser()
    if not path.is_dir():
        found = try_to_load_from_cache(path_or_repo, "config.json")  # the hub's cached snapshot, offline
        if not isinstance(found, str):
            return {"id": path_or_repo}
        path = Path(found).parent
    files = sorted([f.name, f.stat().st_size] for f in path.iterdir() if f.is_file())
    return {"id": path_or_repo, "dir": str(path.resolve()), "files": files}


def pair_key(target_id: str, draft_id: str, draft, tokenizer, kv: dict) -> dict:
    """What an entry depends on besides its tokens: the pair (``draft``
    loaded from ``draft_id``, in the dtype it computes in), the chat template
    and the KV quantization (stream_generate's ``kv_bits``, ...)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return {"layout": LAYOUT, "target": _identity(target_id), "draft": _identity(draft_id),
            "chat_template": _digest(template, 32), "draft_dtype": dtype_name(draft), "kv": kv}


def _warn(message: str) -> None:
    print(f"warning: prefix cache on disk: {message}", file=sys.stderr, flush=True)


def _metadata(path: Path) -> dict:
    """The entry's metadata, read from the safetensors header alone; ValueError
    where the file is shorter or longer than its header says."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size:
            raise ValueError("its header runs past its end")
        header = json.loads(f.read(n))
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(f"{size} bytes where its header describes {8 + n + end} (truncated)")
    return json.loads(header["__metadata__"]["0." + META])


def _detached(cache):
    """A cache of the same class over handles of its own to ``cache``'s arrays
    (no copy): in-place updates of the live cache never reach it."""
    return type(cache).from_state(tree_map(lambda x: mx.contiguous(x) if isinstance(x, mx.array) else x,
                                           cache.state))


def _arrays(caches: list) -> list:
    return [x for c in caches for _, x in tree_flatten(c.state) if isinstance(x, mx.array)]


def _savable(cache) -> bool:
    """Whether ``load_prompt_cache`` can make ``cache`` again (one of mlx-lm's classes)."""
    return getattr(mlx_lm_cache, type(cache).__name__, None) is type(cache)


class DiskTier:
    """The files of one pair under ``config.directory``; written by a thread of its own."""

    def __init__(self, config: DiskConfig, key: dict, warn: Callable[[str], None] = _warn):
        self.root = Path(config.directory).expanduser()
        self.key = json.loads(json.dumps(key))  # as it reads back from a file
        self.folder = self.root / _digest(self.key, 16)
        self.budget = config.budget_bytes
        self.warn = warn
        self.stored: dict[str, Stored] = {}  # by file name
        self._seen: Optional[int] = None  # the folder's modification time at the last scan
        self._guard = threading.Lock()  # ``stored``, shared with the writer
        self._lock_file = self._open_lock()
        self._writes: "queue.Queue" = queue.Queue(PENDING)
        self._writer = None
        if self._lock_file is not None:
            self._writer = threading.Thread(target=self._write_all, name="dflash-mlx-prefix-disk", daemon=True)
            self._writer.start()
        self.refresh()

    @property
    def writable(self) -> bool:
        return self._writer is not None

    def _open_lock(self):
        """The lock file, or None (after one warning) where it cannot be locked: read only."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / ".lock", "a")
        except OSError as e:
            self.warn(f"cannot write in {self.root} ({e.strerror}); reading only")
            return None
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(lock, fcntl.LOCK_UN)
        except BlockingIOError:
            pass  # another server holds it: locking works
        except OSError as e:
            lock.close()
            self.warn(f"cannot lock {self.root / '.lock'} ({e.strerror}); reading only, so that "
                      "servers sharing the directory cannot corrupt it")
            return None
        return lock

    def entries(self) -> list[Stored]:
        """The files of this pair, after taking in what changed on disk."""
        self.refresh()
        with self._guard:
            return list(self.stored.values())

    @property
    def nbytes(self) -> int:
        with self._guard:
            return sum(s.nbytes for s in self.stored.values())

    def refresh(self) -> None:
        """Index the folder again where it changed (another server's writes and evictions)."""
        try:
            seen = self.folder.stat().st_mtime_ns
            names = {p.name for p in self.folder.iterdir() if NAME.fullmatch(p.name)}
        except OSError:
            return
        if seen == self._seen:
            return
        self._seen = seen
        with self._guard:
            for gone in set(self.stored) - names:
                del self.stored[gone]
            new = names - set(self.stored)
        for name in sorted(new):
            stored = self._read(self.folder / name)
            if stored is not None:
                with self._guard:
                    self.stored[name] = stored

    def _problem(self, meta: dict, name: str) -> Optional[str]:
        """Why an entry's metadata does not fit this server, or None."""
        if meta.get("layout") != LAYOUT:
            return f"written in layout {meta.get('layout')}, this server reads layout {LAYOUT}"
        if meta.get("pair") != self.key:
            return "written for another pair (target, draft, chat template, dtype or KV quantization)"
        if entry_name(meta["tokens"]) != name:
            return "its name does not match its tokens"
        return None

    def _read(self, path: Path) -> Optional[Stored]:
        try:
            meta = _metadata(path)
            problem = self._problem(meta, path.name)
            stored = Stored(path, list(meta["tokens"]), int(meta["prompt_len"]), bool(meta["recurrent"]),
                            [int(p) for p in meta["checkpoints"]], path.stat().st_size)
        except FileNotFoundError:
            return None  # evicted by another server meanwhile
        except Exception as e:  # anything a file of bytes can hold
            problem = f"unreadable ({type(e).__name__}: {e})"
        if problem:
            self._discard(path, problem)
            return None
        return stored

    def _discard(self, path: Path, why: str) -> None:
        self.warn(f"removed {path}: {why}; the request is served without it")
        with contextlib.suppress(OSError):
            os.remove(path)
        with self._guard:
            self.stored.pop(path.name, None)

    def load(self, stored: Stored, target, draft) -> Optional[tuple[ContextCache, int, list[Checkpoint]]]:
        """The caches of ``stored`` for ``target`` and ``draft`` (evaluated), its
        prompt_len and checkpoints, as ``PrefixCache.put`` took them; None where
        it is gone or does not check out (removed, with a warning)."""
        try:
            _metadata(stored.path)  # its length, again: it may have changed since it was indexed
            caches, metadata = load_prompt_cache(str(stored.path), return_metadata=True)
            meta = json.loads(metadata[META])
            problem = self._problem(meta, stored.path.name)
            if problem is None and meta["tokens"] != stored.tokens:
                problem = "its tokens differ from its header's"
            loaded = None if problem else self._restore(caches, meta, target, draft)
        except FileNotFoundError:
            with self._guard:
                self.stored.pop(stored.path.name, None)
            return None
        except Exception as e:
            problem = f"unreadable ({type(e).__name__}: {e})"
        if problem:
            self._discard(stored.path, problem)
            return None
        with contextlib.suppress(OSError):
            os.utime(stored.path)  # used: the last to be evicted
        return loaded

    @staticmethod
    def _restore(caches: list, meta: dict, target, draft) -> tuple[ContextCache, int, list[Checkpoint]]:
        fresh_target, fresh_draft = target.make_cache(), draft.make_cache()
        layers, at = meta["layers"], meta["checkpoints"]
        n, s = len(fresh_target), len(layers) * len(at)
        if len(caches) != n + s + len(fresh_draft) or any(
                isinstance(c, ArraysCache) != isinstance(f, ArraysCache) for c, f in zip(caches, fresh_target)):
            raise ValueError("its caches do not fit this pair's layers")
        mx.eval(_arrays(caches))
        checkpoints = []
        for k, position in enumerate(at):
            states = [None] * n
            for i, c in zip(layers, caches[n + k * len(layers): n + (k + 1) * len(layers)]):
                states[i] = list(c.cache)
            checkpoints.append(Checkpoint(int(position), states))
        context_draft = []
        for c, f, start in zip(caches[n + s:], fresh_draft, meta["draft_starts"]):
            keys, values = (None, None) if c.keys is None else (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
            context_draft.append(type(f).from_row(keys, values, start, f.keep))
        return ContextCache(caches[:n], context_draft, list(meta["tokens"])), int(meta["prompt_len"]), checkpoints

    def save(self, context: ContextCache, prompt_len: int, checkpoints: list[Checkpoint], recurrent: bool) -> str:
        """Queue an entry for writing, on the thread that owns its arrays (one
        whose file exists is marked used instead); its file's name. Not
        written: a target cache mlx-lm cannot load, an entry over the budget,
        one while ``PENDING`` wait."""
        name = entry_name(context.tokens)
        if name in self.stored:
            with contextlib.suppress(OSError):
                os.utime(self.folder / name)
            return name
        if self._writer is None or not all(_savable(c) for c in context.target):
            return name
        layers = [i for i, c in enumerate(context.target) if isinstance(c, ArraysCache)]
        caches = [_detached(c) for c in context.target]
        caches += [_detached(ArraysCache.from_state((list(c.states[i]), None, None)))
                   for c in checkpoints for i in layers]
        caches += [_detached(KVCache.from_state((c.keys, c.values, c.held))) for c in context.draft]
        arrays = _arrays(caches)
        if sum(a.nbytes for a in arrays) > self.budget:
            return name
        mx.eval(arrays)
        meta = {"layout": LAYOUT, "pair": self.key, "tokens": list(context.tokens), "prompt_len": prompt_len,
                "recurrent": recurrent, "layers": layers, "checkpoints": [c.position for c in checkpoints],
                "draft_starts": [c.start for c in context.draft]}
        with contextlib.suppress(queue.Full):
            self._writes.put_nowait((name, caches, meta))
        return name

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout=60)

    def _write_all(self) -> None:
        while (job := self._writes.get()) is not None:
            try:
                self._write(*job)
            except Exception as e:  # a full disk, a folder removed: the entry stays in RAM only
                self.warn(f"could not write an entry to {self.folder} ({type(e).__name__}: {e})")

    @contextlib.contextmanager
    def _locked(self):
        fcntl.flock(self._lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)

    def _write(self, name: str, caches: list, meta: dict) -> None:
        with self._locked():
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / name
            temporary = self.folder / f".{name}.{os.getpid()}.tmp{SUFFIX}"
            try:
                save_prompt_cache(str(temporary), caches, {META: json.dumps(meta)})
                os.replace(temporary, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(temporary)
            stored = Stored(path, meta["tokens"], meta["prompt_len"], meta["recurrent"], meta["checkpoints"],
                            path.stat().st_size)
            with self._guard:
                self.stored[name] = stored
            self._evict()

    def _evict(self) -> None:
        """Remove the least recently used files of every pair in the directory
        until they fit the budget, and what writers killed mid-write left (the
        lock is held: nobody is writing)."""
        files = []
        for folder in self.root.iterdir():
            if not (FOLDER.fullmatch(folder.name) and folder.is_dir()):
                continue
            for path in folder.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    if TEMPORARY.fullmatch(path.name):
                        os.remove(path)
                    elif NAME.fullmatch(path.name):
                        st = path.stat()
                        files.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.budget:
                break
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            total -= size
            if path.parent == self.folder:
                with self._guard:
                    self.stored.pop(path.name, None)

    def stats(self) -> dict:
        return {"entries": len(self.stored), "bytes": self.nbytes, "writable": self.writable,
                "directory": str(self.folder)}
