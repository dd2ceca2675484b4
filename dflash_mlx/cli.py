"""The ``dflash-mlx`` command line (typer)."""

import atexit
import importlib
import sys
import warnings
from typing import Optional

import typer
from typer.core import TyperGroup

from .errors import DFlashError


class _Commands(TyperGroup):
    """Bad option values (the wrong type, a missing option) end like every other
    error: one ``error:`` line and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except typer.BadParameter as e:
            _fail(e.format_message())


app = typer.Typer(
    cls=_Commands,
    help="Lossless DFlash speculative decoding for MLX: the target's own output, faster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# generate's options that dflash_mlx.validate checks, by their stream_generate names
GENERATE_FLAGS = {
    "max_tokens": "--max-tokens", "prefill_step_size": "--prefill-step-size", "temperature": "--temp",
    "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p", "seed": "--seed",
    "repetition_penalty": "--repetition-penalty", "draft_vocab": "--draft-vocab",
}
MAX_TOKENS = 256  # generate's default
DEMO_MAX_TOKENS = 128  # the demo pair's: a tiny model's text is worth reading only so far
DEMO_STOPS = ("\n\n\n", "\n\ndef ", "\n\nclass ", "\n\n@", "\n\nif ")  # its first top-level block ends
DRAFT_DTYPE_HELP = ("Dtype the draft computes in: auto (float32 on M1/M2, which emulate bfloat16; else the "
                    "checkpoint's), keep, float32, bfloat16 or float16. `dflash-mlx doctor` shows the choice.")
KV_BITS = typer.Option(None, "--kv-bits", help="Quantize the target's attention KV cache to 4 or 8 bits (also 2, 3, 5, 6) once it holds --quantized-kv-start tokens, as mlx-lm's --kv-bits does: the output equals mlx-lm's with the same KV options. Default: full precision.")
KV_GROUP_SIZE = typer.Option(64, "--kv-group-size", help="--kv-bits: elements per quantization group (32, 64 or 128).")
QUANTIZED_KV_START = typer.Option(5000, "--quantized-kv-start", help="--kv-bits: tokens of context before the cache is quantized (mlx-lm's default).")
SCHEDULE_HELP = ("on or off: under --block-size auto a DSpark draft with a confidence head verifies only the drafts "
                 "its confidences say pay (on, the default) or every draft of auto's block (off). docs/dspark.md.")
THINKING_HELP = ("Pass enable_thinking=True/False to the chat template. Default: the registry's "
                 "choice for the pair (what its draft was trained on), else the template's own.")


def _finish_mlx_work() -> None:
    """Wait for the MLX work still queued when the process ends (a finished
    generation leaves the next block's draft running). Exiting with a BLAS
    call in flight on MLX's worker thread never ends under a multithreaded
    OpenBLAS: its exit-time shutdown joins a worker thread that call leaves
    asleep. (mlx-lm synchronizes its generation stream on Metal only.)"""
    mx = sys.modules.get("mlx.core")
    if mx is None:  # this command never ran MLX
        return
    streams = [None]  # the default stream
    if "mlx_lm.generate" in sys.modules:
        streams.append(sys.modules["mlx_lm.generate"].generation_stream)
    for stream in streams:
        mx.synchronize(stream)


atexit.register(_finish_mlx_work)


def _fail(message: str) -> None:
    importlib.import_module(".distributed", __package__).report(message)  # once: by rank 0 under mlx.launch
    raise typer.Exit(1)


def _call(module: str, function: str, ctx: Optional[typer.Context] = None, **options) -> None:
    """Hand a command's options (with ``ctx``, also the names of those typed, as ``given``) to the tool
    that owns them (imported only when run, so --help stays fast); its DFlashError becomes the one error line."""
    if ctx is not None:
        options["given"] = _given(ctx)
    try:
        getattr(importlib.import_module(module, __package__), function)(**options)
    except DFlashError as e:
        _fail(str(e))


def _given(ctx: typer.Context) -> set[str]:
    """The command's options typed on its command line, named as --help names them."""
    return {"/".join([p.opts[0], *p.secondary_opts]) for p in ctx.command.params
            if getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"}


def _note(message: str) -> None:
    typer.echo(message, err=True)


def _read_prompt(prompt: str) -> str:
    from .validate import text

    if prompt == "-":
        try:
            prompt = sys.stdin.read()
        except UnicodeDecodeError:
            raise DFlashError("the prompt is not valid UTF-8") from None
    return text(prompt)


@app.command()
def generate(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: hub repo id or local mlx-lm directory. Default: the bundled demo pair (offline)."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="DFlash draft: hub repo id or local directory. Default: from the registry (see `dflash-mlx models`)."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text, or '-' to read it from stdin."),
    image: Optional[list[str]] = typer.Option(None, "--image", help="Image file or URL for the prompt; repeatable (docs/vision.md)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n", show_default=False, help=f"Stop after this many generated tokens. Default: {MAX_TOKENS} ({DEMO_MAX_TOKENS} for the demo pair)."),
    stop: Optional[list[str]] = typer.Option(
        None, "--stop", show_default=False,
        help="Stop where the output reaches this text (not printed); repeatable. Default: none (for the demo "
             "pair, where its first top-level block of code ends: two blank lines, or a blank line before a "
             "top-level def, class, decorator or if).",
    ),
    block_size: str = typer.Option("auto", "--block-size", "-b", help="Tokens per draft block: auto (chosen each cycle from this machine's measured costs and the acceptance so far, up to the trained size) or 2 to twice the draft's trained size (above it: a warning)."),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Feed the prompt as is."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for the chat template."),
    thinking: Optional[bool] = typer.Option(None, "--thinking/--no-thinking", help=THINKING_HELP, show_default=False),
    prefill_step_size: int = typer.Option(2048, "--prefill-step-size", help="Prompt tokens per prefill chunk."),
    temp: float = typer.Option(0.0, "--temp", "-t", help="Sampling temperature; 0 is greedy. Lossless at any value."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min-p times the top probability (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed in [0, 2^64); the same seed gives the same tokens."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", help="mlx-lm's repetition penalty (> 0, e.g. 1.1), applied exactly."),
    tree_budget: int = typer.Option(0, "--tree-budget", help="Verify a DDTree of up to this many drafted tokens per cycle instead of one chain (lossless at any temperature; 0 = the chain)."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", help="Draft over the N most frequent token ids only (the ranking beside the draft, made by `dflash-mlx draft-vocab`): a cheaper draft head, still lossless."),
    confidence_schedule: Optional[str] = typer.Option(None, "--confidence-schedule", help=SCHEDULE_HELP, show_default=False),
    show_drafts: Optional[bool] = typer.Option(
        None, "--show-drafts/--no-show-drafts", show_default=False,
        help="On a terminal, color the text of accepted drafts (green) apart from the target's own token of "
             "each cycle. Default: on for the demo pair (its run is there to show what DFlash does), off with --model.",
    ),
    no_color: bool = typer.Option(False, "--no-color", help="Plain text on stdout even on a terminal (as NO_COLOR=1 does)."),
    distributed: Optional[str] = typer.Option(
        None, "--distributed", help="tensor or pipeline: shard the target over the processes mlx.launch started "
                                    "(docs/distributed.md); only rank 0 prints.",
    ),
    draft_dtype: str = typer.Option("auto", "--draft-dtype", help=DRAFT_DTYPE_HELP),
    kv_bits: Optional[int] = KV_BITS, kv_group_size: int = KV_GROUP_SIZE, quantized_kv_start: int = QUANTIZED_KV_START,
):
    """Generate text with DFlash; text to stdout, speed and acceptance to stderr."""
    demo = model is None  # the bundled pair (without --draft; resolve_pair below checks that)
    if max_tokens is None:
        max_tokens = DEMO_MAX_TOKENS if demo else MAX_TOKENS
    if stop is None:
        stop = list(DEMO_STOPS) if demo else []
    options = dict(max_tokens=max_tokens, prefill_step_size=prefill_step_size, temperature=temp,
                   top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, repetition_penalty=repetition_penalty,
                   draft_vocab=draft_vocab, kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start)
    try:
        from . import validate
        from .draft import draft_classes
        from .precision import choose_draft_dtype
        from .registry import read_config, resolve_pair

        validate.options(options, {**GENERATE_FLAGS, **validate.KV_FLAGS})
        schedule = None if confidence_schedule is None else validate.switch(confidence_schedule, "--confidence-schedule")
        validate.kv_options(kv_bits, kv_group_size, quantized_kv_start, _given(ctx))
        choose_draft_dtype({}, draft_dtype)  # a bad value fails before any model loads
        tree_budget = validate.tree_budget(tree_budget, None, "--tree-budget")
        if distributed and kv_bits is not None:
            raise DFlashError("--kv-bits is not supported with --distributed; leave one out")
        block_size = validate.block_option(block_size, "--block-size")
        text = _read_prompt(prompt)
        for value, name in [(system or "", "--system text"), *((s, "--stop string") for s in stop)]:
            validate.utf8(value, name)
        if system is not None and no_chat_template:
            raise DFlashError("--system goes through the chat template; drop --no-chat-template "
                              "or put the system text in the prompt")
        pair = resolve_pair(model, draft)
        if pair.demo:
            _note("no --model given: using the bundled demo pair (a tiny Qwen3.5-hybrid Python code "
                  "model and its trained draft, offline); pass --model for a real model")
        raw = read_config(pair.draft, "draft")
        config = draft_classes(raw)[1].from_dict(raw)
        trained = config.block_size
        if tree_budget:
            config = read_config(pair.target, "target")
            context = (config.get("text_config") or config).get("max_position_embeddings")
            validate.tree_budget(tree_budget, context, "--tree-budget")
        validate.block_size(block_size, trained, "--block-size", warn=lambda m: _note(f"warning: {m}"))
        if schedule is not None:  # typed: refused where no schedule would run
            options["confidence_schedule"] = validate.confidence_schedule(
                schedule, getattr(config, "enable_confidence_head", False), block_size, tree_budget, True,
                "--confidence-schedule")
        chat = None
        if not no_chat_template:
            chat = dict(system=system, enable_thinking=pair.enable_thinking if thinking is None else thinking)
        from .distributed import session

        with session(distributed) as launch:
            _run(pair.target, pair.draft, text, chat, stop, demo if show_drafts is None else show_drafts, no_color,
                 launch, draft_dtype, block_size=block_size, tree_budget=tree_budget, images=image or None, **options)
    except DFlashError as e:
        _fail(str(e))


def _run(model_id: str, draft_id: str, text: str, chat: Optional[dict], stops: list[str],
         show_drafts: bool, no_color: bool, launch=None, draft_dtype: str = "auto", **options) -> None:
    """Load the pair, template the prompt (``chat``: apply_template's options, or None for the text as is)
    and stream the output up to the first of ``stops``, styled by origin when ``show_drafts`` and stdout
    shows colors; the figures go to stderr. ``launch``: this rank of a distributed launch
    (``distributed.Launch``); ``draft_dtype``: ``--draft-dtype``."""
    from .chat import apply_template, has_template, thinking_note
    from .display import LEGEND, Output, Tally, styled_console
    from .generate import stream_generate
    from .loading import load, load_draft
    from .validate import UntrainedBlockWarning
    from .vision import user_turn

    model, tokenizer = launch.load(model_id) if launch else load(model_id)
    draft = load_draft(draft_id, dtype=draft_dtype)
    if chat is not None:  # without a template, apply_template joins the messages (as the server does)
        text = apply_template(tokenizer, user_turn(text, options.get("images")), **chat)
    note = thinking_note(chat["enable_thinking"]) if chat is not None and has_template(tokenizer) else None
    console = styled_console(no_color) if show_drafts else None
    output = Output(stops, console, tokenizer.detokenizer)
    tally = Tally()
    stopped = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntrainedBlockWarning)  # the command warned already
        warnings.showwarning = lambda message, *_: _note(f"warning: {message}")  # one line, no source
        for r in (launch.stream_generate if launch else stream_generate)(model, draft, tokenizer, text, **options):
            if tally.last is None:  # once the pair and prompt passed every check
                for line in (note, console and LEGEND):
                    if line:
                        _note(line)
            stopped = output.write(r)
            tally.add(r, options.get("tree_budget"))
            if stopped:
                break
    output.close(stopped)
    _note(tally.summary(options["block_size"], options.get("tree_budget"), stopped))


@app.command()
def models():
    """List the known target -> draft pairs (used when --draft is not given), their
    sizes and whether they fit this machine, and the drafts whose targets cannot run."""
    from .precision import device_description
    from .registry import BITS, listing, memory_budget

    budget = memory_budget(device_description())
    pairs, others = listing(budget)
    head = ["target", "draft", "thinking", "block", *(f"{b} GB" for b in BITS), "fits"]
    for rows in ([head, *pairs], [["cannot run", "draft", "why"], *others]):
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        typer.echo("")
    memory = f"{budget / 1e9:.0f} GB" if budget else "unknown"
    typer.echo(f"Sizes: the target's weights (bf16; mlx-lm 8-/4-bit, group 64), drafts add 1-3 GB. fits: the widest "
               f"that fits this machine's model memory ({memory}) with 10% spare, or 'on N Macs' like it, sharded with "
               "--distributed (docs/distributed.md). mlx-community/<name>-4bit / -8bit "
               "targets use the draft of <name>. thinking: the chat template's default for the pair "
               "(--thinking / --no-thinking); block: the draft's trained block size.")


@app.command()
def convert(
    ctx: typer.Context,
    src: Optional[str] = typer.Argument(None, help="Draft to convert (DFlash, DFlash2 or DSpark): a local directory or a hub repo id."),
    out: str = typer.Option(..., "--out", "-o", help="Output directory (written atomically)."),
    target: Optional[str] = typer.Option(None, "--target", help="Convert this target model (hub id or directory) with mlx-lm's converter instead of a draft."),
    quantize: bool = typer.Option(False, "--quantize", "-q", help="Quantize (4 bits unless --q-bits)."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="Bits per weight, 4 or 8; implies -q."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Quantization group size: 32, 64 or 128."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Drafts: mixed_4_8 (fc and the last layer at 8 bits, the rest at 4). Targets: an mlx-lm recipe (mixed_3_6, ...)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float16, bfloat16 or float32 for unquantized tensors and scales. Default: keep the source's."),
    quantize_heads: bool = typer.Option(False, "--quantize-heads", help="DSpark drafts, with -q: quantize the Markov and confidence heads too (else they stay float; docs/dspark.md)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
):
    """Convert a z-lab DFlash draft to MLX, optionally 4/8-bit quantized (or a target, with --target)."""
    if (src is None) == (target is None):
        _fail("give either a draft SRC or --target MODEL, not both or neither")
    try:
        from dflash_mlx.convert import convert_draft, convert_target
        from dflash_mlx.convert.draft import check_options
        from .validate import needs

        needs(_given(ctx), ["--q-group-size", "--quantize-heads"], "--quantize, --q-bits or --recipe", quantize or q_bits or recipe)
        needs(_given(ctx), ["--quantize-heads"], "a draft SRC (targets have no DSpark heads)", target is None)
        check_options(q_bits, q_group_size, dtype, None if target else recipe)
        if target is not None:
            convert_target(target, out, quantize=quantize, bits=q_bits, group_size=q_group_size,
                           dtype=dtype, recipe=recipe, force=force)
        else:
            bits = q_bits or (4 if quantize or recipe else None)
            convert_draft(src, out, bits=bits, group_size=q_group_size, dtype=dtype, recipe=recipe,
                          quantize_heads=quantize_heads, force=force, log=lambda m: typer.echo(m, err=True))
    except DFlashError as e:
        _fail(str(e))
    typer.echo(f"wrote {out}", err=True)


@app.command("draft-vocab")
def draft_vocab(
    corpus: list[str] = typer.Argument(..., help="Text or JSONL files or directories, read as `dflash-mlx train --data` reads them."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target whose tokenizer counts the corpus (the bundled demo pair keeps the ranking it ships with)."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft directory of --model to store the ranking in. Default: the registry's draft for --model."),
):
    """Rank the target's vocabulary by frequency in a corpus and store it beside the draft, for --draft-vocab N."""
    try:
        from .vocab_ranking import rank_for_draft

        path, vocab_size, counted = rank_for_draft(corpus, model, draft)
    except DFlashError as e:
        _fail(str(e))
    _note(f"wrote {path}: {vocab_size} ids ranked by frequency over {counted} corpus tokens")


@app.command()
def doctor(
    no_check: bool = typer.Option(False, "--no-check", help="Do not run the kernels' self-checks (they only run where Metal is available)."),
):
    """Platform, MLX backend, Metal, each custom kernel's status and, on Linux, the BLAS in use."""
    from .doctor import main

    raise typer.Exit(main(check=not no_check, echo=typer.echo))


@app.command()
def train(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", "-m", help="Target: hub repo id or local mlx-lm directory."),
    out: str = typer.Option(..., "--out", "-o", help="Run directory: checkpoints/, draft/ (MLX layout), eval.json."),
    data: list[str] = typer.Option([], "--data", help="Text or JSONL file or directory; repeat for more. JSONL records: text, prompt (+ completion) or messages."),
    self_distill: bool = typer.Option(False, "--self-distill", help="Train on the target's own greedy continuations of prompts from --data (the published recipe)."),
    layers: int = typer.Option(1, "--layers", help="Draft layers."),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="Comma-separated target layers to read features from. Default: one per draft layer, spread over 1..L-3."),
    block_size: int = typer.Option(16, "--block-size", "-b", help="Block size the draft is trained for."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="Default: the tokenizer's mask token, else the last vocabulary id."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Attention heads (default: the target's)."),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="KV heads (default: the target's)."),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help="Head dimension (default: the target's)."),
    intermediate_size: Optional[int] = typer.Option(None, "--intermediate-size", help="MLP width (default: the target's)."),
    sliding_window: Optional[int] = typer.Option(None, "--sliding-window", help="Make all layers but the last sliding-window layers."),
    arch: str = typer.Option("dflash", "--arch", help="dflash (v1), dflash2 (conv-wrapped sublayers and a candidate selector; see docs/dflash2.md) or dspark (anchor-first block, Markov and confidence heads; see docs/training.md)."),
    conv: str = typer.Option("2,16", "--conv", help="dflash2: K,GS: taps of each block convolution, channels sharing a dynamic tap (GS divides the hidden size)."),
    selector: str = typer.Option("256,16", "--selector", help="dflash2: R,k: rank of the selector's codebooks (2 x vocabulary x R weights), candidates per row."),
    selector_weight: float = typer.Option(1.0, "--selector-weight", help="dflash2: weight of the selector's loss beside the block loss."), markov_rank: int = typer.Option(256, "--markov-rank", help="dspark: rank r of the Markov head (2 x vocabulary x r weights; 0: none)."),
    steps: int = typer.Option(1000, "--steps", help="Optimizer steps."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per micro-batch."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per training sequence."),
    blocks_per_seq: int = typer.Option(8, "--blocks-per-seq", help="Anchored blocks trained per sequence."),
    gamma: float = typer.Option(7.0, "--gamma", help="Loss weight exp(-(k-1)/gamma) at block position k."),
    lr: float = typer.Option(1e-3, "--lr", help="Peak learning rate (AdamW)."),
    warmup: int = typer.Option(100, "--warmup", help="Linear warmup steps before the cosine decay."),
    min_lr_ratio: float = typer.Option(0.1, "--min-lr-ratio", help="The cosine decays to lr * this."),
    weight_decay: float = typer.Option(0.01, "--weight-decay"),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    grad_clip: float = typer.Option(1.0, "--grad-clip", help="Global gradient-norm clip (0: off)."),
    num_prompts: int = typer.Option(2000, "--num-prompts", help="Self-distillation: prompts to continue."),
    distill_tokens: int = typer.Option(192, "--distill-tokens", help="Self-distillation: greedy tokens per prompt."),
    cache_features: bool = typer.Option(False, "--cache-features", help="Self-distillation: run the target once per sequence and keep its features (float16) in memory."),
    eval_prompts: Optional[list[str]] = typer.Option(None, "--eval-prompts", help="Held-out prompts (text/JSONL). Default: held out from --data."),
    eval_count: int = typer.Option(8, "--eval-count", help="Held-out prompts for the tau eval (0: none)."),
    eval_tokens: int = typer.Option(128, "--eval-tokens", help="Tokens generated per eval prompt."),
    eval_every: int = typer.Option(0, "--eval-every", help="Also eval every N checkpoints (0: at the end only)."),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every", help="Steps between checkpoints."),
    seed: int = typer.Option(0, "--seed"),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Continue exactly from the last checkpoint in --out."),
    export_hf: Optional[str] = typer.Option(None, "--export-hf", help="Also write the z-lab Hugging Face layout here (for vLLM / SGLang)."),
    hf_dtype: str = typer.Option("bfloat16", "--hf-dtype", help="dtype of the --export-hf weights."),
):
    """Train a DFlash draft for a target (block-diffusion objective, frozen target)."""
    _call(".train.command", "run_cli", **locals())


@app.command()
def bench(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: hub repo id or local mlx-lm directory. Default: the bundled demo pair."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="DFlash draft. Default: the registry's draft for --model (or the demo pair's)."),
    prompts: str = typer.Option("builtin", "--prompts", "-p", help="builtin (32 tagged prompts), demo (the demo pair's held-out prompts) or a JSONL file of {prompt, category, id}."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="Tokens generated per run."),
    block_size: Optional[list[str]] = typer.Option(None, "--block-size", "-b", help="Block size(s) to compare: integers or auto (chosen per cycle); repeat or comma-separate (e.g. -b auto,16,8,4). Default: auto."),
    temp: float = typer.Option(0.0, "--temp", "-t", help="Sampling temperature (0: greedy, where token identity is checked)."),
    top_p: float = typer.Option(1.0, "--top-p"), top_k: int = typer.Option(0, "--top-k"), min_p: float = typer.Option(0.0, "--min-p"),
    seed: int = typer.Option(0, "--seed", help="Random seed of both sides when sampling."),
    tree_budget: Optional[list[str]] = typer.Option(None, "--tree-budget", help="Also run a DDTree of up to B drafted nodes per cycle, at the first integer --block-size (else the draft's trained size); repeat or comma-separate (e.g. --tree-budget 16,32). 0: the chain only. With --predict: price each tree's verify over B+1 positions."),
    repeat: int = typer.Option(1, "--repeat", "-r", help="Runs per prompt and arm."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use at most N prompts, taken round-robin over categories."),
    category: Optional[list[str]] = typer.Option(None, "--category", help="Only these prompt categories (repeatable)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (float32 on the CPU backend, else as stored), keep, float32, float16 or bfloat16."),
    draft_dtype: str = typer.Option("auto", "--draft-dtype", help=DRAFT_DTYPE_HELP + " Other than auto it sets the draft's dtype apart from --dtype."),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Feed prompts as is."),
    thinking: Optional[bool] = typer.Option(None, "--thinking/--no-thinking", help=THINKING_HELP, show_default=False),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="One untimed short run of every arm first."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write every raw figure, the machine and the config here."),
    plot_out: Optional[str] = typer.Option(None, "--plot", help="Write a PNG chart (needs the plot extra: matplotlib)."),
    predict: bool = typer.Option(False, "--predict", help="No run: predict the speedup on Apple M-series chips from bytes and FLOPs."),
    tau: Optional[float] = typer.Option(None, "--tau", help="--predict: the acceptance length tau at the first --block-size (others extrapolated)."),
    tree_tau: Optional[float] = typer.Option(None, "--tree-tau", help="--predict: tokens per cycle expected of every --tree-budget arm. Default: measured in --results for that budget and block, else the chain's tau at the tree's block (no gain assumed; the 'tie tau' column says what the tree must reach)."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", help="Every DFlash arm drafts over the N most frequent ids (the ranking beside the draft; see `dflash-mlx draft-vocab`)."),
    confidence_schedule: Optional[list[str]] = typer.Option(None, "--confidence-schedule", help="on, off or on,off: run the auto arm of a DSpark draft with a confidence head with its confidence schedule, without it (every draft of auto's block verified), or both as two arms. Default: on."),
    results: Optional[str] = typer.Option(None, "--results", help="--predict: take tau (and the pair) from a bench --json report."),
    preset: Optional[str] = typer.Option(None, "--preset", help="--predict: a published model instead of --model/--draft (qwen3.5-4b, qwen3.5-9b, qwen3.5-27b-4bit, qwen3.5-35b-a3b-4bit)."),
    chip: Optional[list[str]] = typer.Option(None, "--chip", help="--predict: only these chips (e.g. 'M5 Max'); default: all."),
    context: Optional[list[str]] = typer.Option(None, "--context", help="Context lengths in tokens, e.g. 1k,4k,8k (k = 1024); repeat or comma-separate. A measured run uses 3 prompts of each length (--limit N: N) cut from Python's standard library sources instead of --prompts, skips a length past the target's context, and adds a table per context; --synthetic measures the random target at each; --predict prices one (default 1024)."),
    neural_accelerators: bool = typer.Option(False, "--neural-accelerators", help="--predict: M5 chips at Apple's claimed GPU Neural Accelerator matmul rate."),
    overhead_ms: float = typer.Option(0.0, "--overhead-ms", help="--predict: fixed cost added to every forward pass."),
    synthetic: bool = typer.Option(False, "--synthetic", help="No model: a random ~200M-parameter target built in memory, decoded with oracle drafts right for all, half or none of each block; prints the loop's efficiency (measured over ideal speedup)."),
    calibrate: bool = typer.Option(False, "--calibrate", help="No run: measure the pair's cost per cycle at each block size on this machine (what --block-size auto uses), cache and print it."),
    kv_bits: Optional[int] = KV_BITS, kv_group_size: int = KV_GROUP_SIZE, quantized_kv_start: int = QUANTIZED_KV_START,
    distributed: Optional[str] = typer.Option(None, "--distributed", help="tensor or pipeline: a measured run on a target sharded over the processes mlx.launch started (only rank 0 prints and writes); with --predict --machines, price only this sharding (default: both). docs/distributed.md."),
    machines: int = typer.Option(1, "--machines", help="--predict: price the target sharded over this many Macs of each --chip, linked by --link."),
    link: str = typer.Option("tb5", "--link", help="--predict --machines: tb5 (Thunderbolt 5 RDMA, JACCL backend), tb5-ring or tb4-ring (TCP, ring backend); figures and sources in docs/distributed.md."),
    link_latency_us: Optional[float] = typer.Option(None, "--link-latency-us", help="--predict --machines: the link's latency per collective step, in microseconds, instead of --link's."),
    link_gbs: Optional[float] = typer.Option(None, "--link-gbs", help="--predict --machines: the link's bandwidth one way, in GB/s, instead of --link's."),
    concurrency: Optional[list[str]] = typer.Option(None, "--concurrency", help="Widths N, e.g. 1,2,4,8: the prompts in waves of N requests at once, mlx-lm's batched decoding beside DFlash's batch decoder (greedy, one --block-size): aggregate tok/s, latency, time to first token, identity. docs/benchmarks.md."),
):
    """Baseline (mlx-lm), DFlash chains and DDTrees side by side: speedup, tau, acceptance, memory, identity."""
    _call(".bench.command", "main", **locals())


@app.command()
def serve(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: hub repo id or local mlx-lm directory. Default: the bundled demo pair (offline)."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="DFlash draft. Default: the registry's draft for --model."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; anything but loopback exposes the server."), port: int = typer.Option(8080, "--port", help="TCP port."),
    max_tokens_limit: int = typer.Option(4096, "--max-tokens-limit", help="Largest max_tokens a request may ask for (and the default)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DFLASH_MLX_API_KEY", help="Require 'Authorization: Bearer KEY' on every route."),
    max_queue: int = typer.Option(32, "--max-queue", help="Requests that may wait behind those decoding; more get HTTP 429."),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help="Requests decoded at once, as the rows of one batch; more wait in the queue (docs/serve.md). 1: one at a time. Default: 8."),
    prefix_cache_gb: float = typer.Option(2.0, "--prefix-cache-gb", help="Memory for reusing earlier requests' caches (0: off)."),
    prefix_cache_dir: Optional[str] = typer.Option(None, "--prefix-cache-dir", help="The prefix cache's disk tier (docs/serve.md). Default: ~/.cache/dflash-mlx/prefix-cache."), prefix_cache_disk_gb: float = typer.Option(16.0, "--prefix-cache-disk-gb", help="Disk for it, least recently used first out (0: off)."), prefix_cache_disk: bool = typer.Option(True, "--prefix-cache-disk/--no-prefix-cache-disk", help="Off: nothing written to disk (SSD wear)."),
    block_size: str = typer.Option("auto", "--block-size", "-b", help="Tokens per draft block: auto (chosen each cycle from measured costs and acceptance) or 2 to twice the draft's trained size."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", help="Draft over the N most frequent ids (the ranking beside the draft; see `dflash-mlx draft-vocab`)."),
    distributed: Optional[str] = typer.Option(None, "--distributed", help="tensor or pipeline: shard the target over the processes mlx.launch started (docs/distributed.md); rank 0 serves HTTP, the others follow."),
    draft_dtype: str = typer.Option("auto", "--draft-dtype", help=DRAFT_DTYPE_HELP + " /health names the dtype chosen."),
    kv_bits: Optional[int] = KV_BITS, kv_group_size: int = KV_GROUP_SIZE, quantized_kv_start: int = QUANTIZED_KV_START,
):
    """OpenAI-compatible HTTP server (chat and text completions, streaming) over one DFlash pair."""
    _call(".server.command", "main", **locals())
