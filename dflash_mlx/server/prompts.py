"""Request prompts as token ids: chat messages (tool calls and results
included) and tools through the tokenizer's chat template
(``dflash_mlx.chat``), completion prompts as text or ids."""

import json
from typing import Optional

from .. import validate
from ..chat import encode, template_ids
from ..errors import DFlashError
from .errors import APIError
from .schemas import ChatRequest, CompletionRequest, Message


def unicode_text(text: str, param: str) -> str:
    """``text``, if it is valid Unicode: a lone surrogate (a JSON escape in
    \\ud800-\\udfff without its pair) cannot be encoded, so it is a 400 naming ``param``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode: it holds a lone surrogate "
                            f"({ascii(text[e.start])} at character {e.start}); a character outside "
                            "the Basic Multilingual Plane must be escaped as a surrogate pair", param) from None
    return text


def _content(content, param: str):
    """A message's content for the template: its text parts joined, or, with
    images, its parts in order, an image as ``{"type": "image"}`` (as
    ``vision.user_turn`` writes it; the template writes its placeholder)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return unicode_text(content, param)
    if any(part.type == "image_url" for part in content):
        return [{"type": "image"} if part.type == "image_url" else
                {"type": "text", "text": unicode_text(part.text, f"{param}[{j}].text")}
                for j, part in enumerate(content)]
    return unicode_text("".join(part.text or "" for part in content), param)


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's calls for the template, whose ``arguments`` are
    objects (templates write them with ``tojson``; OpenAI clients send strings)."""
    out = []
    for j, call in enumerate(calls):
        arguments = call.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as e:
                raise APIError(400, f"{where}[{j}].function.arguments is not valid JSON: {e}",
                               f"{where}[{j}].function.arguments") from None
        function = {"name": call.function.name, "arguments": arguments}
        out.append({"id": call.id, "type": call.type, "function": function})
    return out


def _message(m: Message, i: int) -> dict:
    message = {"role": "system" if m.role == "developer" else m.role,
               "content": _content(m.content, f"messages[{i}].content")}
    if m.tool_calls:
        message["tool_calls"] = _tool_calls(m.tool_calls, f"messages[{i}].tool_calls")
    message.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v is not None})
    return message


def chat_ids(tokenizer, body: ChatRequest, enable_thinking: Optional[bool]) -> list[int]:
    """The conversation through the chat template, with the request's tools; a
    ``developer`` message is a system message. ``enable_thinking`` is the
    default when the request does not say (in ``enable_thinking`` or
    ``chat_template_kwargs``). Tools for a model whose template has no tool
    calling (mlx-lm's tokenizer found no tool parser for it) are a 400."""
    if body.tools and not getattr(tokenizer, "has_tool_calling", False):
        raise APIError(400, "this model does not support tool calling: its chat template has no tool-call "
                            "format mlx-lm knows; send the request without tools", "tools")
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    thinking = body.template_kwargs().get("enable_thinking", enable_thinking)
    try:
        ids = template_ids(tokenizer, messages, enable_thinking=thinking, tools=body.tools,
                           tool_choice=body.tool_choice)
    except Exception as e:  # the template's own complaint (roles out of order, ...)
        raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None
    if not ids:
        raise APIError(400, "the messages render to an empty prompt", "messages")
    return ids


def completion_ids(tokenizer, body: CompletionRequest, vocab_size: int) -> list[int]:
    """The prompt encoded as ``generate`` encodes text, or the ids as given."""
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        ids = encode(tokenizer, unicode_text(prompt, "prompt")) if prompt else []
    else:
        try:
            ids = validate.token_ids(list(prompt), vocab_size).tolist() if prompt else []
        except DFlashError as e:
            raise APIError(400, str(e), "prompt") from None
    if not ids:
        raise APIError(400, "the prompt is empty", "prompt")
    return ids
