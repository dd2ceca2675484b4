"""Prompts as the target expects them: its chat template and BOS-aware encoding.

Generation, the benchmark and training all turn text into ids through these
functions, so a prompt is tokenized the same way everywhere.
"""

from typing import Optional, Union

Messages = list[dict]


def has_template(tokenizer) -> bool:
    """Whether the tokenizer (mlx-lm's wrapper or a plain Hugging Face one) has a chat template."""
    return bool(getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None))


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text``, adding the tokenizer's special tokens (BOS) unless
    the text already starts with the BOS token, as a rendered chat template may."""
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def apply_template(
    tokenizer,
    prompt: Union[str, Messages],
    *,
    system: Optional[str] = None,
    enable_thinking: Optional[bool] = None,
    add_generation_prompt: bool = True,
    tools: Optional[list[dict]] = None,
    tool_choice: Union[str, dict, None] = None,
) -> str:
    """The conversation as text through the tokenizer's chat template.

    ``prompt`` is the user's text or a list of ``{"role", "content"}`` messages;
    ``system`` puts a system message first. ``enable_thinking`` reaches the
    template only when not None (templates without a thinking switch ignore it;
    None keeps the template's default). ``tools`` (OpenAI function schemas)
    and ``tool_choice`` reach the template likewise, only when given. Without
    a chat template the message contents are joined by newlines.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    if not has_template(tokenizer):
        return "\n".join(str(m.get("content", "")) for m in messages)
    given = {"enable_thinking": enable_thinking, "tools": tools, "tool_choice": tool_choice}
    extra = {k: v for k, v in given.items() if v is not None}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
    )


def template_ids(tokenizer, prompt: Union[str, Messages], **options) -> list[int]:
    """``encode(tokenizer, apply_template(tokenizer, prompt, **options))``: the ids
    generation would run on for the same conversation."""
    return encode(tokenizer, apply_template(tokenizer, prompt, **options))


def thinking_note(enable_thinking: Optional[bool]) -> str:
    """One line for stderr saying which thinking mode a templated prompt used."""
    if enable_thinking is None:
        return "chat template: its default thinking mode (choose with --thinking / --no-thinking)"
    mode = "on" if enable_thinking else "off"
    return f"chat template: thinking {mode} (enable_thinking={enable_thinking}; change with --thinking / --no-thinking)"
