"""Images on ``dflash-mlx serve`` (docs/vision.md, docs/serve.md): one real
server over the tiny Qwen3.5 multimodal pair of test_vision_checkpoints.py,
sent OpenAI ``image_url`` parts (data URLs and URLs of a loopback HTTP server
in this process), Anthropic ``image`` blocks and Responses ``input_image``
parts; each greedy reply equals the Python API's for the same prompt and image.
(A text-only target's 400 is in test_server.py, test_server_anthropic.py and
test_server_responses.py, whose servers have none.)"""

import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import pytest
from test_server import KEY, client, free_port, post, running_server  # noqa: F401 (client: over this module's server)
from test_vision_checkpoints import image_messages, picture, qwen_vision  # noqa: F401 (a fixture)

from dflash_mlx import generate, load, load_draft
from dflash_mlx.chat import template_ids

TEXT = "what is in the picture"
TOKENS = 12
LATER = [{"role": "assistant", "content": "a picture"}, {"role": "user", "content": "and its colours?"}]


def png(seed: int) -> bytes:
    out = io.BytesIO()
    picture(seed).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat_parts(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": TEXT}]}]


@pytest.fixture(scope="module")
def files():
    """A loopback HTTP server of this process: path -> the bytes it serves."""
    served = {"/one.png": png(1), "/huge.png": bytes(20 * 1024 * 1024 + 1)}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = served.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(qwen_vision, tmp_path_factory):  # noqa: F811
    with running_server(tmp_path_factory.mktemp("server"), *qwen_vision, "--api-key", KEY,
                        "--max-tokens-limit", "256") as (url, _):
        yield url


@pytest.fixture(scope="module")
def want(qwen_vision):  # noqa: F811
    """The Python API's greedy reply (cold: no cache) to TEXT after the image
    of ``seed``, or to that chat with the ``LATER`` turns, memoised."""
    model, tokenizer = load(str(qwen_vision[0]))
    draft = load_draft(str(qwen_vision[1]))
    replies = {}

    def reply(seed: int, later: bool = False):
        if (seed, later) not in replies:
            ids = template_ids(tokenizer, image_messages(TEXT, 1) + (LATER if later else []))
            replies[seed, later] = generate(model, draft, tokenizer, ids, max_tokens=TOKENS, images=[png(seed)])
        return replies[seed, later]

    return reply


def test_a_data_url_or_a_loopback_url_image_equals_the_python_api(client, files, want):
    for url in (data_url(png(1)), files + "/one.png"):
        reply = client.chat.completions.create(model="any", messages=chat_parts(url), max_tokens=TOKENS)
        assert reply.choices[0].message.content == want(1).text
        assert reply.usage.prompt_tokens == want(1).prompt_tokens  # the image's rows included
    stream = client.chat.completions.create(model="any", messages=chat_parts(data_url(png(1))),
                                            max_tokens=TOKENS, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want(1).text


def test_the_same_image_reuses_the_prefix_cache_and_another_image_never_does(client, want):
    """A (TEXT and image 1), then B (A with a later turn): B resumes A's caches,
    image rows included; C (TEXT and image 2, of the same size) reuses none of them."""
    assert want(1).text != want(2).text

    def ask(seed: int, later: list = ()):
        reply = client.chat.completions.create(model="any", messages=chat_parts(data_url(png(seed))) + list(later),
                                               max_tokens=TOKENS)
        return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens

    assert ask(1)[0] == want(1).text
    text, cached = ask(1, LATER)
    assert text == want(1, later=True).text and cached == want(1).prompt_tokens - 1  # all of A's prompt but its last
    assert ask(2) == (want(2).text, 0)  # the hybrid target keeps no checkpoint in the few tokens before the image


def test_an_image_request_waits_for_the_batch_s_rows_and_both_replies_are_right(server, client, want):
    """The batch takes no images: one sent while a text reply decodes runs alone after it."""
    text = {}
    writer = threading.Thread(target=lambda: text.update(reply=client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "tell a long story"}], max_tokens=256)))
    writer.start()
    deadline = time.monotonic() + 60
    while httpx.get(server + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()["rows"] < 1:
        assert time.monotonic() < deadline and writer.is_alive()
        time.sleep(0.05)
    reply = client.chat.completions.create(model="any", messages=chat_parts(data_url(png(1))), max_tokens=TOKENS)
    writer.join()
    assert reply.choices[0].message.content == want(1).text
    assert text["reply"].usage.completion_tokens == 256 or text["reply"].choices[0].finish_reason == "stop"


def test_an_anthropic_image_block_and_a_responses_input_image_equal_the_python_api(server, client, files, want):
    messages = anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60).messages
    for source in ({"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(2)).decode()},
                   {"type": "url", "url": files + "/one.png"}):
        reply = messages.create(model="any", max_tokens=TOKENS, messages=[{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": TEXT}]}])
        assert reply.content[0].text == want(2 if source["type"] == "base64" else 1).text
    reply = client.responses.create(model="any", max_output_tokens=TOKENS, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(png(2))}, {"type": "input_text", "text": TEXT}]}])
    assert reply.output_text == want(2).text


@pytest.mark.parametrize("route, part, param, says", [
    ("chat", data_url(b"not an image"), "messages[0].content[0].image_url", "not an image PIL can read"),
    ("chat", "{files}/huge.png", "messages[0].content[0].image_url", "larger than 20 MB"),
    ("chat", "{files}/missing.png", "messages[0].content[0].image_url", "cannot fetch image"),
    ("chat", "{closed}/x.png", "messages[0].content[0].image_url", "cannot fetch image"),
    ("chat", "/etc/passwd", "messages[0].content[0].image_url", "must be a data URL"),
    ("chat", None, "messages[0].content[0].image_url.url", "Field required"),
    ("anthropic", {"type": "base64", "data": "bm90IGFuIGltYWdl"}, "messages[0].content[0].source", "not an image"),
    ("anthropic", {"type": "file", "file_id": "f"}, "messages[0].content[0].source", "must be {type: base64"),
    ("responses", "{files}/missing.png", "input[0].content[0].image_url", "cannot fetch image"),
])
def test_a_bad_image_part_is_a_400_naming_it(server, files, route, part, param, says):
    if isinstance(part, str):  # a URL of the loopback server, or of a port nobody listens on
        part = part.format(files=files, closed=f"http://127.0.0.1:{free_port()}")
    if route == "chat":
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": part}}]}]}
        path = "/v1/chat/completions"
    elif route == "anthropic":
        body = {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": part}]}]}
        path = "/v1/messages"
    else:
        body = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": part}]}]}
        path = "/v1/responses"
    reply = post(server, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert says in error["message"] and "\n" not in error["message"], error
    assert error.get("param", param) == param and param in error["message"]
