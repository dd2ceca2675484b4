"""OpenAI's Responses API on ``dflash-mlx serve``: a real server on a free
127.0.0.1 port serving the scripted target of tests/scripted.py (its greedy
reply is reasoning, an answer and a get_weather call, or a final answer once a
tool result is in the context), talked to with the ``openai`` client's
``responses.create`` and raw HTTP, compared with the chat route's replies for
the same conversation."""

import json
import signal
import threading
import time

import httpx
import openai
import pytest
from scripted import ANSWER, CALL, CALL_JSON, FINAL
from test_server import KEY, running_server
from test_server_tools import ASK, REASONING_TEXT, TOOLS, pair, tokenizer  # noqa: F401 (fixtures)

from dflash_mlx.chat import template_ids

CALLED = ANSWER + "<tool_call>" + CALL_JSON + "</tool_call>"  # the reply's text when no tool is offered
WEATHER = {"type": "function", **TOOLS[0]["function"]}  # the Responses API's flat function tool
HEADERS = {"Authorization": f"Bearer {KEY}"}
# a request as Codex sends it: its instructions, a developer item, shell and update_plan functions, the
# freeform apply_patch tool (a Lark grammar), hosted tools it may add, encrypted reasoning asked for
PATCH_GRAMMAR = 'start: "*** Begin Patch" LF hunk+ "*** End Patch" LF?\nhunk: /(.+\\n)+/\n%import common.LF'
CODEX = {
    "model": "gpt-5-codex", "instructions": "You are Codex, a coding agent.",
    "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions instructions>sandbox: workspace-write"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK[0]["content"]}]},
    ],
    "tools": [
        {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                        "required": ["command"], "additionalProperties": False}},
        {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
         "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}},
        {"type": "web_search"}, {"type": "local_shell"}, {"type": "image_generation", "output_format": "png"},
        WEATHER,
    ],
    "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False, "stream": True, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "session-1",
    "text": {"verbosity": "medium"},
}
TEXT_EVENTS = ["response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done"]
REASONING_EVENTS = ["response.content_part.added", "response.reasoning_text.delta", "response.reasoning_text.done",
                    "response.content_part.done"]


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):  # noqa: F811
    with running_server(tmp_path_factory.mktemp("server"), *pair, "--api-key", KEY, "--block-size", "4",
                        "--max-tokens-limit", "64") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server: str, body: dict) -> httpx.Response:
    return httpx.post(server + "/v1/responses", json=body, headers=HEADERS, timeout=60)


def stream(server: str, body: dict) -> list[dict]:
    """Every event of a streamed response, its SSE name checked against its ``type``."""
    events = []
    with httpx.stream("POST", server + "/v1/responses", json=body | {"stream": True}, headers=HEADERS,
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                assert events[-1]["type"] == name
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def kinds(events: list[dict]) -> list[str]:
    """The event types in order, a run of deltas as one."""
    out = []
    for e in events:
        if not (e["type"].endswith(".delta") and out and out[-1] == e["type"]):
            out.append(e["type"])
    return out


def item(kind: str, *inner: str) -> list[str]:
    """One output item's events: added, ``inner`` ones, done."""
    return ["response.output_item.added", *inner, "response.output_item.done"]


@pytest.mark.parametrize("streamed", [False, True])
def test_text_and_reasoning_equal_the_chat_routes_reply(client, streamed):
    same = client.chat.completions.create(model="any", max_tokens=32, messages=ASK)
    if streamed:
        events = list(client.responses.create(model="any", input=ASK[0]["content"], max_output_tokens=32,
                                              stream=True))
        assert events[-1].type == "response.completed"
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == CALLED
        reply = events[-1].response
    else:
        reply = client.responses.create(model="any", input=ASK[0]["content"], max_output_tokens=32)
    assert reply.object == "response" and reply.status == "completed" and reply.id.startswith("resp_")
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING_TEXT
    assert REASONING_TEXT == same.choices[0].message.model_extra["reasoning_content"]
    assert message.type == "message" and message.status == "completed"
    assert reply.output_text == same.choices[0].message.content == CALLED
    assert reply.usage.input_tokens == same.usage.prompt_tokens
    assert reply.usage.output_tokens == same.usage.completion_tokens
    assert reply.usage.input_tokens_details.cached_tokens == reply.usage.input_tokens - 1  # the chat's prompt
    assert 0 < reply.usage.output_tokens_details.reasoning_tokens < reply.usage.output_tokens


def test_a_reply_cut_by_max_output_tokens_is_incomplete_and_still_completes(server):
    events = stream(server, {"input": ASK, "max_output_tokens": 6})
    assert events[-1]["type"] == "response.completed"
    done = events[-1]["response"]
    assert (done["status"], done["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert done["output"][-1]["status"] == "incomplete" and done["usage"]["output_tokens"] == 6


def test_reasoning_effort_none_turns_thinking_off(client):
    reply = client.responses.create(model="any", input=ASK, max_output_tokens=32, reasoning={"effort": "none"})
    assert [i.type for i in reply.output] == ["message"] and reply.output_text == CALLED.lstrip()
    assert reply.usage.output_tokens_details.reasoning_tokens == 0


def test_a_streamed_reply_comes_in_openais_event_order(server):
    events = stream(server, {"input": ASK, "max_output_tokens": 32})
    assert kinds(events) == ["response.created", "response.in_progress", *item("reasoning", *REASONING_EVENTS),
                             *item("message", *TEXT_EVENTS), "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    done = events[-1]["response"]
    assert [i["type"] for i in done["output"]] == ["reasoning", "message"]
    assert {e["item_id"] for e in events if e["type"] == "response.output_text.delta"} == {done["output"][1]["id"]}
    assert {e["output_index"] for e in events if e["type"] == "response.output_text.delta"} == {1}


@pytest.mark.parametrize("streamed", [False, True])
def test_a_tool_loop_over_the_responses_api(client, streamed):
    def turn(items):
        if not streamed:
            return client.responses.create(model="any", input=items, tools=[WEATHER], max_output_tokens=32)
        with client.responses.stream(model="any", input=items, tools=[WEATHER], max_output_tokens=32) as events:
            return events.get_final_response()

    first = turn(ASK)
    reasoning, message, call = first.output
    assert (reasoning.type, message.type, call.type) == ("reasoning", "message", "function_call")
    assert message.content[0].text == ANSWER
    assert call.name == CALL["name"] and json.loads(call.arguments) == CALL["arguments"] and call.call_id
    # the client sends the whole output back (reasoning included) and the tool's result
    history = ASK + [i.model_dump(exclude_none=True) for i in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    second = turn(history)
    assert second.output_text == FINAL and [i.type for i in second.output] == ["reasoning", "message"]
    # the prefix cache: the first turn's prompt is not prefilled again
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1


def test_a_codex_request_is_answered_with_codexs_event_sequence(server, tokenizer):  # noqa: F811
    events = stream(server, CODEX)
    assert kinds(events) == [
        "response.created", "response.in_progress", *item("reasoning", *REASONING_EVENTS),
        *item("message", *TEXT_EVENTS),
        *item("function_call", "response.function_call_arguments.delta", "response.function_call_arguments.done"),
        "response.completed",
    ]
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["store"] is False
    usage = done["usage"]
    assert set(usage) >= {"input_tokens", "output_tokens", "total_tokens", "input_tokens_details"}
    assert usage["input_tokens_details"]["cached_tokens"] >= 0
    call = done["output"][2]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "get_weather",
                                                                          CALL["arguments"])
    arguments = [e for e in events if e["type"].startswith("response.function_call_arguments")]
    assert arguments[0]["delta"] == arguments[1]["arguments"] == call["arguments"]
    # instructions and the developer item make one system message; apply_patch is a function of its input
    system = CODEX["instructions"] + "\n\n" + CODEX["input"][0]["content"][0]["text"]
    functions = [
        {"type": "function", "function": {k: v for k, v in CODEX["tools"][0].items() if k not in ("type", "strict")}},
        {"type": "function", "function": {"name": "apply_patch", "description": "Edit files with a patch",
                                          "parameters": {"type": "object", "required": ["input"], "properties": {
                                              "input": {"type": "string", "description": (
                                                  "raw text in this lark grammar, not JSON:\n" + PATCH_GRAMMAR)}}}}},
        TOOLS[0],
    ]
    conversation = [{"role": "system", "content": system}, {"role": "user", "content": "<environment_context>"}, *ASK]
    assert usage["input_tokens"] == len(template_ids(tokenizer, conversation, tools=functions))


def test_codexs_next_turn_takes_back_reasoning_calls_and_custom_tool_results(server, tokenizer):  # noqa: F811
    first = stream(server, CODEX)[-1]["response"]
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch\n"
    later = [{"type": "custom_tool_call", "call_id": "call_patch", "name": "apply_patch", "input": patch},
             {"type": "custom_tool_call_output", "call_id": "call_patch", "output": "Done!"}]
    results = [{"type": "function_call_output", "call_id": i["call_id"], "output": '{"temperature": 21}'}
               for i in first["output"] if i["type"] == "function_call"]
    events = stream(server, CODEX | {"input": CODEX["input"] + first["output"] + results + later})
    done = events[-1]["response"]
    assert done["status"] == "completed" and [i["type"] for i in done["output"]] == ["reasoning", "message"]
    assert done["output"][1]["content"][0]["text"] == FINAL
    # the custom call went to the template as a call of the function apply_patch with its input
    assert done["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] - 1
    text = tokenizer.decode(template_ids(tokenizer, [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_patch", "type": "function", "function": {"name": "apply_patch", "arguments": {
                "input": patch}}}]}]))
    assert json.dumps({"input": patch}) in text


def test_a_custom_tools_call_comes_back_as_a_custom_tool_call(server):
    custom = {"type": "custom", "name": "get_weather", "description": "the weather in a city"}
    events = stream(server, {"input": ASK, "tools": [custom], "max_output_tokens": 32})
    assert kinds(events)[-5:] == [*item("custom_tool_call", "response.custom_tool_call_input.delta",
                                        "response.custom_tool_call_input.done"), "response.completed"]
    call = events[-1]["response"]["output"][-1]
    # the model wrote the call as a function's arguments, not {"input": ...}: passed on as written
    assert (call["type"], call["name"], json.loads(call["input"])) == ("custom_tool_call", "get_weather",
                                                                      CALL["arguments"])


def test_previous_response_id_continues_a_stored_response(client):
    first = client.responses.create(model="any", input=ASK, tools=[WEATHER], max_output_tokens=32, store=True)
    call = first.output[-1]
    second = client.responses.create(
        model="any", previous_response_id=first.id, tools=[WEATHER], max_output_tokens=32,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}])
    assert second.output_text == FINAL and second.previous_response_id == first.id
    unstored = client.responses.create(model="any", input=ASK, max_output_tokens=4, store=False)
    for unknown in (unstored.id, "resp_nowhere"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="any", input="hi", previous_response_id=unknown)
        assert e.value.body["param"] == "previous_response_id" and "store" in e.value.body["message"]


def test_json_output_and_logprobs_equal_the_chat_routes(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    reply = client.responses.create(
        model="any", input=ASK, max_output_tokens=48, top_logprobs=2, include=["message.output_text.logprobs"],
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    same = client.chat.completions.create(
        model="any", messages=ASK, max_tokens=48, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    assert reply.output_text.lstrip().startswith("{")  # held to the schema (cut off by max_output_tokens)
    assert reply.output_text == same.choices[0].message.content
    logprobs = reply.output[-1].content[0].logprobs
    assert [p.token for p in logprobs] == [p.token for p in same.choices[0].logprobs.content]
    assert [[t.token for t in p.top_logprobs] for p in logprobs] == [
        [t.token for t in p.top_logprobs] for p in same.choices[0].logprobs.content]
    assert all(len(p.top_logprobs) <= 2 for p in logprobs)  # fewer where the grammar rules the rest out


@pytest.mark.parametrize("body, param, message", [
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url", "target"),  # a text-only target (tests/test_server_vision.py: images)
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "input[0].content[0].type", "'input_file' are not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "'item_reference' are not supported"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "Field required"),
    ({"input": [{"type": "message", "role": "robot", "content": "hi"}]}, "input[0].role", "'robot'"),
    ({"input": []}, "input", "no user turn"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name", "Field required"),
    ({"input": "hi", "max_tokens": 4}, "max_tokens", "send max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 65}, "max_output_tokens", "max_output_tokens 65 is above"),
    ({"input": "hi", "text": {"format": {"type": "nonsense"}}}, "text.format", "'nonsense' is not supported"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments",
     "input[0].arguments is not valid JSON"),
    ({"input": "the quick brown fox " * 1200}, "input", "over this model's context of 4096 tokens"),
])
@pytest.mark.parametrize("streamed", [False, True])
def test_bad_input_is_a_400_naming_the_field(server, body, param, message, streamed):
    reply = post(server, body | {"stream": streamed})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_a_stream_that_fails_ends_with_response_failed(target_dirs, draft_dir, tmp_path):
    """The server shutting down mid-reply: the stream's last event is ``response.failed``."""
    events = []
    with running_server(tmp_path, target_dirs["qwen3_5"], draft_dir("qwen3_5", block_size=4),
                        "--max-tokens-limit", "4000") as (url, proc):
        def read():
            with httpx.stream("POST", url + "/v1/responses", timeout=60,
                              json={"input": "the quick brown fox", "max_output_tokens": 4000, "stream": True}) as r:
                events.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=10).json()["rows"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=30)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["sequence_number"] == len(events) - 1
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_shutting_down"
