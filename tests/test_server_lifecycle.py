"""dflash-mlx serve starting and stopping: an address it cannot listen on
fails before any model loads, and SIGINT/SIGTERM mid-request shut a real
server down gracefully (every request in flight gets an OpenAI-shaped answer,
nothing is cut, nothing is logged as a traceback, exit 0)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import free_port, running_server

LONG = {"prompt": "the quick brown fox", "max_tokens": 4000}  # runs for many seconds


def serve_until_it_fails(pair_dirs, *options) -> subprocess.CompletedProcess:
    target, draft = pair_dirs
    return subprocess.run(
        [sys.executable, "-m", "dflash_mlx", "serve", "--model", str(target), "--draft", str(draft), *options],
        capture_output=True, text=True, timeout=60, env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )


@pytest.fixture(scope="module")
def pair_dirs(target_dirs, draft_dir):
    return target_dirs["qwen3_5"], draft_dir("qwen3_5", block_size=4)


def test_a_port_in_use_is_one_error_line_before_loading(pair_dirs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve_until_it_fails(pair_dirs, "--port", str(port))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use): "
        "another program is listening there; stop it or pick another --port"
    ]


@pytest.mark.parametrize("host, message", [
    ("::zz", "error: --host '::zz' is not an address or a name this machine can resolve"),
    ("192.0.2.1", "error: cannot listen on 192.0.2.1:"),  # a documentation address: not this machine's
])
def test_an_invalid_host_is_one_error_line_before_loading(pair_dirs, host, message):
    result = serve_until_it_fails(pair_dirs, "--host", host, "--port", str(free_port()), "--api-key", "k")
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr


def stream_events(url: str, body: dict, events: list) -> None:
    """Every ``data:`` payload of a streamed completion, as it arrives."""
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=60) as r:
        events.extend(line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))


def active(url: str) -> int:
    return httpx.get(url + "/health", timeout=10).json()["active"]


@pytest.mark.parametrize("sig, streamed_first", [(signal.SIGTERM, True), (signal.SIGINT, False)])
def test_a_signal_mid_request_shuts_down_gracefully(pair_dirs, tmp_path, sig, streamed_first):
    """One request decodes and one waits (streamed and not, either way round)
    when the signal comes: both get a 503 'shutting down' error, the stream as
    a last event before [DONE]; the server exits 0 with a clean log."""
    target, draft = pair_dirs
    with running_server(tmp_path, target, draft, "--max-tokens-limit", "4000") as (url, proc):
        events, replies = [], []
        streamed = threading.Thread(target=stream_events, args=(url, LONG, events))
        plain = threading.Thread(target=lambda: replies.append(
            httpx.post(url + "/v1/completions", json=LONG, timeout=60)))
        for admitted, thread in enumerate((streamed, plain) if streamed_first else (plain, streamed), 1):
            thread.start()  # the first decodes, the second waits behind it
            deadline = time.monotonic() + 30
            while active(url) < admitted and time.monotonic() < deadline:
                time.sleep(0.05)
        assert active(url) == 2
        proc.send_signal(sig)
        streamed.join(timeout=30)
        plain.join(timeout=30)
        assert proc.wait(timeout=30) == 0
    error = {"message": "the server is shutting down; retry once it is back", "type": "server_error",
             "param": None, "code": "server_shutting_down"}
    assert events[-1] == "[DONE]" and json.loads(events[-2]) == {"error": error}
    assert replies[0].status_code == 503 and replies[0].json() == {"error": error}
    with pytest.raises(httpx.ConnectError):  # it no longer listens
        httpx.get(url + "/health", timeout=5)
    log = next(tmp_path.glob("server-*.log")).read_text()
    for bad in ("Traceback", "CancelledError", "without completing response", "ERROR"):
        assert bad not in log, log[-3000:]


EXIT_AFTER_ONE_REQUEST = """
import asyncio, sys
from dflash_mlx.server.engine import Engine, Request

engine = Engine(sys.argv[1], sys.argv[2], block_size=4, max_queue=1)
engine.start()

async def one_request():
    job = engine.submit(Request(prompt=[1, 2, 3, 4, 5], max_tokens=30, sampling={}), asyncio.get_running_loop())
    return [event async for event in job.stream()]

asyncio.run(one_request())
engine.stop()
"""


def test_a_process_whose_worker_thread_generated_exits_cleanly(pair_dirs):
    """MLX's streams of the worker thread are torn down with it; left to the
    interpreter's exit they abort the process about one run in three, so three
    runs at once nearly always catch it."""
    runs = [subprocess.Popen([sys.executable, "-c", EXIT_AFTER_ONE_REQUEST, *map(str, pair_dirs)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=os.environ | {"HF_HUB_OFFLINE": "1"}) for _ in range(3)]
    for run in runs:
        output, _ = run.communicate(timeout=120)
        assert run.returncode == 0 and "terminate called" not in output, output[-2000:]
