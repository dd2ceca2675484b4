"""Request prompts as token ids: chat messages through the tokenizer's chat
template (``dflash_mlx.chat``), completion prompts as text or ids."""

from typing import Optional

from .. import validate
from ..chat import encode, template_ids
from ..errors import DFlashError
from .errors import APIError
from .schemas import ChatRequest, CompletionRequest


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


def _text(content, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return unicode_text(content, param)
    return unicode_text("".join(part.text or "" for part in content), param)


def chat_ids(tokenizer, body: ChatRequest, enable_thinking: Optional[bool]) -> list[int]:
    """The conversation through the chat template; a ``developer`` message is a
    system message. ``enable_thinking`` is the default when the request does
    not say (in ``enable_thinking`` or ``chat_template_kwargs``)."""
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content, f"messages[{i}].content")}
        for i, m in enumerate(body.messages)
    ]
    thinking = body.template_kwargs().get("enable_thinking", enable_thinking)
    try:
        ids = template_ids(tokenizer, messages, enable_thinking=thinking)
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
