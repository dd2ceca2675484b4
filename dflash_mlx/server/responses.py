"""OpenAI's Responses API: ``POST /v1/responses``, the API Codex speaks.

A request is turned into the chat request the chat route would get for the
same conversation (``instructions`` and developer items as the system
message, ``message`` items as turns (``input_image`` parts as image parts),
``function_call`` and ``function_call_output`` items as an assistant's tool
calls and tool messages, function tools as function schemas, ``text.format`` as
``response_format``), and runs through that route's own pipeline: template,
grammar, queue, engine, prefix cache and reply splitter. A custom (freeform)
tool, such as Codex's ``apply_patch``, is offered to the model as a function
of one string argument, ``input``, and its calls come back as
``custom_tool_call`` items; hosted tool types (web search, ...) are ignored.
The reply comes back as reasoning, message and call items (``responses_stream``);
a stream with nothing to say for ``HEARTBEAT`` seconds (a long prefill) repeats
``response.in_progress``, so clients' idle timeouts do not fire.

Stateless by default: a request with ``"store": true`` is kept (its items and
its output, the last ``STORED`` of them) so a later one can name it in
``previous_response_id``.
"""

import asyncio
import json
from collections import OrderedDict
from typing import Optional, Union

from fastapi import FastAPI, Request
from pydantic import Field, StrictBool
from sse_starlette import EventSourceResponse

from . import engine as eng
from . import images
from .errors import APIError
from .logprobs import MAX_TOP, Logprobs
from .prompts import unicode_text
from .responses_stream import ResponseReply
from .schemas import ChatRequest, Sampling

ROUTE = "/v1/responses"
STORED = 256  # responses kept for previous_response_id
HEARTBEAT = 10.0  # seconds without an event after which a stream repeats response.in_progress
TEXT_PARTS = ("input_text", "output_text")
# the chat route's names of fields and the Responses API's
RENAMED = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
SYSTEM = ("system", "developer")


class ResponsesRequest(Sampling):
    """The Responses API's fields; the sampling extensions of the chat route
    (``top_k``, ``min_p``, ``seed``, ``stop``, penalties...) are taken too."""

    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict, None] = None
    text: Optional[dict] = None  # {"format": {...}, "verbosity": ...}
    reasoning: Optional[dict] = None  # {"effort": ..., "summary": ...}
    max_output_tokens: Optional[int] = Field(None, ge=1)
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP)
    include: Optional[list[str]] = None
    store: Optional[StrictBool] = None
    previous_response_id: Optional[str] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        for name, instead in (("max_tokens", "max_output_tokens"), ("response_format", "text.format")):
            if getattr(self, name) is not None:
                return name, f"{name} is not a Responses API field; send {instead}"
        return super().unsupported()

    def chat(self, earlier: list[dict]) -> ChatRequest:
        """The chat request for the same conversation, after the ``earlier`` items."""
        problem = self.unsupported()
        if problem:
            raise APIError(400, problem[1], problem[0], "unsupported_value")
        sampling = self.model_dump(include=set(Sampling.model_fields) - {"max_tokens", "response_format"})
        effort = (self.reasoning or {}).get("effort")
        asked = self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or [])
        return ChatRequest(
            messages=messages(earlier + self.items(), self.instructions), tools=function_tools(self.tools),
            tool_choice=self._tool_choice(), max_tokens=self.max_output_tokens, response_format=self._format(),
            logprobs=asked or None, top_logprobs=self.top_logprobs if asked else None,
            enable_thinking=False if effort == "none" else None, **sampling,
        )

    def image_sources(self, earlier: list[dict]) -> list[images.Source]:
        """(field, URL) of each ``input_image`` part, in the prompt's order;
        those of the ``earlier`` items are named by ``previous_response_id``."""
        found = []
        for i, item in enumerate(earlier + self.items()):
            content = item.get("content") if item.get("type", "message") == "message" else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                if _is_image(part):
                    current = f"input[{i - len(earlier)}].content[{j}].image_url"
                    found.append(("previous_response_id" if i < len(earlier) else current, part["image_url"]))
        return found

    def items(self) -> list[dict]:
        """The input as items: a string is one user message."""
        return [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input

    def custom_tools(self) -> set[str]:
        """Names of the request's custom (freeform) tools."""
        return {t.get("name") for t in self.tools or [] if t.get("type") == "custom"}

    def _tool_choice(self) -> Union[str, dict, None]:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") not in ("function", "custom"):
                return None  # a hosted tool or an allowed list: the model chooses
            if not isinstance(choice.get("name"), str):
                raise APIError(400, "tool_choice.name: Field required", "tool_choice.name")
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def _format(self) -> Optional[dict]:
        """``text.format`` as the chat route's ``response_format``."""
        spec = (self.text or {}).get("format")
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise APIError(400, "text.format must be an object such as {'type': 'json_object'}", "text.format")
        if spec.get("type") != "json_schema":
            return spec
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if k != "type"}}


def function_tools(tools: Optional[list[dict]]) -> Optional[list[dict]]:
    """Function and custom tools as the chat template's function schemas; other types are left out."""
    out = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind not in ("function", "custom"):
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(400, f"tools[{i}].name: Field required", f"tools[{i}].name")
        function = {"name": tool["name"], "description": tool.get("description") or ""}
        if kind == "function":
            function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
        else:
            function["parameters"] = {"type": "object", "required": ["input"], "properties": {
                "input": {"type": "string", "description": _freeform(tool.get("format"))}}}
        out.append({"type": "function", "function": function})
    return out or None


def _freeform(spec) -> str:
    """What a custom tool's ``input`` is: free text, or text in its grammar."""
    if isinstance(spec, dict) and spec.get("type") == "grammar":
        return f"raw text in this {spec.get('syntax', '')} grammar, not JSON:\n{spec.get('definition', '')}"
    return "raw text, not JSON"


def _text(content, at: str) -> str:
    """A message's or tool output's text: a string, or text parts joined."""
    if content is None or isinstance(content, str):
        return unicode_text(content or "", at)
    if not isinstance(content, list):
        raise APIError(400, f"{at} must be a string or a list of text parts", at)
    return unicode_text("".join(_part_text(part, f"{at}[{j}]") for j, part in enumerate(content)), at)


def _part_text(part, at: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS:
        raise APIError(400, f"{at}: content parts of type {kind!r} are not supported; only "
                            f"{', '.join(TEXT_PARTS)} (and input_image in a user or assistant turn)", f"{at}.type")
    if not isinstance(part.get("text"), str):
        raise APIError(400, f"{at}.text: Field required", f"{at}.text")
    return part["text"]


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "input_image"


def _content(content, at: str):
    """A turn's content: its text, or, where it holds ``input_image`` parts,
    its text and image parts in order, as the chat route takes them."""
    if not isinstance(content, list) or not any(_is_image(part) for part in content):
        return _text(content, at)
    parts = []
    for j, part in enumerate(content):
        if not _is_image(part):
            parts.append({"type": "text", "text": _part_text(part, f"{at}[{j}]")})
        elif isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise APIError(400, f"{at}[{j}].image_url: Field required (a data URL or an http(s) URL; "
                                "file_id is not supported)", f"{at}[{j}].image_url")
    return parts


def _field(item: dict, name: str, at: str) -> str:
    if not isinstance(item.get(name), str):
        raise APIError(400, f"{at}.{name}: Field required (a string)", f"{at}.{name}")
    return item[name]


def _call(item: dict, at: str) -> dict:
    """A ``function_call`` or ``custom_tool_call`` item as an assistant's tool call."""
    if item["type"] == "function_call":
        arguments = _field(item, "arguments", at)
        try:
            json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise APIError(400, f"{at}.arguments is not valid JSON: {e}", f"{at}.arguments") from None
    else:
        arguments = json.dumps({"input": _field(item, "input", at)}, ensure_ascii=False)
    function = {"name": _field(item, "name", at), "arguments": arguments}
    return {"id": _field(item, "call_id", at), "type": "function", "function": function}


def messages(items: list[dict], instructions: Optional[str]) -> list[dict]:
    """The input items as chat messages: ``instructions`` and the system and
    developer items before the first turn make one system message (a later
    one is a user turn where it stands, since templates take a system message
    only first); calls join the assistant turn before them; reasoning items
    are dropped, as chat templates drop earlier turns' reasoning."""
    system = [unicode_text(instructions, "instructions")] if instructions else []
    out: list[dict] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{at} must be an object (an input item)", at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", *SYSTEM):
                raise APIError(400, f"{at}.role must be one of user, assistant, system, developer; got {role!r}",
                               f"{at}.role")
            content = (_text if role in SYSTEM else _content)(item.get("content"), f"{at}.content")
            if role in SYSTEM and not out:
                system.append(content)
            else:
                out.append({"role": "user" if role in SYSTEM else role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(_call(item, at))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", at),
                        "content": _text(item.get("output"), f"{at}.output")})
        elif kind != "reasoning":
            raise APIError(400, f"{at}: input items of type {kind!r} are not supported; only message, "
                                "function_call, function_call_output, custom_tool_call, custom_tool_call_output "
                                "and reasoning", f"{at}.type")
    if not out:
        raise APIError(400, "input: the conversation has no user turn", "input")
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + out


def renamed(error: APIError) -> APIError:
    """An error of the chat pipeline, naming the Responses API's fields."""
    root = (error.param or "").split(".")[0].split("[")[0]
    if root not in RENAMED:
        return error
    message = error.message.replace(root, RENAMED[root]) if root != "messages" else error.message
    return APIError(error.status, message, RENAMED[root], error.code)


def add_routes(app: FastAPI, engine: eng.Engine, model_name: str, chat, watch) -> None:
    """Register ``POST /v1/responses`` on ``app``. ``chat(chat_request,
    sources)`` runs the chat route's pipeline, with the images at ``sources``,
    up to the queued job (it returns the job and its reply splitter);
    ``watch(job, request)`` cancels a job when the client goes away."""
    stored: "OrderedDict[str, list[dict]]" = OrderedDict()  # id -> the items of its conversation

    @app.post(ROUTE)
    async def create(body: ResponsesRequest, request: Request):
        earlier = []
        if body.previous_response_id is not None:
            earlier = stored.get(body.previous_response_id)
            if earlier is None:
                raise APIError(400, f"previous_response_id {body.previous_response_id!r} is not known: this server "
                                    f"keeps only the last {STORED} responses created with \"store\": true, in "
                                    "memory, until it restarts", "previous_response_id")
        chat_request = body.chat(earlier)
        try:
            job, splitter = await chat(chat_request, body.image_sources(earlier))
        except APIError as e:
            raise renamed(e) from None
        logprobs = None if chat_request.top_logprobs_asked() is None else Logprobs(engine.tokenizer)
        reply = ResponseReply(body, model_name, splitter, logprobs, engine.tokenizer)
        if body.store:
            reply.on_done = lambda output: _store(reply.response["id"], earlier + body.items() + output)
        if body.stream:
            return EventSourceResponse(_stream(job, reply), sep="\n", shutdown_grace_period=3)
        watcher = asyncio.create_task(watch(job, request))
        try:
            async for event in job.stream():
                if isinstance(event, eng.Failed):
                    raise APIError(event.status, event.message, code=event.code)
                reply.step(event)
            return reply.response
        finally:
            watcher.cancel()
            engine.cancel(job)

    def _store(response_id: str, items: list[dict]) -> None:
        stored[response_id] = items
        while len(stored) > STORED:
            stored.popitem(last=False)

    async def _stream(job: eng.Job, reply: ResponseReply):
        try:
            for event in reply.start():
                yield event
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), HEARTBEAT)
                except asyncio.TimeoutError:  # a long prefill: say it is still in progress
                    yield reply.in_progress()
                    continue
                for step in reply.step(event):
                    yield step
                if not isinstance(event, eng.Delta):
                    return
        finally:  # also when the client disconnects: the slot is freed at once
            engine.cancel(job)
