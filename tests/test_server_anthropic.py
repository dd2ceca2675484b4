"""Anthropic's Messages API on ``dflash-mlx serve``: a real server on a free
127.0.0.1 port serving the scripted target of tests/scripted.py (its greedy
reply is reasoning, an answer and a get_weather call, or a final answer once a
tool result is in the context), talked to with the official ``anthropic``
client, compared with the ``openai`` client's replies for the same conversation."""

import asyncio
import json

import anthropic
import httpx
import openai
import pytest
from scripted import ANSWER, CALL, CALL_JSON, FINAL
from test_server import KEY, running_server
from test_server_tools import ASK, REASONING_TEXT, TOOLS, get_weather, pair, tokenizer  # noqa: F401 (fixtures)

from dflash_mlx.chat import template_ids
from dflash_mlx.server import engine as eng
from dflash_mlx.server.anthropic import MessageReply, server_sent_events
from dflash_mlx.server.parts import ReplySplitter

TOOL = {"name": "get_weather", "description": "the weather in a city",
        "input_schema": TOOLS[0]["function"]["parameters"]}
CALLED = ANSWER + "<tool_call>" + CALL_JSON + "</tool_call>"  # the reply's text when no tool is offered


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):  # noqa: F811
    with running_server(tmp_path_factory.mktemp("server"), *pair, "--api-key", KEY, "--block-size", "4") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _input_tokens(usage) -> int:
    """The whole prompt: Anthropic counts the tokens read from the cache apart."""
    return usage.input_tokens + usage.cache_read_input_tokens


def test_text_and_thinking_equal_the_chat_routes_reply(client, chat):
    reply = client.messages.create(model="any", max_tokens=32, messages=ASK)
    same = chat.chat.completions.create(model="any", max_tokens=32, messages=ASK)
    assert (reply.type, reply.role, reply.id[:4]) == ("message", "assistant", "msg_")
    thinking, text = reply.content
    assert (thinking.type, thinking.signature, text.type) == ("thinking", "", "text")
    assert thinking.thinking == same.choices[0].message.model_extra["reasoning_content"] == REASONING_TEXT
    assert text.text == same.choices[0].message.content == CALLED
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    assert _input_tokens(reply.usage) == same.usage.prompt_tokens
    assert reply.usage.output_tokens == same.usage.completion_tokens
    # how DFlash served it, as the chat route says
    assert set(reply.usage.model_extra) == {"cycles", "tokens_per_cycle", "block_sizes", "decoding", "cache_tier"}
    assert reply.usage.model_extra["decoding"] == same.usage.model_extra["decoding"] == "speculative"
    assert set(reply.usage.model_extra["block_sizes"]) <= {"1", "4"}


@pytest.mark.parametrize("system", ["be brief", [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]])
def test_the_system_prompt_goes_first(client, tokenizer, system):  # noqa: F811
    ids = template_ids(tokenizer, [{"role": "system", "content": "be brief"}] + ASK)
    assert client.messages.count_tokens(model="any", system=system, messages=ASK).input_tokens == len(ids)
    reply = client.messages.create(model="any", max_tokens=32, system=system, messages=ASK)
    assert _input_tokens(reply.usage) == len(ids) and reply.content[-1].text == CALLED


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_reply_and_is_named(client, stream):
    kwargs = dict(model="any", max_tokens=32, messages=ASK, stop_sequences=["nowhere", " world"])
    reply = _message(client, kwargs, stream)
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", " world")
    assert [b.type for b in reply.content] == ["thinking", "text"] and reply.content[1].text == " hello"


def test_max_tokens_cuts_the_reply(client):
    # 3 reasoning tokens, </think>, then the answer's first token
    reply = client.messages.create(model="any", max_tokens=5, messages=ASK)
    assert (reply.stop_reason, reply.usage.output_tokens) == ("max_tokens", 5)
    assert [(b.type, getattr(b, "text", None)) for b in reply.content] == [("thinking", None), ("text", " hello")]


def test_sampling_fields_reach_the_sampler(client):
    """The client no longer has sampling arguments; older clients send them in the body.
    At temperature 50 the scripted target's next token is nearly uniform over the
    vocabulary, unless top_k or top_p keep only its best token."""
    ask = dict(model="any", max_tokens=16, messages=ASK)
    greedy = client.messages.create(**ask).content
    for narrow in ({"top_k": 1}, {"top_p": 1e-4}):
        assert client.messages.create(**ask, extra_body={"temperature": 50} | narrow).content == greedy
    assert client.messages.create(**ask, extra_body={"temperature": 50}).content != greedy


def test_thinking_switches_the_templates_thinking(client):
    on = client.messages.create(model="any", max_tokens=32, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in on.content] == ["thinking", "text"] and on.content[0].thinking == REASONING_TEXT
    off = client.messages.create(model="any", max_tokens=32, messages=ASK, tools=[TOOL],
                                 thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text", "tool_use"] and off.content[0].text == ANSWER.lstrip()


def _as_chat(call_id: str, arguments) -> list[dict]:
    """The conversation of the tool use turn test in OpenAI's form."""
    call = {"id": call_id, "type": "function", "function": {"name": CALL["name"], "arguments": arguments}}
    return ASK + [{"role": "assistant", "content": ANSWER, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'}]


def test_a_tool_use_turn_renders_as_the_chat_routes_tool_call(client, chat, tokenizer):  # noqa: F811
    first = client.messages.create(model="any", max_tokens=32, messages=ASK, tools=[TOOL])
    thinking, text, call = first.content
    assert (call.type, call.name, call.input, call.id[:6]) == ("tool_use", CALL["name"], CALL["arguments"], "toolu_")
    assert first.stop_reason == "tool_use" and text.text == ANSWER
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 21}'}]},
    ]
    ids = template_ids(tokenizer, _as_chat(call.id, CALL["arguments"]), tools=TOOLS)
    assert client.messages.count_tokens(model="any", messages=history, tools=[TOOL]).input_tokens == len(ids)
    second = client.messages.create(model="any", max_tokens=32, messages=history, tools=[TOOL])
    # OpenAI clients send the arguments as a JSON string; the template is handed an object either way
    same = chat.chat.completions.create(model="any", max_tokens=32, tools=TOOLS,
                                        messages=_as_chat(call.id, json.dumps(CALL["arguments"])))
    assert _input_tokens(second.usage) == same.usage.prompt_tokens == len(ids)
    assert second.content[-1].text == same.choices[0].message.content == FINAL
    assert second.stop_reason == "end_turn"


@pytest.mark.parametrize("content", ['{"temperature": 21}', [{"type": "text", "text": '{"temperature": 21}'}]])
def test_a_tool_result_and_text_blocks_count_as_the_chat_route_renders_them(client, tokenizer, content):  # noqa: F811
    history = ASK + [
        {"role": "assistant", "content": [{"type": "text", "text": ANSWER},
                                          {"type": "tool_use", "id": "toolu_1", "name": CALL["name"],
                                           "input": CALL["arguments"]}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content},
                                     {"type": "text", "text": "and "}, {"type": "text", "text": "tomorrow?"}]},
    ]
    as_chat = _as_chat("toolu_1", CALL["arguments"]) + [{"role": "user", "content": "and tomorrow?"}]
    ids = template_ids(tokenizer, as_chat, tools=TOOLS)
    assert client.messages.count_tokens(model="any", messages=history, tools=[TOOL]).input_tokens == len(ids)


def test_tool_choice_none_reads_no_call(client):
    reply = client.messages.create(model="any", max_tokens=32, messages=ASK, tools=[TOOL],
                                   tool_choice={"type": "none"})
    assert [b.type for b in reply.content] == ["thinking", "text"] and reply.content[1].text == CALLED
    assert reply.stop_reason == "end_turn"


def _message(client, kwargs: dict, stream: bool):
    if not stream:
        return client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as events:
        return events.get_final_message()


@pytest.mark.parametrize("kwargs", [{}, {"tools": [TOOL]}, {"max_tokens": 5}])
def test_a_stream_assembles_into_the_same_message(client, kwargs):
    kwargs = {"model": "any", "max_tokens": 32, "messages": ASK} | kwargs
    whole, streamed = _message(client, kwargs, False), _message(client, kwargs, True)

    def comparable(message):
        content = [b.model_dump(exclude={"id"}) for b in message.content]
        return message.model_dump(exclude={"id", "content", "usage"}), content, _input_tokens(message.usage)

    assert comparable(streamed) == comparable(whole)
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_the_stream_is_anthropics_event_sequence(server):
    body = {"model": "any", "max_tokens": 32, "messages": ASK, "tools": [TOOL], "stream": True}
    with httpx.stream("POST", server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [d["type"] for d in data] == names
    collapsed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    block = ["content_block_start", "content_block_delta", "content_block_stop"]
    assert collapsed == ["message_start", *block * 3, "message_delta", "message_stop"]
    deltas = {}
    for d in data:
        if d["type"] == "content_block_delta":
            deltas.setdefault(d["index"], []).append(d["delta"]["type"])
    assert set(deltas[0]) == {"thinking_delta", "signature_delta"} and deltas[0][-1] == "signature_delta"
    assert set(deltas[1]) == {"text_delta"} and deltas[2] == ["input_json_delta"]
    assert data[0]["message"]["stop_reason"] is None and data[-2]["delta"]["stop_reason"] == "tool_use"


def test_a_failure_mid_stream_is_an_error_event(tokenizer):  # noqa: F811
    ids = template_ids(tokenizer, ASK)

    async def events():
        job = eng.Job(eng.Request(prompt=ids, max_tokens=8, sampling={}), asyncio.get_running_loop())
        for event in (eng.Delta(" the"), eng.Failed(503, eng.SHUTTING_DOWN, "server_shutting_down")):
            job.events.put_nowait(event)
        return [e async for e in server_sent_events(job, MessageReply("m", ReplySplitter(tokenizer, ids, None), 9))]

    sent = asyncio.run(events())
    assert [e["event"] for e in sent] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert json.loads(sent[2]["data"])["delta"] == {"type": "thinking_delta", "thinking": " the"}
    error = {"type": "overloaded_error", "message": eng.SHUTTING_DOWN}
    assert json.loads(sent[-1]["data"]) == {"type": "error", "error": error}


def get_weather_result(call) -> dict:
    return {"type": "tool_result", "tool_use_id": call.id, "content": json.dumps(get_weather(**call.input))}


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop_calls_a_tool_and_answers(client, stream):
    """The loop an agent runs: ask, run each tool the model calls, send the
    results back, until the model answers; each turn reuses the one before."""
    messages, replies = list(ASK), []
    while len(replies) < 4:
        reply = _message(client, dict(model="any", max_tokens=32, messages=messages, tools=[TOOL]), stream)
        replies.append(reply)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        if reply.stop_reason != "tool_use":
            break
        messages.append({"role": "user", "content": [get_weather_result(b) for b in reply.content
                                                     if b.type == "tool_use"]})
    assert [r.stop_reason for r in replies] == ["tool_use", "end_turn"]
    first, second = replies
    assert second.content[-1].text == FINAL and '"temperature": 21' in messages[-2]["content"][0]["content"]
    # the second prompt is the first one, its reply and the result: all but the reply's tail is cached
    assert second.usage.cache_read_input_tokens >= _input_tokens(first.usage) - 1
    assert _input_tokens(second.usage) > _input_tokens(first.usage) + first.usage.output_tokens


def test_auth_takes_x_api_key_or_bearer(server):
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="any", max_tokens=8, messages=ASK)
    assert caught.value.status_code == 401 and caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server, api_key=None, auth_token=KEY, max_retries=0, timeout=60)
    assert bearer.messages.create(model="any", max_tokens=8, messages=ASK).stop_reason == "max_tokens"
    # the OpenAI routes take either header too, and keep their own error shape
    assert httpx.get(server + "/v1/models", headers={"x-api-key": KEY}, timeout=60).status_code == 200
    assert httpx.get(server + "/v1/models", timeout=60).json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("body, status, says", [
    ({"model": "any", "messages": ASK}, 400, "max_tokens: Field required"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "aGk="}}]}]}, 400,
     "messages[0].content[0].source: target"),  # a text-only target (tests/test_server_vision.py: images)
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
     "messages[0].content[0]: content blocks of type 'document' are not supported"),
    ({"max_tokens": 8, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "tool type 'web_search_20250305' is not supported"),
    ({"max_tokens": 8, "messages": ASK, "tools": [{"name": "get_weather"}]}, 400,
     "tools[0].input_schema: Field required"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages[0].content[0].text: Field required"),
    ({"max_tokens": 8, "system": [{"type": "text"}], "messages": ASK}, 400, "system[0].text: Field required"),
    ({"max_tokens": 8, "messages": ASK, "stream": "yes"}, 400, "stream: Input should be a valid boolean"),
    ('{"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "temperature: Input should be a finite number"),
    ('{"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udcff"}]}]}', 400,
     "messages[0].content[0].text is not valid Unicode"),
    ({"max_tokens": 99999, "messages": ASK}, 400, "max_tokens 99999 is above this server's limit"),
    ({"max_tokens": 8, "messages": [{"role": "assistant", "content": "hi"}]}, 400, "the last message must be"),
    ("{not json", 400, "not valid JSON"),
    ({"max_tokens": 8, "messages": ASK}, 404, "Not Found: POST /v1/messages/nowhere"),
])
def test_a_bad_request_gets_an_anthropic_error(server, body, status, says):
    send = {"content": body} if isinstance(body, str) else {"json": body}
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    route = "/v1/messages" + ("/nowhere" if status == 404 else "")
    r = httpx.post(server + route, **send, headers=headers, timeout=60)
    assert r.status_code == status
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert error["error"]["type"] == kind and says in error["error"]["message"]


def test_the_client_raises_on_a_bad_request(client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="any", max_tokens=8, messages=ASK, extra_body={"top_p": 0})
    assert caught.value.body["error"]["type"] == "invalid_request_error" and "top_p" in caught.value.message
