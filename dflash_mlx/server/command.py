"""Entry point of ``dflash-mlx serve`` (the CLI parses options and calls ``main``)."""

import errno
import math
import signal
import socket
import sys
from pathlib import Path
from typing import Callable, Optional, Union

import uvicorn

from ..errors import DFlashError
from ..precision import choose_draft_dtype
from ..registry import Pair, resolve_pair
from ..validate import KV_FLAGS, block_option, kv_options, options
from .prefix_disk import DEFAULT_GB, DiskConfig, default_directory

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_options(port: int, max_tokens_limit: int, max_queue: int, prefix_cache_gb: float,
                  block_size: Union[int, str, None], draft_vocab: Optional[int] = None,
                  api_key: Optional[str] = None, kv: Optional[dict] = None, draft_dtype: str = "auto",
                  max_concurrency: Optional[int] = None) -> None:
    """Raise a one-line DFlashError for an option out of range (``kv``: the
    quantized KV cache's stream_generate arguments)."""
    if not 0 <= port <= 65535:
        raise DFlashError(f"--port must be in 0..65535, got {port}")
    if max_tokens_limit <= 0:
        raise DFlashError(f"--max-tokens-limit must be positive, got {max_tokens_limit}")
    if max_queue < 0:
        raise DFlashError(f"--max-queue must be >= 0, got {max_queue}")
    if max_concurrency is not None and max_concurrency < 1:
        raise DFlashError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    if not (math.isfinite(prefix_cache_gb) and prefix_cache_gb >= 0):
        raise DFlashError(f"--prefix-cache-gb must be a finite number >= 0, got {prefix_cache_gb}")
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise DFlashError("--api-key must not be empty or begin or end with whitespace "
                          "(clients send it as 'Authorization: Bearer KEY'); leave it out to serve without a key")
    if block_size is not None:
        block_option(str(block_size), "--block-size")
    options({"draft_vocab": draft_vocab}, {"draft_vocab": "--draft-vocab"})
    options(kv or {}, KV_FLAGS)
    choose_draft_dtype({}, draft_dtype)


def main(model: Optional[str], draft: Optional[str], host: str, port: int, max_tokens_limit: int,
         api_key: Optional[str], max_queue: int, prefix_cache_gb: float, block_size: str,
         draft_vocab: Optional[int] = None, distributed: Optional[str] = None, kv_bits: Optional[int] = None,
         kv_group_size: int = 64, quantized_kv_start: int = 5000, draft_dtype: str = "auto",
         max_concurrency: Optional[int] = None, prefix_cache_dir: Optional[str] = None,
         prefix_cache_disk_gb: float = DEFAULT_GB, prefix_cache_disk: bool = True, given: frozenset = frozenset()) -> None:
    """``dflash-mlx serve``: resolve the pair (the demo pair without --model)
    and serve it; progress goes to stderr. ``distributed``: the target is
    sharded over the ranks mlx.launch started; rank 0 serves, the others follow
    (one request at a time). ``kv_bits``: every request runs with a quantized
    KV cache (one at a time); ``draft_dtype``: ``--draft-dtype``;
    ``max_concurrency``: requests decoded at once (None: ``DEFAULT_MAX_CONCURRENCY``); the prefix
    cache's disk tier in ``prefix_cache_dir`` (None: the default), up to ``prefix_cache_disk_gb``
    (0 or ``prefix_cache_disk=False``: none; never with ``distributed``)."""
    from ..distributed import session, talks

    kv = kv_options(kv_bits, kv_group_size, quantized_kv_start, given)
    if kv and distributed:
        raise DFlashError("--kv-bits is not supported with --distributed; leave one out")
    pair, block = resolve_pair(model, draft), block_option(block_size, "--block-size")
    with session(distributed) as launch:
        if launch is not None and not talks(launch.group):
            check_options(port, max_tokens_limit, max_queue, prefix_cache_gb, block, draft_vocab, api_key,
                          draft_dtype=draft_dtype, max_concurrency=max_concurrency)
            # a terminal's Ctrl-C reaches every rank: a follower ends when rank 0, shutting down, says so
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            make_engine(pair, block, max_queue, prefix_cache_gb, draft_vocab, launch, draft_dtype=draft_dtype).follow()
            return
        disk = None if launch is not None else disk_config(prefix_cache_dir, prefix_cache_disk_gb, prefix_cache_disk)
        serve(pair, host, port, max_tokens_limit, api_key, max_queue, prefix_cache_gb, block, draft_vocab, launch,
              kv, draft_dtype, max_concurrency, disk)


def disk_config(directory: Optional[str], gb: float, on: bool) -> Optional[DiskConfig]:
    """The prefix cache's disk tier of ``--prefix-cache-dir``, ``--prefix-cache-disk-gb`` and
    ``--prefix-cache-disk`` (None: off), or a one-line DFlashError."""
    if not (math.isfinite(gb) and gb >= 0):
        raise DFlashError(f"--prefix-cache-disk-gb must be a finite number >= 0, got {gb}")
    if not (on and gb):
        return None
    return DiskConfig(Path(directory).expanduser() if directory else default_directory(), int(gb * 1e9))


def make_engine(pair: Pair, block_size: Union[int, str, None], max_queue: int, prefix_cache_gb: float,
                draft_vocab: Optional[int], launch=None, kv: Optional[dict] = None, draft_dtype: str = "auto",
                max_concurrency: Optional[int] = None, prefix_disk: Optional[DiskConfig] = None):
    """The engine of ``pair``; on a rank of ``launch`` (``distributed.Launch``), the group's,
    which decodes one request at a time; ``kv``: the quantized KV cache's stream_generate
    arguments (not distributed); ``max_concurrency``: requests decoded at once (None: the default)."""
    from .distributed import GroupEngine
    from .engine import DEFAULT_MAX_CONCURRENCY, Engine

    args = (pair.target, pair.draft, block_size, max_queue, int(prefix_cache_gb * 1e9), draft_vocab)
    if launch is None:
        return Engine(*args, kv=kv, draft_dtype=draft_dtype, max_concurrency=max_concurrency or DEFAULT_MAX_CONCURRENCY,
                      prefix_disk=prefix_disk)
    return GroupEngine(launch, *args, draft_dtype=draft_dtype)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, so that an address in use or one
    this machine does not have fails before any model loads (DFlashError).
    It starts listening when the server starts."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as e:
        sock.close()
        raise DFlashError(f"--host {host!r} is not an address or a name this machine can resolve "
                          f"({e.strerror})") from None
    except OSError as e:
        sock.close()
        hint = {errno.EADDRINUSE: ": another program is listening there; stop it or pick another --port",
                errno.EADDRNOTAVAIL: ": --host must be an address of this machine (127.0.0.1: this machine only)",
                errno.EACCES: ": ports below 1024 need privileges; pick another --port"}.get(e.errno, "")
        raise DFlashError(f"cannot listen on {host}:{port} ({e.strerror}){hint}") from None
    return sock


class Server(uvicorn.Server):
    """uvicorn's server that, when it starts shutting down (SIGINT/SIGTERM),
    first ends every admitted request (``on_shutdown``), so that each gets an
    answer before the connections close."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]):
        super().__init__(config)
        self.on_shutdown = on_shutdown

    async def shutdown(self, sockets=None):
        self.on_shutdown()
        await super().shutdown(sockets)


def serve(pair: Pair, host: str = "127.0.0.1", port: int = 8080, max_tokens_limit: int = 4096,
          api_key: Optional[str] = None, max_queue: int = 32, prefix_cache_gb: float = 2.0,
          block_size: Union[int, str, None] = "auto", draft_vocab: Optional[int] = None, launch=None,
          kv: Optional[dict] = None, draft_dtype: str = "auto", max_concurrency: Optional[int] = None,
          prefix_disk: Optional[DiskConfig] = None) -> None:
    """Check the options and the address, load ``pair`` on the worker thread,
    then serve it until SIGINT or SIGTERM (DFlashError for a bad option, an
    address it cannot listen on or a bad pair). On the signal it stops
    accepting, ends every request still in flight with a 503 error and returns.
    ``launch``: rank 0 of a distributed launch, whose other ranks follow;
    ``kv``: every request quantizes its KV cache with these stream_generate arguments;
    ``draft_dtype``: what the draft computes in (``--draft-dtype``); ``max_concurrency``: requests
    decoded at once, as the rows of one batch (None: ``DEFAULT_MAX_CONCURRENCY``); ``prefix_disk``:
    the prefix cache's disk tier (None: none)."""
    from .app import Settings, create_app

    check_options(port, max_tokens_limit, max_queue, prefix_cache_gb, block_size, draft_vocab, api_key, kv, draft_dtype,
                  max_concurrency)
    sock = bind(host, port)
    try:
        if pair.demo:
            _log("no --model given: serving the bundled demo pair (offline); pass --model for a real model")
        if host not in LOOPBACK and api_key is None:
            _log(f"warning: serving on {host} without --api-key: anyone who can reach it can use it")
        engine = make_engine(pair, block_size, max_queue, prefix_cache_gb, draft_vocab, launch, kv, draft_dtype,
                             max_concurrency, prefix_disk)
        _log(f"loading {pair.target} with draft {pair.draft}")
        engine.start()
        name = "dflash-mlx-demo" if pair.demo else pair.target
        app = create_app(engine, Settings(name, max_tokens_limit, api_key, pair.enable_thinking))
        port = sock.getsockname()[1]  # the one the system chose for --port 0
        width = engine.width
        at_once = "one request decodes at a time" if width == 1 else f"up to {width} requests decode at once"
        _log(f"serving '{name}' at http://{host}:{port}/v1 ({at_once}; up to {max_queue} more wait)")
        config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
        # uvicorn raises the signal it shut down on again once it returns, for
        # the handler that was there before it; the shutdown is done by then
        quiet = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            Server(config, engine.shut_down).run(sockets=[sock])
        finally:
            engine.stop()
            for s, handler in quiet.items():
                signal.signal(s, handler)
        if getattr(engine, "lost", None):  # a rank of the group stopped: the server shut itself down
            raise DFlashError(engine.lost)
    finally:
        sock.close()
