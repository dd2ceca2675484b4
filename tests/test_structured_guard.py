"""A reply under ``response_format`` is one its grammar accepts, or it says
that it is not: a 400 naming ``response_format`` before decoding (a grammar
that can produce no value), or a finish reason other than "stop" ("length"
when ``max_tokens`` cut it, "error" with an ``error`` saying why when the
grammar went no further). Never free text, never an empty "stop".

The target's tokenizer here has a SentencePiece-style decoder llguidance
accepts and words with no space marker and no byte fallback, so it cannot
spell most of what a grammar may force: llguidance's shortcut for forced text
then allows ``<unk>``, which its own parser rejects."""

import json

import httpx
import mlx.core as mx
import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from mlx_lm import load as mlx_lm_load

from checkpoints import write_target
from dflash_mlx import batch_generate, generate, load_draft
from dflash_mlx.structured import constraint_for
from test_server import running_server

WORDS = ["<unk>", "<s>", "</s>", "{", "}", '"x"', ":", "today", "hello"]
VOCAB = 512  # the tiny llama's
SELF_REFERENCE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}  # unbounded recursion
ENDLESS = {"$ref": "#/$defs/a", "$defs": {"a": {  # every value holds another: none ends
    "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"], "additionalProperties": False}}}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def write_unspelling_tokenizer(path) -> None:
    """``tokenizer.json`` of ``WORDS``, fillers and ``<mask>`` (VOCAB ids), decoded as SentencePiece's."""
    vocab = WORDS + [f"w{i}" for i in range(VOCAB - len(WORDS) - 1)] + ["<mask>"]
    tok = Tokenizer(models.BPE({w: i for i, w in enumerate(vocab)}, [], unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<mask>"])
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("unspelling-target")
    write_target(path, "llama")
    write_unspelling_tokenizer(path)  # the chat template and special tokens' names stay
    return path


@pytest.fixture(scope="module")
def tokenizer(target):
    return PreTrainedTokenizerFast.from_pretrained(str(target))


@pytest.fixture(scope="module", params=[[], ["--max-concurrency", "1"]], ids=["batch", "alone"])
def server(request, target, draft_dir, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("server"), target, draft_dir("llama", block_size=4),
                        "--block-size", "4", *request.param) as (url, _):
        yield url


def request(response_format: dict, max_tokens: int, route: str = "/v1/chat/completions", **extra) -> dict:
    prompt = {"messages": [{"role": "user", "content": "today"}]} if "chat" in route else {"prompt": [7, 8]}
    return prompt | {"response_format": response_format, "max_tokens": max_tokens, **extra}


def ask(server, response_format: dict, max_tokens: int, route: str = "/v1/chat/completions"):
    return httpx.post(server + route, json=request(response_format, max_tokens, route), timeout=120)


@pytest.mark.parametrize("response_format, why", [
    (json_schema(SELF_REFERENCE), "llguidance failed"),
    (json_schema({"type": "array"}), "no token of this tokenizer"),  # "[" cannot be spelled: it was <unk><unk>...
    ({"type": "regex", "regex": "!today"}, "no token of this tokenizer"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_grammar_that_can_produce_no_value_is_a_400_before_decoding(server, response_format, why, route):
    r = ask(server, response_format, 8, route)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "\n" not in error["message"]
    assert error["message"].startswith("response_format: the grammar cannot produce any value") and why in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_goes_no_further_mid_reply_ends_with_an_error(server, stream):
    """After "today" the grammar forces "!", which no token spells: the reply
    ends there with "error", never "stop", and never goes on as free text."""
    body = request({"type": "regex", "regex": "today!"}, 16, stream=stream)
    if stream:
        with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=120) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        choice = chunks[-1]["choices"][0]
    else:
        choice = httpx.post(server + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
        content = choice["message"]["content"]
    assert content == "today" and choice["finish_reason"] == "error"
    assert choice["error"]["param"] == "response_format"
    assert choice["error"]["message"] == ("response_format: the reply stopped short of its grammar: "
                                          "no token of this tokenizer can continue it")


@pytest.mark.parametrize("response_format, max_tokens", [
    (json_schema(ENDLESS), 12),  # a schema that cannot terminate
    ({"type": "json_object"}, 2),  # a grammar max_tokens exhausts: no object is shorter than "{" "}" EOS
])
def test_a_reply_cut_by_max_tokens_says_length(server, response_format, max_tokens):
    r = ask(server, response_format, max_tokens)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and "error" not in choice
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def test_a_committed_token_outside_the_grammar_ends_the_reply(tokenizer):
    """The loop commits a token the grammar rejects: from then on only EOS
    is allowed, and the verdict says which token left the grammar."""
    constraint = constraint_for({"type": "regex", "regex": "today(today)*"}, tokenizer, VOCAB)
    assert constraint.verdict() is not None  # nothing yet: not a whole reply
    constraint.commit(mx.array([7]))
    assert constraint.verdict() is None and constraint.allowed([]).tolist()[7]
    constraint.commit(mx.array([8]))  # "hello"
    assert constraint.allowed([]).tolist() == [t == 2 for t in range(VOCAB)]
    assert constraint.verdict() == "response_format: the reply stopped short of its grammar: token 8 of the reply is outside the grammar"


def test_the_python_api_says_when_a_reply_stops_short_of_its_grammar(target, draft_dir):
    """``generate`` and ``batch_generate``: the same mid-reply dead end ends
    with finish_reason "error" and the verdict, not "stop"; a reply the grammar
    accepts whole still ends with "stop"."""
    model, tokenizer = mlx_lm_load(str(target))
    draft = load_draft(str(draft_dir("llama", block_size=4)))
    stuck, whole = {"type": "regex", "regex": "today!"}, {"type": "regex", "regex": "today"}
    reply = generate(model, draft, tokenizer, [7, 8], max_tokens=16, block_size=4, response_format=stuck)
    assert (reply.tokens, reply.finish_reason) == ([7], "error")
    assert reply.error == ("response_format: the reply stopped short of its grammar: "
                           "no token of this tokenizer can continue it")
    replies = batch_generate(model, draft, tokenizer, [[7, 8], [8, 7]], max_tokens=16, block_size=4,
                             sampling=[{"response_format": stuck}, {"response_format": whole}])
    assert [(r.tokens, r.finish_reason, r.error) for r in replies] == [
        ([7], "error", reply.error), ([7], "stop", None)]
