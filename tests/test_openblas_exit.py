"""``dflash-mlx generate``, and a library caller of ``generate``, exit under
OpenBLAS with MLX work still in flight.

A finished generation leaves the draft of the next block queued on MLX's
worker thread. A process that exits while that draft's BLAS calls run never
ends under a multithreaded OpenBLAS: OpenBLAS's exit-time shutdown joins a
worker thread the running call leaves asleep. The draft's cost grows with the
context (about 0.1 s at 20k tokens on the demo pair here), so a long prompt
races the exit and hangs now and then. This test makes the race certain: the
CLI runs as ``python -m dflash_mlx`` does, but the generation ends with a
chain of matmuls queued on mlx-lm's generation stream, seconds of BLAS work
where the draft's is a fraction of a second.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mlx.doctor import OPENBLAS_LIB

pytestmark = pytest.mark.skipif(not Path(OPENBLAS_LIB).exists(), reason=f"OpenBLAS is not installed ({OPENBLAS_LIB})")

LAUNCH = """
import importlib, runpy, sys
import mlx.core as mx
from mlx_lm.generate import generation_stream

module = importlib.import_module("dflash_mlx.generate")
stream_generate = module.stream_generate

def ending_with_work_in_flight(*args, **kwargs):
    yield from stream_generate(*args, **kwargs)
    with mx.stream(generation_stream):
        a = mx.random.normal((1024, 1024))
        b = a
        for _ in range(100):
            b = b @ a
        mx.async_eval(b)

module.stream_generate = ending_with_work_in_flight
sys.argv = ["dflash-mlx", "generate", "--prompt", "def fibonacci(n):", "--max-tokens", "8"]
runpy.run_module("dflash_mlx", run_name="__main__")
"""


def test_generate_exits_with_mlx_work_in_flight():
    run = exits(LAUNCH)
    assert run.stdout.strip() and "generation: 8 tokens" in run.stderr


def exits(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` under OpenBLAS; fail unless it exits, with status 0, within 120 s."""
    # two OpenBLAS threads even on a one-CPU runner: the hang needs a worker thread
    env = {**os.environ, "LD_PRELOAD": OPENBLAS_LIB, "OPENBLAS_NUM_THREADS": "2"}
    try:
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"still running after 120 s; its stderr:\n{e.stderr}")
    assert run.returncode == 0, run.stderr
    return run


LIBRARY = """
import mlx.core as mx
import dflash_mlx.loop.decoder as decoder
from dflash_mlx import generate, load, load_draft
from dflash_mlx.demo import demo_pair

propose = decoder.DraftProposer.propose

def propose_with_seconds_of_blas(self, y, block_size):
    a = mx.random.normal((1024, 1024))
    b = a
    for _ in range(20):
        b = b @ a
    return propose(self, y, block_size) + 0 * b.sum()

decoder.DraftProposer.propose = propose_with_seconds_of_blas
pair = demo_pair()
model, tokenizer = load(str(pair.target))
result = generate(model, load_draft(str(pair.draft)), tokenizer, "def fibonacci(n):", max_tokens=8, block_size=4)
print(len(result.tokens))
"""


def test_a_library_caller_exits_after_generate_returns():
    """No atexit hook here: ``stream_generate`` itself waits for the draft it
    queued after the last cycle (each draft here carries a second or so of BLAS work)."""
    assert exits(LIBRARY).stdout.strip() == "8"
