"""A chat reply's text split into its answer, its reasoning and its tool calls.

mlx-lm's ``TextStateMachine`` (built from what its tokenizer wrapper inferred
from the chat template: thinking and tool-call markers) follows the streamed
text and strips the markers; each call's text is parsed by the tokenizer's own
tool parser. A call that does not parse, or any call when the request named no
tools, stays in the answer as the model wrote it.
"""

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional

from mlx_lm.generate import TextStateMachine, make_text_state_machine


@dataclass
class Parts:
    """Text released by one step of a ``ReplySplitter``."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __add__(self, other: "Parts") -> "Parts":
        return Parts(self.content + other.content, self.reasoning + other.reasoning,
                     self.tool_calls + other.tool_calls)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def delta(self) -> dict:
        """The chat stream delta carrying these parts."""
        delta = {"content": self.content} if self.content else {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.tool_calls:
            delta["tool_calls"] = self.tool_calls
        return delta


def initial_state(tokenizer, prompt: list[int]) -> str:
    """``reasoning`` when the prompt leaves a thinking block open (templates
    that start the reply with the think marker), else ``normal``, as mlx-lm's server."""
    state = "normal"
    if getattr(tokenizer, "has_thinking", False):
        if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
            state = "reasoning"
    return getattr(tokenizer, "response_initial_state", None) or state


class ReplySplitter:
    """Feeds a reply's text through the state machine and releases its parts.

    ``tools`` are the request's (None: no call is parsed). Streamed tool calls
    carry their ``index`` in the reply.
    """

    def __init__(self, tokenizer, prompt: list[int], tools: Optional[list[dict]]):
        self.state = make_text_state_machine(tokenizer).make_state(initial_state(tokenizer, prompt))
        self.parser = getattr(tokenizer, "tool_parser", None) if tools else None
        self.tools = tools
        self.markers = (getattr(tokenizer, "tool_call_start", None) or "",
                        getattr(tokenizer, "tool_call_end", None) or "")
        self.call_text: Optional[str] = None  # the call being read, in the tool state
        self.calls = 0  # tool calls parsed so far

    def feed(self, text: str) -> Parts:
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._collect(segments)

    def finish(self) -> Parts:
        """What the state machine still holds, once the reply ended; a call
        cut off by the end (``max_tokens``, a stop string) stays text."""
        self.state, held, name = TextStateMachine.flush(self.state)
        parts = self._collect([(name, held)])
        if self.call_text is not None:
            parts.content += self.markers[0] + self.call_text
            self.call_text = None
        return parts

    def _collect(self, segments: list[tuple[Optional[str], str]]) -> Parts:
        parts = Parts()
        for name, text in segments:
            if name == "tool":
                self.call_text = (self.call_text or "") + text
                continue
            if self.call_text is not None:
                self._close_call(parts)
            if name == "reasoning":
                parts.reasoning += text
            elif name == "normal":
                parts.content += text
        return parts

    def _close_call(self, parts: Parts) -> None:
        text, self.call_text = self.call_text, None
        calls = self._parsed(text)
        if calls is None:
            parts.content += self.markers[0] + text + self.markers[1]
            return
        for call in calls:
            parts.tool_calls.append({"index": self.calls, **call})
            self.calls += 1

    def _parsed(self, text: str) -> Optional[list[dict]]:
        """The OpenAI form of the calls in ``text``, or None when the request
        has no tools or the parser cannot read it."""
        if self.parser is None:
            return None
        try:
            parsed = self.parser(text, self.tools)
            calls = []
            for call in parsed if isinstance(parsed, list) else [parsed]:
                arguments = call["arguments"]
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                function = {"name": str(call["name"]), "arguments": arguments}
                calls.append({"id": call.get("id") or "call_" + uuid.uuid4().hex[:24],
                              "type": "function", "function": function})
        # the model's text is arbitrary: whatever a parser raises on it, the text is the reply
        except Exception:
            return None
        return calls or None
