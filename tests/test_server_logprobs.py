"""What a reply says beside its text, against a real ``dflash-mlx serve`` with
the ``openai`` client: the target's log-probabilities of its tokens (equal to
mlx-lm's for the same tokens, greedy and sampled), and which engine served it
(``system_fingerprint``, the pair on ``/health`` and ``/v1/models``, the
block sizes and decoding in ``usage``)."""

from importlib import metadata

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm import load as mlx_lm_load
from test_logprobs import ATOL, mlx_lm_logprobs
from test_server import KEY, running_server

from dflash_mlx.chat import template_ids
from dflash_mlx.server.engine import Usage

FAMILY = "qwen3"
ASK = [{"role": "user", "content": "write a short story about a cat"}]


@pytest.fixture(scope="module")
def pair(target_dirs, draft_dir):
    return target_dirs[FAMILY], draft_dir(FAMILY, block_size=4)


@pytest.fixture(scope="module")
def model(pair):
    return mlx_lm_load(str(pair[0]))


@pytest.fixture(scope="module")
def url(pair, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("server"), *pair, "--api-key", KEY, "--block-size", "4") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def token_ids(tokenizer, texts: list[str]) -> list[int]:
    """The ids whose text alone is each of ``texts`` (the tiny vocabulary's texts are unique)."""
    by_text = {}
    for i in range(len(tokenizer.vocab)):
        by_text.setdefault(tokenizer.decode([i]), []).append(i)
    assert all(len(by_text[t]) == 1 for t in texts)
    return [by_text[t][0] for t in texts]


def check_against_mlx_lm(model, prompt: list[int], content: list, top: int) -> None:
    """Each entry's logprob and top alternatives equal mlx-lm's row at that position."""
    model, tokenizer = model
    tokens = token_ids(tokenizer, [e.token for e in content])
    want = mlx_lm_logprobs(model, prompt, tokens)
    for entry, token, row in zip(content, tokens, want):
        assert entry.bytes == list(entry.token.encode()) and abs(entry.logprob - row[token].item()) < ATOL
        assert len(entry.top_logprobs) == top
        best = mx.argsort(-row)[:top].tolist()
        assert token_ids(tokenizer, [t.token for t in entry.top_logprobs]) == best
        assert mx.allclose(mx.array([t.logprob for t in entry.top_logprobs]), row[mx.array(best)], atol=ATOL).item()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}])
def test_chat_logprobs_are_mlx_lm_s(client, model, sampling):
    reply = client.chat.completions.create(model="any", messages=ASK, max_tokens=12, logprobs=True,
                                           top_logprobs=3, **sampling)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 12
    assert "".join(e.token for e in content).lstrip() == reply.choices[0].message.content.lstrip()
    check_against_mlx_lm(model, template_ids(model[1], ASK), content, 3)


def test_streamed_chat_logprobs_are_those_of_the_whole_reply(client):
    kwargs = dict(model="any", messages=ASK, max_tokens=12, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [e for chunk in client.chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_mlx_lm_s(client, model, stream):
    reply = client.completions.create(model="any", prompt="the quick brown fox", max_tokens=10, logprobs=2,
                                      stream=stream)
    chunks = list(reply) if stream else [reply]
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = [t for lp in logprobs for t in lp.tokens]
    values = [v for lp in logprobs for v in lp.token_logprobs]
    offsets = [o for lp in logprobs for o in lp.text_offset]
    assert len(tokens) == 10 and offsets == [sum(map(len, tokens[:i])) for i in range(10)]
    top = [d for lp in logprobs for d in lp.top_logprobs]
    assert all(len(d) in (2, 3) and d[t] == v for d, t, v in zip(top, tokens, values))
    model, tokenizer = model
    ids = token_ids(tokenizer, tokens)
    want = mlx_lm_logprobs(model, tokenizer.encode("the quick brown fox"), ids)
    assert mx.allclose(mx.array(values), want[mx.arange(10), mx.array(ids)], atol=ATOL).item()


def test_no_logprobs_unless_asked(client):
    reply = client.chat.completions.create(model="any", messages=ASK, max_tokens=4)
    assert reply.choices[0].logprobs is None


def test_top_logprobs_without_logprobs_is_a_400(url):
    body = {"messages": ASK, "top_logprobs": 2}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_replies_name_the_engine_and_the_pair(client, url, pair):
    reply = client.chat.completions.create(model="any", messages=ASK, max_tokens=12)
    version = metadata.version("dflash-mlx")
    assert reply.system_fingerprint == f"dflash-mlx-{version} target={pair[0]} draft={pair[1]}"
    chunks = list(client.completions.create(model="any", prompt="hello", max_tokens=4, stream=True))
    assert {c.system_fingerprint for c in chunks} == {reply.system_fingerprint}
    headers = {"Authorization": f"Bearer {KEY}"}
    described = {"target": str(pair[0]), "draft": str(pair[1]), "block_size": 4, "draft_vocab": None,
                 "draft_dtype": "float32", "dflash_mlx": version}
    assert httpx.get(url + "/health", headers=headers, timeout=60).json()["pair"] == described
    [listed] = httpx.get(url + "/v1/models", headers=headers, timeout=60).json()["data"]
    assert listed["pair"] == described


def test_usage_says_how_the_reply_was_decoded(client):
    usage = client.chat.completions.create(model="any", messages=ASK, max_tokens=12).usage.model_extra
    blocks = usage["block_sizes"]  # 4, or the tokens left when fewer
    assert sum(blocks.values()) == usage["cycles"] and usage["decoding"] == "speculative"
    assert "4" in blocks and all(1 <= int(b) <= 4 for b in blocks)


@pytest.mark.parametrize("blocks, decoding", [({1: 5}, "plain"), ({1: 3, 4: 2}, "speculative"), ({}, "plain")])
def test_a_reply_of_plain_steps_says_so(blocks, decoding):
    """Under --block-size auto a cycle may be a plain target step (b = 1); a
    reply made only of those was decoded as the target alone would."""
    usage = Usage(prompt_tokens=3, completion_tokens=6, cycles=sum(blocks.values()), blocks=blocks).to_dict()
    assert usage["decoding"] == decoding and usage["block_sizes"] == {str(b): n for b, n in sorted(blocks.items())}
