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
    temp: float = typer.Option(0.0, "--temp", "-t", help="Sampling temperature; 0 is greedy. Lossless at any value."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min-p times the top probability (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed; the same seed gives the same tokens."),
    repetition_penalty: Optional[float] = typer.Option(
        None, "--repetition-penalty", help="mlx-lm's repetition penalty (e.g. 1.1), applied exactly."
    ),
):
    """Generate text with DFlash; text to stdout, speed and acceptance to stderr."""
    from .sampling import SamplingParams

    sampling = dict(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                    repetition_penalty=repetition_penalty)
    try:
        SamplingParams(**sampling).validate()
    except DFlashError as e:
        _fail(str(e))
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
        _run(model, draft, text, not no_chat_template, system, block_size=block_size,
             max_tokens=max_tokens, prefill_step_size=prefill_step_size, **sampling)
    except DFlashError as e:
        _fail(str(e))


def _run(model_id, draft_id, text, chat, system, **options):
    from .generate import stream_generate
    from .loading import load, load_draft

    model, tokenizer = load(model_id)
    draft = load_draft(draft_id)
    if chat:
        text = _chat_prompt(tokenizer, text, system)
    accepted = cycles = 0
    last = None
    for r in stream_generate(model, draft, tokenizer, text, **options):
        sys.stdout.write(r.text)
        sys.stdout.flush()
        if last is not None:
            cycles += 1
            accepted += r.accepted
        last = r
    sys.stdout.write("\n")
    b = options["block_size"] or draft.config.block_size
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


@app.command()
def convert(
    src: Optional[str] = typer.Argument(
        None, help="Draft to convert: a local z-lab draft directory or a hub repo id."
    ),
    out: str = typer.Option(..., "--out", "-o", help="Output directory (written atomically)."),
    target: Optional[str] = typer.Option(
        None, "--target", help="Convert this target model (hub id or directory) with mlx-lm's converter instead of a draft."
    ),
    quantize: bool = typer.Option(False, "--quantize", "-q", help="Quantize (4 bits unless --q-bits)."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="Bits per weight, 4 or 8; implies -q."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Quantization group size: 32, 64 or 128."),
    recipe: Optional[str] = typer.Option(
        None, "--recipe", help="Drafts: mixed_4_8 (fc and the last layer at 8 bits, the rest at 4). Targets: an mlx-lm recipe (mixed_3_6, ...)."
    ),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="float16, bfloat16 or float32 for unquantized tensors and scales. Default: keep the source's."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
):
    """Convert a z-lab DFlash draft to MLX, optionally 4/8-bit quantized (or a target, with --target)."""
    if (src is None) == (target is None):
        _fail("give either a draft SRC or --target MODEL, not both or neither")
    try:
        from dflash_mlx.convert import convert_draft, convert_target
        from dflash_mlx.convert.draft import check_options

        check_options(q_bits, q_group_size, dtype, None if target else recipe)
        if target is not None:
            convert_target(
                target, out, quantize=quantize, bits=q_bits, group_size=q_group_size,
                dtype=dtype, recipe=recipe, force=force,
            )
        else:
            bits = q_bits or (4 if quantize or recipe else None)
            convert_draft(
                src, out, bits=bits, group_size=q_group_size, dtype=dtype,
                recipe=recipe, force=force, log=lambda m: typer.echo(m, err=True),
            )
    except DFlashError as e:
        _fail(str(e))
    typer.echo(f"wrote {out}", err=True)


@app.command()
def doctor(
    no_check: bool = typer.Option(
        False, "--no-check", help="Do not run the kernels' self-checks (they only run where Metal is available)."
    ),
):
    """Platform, MLX backend, Metal, each custom kernel's status and, on Linux, the BLAS in use."""
    from .doctor import main

    raise typer.Exit(main(check=not no_check, echo=typer.echo))
