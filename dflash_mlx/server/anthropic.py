"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A request is turned into the chat request the OpenAI route would get for the
same conversation (system, turns, ``tool_use`` blocks as an assistant's tool
calls, ``tool_result`` blocks as tool messages, ``image`` blocks as image
parts, tools as function schemas), so
it goes through the same chat template, engine, prefix cache and reply
splitter. The reply comes back as Anthropic's message: ``thinking``, ``text``
and ``tool_use`` content blocks, streamed as Anthropic's events.
"""

import asyncio
import json
import uuid
from typing import Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field, StrictBool
from sse_starlette import EventSourceResponse

from . import engine as eng
from . import images
from .errors import APIError
from .parts import Parts, ReplySplitter
from .prompts import chat_ids, unicode_text
from .schemas import Body, ChatRequest, tool_problem

ROUTE = "/v1/messages"
DFLASH_USAGE = ("cycles", "tokens_per_cycle", "block_sizes", "decoding")  # how DFlash served it, as on the chat route
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def speaks_anthropic(path: str) -> bool:
    """Whether ``path`` is one of this module's routes (errors there take Anthropic's shape)."""
    return path == ROUTE or path.startswith(ROUTE + "/")


def error_body(error: APIError) -> dict:
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: APIError) -> JSONResponse:
    """``{"type": "error", "error": {"type", "message"}}`` with the error's status."""
    return JSONResponse(error_body(error), status_code=error.status)


class Block(Body):
    """A content block; which fields it needs depends on its ``type``."""

    type: str
    text: Optional[str] = None  # text
    id: Optional[str] = None  # tool_use
    name: Optional[str] = None
    input: Optional[dict] = None
    tool_use_id: Optional[str] = None  # tool_result
    content: Union[str, list["Block"], None] = None
    source: Optional[dict] = None  # image: {type: base64, media_type, data} or {type: url, url}


class Turn(Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(Body):
    name: str
    description: Optional[str] = None
    input_schema: Optional[dict] = None  # required of custom tools; server tools have none
    type: Optional[str] = None  # "custom" or absent; Anthropic's server tools cannot run here


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None


class Thinking(Body):
    """``enabled`` and ``disabled`` switch the template's thinking; the others
    (the model decides) keep the template's default. The budget is not enforced."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[int] = Field(None, ge=1)


class Conversation(Body):
    """What ``count_tokens`` takes: the prompt's parts."""

    model: Optional[str] = None
    messages: list[Turn] = Field(min_length=1)
    system: Union[str, list[Block], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[dict] = None

    def chat(self, **sampling) -> ChatRequest:
        """The OpenAI chat request for the same conversation."""
        messages = [{"role": "system", "content": _text(self.system, "system")}] if self.system else []
        for i, turn in enumerate(self.messages):
            messages += _messages(turn, f"messages[{i}]")
        if self.messages[-1].role != "user":
            raise APIError(400, "the last message must be the user's: continuing a partial assistant "
                                "reply is not supported", f"messages[{len(self.messages) - 1}]")
        if (self.output_config or {}).get("format") is not None:
            raise APIError(400, "output_config.format (structured output) is not supported", "output_config.format")
        switch = {"enabled": True, "disabled": False}
        thinking = None if self.thinking is None else switch.get(self.thinking.type)
        return ChatRequest(messages=messages, tools=self._tools(), tool_choice=self._tool_choice(),
                           enable_thinking=thinking, **sampling)

    def image_sources(self) -> list[images.Source]:
        """(field, URL) of each image block, in the prompt's order."""
        return [(f"messages[{i}].content[{j}].source", _image_url(block, f"messages[{i}].content[{j}]"))
                for i, turn in enumerate(self.messages) for j, block in enumerate(turn.content)
                if not isinstance(turn.content, str) and block.type == "image"]

    def _tools(self) -> Optional[list[dict]]:
        if not self.tools:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            problem = tool_problem(i, tool.type, (None, "custom"), "custom tools (name, description, input_schema)",
                                   {"input_schema": tool.input_schema})
            if problem:
                raise APIError(400, problem[1], problem[0])
            function = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        return tools

    def _tool_choice(self) -> Union[str, dict, None]:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice: type 'tool' needs the tool's name", "tool_choice.name")
            return {"type": "function", "function": {"name": choice.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


class MessagesRequest(Conversation):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: Optional[list[str]] = None
    temperature: float = Field(0.0, ge=0.0)  # greedy unless asked, as the OpenAI routes
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stream: StrictBool = False

    def chat(self) -> ChatRequest:
        stop = [unicode_text(s, f"stop_sequences[{k}]") for k, s in enumerate(self.stop_sequences or [])]
        return super().chat(max_tokens=self.max_tokens, stop=stop, temperature=self.temperature,
                            top_p=self.top_p, top_k=self.top_k, stream=self.stream)


def _text(content: Union[str, list[Block], None], where: str) -> str:
    """A string, or text blocks joined (as the OpenAI route joins text parts);
    valid Unicode (a 400 naming ``where`` otherwise)."""
    if content is None or isinstance(content, str):
        return unicode_text(content or "", where)
    for j, block in enumerate(content):
        if block.type != "text":
            raise APIError(400, f"{where}[{j}]: content blocks of type '{block.type}' are not supported "
                                "here; only text", f"{where}[{j}].type")
    return unicode_text("".join(_block_text(block, f"{where}[{j}]") for j, block in enumerate(content)), where)


def _block_text(block: Block, at: str) -> str:
    """A text block's text (a 400 naming ``at.text`` when it has none)."""
    if block.text is None:
        raise APIError(400, f"{at}.text: Field required", f"{at}.text")
    return block.text


def _image_url(block: Block, at: str) -> str:
    """An image block's source as a URL: base64 data as a data URL."""
    source = block.source or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise APIError(400, f"{at}.source must be {{type: base64, media_type, data}} or {{type: url, url}}",
                   f"{at}.source")


def _user(parts: list[dict]) -> dict:
    """The user's message of text and image parts: the text joined where it holds no image."""
    if any(part["type"] == "image_url" for part in parts):
        return {"role": "user", "content": parts}
    return {"role": "user", "content": "".join(part["text"] for part in parts)}


def _messages(turn: Turn, where: str) -> list[dict]:
    """One turn as OpenAI chat messages: an assistant's text and tool calls
    (its thinking blocks are dropped, as OpenAI clients drop reasoning), or
    the user's tool results (tool messages), text and images, in their order."""
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": _text(turn.content, f"{where}.content")}]
    allowed = {"user": ("text", "image", "tool_result"),
               "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
    messages, parts, calls = [], [], []
    for j, block in enumerate(turn.content):
        at = f"{where}.content[{j}]"
        if block.type not in allowed[turn.role]:
            raise APIError(400, f"{at}: content blocks of type '{block.type}' are not supported in a "
                                f"{turn.role} message; only {', '.join(allowed[turn.role])}", f"{at}.type")
        if block.type == "text":
            parts.append({"type": "text", "text": _text(_block_text(block, at), f"{at}.text")})
        elif block.type == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise APIError(400, f"{at}: a tool_use block needs its id and name", at)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input or {}}})
        elif block.type == "tool_result":
            if not block.tool_use_id:
                raise APIError(400, f"{at}: a tool_result block needs its tool_use_id", f"{at}.tool_use_id")
            if parts:
                messages.append(_user(parts))
                parts = []
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": _text(block.content, f"{at}.content")})
    if turn.role == "assistant":
        text = "".join(part["text"] for part in parts)
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    return messages + ([_user(parts)] if parts or not messages else [])


class MessageReply:
    """Anthropic's message for one reply, built block by block from the
    splitter's parts; each step returns the stream events it makes."""

    def __init__(self, model: str, splitter: ReplySplitter, prompt_tokens: int):
        self.splitter = splitter
        self.message = {
            "id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }
        self.open: Optional[int] = None  # index of the thinking or text block being written

    def start(self) -> list[tuple[str, dict]]:
        return [("message_start", {"type": "message_start", "message": json.loads(json.dumps(self.message))})]

    def feed(self, text: str) -> list[tuple[str, dict]]:
        return self._blocks(self.splitter.feed(text))

    def finish(self, done: eng.Finished) -> list[tuple[str, dict]]:
        """The last blocks and the message's stop reason and usage."""
        events = self._blocks(self.splitter.finish()) + self._close()
        if done.finish_reason == "length":
            reason = "max_tokens"
        elif done.stop_sequence is not None:
            reason = "stop_sequence"
        else:
            reason = "tool_use" if self.splitter.calls else "end_turn"
        usage = done.usage
        served = usage.to_dict()
        self.message["usage"] = {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
                                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens,
                                 "cache_tier": usage.cache_tier,
                                 "output_tokens": usage.completion_tokens} | {k: served[k] for k in DFLASH_USAGE}
        self.message.update(stop_reason=reason, stop_sequence=done.stop_sequence)
        delta = {"stop_reason": reason, "stop_sequence": done.stop_sequence}
        return events + [("message_delta", {"type": "message_delta", "delta": delta, "usage": self.message["usage"]}),
                         ("message_stop", {"type": "message_stop"})]

    def _blocks(self, parts: Parts) -> list[tuple[str, dict]]:
        events = []
        for kind, text in (("thinking", parts.reasoning), ("text", parts.content)):
            if text:
                events += self._write(kind, text)
        for call in parts.tool_calls:
            events += self._close()
            function = call["function"]
            block = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": function["name"],
                     "input": {}}
            events += self._started(block)
            block["input"] = json.loads(function["arguments"])
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            events += [self._delta(delta)] + self._close()
        return events

    def _write(self, kind: str, text: str) -> list[tuple[str, dict]]:
        """``text`` added to the open block of ``kind`` (a new one if the open block is of another)."""
        events = []
        if self.open is None or self.message["content"][self.open]["type"] != kind:
            events += self._close()
            events += self._started({"type": "thinking", "thinking": "", "signature": ""}
                                    if kind == "thinking" else {"type": "text", "text": ""})
        self.message["content"][self.open][kind] += text
        return events + [self._delta({"type": kind + "_delta", kind: text})]

    def _started(self, block: dict) -> list[tuple[str, dict]]:
        self.message["content"].append(block)
        self.open = len(self.message["content"]) - 1
        return [("content_block_start", {"type": "content_block_start", "index": self.open,
                                         "content_block": dict(block)})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.open, "delta": delta}

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        events = []
        if self.message["content"][index]["type"] == "thinking":
            # this server does not sign its reasoning: the signature is empty
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "signature_delta", "signature": ""}}))
        return events + [("content_block_stop", {"type": "content_block_stop", "index": index})]


def add_routes(app: FastAPI, engine: eng.Engine, model_name: str, enable_thinking: Optional[bool],
               tokenized, submit, marks, watch) -> None:
    """Register the Messages routes on ``app``. ``tokenized(prompt_ids, *args)``
    runs a prompt function on the tokenizing thread, ``submit(chat_request,
    ids, images, marks)`` queues a job, ``marks(chat_request, ids)`` says where its
    prefix cache checkpoints (the chat route's), ``watch(job, request)`` cancels it when the client goes away."""

    @app.post(ROUTE)
    async def messages(body: MessagesRequest, request: Request):
        chat = body.chat()
        ids = await tokenized(chat_ids, engine.tokenizer, chat, enable_thinking)
        job = submit(chat, ids, await images.read(body.image_sources(), engine.image_refusal), await marks(chat, ids))
        reply = MessageReply(model_name, ReplySplitter(engine.tokenizer, ids, chat.called_tools()), len(ids))
        if body.stream:
            return EventSourceResponse(_stream(job, reply), sep="\n", shutdown_grace_period=3)
        watcher = asyncio.create_task(watch(job, request))
        try:
            async for _ in _events(job, reply):
                pass
            return reply.message
        finally:
            watcher.cancel()
            engine.cancel(job)

    @app.post(ROUTE + "/count_tokens")
    async def count_tokens(body: Conversation):
        ids = await tokenized(chat_ids, engine.tokenizer, body.chat(), enable_thinking)
        return {"input_tokens": len(ids)}

    async def _stream(job: eng.Job, reply: MessageReply):
        try:
            async for event in server_sent_events(job, reply):
                yield event
        finally:  # also when the client disconnects: the slot is freed at once
            engine.cancel(job)


async def server_sent_events(job: eng.Job, reply: MessageReply):
    """The reply's events as sse-starlette dicts, named; a failure (the server
    shutting down) is Anthropic's ``error`` event, and the stream ends there."""
    try:
        async for name, data in _events(job, reply):
            yield {"event": name, "data": json.dumps(data)}
    except APIError as e:
        yield {"event": "error", "data": json.dumps(error_body(e))}


async def _events(job: eng.Job, reply: MessageReply):
    """The reply's stream events as the job runs; a failed job raises its APIError."""
    for event in reply.start():
        yield event
    async for event in job.stream():
        if isinstance(event, eng.Delta):
            steps = reply.feed(event.text)
        elif isinstance(event, eng.Failed):
            raise APIError(event.status, event.message, code=event.code)
        else:
            steps = reply.finish(event)
        for step in steps:
            yield step
