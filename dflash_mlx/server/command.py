"""Entry point of ``dflash-mlx serve`` (the CLI parses options and calls ``main``)."""

import sys
from typing import Optional, Union

from ..errors import DFlashError
from ..registry import Pair, resolve_pair
from ..validate import block_option, options

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_options(port: int, max_tokens_limit: int, max_queue: int, prefix_cache_gb: float,
                  block_size: Union[int, str, None], draft_vocab: Optional[int] = None) -> None:
    """Raise a one-line DFlashError for an option out of range."""
    if not 0 <= port <= 65535:
        raise DFlashError(f"--port must be in 0..65535, got {port}")
    if max_tokens_limit <= 0:
        raise DFlashError(f"--max-tokens-limit must be positive, got {max_tokens_limit}")
    if max_queue < 0:
        raise DFlashError(f"--max-queue must be >= 0, got {max_queue}")
    if prefix_cache_gb < 0:
        raise DFlashError(f"--prefix-cache-gb must be >= 0, got {prefix_cache_gb}")
    if block_size is not None:
        block_option(str(block_size), "--block-size")
    options({"draft_vocab": draft_vocab}, {"draft_vocab": "--draft-vocab"})


def main(model: Optional[str], draft: Optional[str], host: str, port: int, max_tokens_limit: int,
         api_key: Optional[str], max_queue: int, prefix_cache_gb: float, block_size: str,
         draft_vocab: Optional[int] = None) -> None:
    """``dflash-mlx serve``: resolve the pair (the demo pair without --model)
    and serve it; progress goes to stderr."""
    pair = resolve_pair(model, draft)
    if pair.demo:
        _log("no --model given: serving the bundled demo pair (offline); pass --model for a real model")
    serve(pair, host, port, max_tokens_limit, api_key, max_queue, prefix_cache_gb,
          block_option(block_size, "--block-size"), draft_vocab)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def serve(pair: Pair, host: str = "127.0.0.1", port: int = 8080, max_tokens_limit: int = 4096,
          api_key: Optional[str] = None, max_queue: int = 32, prefix_cache_gb: float = 2.0,
          block_size: Union[int, str, None] = "auto", draft_vocab: Optional[int] = None) -> None:
    """Check the options, load ``pair`` on the worker thread, then serve it
    until interrupted (DFlashError for a bad option or pair)."""
    import uvicorn

    from .app import Settings, create_app
    from .engine import Engine

    check_options(port, max_tokens_limit, max_queue, prefix_cache_gb, block_size, draft_vocab)
    if host not in LOOPBACK and api_key is None:
        _log(f"warning: serving on {host} without --api-key: anyone who can reach it can use it")
    engine = Engine(pair.target, pair.draft, block_size, max_queue, int(prefix_cache_gb * 1e9), draft_vocab)
    _log(f"loading {pair.target} with draft {pair.draft}")
    engine.start()
    name = "dflash-mlx-demo" if pair.demo else pair.target
    app = create_app(engine, Settings(name, max_tokens_limit, api_key, pair.enable_thinking))
    _log(f"serving '{name}' at http://{host}:{port}/v1 (one request decodes at a time; "
         f"up to {max_queue} wait)")
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        engine.stop()
