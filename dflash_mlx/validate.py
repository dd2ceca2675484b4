"""Type and range checks of every public argument, shared by the Python API
(``stream_generate``) and the command line, which checks before loading any
model. Each failure is a one-line ``DFlashError`` naming the argument as the
caller knows it (``max_tokens`` in Python, ``--max-tokens`` on the command line).
"""

import math
import tempfile
import warnings
from numbers import Integral, Real
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from .errors import DFlashError

MAX_SEED = 2**64  # mx.random.seed takes an unsigned 64-bit integer
BLOCK_CAP_FACTOR = 2  # a block may be at most this many times the draft's trained size
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs (a quantized KV cache, kv_quantization.py)
KV_GROUP_SIZES = (32, 64, 128)
AUTO = "auto"  # block_size: chosen per cycle from the cost curve and acceptance (loop/block_policy.py)


class UntrainedBlockWarning(UserWarning):
    """A block size above the draft's trained block size."""


class LongPromptWarning(UserWarning):
    """A prompt longer than the target's context length."""


def integer(value, name: str, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """An integer (not a bool, not a float) in [low, high)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise DFlashError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise DFlashError(f"{name} must be {'positive' if low == 1 else f'>= {low}'}, got {value}")
    if high is not None and value >= high:
        raise DFlashError(f"{name} must be below {high}, got {value}")
    return int(value)


def real(value, name: str, low: Optional[float] = None, high: Optional[float] = None,
         open_low: bool = False) -> float:
    """A finite number (not a bool) in [low, high], or (low, high] with ``open_low``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise DFlashError(f"{name} must be a finite number, got {value!r}")
    below = low is not None and (value <= low if open_low else value < low)
    if below or (high is not None and value > high):
        rule = (f"{'>' if open_low else '>='} {low:g}" if high is None
                else f"in {'(' if open_low else '['}{low:g}, {high:g}]")
        raise DFlashError(f"{name} must be {rule}, got {value:g}")
    return float(value)


def one_of(value, name: str, allowed: tuple) -> int:
    """An integer that is one of ``allowed``."""
    if integer(value, name) not in allowed:
        raise DFlashError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value}")
    return int(value)


def optional(check: Callable) -> Callable:
    """``check`` for a value that may also be None."""
    return lambda value, name: None if value is None else check(value, name)


# The numeric options of stream_generate (and the CLI flags that map to them).
RULES: dict[str, Callable] = {
    "max_tokens": lambda v, n: integer(v, n, low=1),
    "prefill_step_size": lambda v, n: integer(v, n, low=1),
    "temperature": lambda v, n: real(v, n, low=0.0),
    "top_p": lambda v, n: real(v, n, low=0.0, high=1.0, open_low=True),
    "top_k": lambda v, n: integer(v, n, low=0),
    "min_p": lambda v, n: real(v, n, low=0.0, high=1.0),
    "seed": optional(lambda v, n: integer(v, n, low=0, high=MAX_SEED)),
    "repetition_penalty": optional(lambda v, n: real(v, n, low=0.0, open_low=True)),
    "repetition_context_size": lambda v, n: integer(v, n, low=1),
    "presence_penalty": optional(real),
    "frequency_penalty": optional(real),
    "draft_vocab": optional(lambda v, n: integer(v, n, low=1)),
    "kv_bits": optional(lambda v, n: one_of(v, n, KV_BITS)),
    "kv_group_size": lambda v, n: one_of(v, n, KV_GROUP_SIZES),
    "quantized_kv_start": lambda v, n: integer(v, n, low=0),
}


def options(values: dict, flags: Optional[dict] = None) -> None:
    """Check every ``RULES`` option in ``values``, naming it ``flags[key]`` if given."""
    for key, value in values.items():
        RULES[key](value, (flags or {}).get(key, key))


KV_FLAGS = {"kv_bits": "--kv-bits", "kv_group_size": "--kv-group-size", "quantized_kv_start": "--quantized-kv-start"}
KV_TUNING = ["--kv-group-size", "--quantized-kv-start"]  # each does nothing without --kv-bits


def kv_options(bits: Optional[int], group_size: int, start: int, given: frozenset = frozenset()) -> Optional[dict]:
    """The quantized KV cache's ``stream_generate`` arguments from the command
    line's ``--kv-bits``, ``--kv-group-size`` and ``--quantized-kv-start``
    (checked; ``given``: the options typed, the latter two refused without
    ``--kv-bits``), or None without ``--kv-bits``."""
    needs(given, KV_TUNING, "--kv-bits", bits is not None)
    if bits is None:
        return None
    kv = {"kv_bits": bits, "kv_group_size": group_size, "quantized_kv_start": start}
    options(kv, KV_FLAGS)
    return kv


def needs(given: set[str], flags, needed: str, present) -> None:
    """DFlashError naming the command-line ``flags`` among ``given`` (those
    typed) when what they act through, ``needed``, is not ``present``: an
    option that would do nothing is refused, not ignored."""
    typed = [flag for flag in flags if flag in given]
    if typed and not present:
        one = len(typed) == 1
        raise DFlashError(f"{', '.join(typed)} {'does' if one else 'do'} nothing without {needed}; "
                          f"give {needed} or leave {'it' if one else 'them'} out")


def block_option(text: str, name: str = "--block-size") -> Union[int, str]:
    """A command-line block size: ``auto`` or an integer of at least 2."""
    if text.strip() == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise DFlashError(f"Invalid value for '{name}': '{text}' is not an integer or 'auto'") from None
    if value < 2:
        raise DFlashError(f"{name} must be at least 2, got {value}")
    return value


SWITCH = {"on": True, "off": False}  # the command line's spelling of a switch such as --confidence-schedule


def switch(text: str, name: str) -> bool:
    """A command-line on/off value."""
    if text.strip().lower() not in SWITCH:
        raise DFlashError(f"Invalid value for '{name}': '{text}' is not on or off")
    return SWITCH[text.strip().lower()]


def confidence_schedule(value, scheduled: bool, block_size, tree_budget, given: bool,
                        name: str = "confidence_schedule") -> bool:
    """``value`` (a bool), refused where ``given`` (False in Python, typed on the
    command line) but no confidence schedule would run: that needs block size
    auto, the chain (no tree budget) and a draft that is ``scheduled`` (DSpark,
    with a confidence head; docs/dspark.md)."""
    if not isinstance(value, bool):
        raise DFlashError(f"{name} must be True or False, got {value!r}")
    if given and (block_size != AUTO or tree_budget or not scheduled):
        why = ("the draft has no confidence head (a DSpark draft's)" if not scheduled else
               "a tree verifies every node" if tree_budget else "a fixed block verifies every draft")
        raise DFlashError(f"{name} does nothing here: {why}; the confidence schedule runs only under "
                          f"block size '{AUTO}' on the chain; leave it out")
    return value


def block_size(value, trained: int, name: str = "block_size",
               warn: Optional[Callable[[str], None]] = None) -> Union[int, str]:
    """``"auto"``, or an integer from 2 to ``BLOCK_CAP_FACTOR`` times the draft's trained block size.

    Above the trained size the draft predicts positions it never learned: that
    is allowed, with a warning (``warn(message)``, by default an
    ``UntrainedBlockWarning``); beyond the cap those positions are all but never
    accepted while each still costs a verified token, so it is an error.
    """
    if isinstance(value, str):
        if value == AUTO:
            return AUTO
        raise DFlashError(f"{name} must be an integer or '{AUTO}', got {value!r}")
    value = integer(value, name)
    if value < 2:
        raise DFlashError(f"{name} must be at least 2, got {value}")
    cap = BLOCK_CAP_FACTOR * trained
    if value > cap:
        raise DFlashError(f"{name} must be at most {cap} ({BLOCK_CAP_FACTOR}x the draft's trained "
                          f"block size {trained}), got {value}")
    if value > trained:
        message = (f"{name} {value} is above the draft's trained block size {trained}: "
                   f"acceptance at draft positions beyond {trained} is untrained")
        if warn is None:
            warnings.warn(message, UntrainedBlockWarning, stacklevel=3)
        else:
            warn(message)
    return value


def token_ids(ids, vocab_size: int, name: str = "prompt") -> np.ndarray:
    """A non-empty 1-D sequence of integer ids in [0, vocab_size), as int32.

    Takes a list or tuple of ints, an integer NumPy array or an integer
    ``mx.array``.
    """
    if isinstance(ids, (list, tuple)):
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)), None)
        if bad is not None:
            raise DFlashError(f"{name} token ids must be integers, got {bad!r}")
        outside = [int(t) for t in ids if not 0 <= t < vocab_size]
        array = np.array([] if outside else ids, dtype=np.int64)
    else:
        array = np.asarray(ids)
        if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
            raise DFlashError(f"{name} token ids must be integers, got an array of {array.dtype}")
        if array.ndim != 1:
            raise DFlashError(f"{name} must be one sequence of token ids, got shape {tuple(array.shape)}")
        outside = [int(t) for t in (array.min(), array.max()) if not 0 <= t < vocab_size] if array.size else []
    if outside:
        raise DFlashError(f"{name} token ids must lie in [0, {vocab_size}), got {outside[0]}")
    if array.size == 0:
        raise DFlashError(f"the {name} is empty; give some text or token ids")
    return array.astype(np.int32)


def logit_bias(bias, vocab_size: int, name: str = "logit_bias") -> None:
    """None, or a dict of integer token ids in [0, vocab_size) to finite numbers."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise DFlashError(f"{name} must be a dict of token id to bias, got {type(bias).__name__}")
    for token, value in bias.items():
        integer(token, f"{name} token id", low=0, high=vocab_size)
        real(value, f"{name}[{token}]")


def utf8(value: str, name: str) -> str:
    """Text that is valid UTF-8 (undecodable input bytes arrive as lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise DFlashError(f"the {name} is not valid UTF-8") from None
    return value


def text(value: str, name: str = "prompt") -> str:
    """Text that is valid UTF-8 and not empty or all whitespace."""
    utf8(value, name)
    if not value.strip():
        raise DFlashError(f"the {name} is empty")
    return value


def tree_budget(value, context: Optional[int], name: str = "tree_budget") -> Optional[int]:
    """The DDTree's node budget: an integer from 1 to the target's context
    length (``context``, None when the config gives none); None or 0 is the chain (None)."""
    if value is None:
        return None
    value = integer(value, name)
    if value < 0:
        raise DFlashError(f"{name} must be positive (0: no tree), got {value}")
    if context is not None and value > context:
        raise DFlashError(f"{name} must be at most the target's context length {context}, got {value}")
    return value or None


def loaded(model, draft, tokenizer, cost_curve, curve_types: tuple) -> None:
    """The objects ``stream_generate`` takes: a target model (mlx-lm's, or a
    ``Target``), a DFlash draft (``load_draft``), its tokenizer and a cost
    curve or None (``curve_types``, ``loop.cost_curve.CostCurve`` and ``loop.drift_watch.Watched``:
    passed in, as that module imports this one through the decoder)."""
    import mlx.nn as nn

    from .draft import DFlashDraft
    from .targets import Target

    def kind(value) -> str:
        return "None" if value is None else f"{type(value).__module__}.{type(value).__name__}"

    if not isinstance(model, (nn.Module, Target)):
        raise DFlashError(f"model must be a target model from dflash_mlx.load, got {kind(model)}")
    if not isinstance(draft, DFlashDraft):
        raise DFlashError(f"draft must be a DFlash draft from dflash_mlx.load_draft, got {kind(draft)}")
    if not callable(getattr(tokenizer, "encode", None)):
        raise DFlashError(f"tokenizer must be the target's tokenizer (from dflash_mlx.load), got {kind(tokenizer)}")
    if cost_curve is not None and not isinstance(cost_curve, curve_types):
        raise DFlashError(f"cost_curve must be a CostCurve (dflash_mlx.loop.cost_curve), a Watched one "
                          f"(dflash_mlx.loop.drift_watch) or None, got {cost_curve!r}")


def writable(path, name: str) -> None:
    """DFlashError unless something can be written at ``path``: a temporary file
    is made, and removed, in it if it is a directory, else in its nearest
    existing parent. Permission bits do not tell (/proc and /sys refuse new
    files whatever they say, root passes every access check)."""
    path = Path(path).expanduser()
    place = path if path.is_dir() else path.parent
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        raise DFlashError(f"{name} '{path}' cannot be written: '{place}' is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=place, prefix=".dflash-mlx-probe-"):
            pass
    except OSError as e:
        raise DFlashError(f"{name} '{path}' cannot be written: {e.strerror or e} in '{place}'") from None


def prompt_length(length: int, context: Optional[int]) -> None:
    """Warn (``LongPromptWarning``) when a prompt of ``length`` tokens exceeds
    the target's context length ``context`` (None: the config gives none)."""
    if context and length > context:
        warnings.warn(f"the prompt has {length} tokens, more than the target's context length of {context} "
                      "(max_position_embeddings): the model was not trained that far, so what it generates "
                      "may be poor", LongPromptWarning, stacklevel=3)
