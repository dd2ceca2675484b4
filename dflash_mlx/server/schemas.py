"""Request bodies of the OpenAI-compatible routes (pydantic).

Unknown fields are ignored (clients send ``user``, ``parallel_tool_calls``...); known fields with values this server cannot honour are
rejected by ``unsupported()`` with a message naming the field. Numbers must be
finite and switches JSON booleans (``"yes"`` is not ``true``).
"""

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from .logprobs import MAX_TOP


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def tool_problem(i: int, kind: Optional[str], kinds: tuple, runnable: str,
                 needed: dict) -> Optional[tuple[str, str]]:
    """(param, message) when ``tools[i]``, of type ``kind``, is not one of
    ``kinds`` (``runnable`` says which tools can run) or lacks a field of
    ``needed`` (name -> its value, None when missing); the same check for
    the OpenAI and Anthropic routes' tools."""
    if kind not in kinds:
        return f"tools[{i}].type", f"tools[{i}]: tool type '{kind}' is not supported; only {runnable}"
    missing = next((name for name, value in needed.items() if value is None), None)
    return None if missing is None else (f"tools[{i}].{missing}", f"tools[{i}].{missing}: Field required")


class StreamOptions(Body):
    include_usage: StrictBool = False


class ContentPart(Body):
    """A ``text`` part, or an ``image_url`` part: ``{"url": a data URL or an
    http(s) URL}`` (a bare string is taken too)."""

    type: str
    text: Optional[str] = None
    image_url: Union[str, dict, None] = None

    def url(self) -> Optional[str]:
        url = self.image_url.get("url") if isinstance(self.image_url, dict) else self.image_url
        return url if isinstance(url, str) and url else None


class FunctionCall(Body):
    name: str
    arguments: Union[str, dict] = "{}"  # a JSON object, as OpenAI sends it: a string


class ToolCall(Body):
    id: Optional[str] = None
    type: str = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's calls
    tool_call_id: Optional[str] = None  # the call a tool result answers
    name: Optional[str] = None


class Sampling(Body):
    """Fields shared by chat and text completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0)  # greedy unless asked, as mlx-lm's server
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    logit_bias: Optional[dict[str, float]] = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)
    repetition_context_size: int = Field(20, ge=1)
    n: int = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[dict] = None  # a grammar the reply follows (dflash_mlx.structured)

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(param, message) for a known field this server cannot honour."""
        if self.n != 1:
            return "n", f"n={self.n} is not supported: this server returns one choice per request"
        return None

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def top_logprobs_asked(self) -> Optional[int]:
        """How many top alternatives each token's log-probability comes with; None: no logprobs."""
        return None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP)
    enable_thinking: Optional[StrictBool] = None
    chat_template_kwargs: Optional[dict] = None
    tools: Optional[list[dict]] = None  # OpenAI function schemas, handed to the chat template
    tool_choice: Union[str, dict, None] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        for i, m in enumerate(self.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type not in ("text", "image_url"):
                    return f"messages[{i}].content[{j}].type", "only text and image_url content parts are supported"
                if part.type == "image_url" and part.url() is None:
                    return (f"messages[{i}].content[{j}].image_url.url",
                            f"messages[{i}].content[{j}].image_url.url: Field required (a data URL or an http(s) URL)")
                if part.type == "text" and part.text is None:
                    return f"messages[{i}].content[{j}].text", f"messages[{i}].content[{j}].text: Field required"
        for i, tool in enumerate(self.tools or []):
            function = tool.get("function") if isinstance(tool.get("function"), dict) else None
            problem = tool_problem(i, tool.get("type", "function"), ("function",),
                                   "function tools (a function object with its name)",
                                   {"function": function, "function.name": (function or {}).get("name")})
            if problem:
                return problem
        return super().unsupported()

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def image_sources(self) -> list[tuple[str, str]]:
        """(field, URL) of each image part, in the prompt's order."""
        return [(f"messages[{i}].content[{j}].image_url", part.url()) for i, m in enumerate(self.messages)
                for j, part in enumerate(m.content if isinstance(m.content, list) else []) if part.type == "image_url"]

    def top_logprobs_asked(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def called_tools(self) -> Optional[list[dict]]:
        """The tools whose calls are read from the reply: none with ``tool_choice: "none"``."""
        return None if self.tool_choice == "none" else self.tools

    def template_kwargs(self) -> dict:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        return kwargs


class CompletionRequest(Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: StrictBool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP)

    def unsupported(self) -> Optional[tuple[str, str]]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                return "prompt", "only one prompt per request is supported"
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        return super().unsupported()

    def top_logprobs_asked(self) -> Optional[int]:
        return self.logprobs

    def single_prompt(self) -> Union[str, list[int]]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            return self.prompt[0]
        return self.prompt
