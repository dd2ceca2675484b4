"""The ``dflash-mlx`` command line (typer)."""

import sys
from typing import Optional

import typer

from .errors import DFlashError
from .registry import KNOWN_PAIRS, find_draft

app = typer.Typer(
    help="Lossless DFlash speculative decoding for MLX: the target's own output, faster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _read_prompt(prompt: str) -> str:
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        _fail("the prompt is empty; pass --prompt TEXT or --prompt - with text on stdin")
    return text


def _chat_prompt(tokenizer, prompt: str, system: Optional[str]) -> str:
    if not getattr(tokenizer, "has_chat_template", False):
        return prompt
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@app.command()
def generate(
    model: str = typer.Option(..., "--model", "-m", help="Target: hub repo id or local mlx-lm directory."),
    draft: Optional[str] = typer.Option(
        None, "--draft", "-d", help="DFlash draft: hub repo id or local directory. Default: from the registry (see `dflash-mlx models`)."
    ),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text, or '-' to read it from stdin."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Stop after this many generated tokens."),
    block_size: Optional[int] = typer.Option(
        None, "--block-size", "-b", help="Tokens per draft block (>= 2). Default: the draft's trained size."
    ),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Feed the prompt as is."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for the chat template."),
    prefill_step_size: int = typer.Option(2048, "--prefill-step-size", help="Prompt tokens per prefill chunk."),
):
    """Generate text with DFlash; text to stdout, speed and acceptance to stderr."""
    if max_tokens <= 0:
        _fail(f"--max-tokens must be positive, got {max_tokens}")
    if block_size is not None and block_size < 2:
        _fail(f"--block-size must be at least 2, got {block_size}")
    text = _read_prompt(prompt)
    draft = draft or find_draft(model)
    if draft is None:
        _fail(
            f"no known DFlash draft for target '{model}'; pass --draft, or use one of: "
            + ", ".join(KNOWN_PAIRS)
        )
    try:
        _run(model, draft, text, max_tokens, block_size, not no_chat_template, system, prefill_step_size)
    except DFlashError as e:
        _fail(str(e))


def _run(model_id, draft_id, text, max_tokens, block_size, chat, system, prefill_step_size):
    from .generate import stream_generate
    from .loading import load, load_draft

    model, tokenizer = load(model_id)
    draft = load_draft(draft_id)
    if chat:
        text = _chat_prompt(tokenizer, text, system)
    accepted = cycles = 0
    last = None
    for r in stream_generate(
        model, draft, tokenizer, text, block_size=block_size,
        max_tokens=max_tokens, prefill_step_size=prefill_step_size,
    ):
        sys.stdout.write(r.text)
        sys.stdout.flush()
        if last is not None:
            cycles += 1
            accepted += r.accepted
        last = r
    sys.stdout.write("\n")
    b = block_size or draft.config.block_size
    tau = (accepted + cycles) / cycles if cycles else float("nan")
    rate = accepted / (cycles * (b - 1)) if cycles else float("nan")
    typer.echo(
        f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
        f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s | "
        f"tau {tau:.2f} tokens/cycle over {cycles} cycles (block {b}), "
        f"draft acceptance {rate:.1%} | peak memory {last.peak_memory:.2f} GB",
        err=True,
    )


@app.command()
def models():
    """List the known target -> draft pairs used when --draft is not given."""
    width = max(map(len, KNOWN_PAIRS))
    for target, draft in KNOWN_PAIRS.items():
        typer.echo(f"{target:<{width}}  {draft}")
    typer.echo("\nmlx-community/<name>-4bit / -8bit targets use the draft of <name>.")
