"""``dflash-mlx bench``: its options, checked before any model loads, then the
measured run (``main_run``: the baseline, the chain at each block size and the
DDTree of each budget), with ``--concurrency`` the batched one
(``bench.concurrency.main_concurrency``) or, with ``--predict``, the cost model
(``bench.predict.main_predict``)."""

from typing import Callable, Optional

from .. import validate
from ..chat import has_template, thinking_note
from ..distributed import session, shared_cost_curve, talks
from ..draft import draft_classes, is_dflash2, is_dspark
from ..errors import DFlashError
from ..loop import Watched
from ..loop.cost_curve import cost_curve
from ..precision import choose_draft_dtype, dtype_name
from ..registry import read_config, resolve_pair
from ..targets import Target
from .calibrate import load_pair, main_calibrate
from .cluster import MODES, find_link, main_predict_cluster
from .concurrency import main_concurrency, parse_width
from .cost_model import context_length
from .long_context import PROMPTS_PER_CONTEXT, context_prompts, context_summary, fitting, parse_context, render_contexts
from .predict import main_predict, main_predict_batch
from .prompts import select_prompts
from .render import NO_MATPLOTLIB, console, plot, render, stepping
from .report import check_output_file, machine_info, make_report, validate_report, write_json
from .runs import run_bench, sharded_runners
from .schedule import arms
from .synthetic import main_synthetic

DTYPES = ("float32", "float16", "bfloat16")
FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temp", "top_p": "--top-p",
         "top_k": "--top-k", "min_p": "--min-p", "seed": "--seed", "draft_vocab": "--draft-vocab"}


def _listed(values: Optional[list[str]], parse: Callable, name: str) -> list:
    """Repeated and/or comma-separated option values, each parsed, in order,
    without duplicates; ``parse`` returns None for a value that adds nothing.
    A value with nothing between its commas is an error, not the default."""
    out = []
    for v in values or []:
        parts = [part.strip() for part in str(v).split(",") if part.strip()]
        if not parts:
            raise DFlashError(f"Invalid value for '{name}': '{v}' names nothing")
        for item in map(parse, parts):
            if item is not None and item not in out:
                out.append(item)
    return out


_PAIR = {"--model", "--draft"}
_PROMPTS = {"--prompts", "--max-tokens", "--block-size", "--repeat", "--limit", "--category", "--dtype", "--draft-dtype",
            "--no-chat-template", "--thinking/--no-thinking", "--warmup/--no-warmup", "--json"}
_PRICED = _PAIR | {"--preset", "--tau", "--block-size", "--chip", "--context", "--dtype", "--json"}
_KV = {"--kv-bits", "--kv-group-size", "--quantized-kv-start"}
# the options each mode uses; another one given is refused rather than ignored
USES = {
    "a measured bench run": _PAIR | _PROMPTS | _KV | {"--temp", "--top-p", "--top-k", "--min-p", "--seed",
                                                      "--tree-budget", "--plot", "--draft-vocab", "--context",
                                                      "--distributed", "--confidence-schedule"},
    "bench --concurrency": _PAIR | _PROMPTS | {"--concurrency"},
    "bench --calibrate": _PAIR | {"--calibrate", "--dtype", "--draft-dtype"},
    "bench --synthetic": {"--synthetic", "--block-size", "--max-tokens", "--context"},
    "bench --predict": _PRICED | _KV | {"--predict", "--tree-tau", "--results", "--tree-budget", "--draft-vocab",
                                        "--neural-accelerators", "--overhead-ms"},
    "bench --predict --concurrency": _PRICED | {"--predict", "--concurrency", "--neural-accelerators", "--overhead-ms"},
    "bench --predict --machines": _PRICED | {"--predict", "--machines", "--distributed", "--link",
                                             "--link-latency-us", "--link-gbs"},
}


def _used(given: set[str], mode: str, json_out: Optional[str]) -> None:
    """Refuse what ``mode`` would ignore among the options ``given``, then a
    --json file that cannot be written (checked before any run)."""
    unused = [flag for flag in sorted(given) if flag not in USES[mode]]
    if unused:
        raise DFlashError(f"leave out {', '.join(unused)}: {mode} does not use {'it' if len(unused) == 1 else 'them'}")
    _output_file(json_out, "--json")


def _output_file(path: Optional[str], flag: str) -> None:
    """DFlashError unless ``path`` is None or names a file that can be written."""
    if path is None:
        return
    if not path.strip():
        raise DFlashError(f"{flag} needs a file name, got ''")
    check_output_file(path, flag)
    validate.writable(path, flag)


def parse_block_sizes(values: Optional[list[str]]) -> Optional[list]:
    """``--block-size``: integers or ``auto``; None when none is given."""
    return _listed(values, lambda part: validate.block_option(part, "--block-size"), "--block-size") or None


def _budget(text: str) -> Optional[int]:
    try:
        value = int(text)
    except ValueError:
        raise DFlashError(f"Invalid value for '--tree-budget': '{text}' is not an integer") from None
    return validate.tree_budget(value, None, "--tree-budget")


def parse_contexts(values: Optional[list[str]]) -> list[int]:
    """``--context``: token counts such as 4096 or 4k (4 x 1024)."""
    return _listed(values, parse_context, "--context")


def parse_concurrency(values: Optional[list[str]]) -> list[int]:
    """``--concurrency``: widths, integers >= 1 (requests decoded at once)."""
    return _listed(values, parse_width, "--concurrency")


def parse_schedules(values: Optional[list[str]]) -> list[bool]:
    """``--confidence-schedule``: on and/or off (the auto arm with and without the schedule)."""
    return _listed(values, lambda part: validate.switch(part, "--confidence-schedule"), "--confidence-schedule")


def parse_tree_budgets(values: Optional[list[str]]) -> list[int]:
    """``--tree-budget``: integers >= 1, or 0 for the chain (which every run has)."""
    return _listed(values, _budget, "--tree-budget")


def main(*, given: set[str], model: Optional[str], draft: Optional[str], prompts: str, max_tokens: int,
         block_size: Optional[list[str]], tree_budget: Optional[list[str]], temp: float,
         top_p: float, top_k: int, min_p: float, seed: int, repeat: int, limit: Optional[int],
         category: Optional[list[str]], dtype: str, no_chat_template: bool,
         thinking: Optional[bool], warmup: bool, json_out: Optional[str], plot_out: Optional[str],
         predict: bool, tau: Optional[float], tree_tau: Optional[float], results: Optional[str],
         preset: Optional[str], chip: Optional[list[str]], context: Optional[list[str]],
         neural_accelerators: bool, overhead_ms: float, calibrate: bool, synthetic: bool,
         draft_vocab: Optional[int] = None, draft_dtype: str = "auto", kv_bits: Optional[int] = None,
         kv_group_size: int = 64, quantized_kv_start: int = 5000, distributed: Optional[str] = None,
         machines: int = 1, link: str = "tb5", link_latency_us: Optional[float] = None,
         link_gbs: Optional[float] = None, concurrency: Optional[list[str]] = None,
         confidence_schedule: Optional[list[str]] = None) -> None:
    """Everything ``dflash-mlx bench`` does, from its options as typed (``given``:
    those typed on the command line; one the chosen mode would ignore is refused)."""
    validate.needs(given, ["--link", "--link-latency-us", "--link-gbs"], "--machines", machines != 1)
    validate.needs(given, validate.KV_TUNING, "--kv-bits", kv_bits is not None)
    widths = parse_concurrency(concurrency)
    sizes = parse_block_sizes(block_size)
    budgets = parse_tree_budgets(tree_budget)
    contexts = parse_contexts(context)
    schedules = parse_schedules(confidence_schedule)
    kv = validate.kv_options(kv_bits, kv_group_size, quantized_kv_start)
    if kv and (calibrate or synthetic or distributed):
        raise DFlashError("--kv-bits applies to a measured run or --predict, not --calibrate, --synthetic "
                          "or --distributed")
    if contexts and calibrate:
        raise DFlashError("--context applies to a measured run, --synthetic or --predict, not --calibrate")
    if contexts and (category or prompts != "builtin"):
        raise DFlashError("--context makes its own prompts (one category per length); leave out --prompts and --category")
    if dtype not in ("auto", "keep", *DTYPES):
        raise DFlashError(f"--dtype must be auto, keep, {', '.join(DTYPES)}; got '{dtype}'")
    choose_draft_dtype({}, draft_dtype)  # a bad value fails before any model loads
    if draft_dtype != "auto" and (predict or synthetic):
        raise DFlashError("--draft-dtype applies to a measured run or --calibrate, not --predict or --synthetic")
    if sum((calibrate, predict, synthetic)) > 1:
        raise DFlashError("--calibrate, --predict and --synthetic are separate modes: give one")
    if budgets and (calibrate or synthetic):
        raise DFlashError("--tree-budget applies to a measured run or --predict, not --calibrate or --synthetic")
    if machines != 1 and not predict:
        raise DFlashError("--machines prices a cluster with --predict; to measure one, run bench under "
                          "mlx.launch with --distributed (docs/distributed.md)")
    if distributed is not None and (calibrate or synthetic):
        raise DFlashError("--distributed applies to a measured run or --predict --machines, "
                          "not --calibrate or --synthetic")
    if widths and predict:
        if sizes and validate.AUTO in sizes:
            raise DFlashError("--predict prices fixed block sizes; leave 'auto' out of --block-size")
        if len(contexts) > 1:
            raise DFlashError("--predict prices one context: give one --context value")
        _used(given, "bench --predict --concurrency", json_out)
        main_predict_batch(model=model, draft=draft, preset=preset, tau=tau, block_sizes=sizes, widths=widths,
                           chips=chip, context=contexts[0] if contexts else 1024,
                           dtype=None if dtype in ("auto", "keep") else dtype, neural=neural_accelerators,
                           overhead_ms=overhead_ms, json_out=json_out)
        return
    if widths:
        _used(given, "bench --concurrency", json_out)
        if sizes and len(sizes) > 1:
            raise DFlashError("--concurrency runs one --block-size (auto or an integer); give one")
        validate.options({"max_tokens": max_tokens}, FLAGS)
        validate.integer(repeat, "--repeat", low=1)
        if limit is not None:
            validate.integer(limit, "--limit", low=1)
        main_concurrency(model=model, draft=draft, prompts=prompts, max_tokens=max_tokens, widths=widths,
                         block_size=sizes[0] if sizes else validate.AUTO, repeat=repeat, limit=limit,
                         categories=category, dtype=dtype, chat_template=not no_chat_template,
                         enable_thinking=thinking, warmup=warmup, json_out=json_out, draft_dtype=draft_dtype)
        return
    if calibrate:
        _used(given, "bench --calibrate", json_out)
        main_calibrate(model=model, draft=draft, dtype=dtype, draft_dtype=draft_dtype)
        return
    if synthetic:
        if sizes and validate.AUTO in sizes:
            raise DFlashError("--synthetic measures fixed block sizes; leave 'auto' out of --block-size")
        validate.options({"max_tokens": max_tokens}, FLAGS)
        _used(given, "bench --synthetic", json_out)
        main_synthetic(sizes or [16], max_tokens, contexts or None)
        return
    if predict:
        if sizes and validate.AUTO in sizes:
            raise DFlashError("--predict prices fixed block sizes; leave 'auto' out of --block-size")
        if len(contexts) > 1:
            raise DFlashError("--predict prices one context: give one --context value")
        if machines != 1 or distributed is not None:
            _used(given, "bench --predict --machines", json_out)
            main_predict_cluster(model=model, draft=draft, preset=preset, tau=tau, block_sizes=sizes, chips=chip,
                                 context=contexts[0] if contexts else 1024,
                                 dtype=None if dtype in ("auto", "keep") else dtype, machines=machines,
                                 link=find_link(link, link_latency_us, link_gbs),
                                 modes=[distributed] if distributed else list(MODES), json_out=json_out)
            return
        _used(given, "bench --predict", json_out)
        main_predict(model=model, draft=draft, preset=preset, tau=tau, results=results,
                     block_sizes=sizes, tree_budgets=budgets, tree_tau=tree_tau, chips=chip,
                     context=contexts[0] if contexts else 1024, kv=kv, dtype=None if dtype in ("auto", "keep") else dtype,
                     neural=neural_accelerators, overhead_ms=overhead_ms, json_out=json_out,
                     draft_vocab=draft_vocab)
        return
    if tau is not None or tree_tau is not None or results or preset:
        raise DFlashError("--tau, --tree-tau, --results and --preset only apply with --predict")
    _used(given, "a measured bench run", json_out)
    sampling = dict(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    validate.options({"max_tokens": max_tokens, "draft_vocab": draft_vocab, **sampling}, FLAGS)
    validate.integer(repeat, "--repeat", low=1)
    if limit is not None:
        validate.integer(limit, "--limit", low=1)
    _output_file(plot_out, "--plot")  # fail before a long run, not after it
    if plot_out:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise DFlashError(NO_MATPLOTLIB) from None
    if distributed is not None and draft_vocab is not None:
        raise DFlashError("--draft-vocab is not supported with --distributed; leave it out")
    with session(distributed) as launch:
        main_run(model=model, draft=draft, prompts=prompts, max_tokens=max_tokens, block_sizes=sizes,
                 tree_budgets=budgets, sampling=sampling, repeat=repeat, limit=limit,
                 categories=category, dtype=dtype, chat_template=not no_chat_template,
                 enable_thinking=thinking, warmup=warmup, json_out=json_out, plot_out=plot_out,
                 draft_vocab=draft_vocab, draft_dtype=draft_dtype, contexts=contexts, kv=kv, launch=launch,
                 schedules=schedules)


def draft_architecture(config: dict) -> str:
    """'dspark', 'dflash2' or 'v1': the architecture a draft config.json names."""
    return "dspark" if is_dspark(config) else "dflash2" if is_dflash2(config) else "v1"


def main_run(*, model: Optional[str], draft: Optional[str], prompts: str, max_tokens: int,
             block_sizes: Optional[list[int]], tree_budgets: list[int], sampling: dict,
             repeat: int, limit: Optional[int], categories: Optional[list[str]], dtype: str,
             chat_template: bool, enable_thinking: Optional[bool], warmup: bool,
             json_out: Optional[str], plot_out: Optional[str], draft_vocab: Optional[int] = None,
             draft_dtype: str = "auto", contexts: Optional[list[int]] = None, kv: Optional[dict] = None,
             launch=None, err=None, out=None, schedules: Optional[list[bool]] = None) -> dict:
    """The measured benchmark: prompts and pair resolved, block sizes checked
    against the draft's config and tree budgets against the target's context
    length before the models load; the tables, then the JSON report and the
    chart. Each tree runs at the first fixed block size given, else at the
    draft's trained size. ``enable_thinking`` None takes the registry's;
    ``draft_dtype`` other than auto sets the draft's dtype apart from ``dtype``.
    ``contexts``: instead of ``prompts``, ``limit`` (default 3) prompts of each
    of these token lengths (``long_context.py``), each that fits the target,
    and the per-context table; ``kv``: both sides quantize the KV cache.
    ``launch``: this rank of a distributed launch (``distributed.Launch``):
    the target is sharded, every rank runs every arm, only rank 0 prints and writes.
    ``schedules``: the auto arm with the confidence schedule on and/or off
    (refused unless the draft has one and auto is among the block sizes);
    default: on where the draft has one, and the report's arms say so."""
    err = err or console(stderr=True)
    out = out or console()
    chosen = None if contexts else select_prompts(prompts, categories, limit)
    pair = resolve_pair(model, draft)
    draft_config = read_config(pair.draft, "draft")
    parsed = draft_classes(draft_config)[1].from_dict(draft_config)
    trained, scheduled = parsed.block_size, getattr(parsed, "enable_confidence_head", False)
    warn = lambda message: err.print(f"warning: {message}", markup=False, highlight=False)  # noqa: E731
    block_sizes = [validate.block_size(b, trained, "--block-size", warn) for b in block_sizes or [validate.AUTO]]
    if schedules:
        validate.confidence_schedule(True, scheduled, validate.AUTO if validate.AUTO in block_sizes else block_sizes[0],
                                     None, True, "--confidence-schedule")
    schedules = (schedules or [True]) if scheduled and validate.AUTO in block_sizes else None
    tree_block = None
    if tree_budgets:
        tree_block = next((b for b in block_sizes if b != validate.AUTO), trained)
        context = context_length(read_config(pair.target, "target"))
        for budget in tree_budgets:
            validate.tree_budget(budget, context, "--tree-budget")
    dflash_arms = arms(block_sizes, tree_budgets, tree_block, schedules)
    if contexts:
        contexts = fitting(contexts, max_tokens, context_length(read_config(pair.target, "target")), warn)
    thinking = pair.enable_thinking if enable_thinking is None else enable_thinking
    target, tokenizer, dft, dtype = load_pair(pair, dtype, draft_dtype, launch)
    if contexts:
        chosen = context_prompts(tokenizer, contexts, limit or PROMPTS_PER_CONTEXT)
    if chat_template and has_template(tokenizer):
        err.print(thinking_note(thinking), markup=False, highlight=False)
    curve = None
    # measured (or read) here, off the clock of every run, and held: each run watches it for drift as a user's
    # generation does (Watched), but never measures it again; ranks decide alike on it as it is
    if validate.AUTO in block_sizes:
        curve = shared_cost_curve(target, dft, launch.group) if launch else cost_curve(Target(target), dft)
    steps = (len(chosen) * repeat + int(warmup)) * (1 + len(dflash_arms))
    with stepping(err, "bench", steps, remaining=True) as on_step:
        result = run_bench(target, dft, tokenizer, chosen, arms=dflash_arms,
                           max_tokens=max_tokens, repeat=repeat, sampling=sampling,
                           chat_template=chat_template, enable_thinking=thinking,
                           warmup_tokens=16 if warmup else 0, on_step=on_step, draft_vocab=draft_vocab, kv=kv,
                           cost_curve=curve if launch or curve is None else Watched(curve),
                           runners=sharded_runners(launch) if launch else None)
    config = {"model": pair.target, "draft": pair.draft, "max_tokens": max_tokens,
              "block_sizes": block_sizes, "tree_budgets": tree_budgets, "tree_block_size": tree_block,
              "confidence_schedules": schedules,
              "repeat": repeat, **sampling, "dtype": "checkpoint" if dtype == "keep" else dtype,
              "chat_template": chat_template, "enable_thinking": thinking, "prompts": prompts,
              "categories": categories, "limit": limit, "warmup": warmup,
              "draft_trained_block_size": trained, "draft_vocab": draft_vocab, "draft_dtype": dtype_name(dft),
              "draft_architecture": draft_architecture(draft_config),
              "contexts": contexts, "kv": kv, "cost_curve": curve.to_dict() if curve else None,
              "distributed": f"{launch.mode} x{launch.group.size()}" if launch else None}
    report = make_report(result, config, machine_info())
    validate_report(report)
    render(report, out)
    if contexts:
        report["contexts"] = context_summary(result["runs"], result["pairs"], dflash_arms, contexts)
        render_contexts(report["contexts"], out)
    if json_out and (launch is None or talks(launch.group)):
        write_json(report, json_out)
        err.print(f"wrote {json_out}")
    if plot_out and (launch is None or talks(launch.group)):
        plot(report, plot_out)
        err.print(f"wrote {plot_out}")
    return report
