"""dflash-mlx serve under load: concurrent clients on 127.0.0.1, some hanging
up mid-stream, decoded as rows of one batch; every completed greedy response
must equal the single-client output of the same request, nothing may hang,
and the queue must drain to empty.
Bounded in requests and time; it stops by itself."""

import json
import threading
import time

import httpx
import pytest
from test_server import running_server

DEADLINE_S = 300  # the whole load must finish well within this; it normally takes seconds


def requests_to_send() -> list[tuple[str, dict]]:
    """A mix of routes, streaming, sampling, stop strings and a two-turn chat
    whose second turn can reuse the first one's caches."""
    turn1 = [{"role": "user", "content": "what is the capital of france"}]
    turn2 = turn1 + [{"role": "assistant", "content": "the capital is a city"},
                     {"role": "user", "content": "and of the lazy dog"}]
    return [
        ("/v1/chat/completions", {"messages": turn1, "max_tokens": 24}),
        ("/v1/chat/completions", {"messages": turn2, "max_tokens": 24, "stream": True}),
        ("/v1/chat/completions", {"messages": turn1, "max_tokens": 24, "temperature": 0.8, "seed": 11}),
        ("/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 24, "stream": True,
                             "temperature": 0.7, "top_p": 0.9, "seed": 5}),
        ("/v1/completions", {"prompt": "write a short story about", "max_tokens": 24,
                             "repetition_penalty": 1.2, "stop": ["ea", " the "]}),
        ("/v1/completions", {"prompt": "hello world", "max_tokens": 24, "frequency_penalty": 0.5}),
    ]


def complete(http: httpx.Client, path: str, body: dict, hang_up_after: int = 0) -> str | None:
    """The response text; None when this client hung up after ``hang_up_after`` events."""
    if not body.get("stream"):
        r = http.post(path, json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    text = []
    with http.stream("POST", path, json=body) as r:
        r.raise_for_status()
        events = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
        for i, data in enumerate(events):
            if hang_up_after and i == hang_up_after:
                return None  # leaving the block closes the connection mid-stream
            if data == "[DONE]":
                return "".join(text)
            choices = json.loads(data)["choices"]
            if choices and "delta" in choices[0]:
                text.append(choices[0]["delta"].get("content") or "")
            elif choices:
                text.append(choices[0]["text"])
    raise AssertionError("the stream ended without [DONE]")


def run_load(url: str, clients: int, rounds: int) -> dict:
    """Each client sends ``rounds`` requests; every third streamed one hangs up early."""
    todo = requests_to_send()
    with httpx.Client(base_url=url, timeout=60) as http:
        want = [complete(http, path, body) for path, body in todo]  # one client, one at a time
    results, errors = [], []

    def client(k: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            for r in range(rounds):
                i = (k + r) % len(todo)
                path, body = todo[i]
                hang_up = 2 if body.get("stream") and (k + r) % 3 == 0 else 0
                try:
                    got = complete(http, path, body, hang_up)
                except Exception as e:  # collected, so the test names it
                    errors.append(f"client {k} request {i}: {type(e).__name__}: {e}")
                    return
                results.append((i, got))

    tic = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, DEADLINE_S - (time.monotonic() - tic)))
    wall = time.monotonic() - tic
    assert not any(t.is_alive() for t in threads), f"clients still running after {DEADLINE_S} s"
    assert not errors, errors
    completed = [(i, got) for i, got in results if got is not None]
    assert len(results) == clients * rounds and completed
    # greedy replies are the single client's token for token; a seeded sampled one is distributed
    # as the target's (tests/test_batch_sampling.py), but its draws follow the batch's blocks
    greedy = {i for i, (_, body) in enumerate(todo) if not body.get("temperature")}
    mismatched = [(i, got, want[i]) for i, got in completed if i in greedy and got != want[i]]
    assert not mismatched, mismatched[:3]
    assert all(got for i, got in completed if i not in greedy)
    return {"requests": len(results), "completed": len(completed),
            "hung_up": len(results) - len(completed), "wall_s": wall}


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def drained(url: str) -> bool:
    deadline = time.monotonic() + 10
    while health(url)["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return health(url)["active"] == 0


@pytest.fixture(scope="module")
def load_server(target_dirs, draft_dir, tmp_path_factory):
    target, draft = target_dirs["qwen3_5"], draft_dir("qwen3_5", block_size=4)
    with running_server(tmp_path_factory.mktemp("load"), target, draft, "--max-queue", "16",
                        "--max-tokens-limit", "64") as (url, proc):
        yield url, proc


def test_concurrent_clients_get_the_single_client_output(load_server):
    url, _ = load_server
    stats = run_load(url, clients=8, rounds=3)
    assert stats["hung_up"] > 0 and stats["completed"] > stats["hung_up"]
    assert drained(url)  # every slot came back, hung-up clients' too
    again = run_load(url, clients=1, rounds=2)  # and it still serves the same outputs
    assert again["completed"] == 2


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@pytest.mark.slow
def test_load_8_clients_x_20_requests_reports_memory(load_server):
    url, proc = load_server
    run_load(url, clients=1, rounds=6)  # warm: every request once
    before = health(url)
    rss_before = rss_mb(proc.pid)
    stats = run_load(url, clients=8, rounds=20)
    assert drained(url)
    after = health(url)
    rss_after = rss_mb(proc.pid)
    print(f"\nload 8 x 20: {stats['completed']} completed, {stats['hung_up']} hung up mid-stream, "
          f"{stats['wall_s']:.1f} s wall ({stats['requests'] / stats['wall_s']:.1f} requests/s); "
          f"server RSS {rss_before:.0f} -> {rss_after:.0f} MB; "
          f"MLX active {before['memory_gb']['active'] * 1e3:.1f} -> {after['memory_gb']['active'] * 1e3:.1f} MB, "
          f"peak {after['memory_gb']['peak'] * 1e3:.1f} MB; prefix cache {after['prefix_cache']}")
    assert rss_after < rss_before * 1.5 + 100  # no leak that grows with the request count

