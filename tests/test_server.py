"""dflash-mlx serve, end to end: one real server on a free 127.0.0.1 port in a
subprocess (tiny Qwen3.5-hybrid target + draft), talked to with the official
``openai`` client and, for bad input, raw HTTP."""

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from mlx_lm import load as mlx_lm_load

from dflash_mlx import generate, load_draft
from dflash_mlx.chat import template_ids

KEY = "test-key"
MAX_TOKENS_LIMIT = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(log_dir, target, draft, *options):
    """A ``dflash-mlx serve`` subprocess on 127.0.0.1; yields its base URL.
    Its prefix cache's disk tier is its own (in ``log_dir``) unless ``options`` name one, so no
    server reuses another test's entries."""
    port = free_port()
    if not {"--prefix-cache-dir", "--no-prefix-cache-disk"} & set(options):
        options = ("--prefix-cache-dir", str(log_dir / f"prefix-cache-{port}"), *options)
    log = open(log_dir / f"server-{port}.log", "w")
    command = [sys.executable, "-m", "dflash_mlx", "serve", "--model", str(target),
               "--draft", str(draft), "--port", str(port), *options]  # binds 127.0.0.1 by default
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env=os.environ | {"HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError("server exited: " + (log_dir / f"server-{port}.log").read_text()[-2000:])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", headers=headers, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up in 120 s")
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def pair_dirs(target_dirs, draft_dir):
    return target_dirs["qwen3_5"], draft_dir("qwen3_5", block_size=4)


@pytest.fixture(scope="module")
def server(pair_dirs, tmp_path_factory):
    target, draft = pair_dirs
    with running_server(tmp_path_factory.mktemp("server"), target, draft, "--api-key", KEY,
                        "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--max-queue", "1",
                        "--max-concurrency", "2") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def library(pair_dirs):
    """The same pair in this process: what the server must reproduce."""
    target, draft = pair_dirs
    model, tokenizer = mlx_lm_load(str(target))
    draft = load_draft(str(draft))

    def run(prompt, **options):
        ids = template_ids(tokenizer, prompt) if isinstance(prompt[0], dict) else prompt
        return generate(model, draft, tokenizer, ids, **options), ids

    return run, tokenizer


def post(url, path, body=None, key=KEY, content=None, headers_extra=None):
    headers = ({"Authorization": f"Bearer {key}"} if key else {}) | (headers_extra or {})
    return httpx.post(url + path, json=body, content=content, headers=headers, timeout=60)


def test_models_and_health(client, server, pair_dirs):
    assert [m.id for m in client.models.list().data] == [str(pair_dirs[0])]
    health = httpx.get(server + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert health["status"] == "ok" and health["active"] == 0 and health["max_queue"] == 1


def test_chat_matches_the_library_streamed_and_not(client, library):
    run, _ = library
    messages = [{"role": "user", "content": "write a short story about a cat"}]
    want, ids = run(messages, max_tokens=24)
    reply = client.chat.completions.create(model="any", messages=messages, max_tokens=24)
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].finish_reason == "length"
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 24)
    assert usage.total_tokens == len(ids) + 24
    assert usage.model_extra["tokens_per_cycle"] >= 1 and usage.model_extra["cycles"] >= 1

    stream = client.chat.completions.create(model="any", messages=messages, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_completions_take_text_or_ids_streamed_and_not(client, library):
    run, tokenizer = library
    ids = tokenizer.encode("the quick brown fox")
    want, _ = run(ids, max_tokens=20)
    for prompt in ("the quick brown fox", ids):
        reply = client.completions.create(model="any", prompt=prompt, max_tokens=20)
        assert reply.choices[0].text == want.text and reply.usage.prompt_tokens == len(ids)
        streamed = client.completions.create(model="any", prompt=prompt, max_tokens=20, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == want.text


@pytest.fixture(scope="module")
def fixed_block_client(pair_dirs, tmp_path_factory):
    """A client of a server drafting blocks of 4 always: a seeded sampled reply is the library's
    only where both ran the same blocks (the draws follow the blocks), which the adaptive block
    cannot promise across two processes: its cost curve is timed, and timed again when a
    process's cycles drift from it (as they may under a loaded CI machine)."""
    with running_server(tmp_path_factory.mktemp("fixed"), *pair_dirs, "--api-key", KEY, "--block-size", "4") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_sampling_options_are_honoured_and_seeded(fixed_block_client, library):
    client = fixed_block_client
    run, tokenizer = library
    ids = tokenizer.encode("hello world what is")
    options = dict(temperature=0.9, top_p=0.95, seed=7, presence_penalty=0.5, frequency_penalty=0.3)
    want, _ = run(ids, max_tokens=24, top_k=40, min_p=0.05, logit_bias={10: 5.0}, block_size=4, **options)
    extra = {"top_k": 40, "min_p": 0.05, "user": "someone", "unknown_field": [1, 2]}  # unknown: ignored
    texts = [
        client.completions.create(model="any", prompt=ids, max_tokens=24, logit_bias={"10": 5.0},
                                  extra_body=extra, **options).choices[0].text
        for _ in range(2)
    ]
    assert texts == [want.text, want.text]
    penalised, _ = run(ids, max_tokens=24, repetition_penalty=1.3, block_size=4)
    reply = client.completions.create(model="any", prompt=ids, max_tokens=24,
                                      extra_body={"repetition_penalty": 1.3})
    assert reply.choices[0].text == penalised.text


def test_stop_strings_cut_across_token_boundaries_and_are_never_emitted(client, library):
    run, tokenizer = library
    ids = tokenizer.encode("write a short story")
    want, _ = run(ids, max_tokens=40)
    dropped = len(tokenizer.decode(want.tokens)) - len(want.text)  # mlx-lm drops a leading space
    boundary = len(tokenizer.decode(want.tokens[:10])) - dropped  # where token 10's text starts
    stop = want.text[boundary - 2 : boundary + 2]  # the end of token 9 and the start of token 10
    assert len(stop) == 4
    cut = want.text[: want.text.index(stop)]
    reply = client.completions.create(model="any", prompt=ids, max_tokens=40, stop=[stop, "zzzz"])
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (cut, "stop")
    streamed = list(client.completions.create(model="any", prompt=ids, max_tokens=40, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_multi_turn_prefills_only_the_new_tokens_with_the_cold_output(client, library):
    run, _ = library
    turn1 = [{"role": "system", "content": "you are a dog"},
             {"role": "user", "content": "what is the capital of france"}]
    first = client.chat.completions.create(model="any", messages=turn1, max_tokens=16)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and of the lazy dog"}]
    want, ids2 = run(turn2, max_tokens=16)  # cold: a fresh cache in this process
    ids1 = template_ids(library[1], turn1)
    assert ids2[: len(ids1)] == ids1
    second = client.chat.completions.create(model="any", messages=turn2, max_tokens=16)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(ids1)  # prefilled: only what turn 2 added
    assert second.usage.prompt_tokens - cached <= len(ids2) - len(ids1)
    assert second.choices[0].message.content == want.text


def test_the_same_prompt_again_reuses_all_but_its_last_token(client):
    """On this hybrid target too: its recurrent states are kept one token before the prompt's end."""
    prompt = "a prompt sent twice over"
    first, again = (client.completions.create(model="any", prompt=prompt, max_tokens=8) for _ in range(2))
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].text == first.choices[0].text


def test_a_long_prompt_is_tokenized_without_holding_up_other_requests(server):
    """A ~1 MB prompt takes seconds to tokenize; /health answers meanwhile
    (had the tokenizing blocked the event loop, one /health would wait for
    about all of it)."""
    big = {"prompt": "hello world " * 90_000, "max_tokens": 4}
    done = []
    sender = threading.Thread(target=lambda: done.append(post(server, "/v1/completions", big)))
    tic = time.monotonic()
    sender.start()
    waits = []
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        while sender.is_alive():
            asked = time.monotonic()
            assert http.get("/health").status_code == 200
            waits.append(time.monotonic() - asked)
    sender.join()
    took = time.monotonic() - tic
    assert done[0].status_code == 400 and "over this model's context" in done[0].json()["error"]["message"]
    assert len(waits) > 5 and max(waits) < took / 2, (max(waits), len(waits), took)


def test_thinking_mode_per_request_reaches_the_template(client):
    messages = [{"role": "user", "content": "hello"}]
    for body in ({"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": True}}):
        reply = client.chat.completions.create(model="any", messages=messages, max_tokens=4, extra_body=body)
        assert reply.choices[0].finish_reason == "length"


CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/v1/chat/completions", b'{"messages": [', 400, "not valid JSON"),
        ("/v1/chat/completions", b'[1, 2]', 400, "must be a JSON object"),
        ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages: Field required"),
        ("/v1/chat/completions", CHAT | {"n": 2}, 400, "n=2 is not supported"),
        ("/v1/chat/completions", CHAT | {"temperature": -0.5}, 400, "temperature"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
         "temperature: Input should be a finite number"),
        ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', 400, "top_p: Input should be a finite number"),
        ("/v1/chat/completions", CHAT | {"logprobs": "yes"}, 400, "logprobs: Input should be a valid boolean"),
        ("/v1/completions", {"prompt": "hi", "stream": "no"}, 400, "stream: Input should be a valid boolean"),
        ("/v1/chat/completions", CHAT | {"tools": [{"type": "web_search"}]}, 400,
         "tools[0]: tool type 'web_search' is not supported; only function tools"),
        ("/v1/chat/completions", CHAT | {"tools": [{"type": "function", "name": "f"}]}, 400,
         "tools[0].function: Field required"),
        ("/v1/chat/completions", CHAT | {"tools": [{"type": "function", "function": {"parameters": {}}}]}, 400,
         "tools[0].function.name: Field required"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
         "messages[0].content[0].text: Field required"),
        ("/v1/chat/completions", CHAT | {"top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions", CHAT | {"max_tokens": MAX_TOKENS_LIMIT + 1}, 400, "above this server's limit"),
        ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, 400, "top_logprobs needs logprobs: true"),
        ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": -1}, 400, "logprobs"),
        ("/v1/chat/completions", CHAT | {"logit_bias": {"99999": 1}}, 400, "logit_bias token id must be below"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
         "messages[0].content[0].image_url: target"),  # a text-only target (tests/test_server_vision.py: images)
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
         "only text and image_url content parts"),
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        ("/v1/completions", {"prompt": "hello " * 4100, "max_tokens": 4}, 400, "context of 4096 tokens"),
        ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt is empty"),
        ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4}, 400, "one prompt per request"),
        ("/v1/completions", {"prompt": [1, 99999], "max_tokens": 4}, 400, "token ids must lie in [0,"),
        ("/v1/completions", b'{"prompt": "a\\udcffb", "max_tokens": 4}', 400, "prompt is not valid Unicode"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udcffb"}]}', 400,
         "messages[0].content is not valid Unicode"),
        ("/v1/completions", b'{"prompt": "ab", "stop": ["\\ud800"], "max_tokens": 4}', 400, "stop is not valid Unicode"),
        ("/v1/nothing", {}, 404, "Not Found"),
    ],
)
def test_bad_input_gets_an_openai_shaped_4xx(server, path, body, status, message):
    if isinstance(body, bytes):
        r = post(server, path, content=body, headers_extra={"Content-Type": "application/json"})
    else:
        r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert post(server, "/v1/chat/completions", CHAT).status_code == 200  # still serving


@pytest.mark.parametrize("key", [None, "wrong"])
def test_every_route_needs_the_api_key(server, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions")]:
        r = httpx.request(method, server + path, headers=headers, json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key=key or "x", max_retries=0).models.list()


def test_a_full_queue_answers_429_and_a_disconnect_frees_its_slot_at_once(server):
    """--max-concurrency 2, --max-queue 1: two requests decode, one waits, the
    next is refused; the clients hang up and their slots are free again."""
    long = {"prompt": "the quick brown fox", "max_tokens": MAX_TOKENS_LIMIT, "stream": True}
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=long) as first, \
                http.stream("POST", "/v1/completions", json=long) as second:
            lines = [first.iter_lines(), second.iter_lines()]  # kept: dropping one closes its connection
            for stream in lines:
                next(stream)  # both are decoding now
            with http.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200
                assert http.get("/health").json()["active"] == 3
                refused = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
                assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        deadline = time.monotonic() + 10
        while http.get("/health").json()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.get("/health").json()["active"] == 0
        assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    "options, message",
    [
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--max-queue", "-1"], "--max-queue must be >= 0"),
        (["--max-tokens-limit", "0"], "--max-tokens-limit must be positive"),
        (["--prefix-cache-gb", "-1"], "--prefix-cache-gb must be a finite number >= 0, got -1"),
        (["--draft", "somewhere"], "--draft needs --model"),
        (["--draft-vocab", "0"], "--draft-vocab must be positive"),
        (["--prefix-cache-gb", "nan"], "--prefix-cache-gb must be a finite number >= 0, got nan"),
        (["--prefix-cache-gb", "inf"], "--prefix-cache-gb must be a finite number >= 0, got inf"),
        (["--api-key", ""], "--api-key must not be empty"),
        (["--api-key", " key"], "--api-key must not be empty or begin or end with whitespace"),
    ],
)
def test_serve_options_are_checked_before_loading(options, message):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    # an address no machine has: were an option let through, serve stops there instead of serving
    result = CliRunner().invoke(app, ["serve", *options, "--host", "::zz"])
    assert result.exit_code == 1 and message in result.output
    assert result.output.count("\n") == 1  # one line, no traceback


@pytest.mark.parametrize("option, message", [
    (["--block-size", "1000"], "error: block_size"),
    (["--draft-vocab", "64"], "error: a reduced drafting vocabulary needs a ranking"),  # none beside the draft
])
def test_an_option_the_pair_cannot_take_stops_the_server_at_startup(pair_dirs, option, message):
    target, draft = pair_dirs
    result = subprocess.run(
        [sys.executable, "-m", "dflash_mlx", "serve", "--model", str(target), "--draft", str(draft),
         "--port", str(free_port()), *option],
        capture_output=True, text=True, timeout=120, env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 1 and message in result.stderr
