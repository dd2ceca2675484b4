"""A Responses API reply, built item by item from a chat reply's parts.

Reasoning becomes a ``reasoning`` item (its text as ``reasoning_text``), the
answer a ``message`` item with one ``output_text`` part, each tool call a
``function_call`` item (a ``custom_tool_call`` for a custom tool). Each step
returns the server-sent events it makes, in OpenAI's order, each with its
``sequence_number``: ``response.created`` and ``response.in_progress``; per
item ``response.output_item.added``, its part's ``response.content_part.added``,
deltas, ``.done`` and ``response.output_item.done``; and last
``response.completed`` (usage included) or ``response.failed``.
"""

import json
import time
import uuid
from typing import Callable, Optional

from . import engine as eng
from .anthropic import DFLASH_USAGE
from .logprobs import Logprobs, Picked
from .parts import Parts, ReplySplitter

# how a reply ended -> the response's status; "length" is incomplete (max_output_tokens)
STATUS = {"stop": "completed", "length": "incomplete", "error": "failed", "cancelled": "cancelled"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseReply:
    """The response object of one request and the events that build it.
    ``on_done(output)`` is called with the output items once it completes."""

    def __init__(self, body, model: str, splitter: ReplySplitter, logprobs: Optional[Logprobs], tokenizer):
        self.splitter, self.logprobs, self.tokenizer = splitter, logprobs, tokenizer
        self.custom = body.custom_tools()
        self.response = {
            "id": _id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": True, "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning or {}, "store": bool(body.store), "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "top_p": body.top_p, "truncation": "disabled", "usage": None,
            "metadata": {},
        }
        self.sequence = 0
        self.open: Optional[dict] = None  # the reasoning or message item being written
        self.picked: list[Picked] = []
        self.reasoning = ""  # all of it, for the usage's reasoning_tokens
        self.on_done: Optional[Callable[[list[dict]], None]] = None

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response), self.in_progress()]

    def in_progress(self) -> dict:
        return self._event("response.in_progress", response=self.response)

    def step(self, event: eng.Event) -> list[dict]:
        """The events one of the job's events makes."""
        if isinstance(event, eng.Delta):
            self.picked += event.logprobs
            return self._parts(self.splitter.feed(event.text))
        if isinstance(event, eng.Failed):
            return self._close() + self._failed(event.code or "server_error", event.message)
        return self._finish(event)

    def _finish(self, done: eng.Finished) -> list[dict]:
        events = self._parts(self.splitter.finish())
        self.response["status"] = STATUS[done.finish_reason]
        events += self._close()
        usage = done.usage
        reasoning = len(self.tokenizer.encode(self.reasoning, add_special_tokens=False)) if self.reasoning else 0
        served = usage.to_dict()
        self.response["usage"] = {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_tier": usage.cache_tier},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        } | {k: served[k] for k in DFLASH_USAGE}
        if done.finish_reason == "length":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        if done.error:
            return events + self._failed("invalid_output", done.error, "text.format")
        if done.finish_reason == "cancelled":
            return events + self._failed("cancelled", "the request was cancelled")
        if self.on_done is not None:
            self.on_done(self.response["output"])
        return events + [self._event("response.completed", response=self.response)]

    def _failed(self, code: str, message: str, param: Optional[str] = None) -> list[dict]:
        if self.response["status"] != "cancelled":
            self.response["status"] = "failed"
        self.response["error"] = {"code": code, "message": message, "param": param}
        return [self._event("response.failed", response=self.response)]

    def _event(self, kind: str, **fields) -> dict:
        """One server-sent event (named, and its ``type`` in the data), serialized now."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return {"event": kind, "data": json.dumps(data)}

    def _parts(self, parts: Parts) -> list[dict]:
        events = []
        if parts.reasoning:
            self.reasoning += parts.reasoning
            events += self._write("reasoning", parts.reasoning)
        if parts.content:
            events += self._write("message", parts.content)
        for call in parts.tool_calls:
            events += self._close() + self._call(call["id"], **call["function"])
        return events

    def _added(self, item: dict) -> tuple[int, list[dict]]:
        self.response["output"].append(item)
        index = len(self.response["output"]) - 1
        return index, [self._event("response.output_item.added", output_index=index, item=item)]

    def _write(self, kind: str, text: str) -> list[dict]:
        """``text`` added to the open item of ``kind`` (a new one if the open item is of another)."""
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            index, added = self._added(item)
            item["content"].append(part)
            self.open = item
            events += added + [self._event("response.content_part.added", **self._at(), part=part)]
        part = self.open["content"][0]
        part["text"] += text
        if kind == "reasoning":
            return events + [self._event("response.reasoning_text.delta", **self._at(), delta=text)]
        picked, self.picked = self.picked, []
        logprobs = self.logprobs.chat(picked)["content"] if self.logprobs and picked else []
        part["logprobs"] += logprobs
        return events + [self._event("response.output_text.delta", **self._at(), delta=text, logprobs=logprobs)]

    def _at(self) -> dict:
        """Where the open item's part is."""
        index = self.response["output"].index(self.open)
        return {"item_id": self.open["id"], "output_index": index, "content_index": 0}

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        at, part = self._at(), self.open["content"][0]
        if self.open["type"] == "reasoning":
            events = [self._event("response.reasoning_text.done", **at, text=part["text"])]
        else:
            self.open["status"] = "incomplete" if self.response["status"] == "incomplete" else "completed"
            events = [self._event("response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"])]
        events += [self._event("response.content_part.done", **at, part=part),
                   self._event("response.output_item.done", output_index=at["output_index"], item=self.open)]
        self.open = None
        return events

    def _call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        """A parsed tool call as a function or custom tool call item, with its events."""
        custom = name in self.custom
        if custom:
            field, kind, stream = "input", "custom_tool_call", "response.custom_tool_call_input"
            text = _custom_input(arguments)
        else:
            field, kind, stream, text = "arguments", "function_call", "response.function_call_arguments", arguments
        item = {"id": _id("ctc" if custom else "fc"), "type": kind, "status": "in_progress", "call_id": call_id,
                "name": name, field: ""}
        index, events = self._added(item)
        at = {"item_id": item["id"], "output_index": index}
        item.update({field: text, "status": "completed"})
        return events + [self._event(stream + ".delta", **at, delta=text),
                         self._event(stream + ".done", **at, **{field: text}),
                         self._event("response.output_item.done", output_index=index, item=item)]


def _custom_input(arguments: str) -> str:
    """A custom tool's raw input from the function call it was offered as
    (``{"input": "..."}``); arguments of another shape are passed on as written."""
    try:
        value = json.loads(arguments).get("input")
    except (ValueError, AttributeError):
        return arguments
    return value if isinstance(value, str) else arguments
