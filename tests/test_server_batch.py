"""The server decoding several requests at once (``serve --max-concurrency``):
each reply is the one the same request gets alone, with rows joining and
leaving the batch mid-flight, stop strings, logprobs, cancellation and errors
per row, the prefix cache storing and restoring rows, and ``/health`` showing
the rows and the queue. In process (the engine, against one decoding a
request at a time) and end to end (a real ``dflash-mlx serve`` on 127.0.0.1)."""

import asyncio
import threading
import time

import httpx
import pytest
from test_server import KEY, running_server

from dflash_mlx.chat import template_ids
from dflash_mlx.demo import demo_pair
from dflash_mlx.errors import DFlashError
from dflash_mlx.loop import NON_FINITE, BatchDecoder
from dflash_mlx.server.engine import DEFAULT_MAX_CONCURRENCY, Delta, Engine, Failed, Finished, QueueFull, Request

WIDTH = 3
BLOCK = 8


class Gated(Engine):
    """An engine that takes up its first request only once ``gate`` is open,
    so that every request submitted before is queued by then, and that
    records, before each cycle, its rows and the requests waiting."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.seen: list[tuple[int, int]] = []  # (rows, waiting) before each cycle

    def _next_job(self):
        job = super()._next_job()
        self.gate.wait()
        return job

    def start(self):
        super().start()
        rows = self._rows
        cycle = rows.cycle

        def recorded():
            self.seen.append((len(rows), self.waiting))
            cycle()

        rows.cycle = recorded


@pytest.fixture(scope="module")
def pair():
    """The bundled pair: its trained draft is often accepted, so a cycle commits several tokens
    (cut by max_tokens, EOS or a stop string inside a cycle), and its hybrid target's
    GatedDeltaNet states are what the prefix cache snapshots."""
    demo = demo_pair()
    return str(demo.target), str(demo.draft)


def started(engine: Engine) -> Engine:
    engine.start()
    return engine


@pytest.fixture(scope="module")
def alone(pair):
    """Decodes one request at a time through stream_generate, as before batching; no prefix cache."""
    engine = started(Engine(*pair, block_size=BLOCK, max_concurrency=1))
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def batch(pair):
    engine = started(Gated(*pair, block_size=BLOCK, prefix_cache_bytes=10**9, max_concurrency=WIDTH, max_queue=16))
    engine.gate.set()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def tokenizer(alone):
    return alone.tokenizer


class Reply:
    """What a request got: its events' text, logprobs, and the last event."""

    def __init__(self, events: list):
        self.events = events
        self.text = "".join(e.text for e in events if isinstance(e, Delta))
        self.picked = [(p.token, p.top) for e in events if isinstance(e, Delta) for p in e.logprobs]
        self.logprobs = [p.logprob for e in events if isinstance(e, Delta) for p in e.logprobs]
        self.last = events[-1]

    def ending(self) -> tuple:
        """How it ended: finished (why, at which stop string, with how many tokens) or failed."""
        last = self.last
        if isinstance(last, Finished):
            return "finished", last.finish_reason, last.stop_sequence, last.usage.prompt_tokens, \
                last.usage.completion_tokens
        return "failed", last.status, last.message

    def same_as(self, other: "Reply") -> bool:
        """The same text, ending, tokens and top alternatives, and logprobs (to float noise)."""
        tops = lambda reply: [(token, [i for i, _ in top]) for token, top in reply.picked]
        return (self.text, self.ending(), tops(self)) == (other.text, other.ending(), tops(other)) \
            and all(abs(a - b) < 1e-4 for a, b in zip(self.logprobs, other.logprobs))


def send(engine: Engine, requests: list[Request], cancel_after: dict = None) -> list[Reply]:
    """Submit every request at once (on a Gated engine, all are queued before
    the first is taken up) and collect each one's events; request i is
    cancelled once ``cancel_after[i]`` deltas came."""
    cancel_after = cancel_after or {}

    async def run():
        loop = asyncio.get_running_loop()
        if isinstance(engine, Gated):
            assert drained(engine)  # idle: the gate holds the next request back
            engine.gate.clear()
        jobs = [engine.submit(r, loop) for r in requests]
        if isinstance(engine, Gated):
            engine.gate.set()

        async def collect(i, job):
            events = []
            async for event in job.stream():
                events.append(event)
                if sum(isinstance(e, Delta) for e in events) == cancel_after.get(i):
                    engine.cancel(job)
            return Reply(events)

        return await asyncio.gather(*(collect(i, job) for i, job in enumerate(jobs)))

    return asyncio.run(run())


def one_by_one(engine: Engine, requests: list[Request]) -> list[Reply]:
    return [send(engine, [r])[0] for r in requests]


def drained(engine: Engine) -> bool:
    deadline = time.monotonic() + 10
    while (engine.active or engine.rows) and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.active == engine.rows == engine.waiting == 0


def words(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompts(n: int) -> list[str]:
    """The demo pair's held-out prompts (its draft does well on them)."""
    return demo_pair().load_prompts()[:n]


def requests(tokenizer) -> list[Request]:
    """Six different requests; their limits end them at different cycles."""
    limits = [9, 40, 17, 30, 12, 25]
    out = [Request(tokenizer.encode(p), n, {}) for p, n in zip(prompts(6), limits)]
    out[1].logprobs = 3
    out[3].logprobs = 0
    out[4].sampling = {"repetition_penalty": 1.3, "logit_bias": {7: 2.0}}
    return out


def with_a_stop(requests: list[Request], replies: list[Reply], i: int) -> None:
    """Give request i a stop string that its reply alone reaches halfway."""
    text = replies[i].text
    requests[i].stop = ["zzzz", text[len(text) // 2 : len(text) // 2 + 3]]


def test_rows_joining_and_leaving_get_the_replies_they_get_alone(alone, batch, tokenizer):
    todo = requests(tokenizer)
    with_a_stop(todo, one_by_one(alone, todo), 2)
    want = one_by_one(alone, todo)
    assert want[2].last.finish_reason == "stop" and want[2].last.stop_sequence == todo[2].stop[1]
    assert want[1].picked and want[3].picked and not want[0].picked
    batch.seen.clear()
    got = send(batch, todo)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.same_as(w), (i, g.text, w.text)
    rows = [r for r, _ in batch.seen]
    # three rows at once, with requests waiting: those joined the batch as rows left it
    assert max(rows) == WIDTH and any(r == WIDTH and waiting for r, waiting in batch.seen)
    assert len(batch.seen) < sum(w.last.usage.cycles for w in want)  # cycles were shared
    assert drained(batch)


def test_seeded_sampling_keeps_each_row_s_own_draws(alone, batch, tokenizer):
    """At temperature > 0 each row draws with its own seed's keys, in the order
    it would alone: its tokens are those it gets alone for as long as its
    blocks are (while it has BLOCK tokens or more left; past that the batch
    may verify a longer block than it would alone, and so draw otherwise)."""
    limits = [40, 28, 34]
    todo = [Request(tokenizer.encode(p), n, {"temperature": 0.9, "top_p": 0.95, "seed": 3 + i}, logprobs=0)
            for i, (p, n) in enumerate(zip(prompts(3), limits))]
    want = one_by_one(alone, todo)
    got = send(batch, todo)
    for g, w, n in zip(got, want, limits):
        assert g.ending() == w.ending()
        tokens, alone_tokens = [t for t, _ in g.picked], [t for t, _ in w.picked]
        assert len(tokens) == n and tokens[: n - BLOCK] == alone_tokens[: n - BLOCK]
    assert max(w.last.usage.accepted for w in want) > 0  # drafts were accepted: several tokens a cycle


def test_under_auto_a_request_alone_decodes_as_alone_whatever_ran_before(target_dirs, draft_dir):
    """--block-size auto learns each batch's acceptance as it goes; a batch
    that empties starts afresh, so a request that finds the server idle gets,
    seeded, the very reply stream_generate gives it (a policy new for it)."""
    tiny = str(target_dirs["qwen3_5"]), str(draft_dir("qwen3_5", block_size=4))
    engines = [started(Engine(*tiny, max_concurrency=k)) for k in (1, WIDTH)]  # auto: the default
    try:
        tokenizer = engines[0].tokenizer
        send(engines[1], [Request(tokenizer.encode(p), 24, {}) for p in ("the quick brown fox", "hello world")])
        seeded = Request(tokenizer.encode("hello world what is"), 24, {"temperature": 0.9, "top_p": 0.95, "seed": 7})
        want, got = send(engines[0], [seeded])[0], send(engines[1], [seeded])[0]
    finally:
        for engine in engines:
            engine.stop()
    assert got.same_as(want)


def test_a_request_cancelled_mid_flight_leaves_the_others_unchanged(alone, batch, tokenizer):
    todo = requests(tokenizer)[:4]
    todo[1].max_tokens = 200
    want = one_by_one(alone, todo)
    got = send(batch, todo, cancel_after={1: 2})
    assert got[1].last.finish_reason == "cancelled" and 2 <= got[1].last.usage.completion_tokens < 200
    assert got[1].text == want[1].text[: len(got[1].text)]
    for i in (0, 2, 3):
        assert got[i].same_as(want[i]), i
    assert drained(batch)
    # its caches were kept at the cycle boundary it stopped at: a prompt extending its prompt reuses them
    follow = Request(todo[1].prompt + words(tokenizer, " and then"), 8, {})
    again = send(batch, [follow])[0]
    assert again.last.usage.cached_tokens >= len(todo[1].prompt) - 1
    assert again.same_as(send(alone, [follow])[0])


def test_a_follow_up_turn_of_a_batched_request_reuses_its_caches(alone, batch, tokenizer):
    chat = [{"role": "system", "content": "you are a cat"}, {"role": "user", "content": "name three birds"}]
    turn1 = Request(template_ids(tokenizer, chat), 16, {})
    others = requests(tokenizer)[:2]
    first = send(batch, [turn1, *others])[0]
    assert first.last.usage.cached_tokens == 0
    chat2 = chat + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and fish"}]
    turn2 = Request(template_ids(tokenizer, chat2), 16, {})
    assert turn2.prompt[: len(turn1.prompt)] == turn1.prompt
    second = send(batch, [turn2, *others])[0]
    assert second.last.usage.cached_tokens >= len(turn1.prompt) - 1
    assert second.same_as(send(alone, [turn2])[0])  # alone: no prefix cache, every token prefilled


def test_a_bad_request_fails_alone(alone, batch, tokenizer):
    todo = requests(tokenizer)[:3]
    bad = Request(tokenizer.encode("hello"), 8, {"logit_bias": {10**7: 1.0}})
    got = send(batch, [todo[0], bad, todo[1], todo[2]])
    assert isinstance(got[1].last, Failed) and got[1].last.status == 400 and "logit_bias" in got[1].last.message
    for g, w in zip([got[0], *got[2:]], one_by_one(alone, todo)):
        assert g.same_as(w)
    assert drained(batch)


def test_a_row_whose_cycle_fails_leaves_and_the_others_go_on(alone, batch, tokenizer, monkeypatch):
    todo = requests(tokenizer)[:3]
    want = one_by_one(alone, todo)
    real, calls = BatchDecoder.cycle, []

    def cycle(decoder):  # the second request's second cycle: its draft's logits were not finite
        cycles = real(decoder)
        if len(calls) == 1:
            next(c for c in cycles if c.row.tag.request is todo[1]).error = NON_FINITE
        calls.append(1)
        return cycles

    monkeypatch.setattr(BatchDecoder, "cycle", cycle)
    got = send(batch, todo)
    assert isinstance(got[1].last, Failed) and (got[1].last.status, got[1].last.message) == (400, NON_FINITE)
    assert got[0].same_as(want[0]) and got[2].same_as(want[2])
    assert drained(batch) and not batch._rows.decoder.rows


def test_an_error_inside_a_cycle_fails_that_batch_and_the_worker_goes_on(alone, batch, tokenizer, monkeypatch):
    todo = requests(tokenizer)[:3]
    real, calls = BatchDecoder.cycle, []

    def cycle(decoder):  # the batch's first cycle breaks
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(decoder)

    monkeypatch.setattr(BatchDecoder, "cycle", cycle)
    got = send(batch, todo)
    assert all(isinstance(g.last, Failed) and g.last.status == 500 and "RuntimeError: boom" in g.last.message
               for g in got)
    assert drained(batch)
    assert all(g.same_as(w) for g, w in zip(send(batch, todo), one_by_one(alone, todo)))


def test_a_reduced_drafting_vocabulary_drafts_every_row_over_it(pair, alone, batch, tokenizer):
    """--draft-vocab reaches the batch's drafter as it reaches stream_generate:
    the replies a request gets alone, drafted over fewer ids (so accepted
    otherwise than over the whole vocabulary)."""
    todo = requests(tokenizer)[:3]
    engines = [started(Engine(*pair, block_size=BLOCK, draft_vocab=64, max_concurrency=k)) for k in (1, WIDTH)]
    try:
        want, got = one_by_one(engines[0], todo), send(engines[1], todo)
    finally:
        for engine in engines:
            engine.stop()
    assert all(g.same_as(w) for g, w in zip(got, want))
    whole = send(batch, todo)
    assert [g.last.usage.accepted for g in got] != [g.last.usage.accepted for g in whole]


def test_what_cannot_batch_decodes_one_request_at_a_time():
    """Without loading anything: the width each engine runs, and the queue beside it."""
    assert Engine("t", "d").width == DEFAULT_MAX_CONCURRENCY
    assert Engine("t", "d", max_concurrency=4).width == 4
    assert Engine("t", "d", max_concurrency=4, kv={"kv_bits": 4}).width == 1  # quantized K/V: alone
    engine = Engine("t", "d", max_concurrency=4)
    engine.generator = lambda *args, **kwargs: iter(())  # another loop (the distributed engine's): alone
    assert engine.width == 1
    with pytest.raises(DFlashError, match="max_concurrency must be >= 1, got 0"):
        Engine("t", "d", max_concurrency=0)


def test_the_queue_holds_max_queue_beside_the_rows():
    engine = Engine("t", "d", max_concurrency=2, max_queue=1)  # not started: nothing is taken up
    loop = asyncio.new_event_loop()
    try:
        jobs = [engine.submit(Request([1, 2], 4, {}), loop) for _ in range(3)]
        assert engine.waiting == 3
        with pytest.raises(QueueFull, match="1 requests are already waiting"):
            engine.submit(Request([1, 2], 4, {}), loop)
        engine.cancel(jobs[0])
        assert engine.waiting == 2 and engine.active == 2
    finally:
        loop.close()


# --- end to end: a real server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("server"), *pair, "--api-key", KEY, "--block-size", str(BLOCK),
                        "--max-concurrency", str(WIDTH), "--max-queue", "8") as (url, _):
        yield url


def http(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def complete(url: str, path: str, body: dict, hang_up_after: int = 0):
    """(text, finish_reason, usage, logprobs) of a reply, streamed or not; None once hung up."""
    with http(url) as client:
        if not body.get("stream"):
            r = client.post(path, json=body)
            r.raise_for_status()
            choice, usage = r.json()["choices"][0], r.json()["usage"]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            return text, choice["finish_reason"], usage, choice["logprobs"]
        text, finish, usage, logprobs = [], None, None, []
        with client.stream("POST", path, json=body | {"stream_options": {"include_usage": True}}) as r:
            r.raise_for_status()
            events = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
            for i, data in enumerate(events):
                if hang_up_after and i == hang_up_after:
                    return None  # leaving the block closes the connection mid-stream
                if data == "[DONE]":
                    break
                chunk = httpx.Response(200, content=data).json()
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    text.append(choice["delta"].get("content") or "" if "delta" in choice else choice["text"])
                    finish = choice["finish_reason"] or finish
                    if choice.get("logprobs"):
                        logprobs.append(choice["logprobs"])
        return "".join(text), finish, usage, logprobs


def health(url: str) -> dict:
    with http(url) as client:
        return client.get("/health").json()


def http_requests() -> list[tuple[str, dict]]:
    p = prompts(6)
    ask = [{"role": "user", "content": p[1]}]
    return [
        ("/v1/completions", {"prompt": p[0], "max_tokens": 150, "stream": True}),
        ("/v1/chat/completions", {"messages": ask, "max_tokens": 30}),
        ("/v1/chat/completions", {"messages": ask, "max_tokens": 45, "stream": True, "logprobs": True,
                                  "top_logprobs": 2}),
        ("/v1/completions", {"prompt": p[3], "max_tokens": 20, "logprobs": 1}),
        ("/v1/completions", {"prompt": p[4], "max_tokens": 60, "stream": True}),
        ("/v1/completions", {"prompt": p[5], "max_tokens": 35, "repetition_penalty": 1.2}),
    ]


def comparable(reply) -> tuple:
    """A reply without what may differ between runs (usage's cycles and cached tokens, ids):
    its text, finish reason, token count and the tokens and top alternatives its logprobs name."""
    text, finish, usage, logprobs = reply
    return text, finish, usage["completion_tokens"], logprob_tokens(logprobs)


def logprob_tokens(logprobs) -> list:
    if not logprobs:
        return []
    parts = logprobs if isinstance(logprobs, list) else [logprobs]
    out = []
    for lp in parts:
        if "content" in lp:
            out += [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in lp["content"]]
        else:
            out += list(zip(lp["tokens"], [sorted(d) for d in lp["top_logprobs"]]))
    return out


def test_concurrent_clients_get_their_single_client_replies_and_health_shows_the_rows(server):
    todo = http_requests()
    text = complete(server, *todo[4])[0]
    todo[4][1]["stop"] = ["zzzz", text[len(text) // 2 : len(text) // 2 + 3]]  # reached halfway
    want = [comparable(complete(server, path, body)) for path, body in todo]  # one at a time
    assert want[4][1] == "stop" and want[0][1] == "length"
    results: dict = {}
    seen: list[dict] = []

    def client(i: int, hang_up_after: int = 0) -> None:
        path, body = todo[i] if i >= 0 else todo[0]
        results[i] = complete(server, path, body, hang_up_after)

    def watch() -> None:
        while len(results) < len(todo) + 1:
            seen.append(health(server))
            time.sleep(0.02)

    first = threading.Thread(target=client, args=(0,))
    first.start()
    deadline = time.monotonic() + 30
    while health(server)["rows"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    # the others join it mid-flight; one more client of the first request hangs up after three events
    threads = [threading.Thread(target=client, args=(i,)) for i in range(1, len(todo))]
    threads.append(threading.Thread(target=client, args=(-1, 3)))
    watcher = threading.Thread(target=watch)
    for t in threads + [watcher]:
        t.start()
    for t in [first] + threads + [watcher]:
        t.join(timeout=120)
    assert results[-1] is None
    assert [comparable(results[i]) for i in range(len(todo))] == want
    assert max(h["rows"] for h in seen) == WIDTH and max(h["waiting"] for h in seen) >= 1
    assert all(h["rows"] <= WIDTH and h["max_concurrency"] == WIDTH for h in seen)
    deadline = time.monotonic() + 10
    while health(server)["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {k: health(server)[k] for k in ("active", "rows", "waiting")} == {"active": 0, "rows": 0, "waiting": 0}


def test_a_chat_s_next_turn_after_a_batched_turn_reuses_its_caches(server):
    turn1 = [{"role": "system", "content": "you are a dog"}, {"role": "user", "content": "what is the capital"}]
    others = [threading.Thread(target=complete, args=(server, path, body)) for path, body in http_requests()[1:4]]
    for t in others:
        t.start()
    text, _, usage, _ = complete(server, "/v1/chat/completions", {"messages": turn1, "max_tokens": 16})
    for t in others:
        t.join(timeout=120)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    turn2 = turn1 + [{"role": "assistant", "content": text}, {"role": "user", "content": "and of spain"}]
    _, _, usage2, _ = complete(server, "/v1/chat/completions", {"messages": turn2, "max_tokens": 16})
    assert usage2["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1


def test_max_concurrency_below_one_is_refused_in_one_line():
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    result = CliRunner().invoke(app, ["serve", "--max-concurrency", "0", "--host", "::zz"])
    assert result.exit_code == 1 and "--max-concurrency must be >= 1, got 0" in result.output
    assert result.output.count("\n") == 1
