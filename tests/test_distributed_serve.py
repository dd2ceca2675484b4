"""dflash-mlx serve --distributed: two ranks of MLX's ring backend over
127.0.0.1 (set up as mlx.launch sets them up); rank 0 serves HTTP, rank 1
follows every request it sends."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from test_distributed import PROMPT, free_ports

from dflash_mlx import generate, load, load_draft

MAX_TOKENS = 16


@contextlib.contextmanager
def two_rank_server(tmp_path, target, draft, mode: str, *options):
    """``dflash-mlx serve --distributed mode`` as ranks 0 and 1; yields rank 0's
    URL and both processes (stderr in tmp_path/rank<r>.log)."""
    start = free_ports(3)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{start + rank}"] for rank in range(2)]))
    port = start + 2
    command = [sys.executable, "-m", "dflash_mlx", "serve", "--model", str(target), "--draft", str(draft),
               "--port", str(port), "--distributed", mode, "-b", "4", *options]
    procs = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"rank{rank}.log", "w"),
                              env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile),
                                   "HF_HUB_OFFLINE": "1"})
             for rank in range(2)]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a rank exited: " + (tmp_path / "rank0.log").read_text()[-2000:])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up in 120 s"
            time.sleep(0.2)
        yield url, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def pair(target_dirs, draft_dir):
    target, draft = target_dirs["qwen3_5"], draft_dir("qwen3_5", block_size=4)
    model, tokenizer = load(str(target))
    ids = tokenizer.encode(PROMPT)
    single = generate(model, load_draft(str(draft)), tokenizer, ids, block_size=4, max_tokens=MAX_TOKENS)
    return target, draft, ids, single.text


def complete(url: str, ids: list[int], **fields) -> dict:
    reply = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": MAX_TOKENS, **fields}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_requests_through_rank_0_then_ctrl_c_ends_both(pair, tmp_path, mode):
    target, draft, ids, expected = pair
    with two_rank_server(tmp_path, target, draft, mode) as (url, procs):
        assert complete(url, ids)["choices"][0]["text"] == expected  # the single-process output
        # a stream whose client goes away after its first chunk: both ranks stop at the same cycle
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": ids, "max_tokens": 2000, "stream": True, "temperature": 1.0}) as r:
            next(r.iter_lines())
        sampled = complete(url, ids, temperature=1.0, max_tokens=24, logit_bias={"2": -100})
        assert sampled["usage"]["completion_tokens"] == 24
        again = complete(url, ids)  # the prompt's caches, reused on both ranks
        assert again["choices"][0]["text"] == expected
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert httpx.get(url + "/health", timeout=10).json()["active"] == 0
        for p in procs:  # as a terminal's Ctrl-C reaches every process mlx.launch started
            p.send_signal(signal.SIGINT)
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    for rank in range(2):
        assert "Traceback" not in (tmp_path / f"rank{rank}.log").read_text()


def test_a_lost_follower_ends_the_server_with_one_line(pair, tmp_path):
    target, draft, ids, _ = pair
    with two_rank_server(tmp_path, target, draft, "tensor", "--max-tokens-limit", "4000") as (url, procs):
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": ids, "max_tokens": 4000, "stream": True,
                                "logit_bias": {"2": -100}}) as r:
            lines = r.iter_lines()
            next(lines)
            procs[1].kill()
            events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "distributed_group_lost"
        assert procs[0].wait(timeout=30) == 1
    last = (tmp_path / "rank0.log").read_text().strip().splitlines()[-1]
    assert last.startswith("error: rank 0: the distributed group lost a rank ("), last


HEARTBEATS = """
import sys, time
from dflash_mlx import DFlashError, distributed
from dflash_mlx.server.distributed import GroupEngine

launch = distributed.Launch(distributed.init("tensor"), "tensor")
engine = GroupEngine(launch, sys.argv[1], sys.argv[2], block_size=4, timeout=3.0, heartbeat=0.5)
if launch.group.rank() == 0:
    engine.start()  # its worker sends heartbeats while no request comes
    print("ready", flush=True)
    time.sleep(600)
else:
    try:
        engine.follow()
    except DFlashError as e:
        sys.exit(f"error: {e}")
"""


@pytest.mark.parametrize("stopped", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_idle_ranks_exchange_heartbeats_and_a_hung_one_ends_the_other(pair, tmp_path, stopped):
    """Idle past the watchdog's 3 s, both ranks live on heartbeats; once one rank
    hangs (SIGSTOP: a machine gone without closing its connections), the other's
    watchdog ends it with one line."""
    target, draft, _, _ = pair
    start = free_ports(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{start + rank}"] for rank in range(2)]))
    procs = [subprocess.Popen([sys.executable, "-c", HEARTBEATS, str(target), str(draft)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)})
             for rank in range(2)]
    try:
        assert procs[0].stdout.readline() == "ready\n", procs[0].stderr.read()
        time.sleep(5)
        assert [p.poll() for p in procs] == [None, None]
        procs[stopped].send_signal(signal.SIGSTOP)
        other = procs[1 - stopped]
        assert other.wait(timeout=30) == 1
        assert other.stderr.read().strip().splitlines()[-1].startswith(
            f"error: rank {1 - stopped}: no progress from the distributed group in 3 s")
    finally:
        for p in procs:
            p.kill()
            p.wait()
