"""Tool calling and thinking kept apart on ``dflash-mlx serve``: a real server
on a free 127.0.0.1 port serving a scripted target (tests/scripted.py: its
greedy reply is reasoning, an answer and a get_weather call, or a final answer
once a tool result is in the context), talked to with the ``openai`` client."""

import json

import httpx
import openai
import pytest
from checkpoints import write_draft
from mlx_lm.tool_parsers import json_tools
from scripted import ANSWER, CALL, CALL_JSON, FINAL, REASONING, write_scripted_target
from test_server import KEY, running_server

from dflash_mlx import load
from dflash_mlx.chat import template_ids
from dflash_mlx.server.parts import ReplySplitter

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]
REASONING_TEXT = REASONING.lstrip()  # the reply's first text loses its leading space


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = tmp_path_factory.mktemp("scripted-target")
    config = write_scripted_target(target)
    draft = tmp_path_factory.mktemp("scripted-draft")
    write_draft(draft, config, block_size=4)
    return target, draft


@pytest.fixture(scope="module")
def tokenizer(pair):
    return load(str(pair[0]))[1]


@pytest.fixture(scope="module")
def client(pair, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("server"), *pair, "--api-key", KEY, "--block-size", "4") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_the_wrapper_recognises_tools_and_thinking(tokenizer):
    assert tokenizer.has_tool_calling and tokenizer.tool_parser is json_tools.parse_tool_call
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert tokenizer.has_thinking and (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")


def test_a_tool_call_comes_back_parsed(client):
    reply = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, max_tokens=32)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ANSWER
    assert choice.message.model_extra["reasoning_content"] == REASONING_TEXT
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == CALL["name"] and json.loads(call.function.arguments) == CALL["arguments"]


def test_a_tool_call_streams_as_tool_calls_never_as_content(client):
    stream = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, max_tokens=32, stream=True)
    content, reasoning, calls, finish = "", "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert (content, reasoning, finish) == (ANSWER, REASONING_TEXT, "tool_calls")
    [call] = calls
    assert call.index == 0 and call.id and call.function.name == CALL["name"]
    assert json.loads(call.function.arguments) == CALL["arguments"]


def test_thinking_off_leaves_no_reasoning(client):
    reply = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, max_tokens=32,
                                           extra_body={"enable_thinking": False})
    message = reply.choices[0].message
    assert message.content == ANSWER.lstrip() and "reasoning_content" not in (message.model_extra or {})
    assert [c.function.name for c in message.tool_calls] == [CALL["name"]]


def test_a_tool_result_turn_renders_through_the_template(client, tokenizer):
    first = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, max_tokens=32)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": first.choices[0].message.content,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(model="any", messages=history, tools=TOOLS, max_tokens=32)
    # the template writes the call's arguments as an object (tojson), not the client's JSON string
    rendered = [dict(m) for m in history]
    rendered[1]["tool_calls"] = [{"id": call.id, "type": "function", "function": CALL}]
    ids = template_ids(tokenizer, rendered, tools=TOOLS)
    assert '"arguments": {"city": "Paris"}' in tokenizer.decode(ids)
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in tokenizer.decode(ids)
    assert second.usage.prompt_tokens == len(ids)
    # prefix reuse: the first turn's prompt up to the assistant's reply is not prefilled again
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == FINAL


def get_weather(city: str) -> dict:
    return {"city": city, "temperature": 21}


def _turn(client, messages: list, stream: bool):
    """One chat turn: (assistant message as the client sends it back, finish_reason, usage)."""
    kwargs = dict(model="any", messages=messages, tools=TOOLS, max_tokens=32)
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        message = reply.choices[0].message
        return message.model_dump(exclude_none=True), reply.choices[0].finish_reason, reply.usage
    content, calls, finish, usage = "", [], None, None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += [c.model_dump(exclude_none=True, exclude={"index"}) for c in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}, finish, usage


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop_calls_a_tool_and_answers(client, stream):
    """The loop an agent runs: ask, run each tool the model calls, send the
    results back, until the model answers; each turn reuses the one before."""
    messages, turns = list(ASK), []
    while len(turns) < 4:
        message, finish, usage = _turn(client, messages, stream)
        turns.append((finish, usage))
        messages.append({k: v for k, v in message.items() if k != "reasoning_content"})
        if finish != "tool_calls":
            break
        for call in message["tool_calls"]:
            result = get_weather(**json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
    assert [finish for finish, _ in turns] == ["tool_calls", "stop"]
    assert messages[-1]["content"] == FINAL and '"temperature": 21' in messages[-2]["content"]
    (_, first), (_, second) = turns
    # the second prompt is the first one, its reply and the result: all but the reply's tail is cached
    assert second.prompt_tokens > first.prompt_tokens + first.completion_tokens
    assert second.prompt_tokens_details.cached_tokens >= first.prompt_tokens - 1


@pytest.mark.parametrize("tools", [{}, {"tools": TOOLS, "tool_choice": "none"}])
def test_without_tools_a_call_stays_text(client, tools):
    reply = client.chat.completions.create(model="any", messages=ASK, max_tokens=32, **tools)
    message = reply.choices[0].message
    assert message.content == ANSWER + "<tool_call>" + CALL_JSON + "</tool_call>"
    assert not message.tool_calls and reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_is_returned_as_text(client, stream):
    # 3 reasoning tokens, </think>, 2 answer tokens, <tool_call>, then the first JSON piece
    kwargs = dict(model="any", messages=ASK, tools=TOOLS, max_tokens=8)
    want = ANSWER + '<tool_call>{"name":"get_weather",'
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (want, None, "length")
        return
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert not any(c.choices[0].delta.tool_calls for c in chunks) and chunks[-1].choices[0].finish_reason == "length"


def test_bad_tool_json_is_returned_as_text(tokenizer):
    ids = template_ids(tokenizer, ASK, tools=TOOLS)
    splitter = ReplySplitter(tokenizer, ids, TOOLS)
    text = 'plan</think>ok<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    parts = splitter.feed(text[:20]) + splitter.feed(text[20:]) + splitter.finish()
    assert (parts.reasoning, parts.tool_calls, splitter.calls) == ("plan", [], 0)
    assert parts.content == 'ok<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'


def test_tools_for_a_model_without_tool_calling_are_a_400(tmp_path_factory):
    target = tmp_path_factory.mktemp("plain-target")
    config = write_scripted_target(target, tools=False)
    draft = tmp_path_factory.mktemp("plain-draft")
    write_draft(draft, config, block_size=4)
    with running_server(tmp_path_factory.mktemp("server"), target, draft, "--api-key", KEY,
                        "--block-size", "4") as (url, _):
        body = {"messages": ASK, "tools": TOOLS}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "tools" and "does not support tool calling" in error["message"]
        del body["tools"]
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


def test_a_streamed_tool_call_reply_carries_every_token_s_logprobs(client):
    """Tokens whose text is held back (inside the call) bring their log-probabilities with a later chunk."""
    chunks = list(client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, max_tokens=32,
                                                 logprobs=True, stream=True,
                                                 stream_options={"include_usage": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens
    assert "".join(e.token for e in entries).lstrip() == REASONING_TEXT + "</think>" + ANSWER + "<tool_call>" \
        + CALL_JSON + "</tool_call>"
    assert all(e.logprob > -0.01 for e in entries)  # the scripted reply is the target's near-certain choice
