"""Structured output: a grammar that every emitted token must follow
(docs/python-api.md, "Structured output"; docs/architecture.md, "Constrained decoding").

``response_format`` (OpenAI's shape, plus a regex and a Lark grammar) compiles
to an llguidance grammar; a ``Constraint`` holds one generation's matcher. The
sampler asks it for the tokens allowed after the committed tokens and a
block's drafts, and masks the target's rows (and the draft's) to them, so the
output is exactly what the target alone decodes under the same mask.
"""

import weakref
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .errors import DFlashError

KINDS = ("text", "json_object", "json_schema", "regex", "grammar")
STUCK = "no token of this tokenizer can continue it"
CHECKED = 8  # masks of at most this many tokens are checked token by token (see Constraint.next_tokens)

_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # HF tokenizer -> {(V, eos): LLTokenizer}


def _message(message: str) -> str:
    return "response_format: " + " ".join(message.split())[:400]


def _fail(message: str) -> DFlashError:
    return DFlashError(_message(message))


def grammar(response_format: Optional[dict]) -> Optional[str]:
    """The llguidance grammar of an OpenAI-style ``response_format``; None for
    plain text. ``{"type": "json_object"}``, ``{"type": "json_schema",
    "json_schema": {"schema": {...}}}``, ``{"type": "regex", "regex": "..."}``
    or ``{"type": "grammar", "grammar": "<Lark>"}``."""
    from llguidance import LLMatcher

    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise _fail(f"must be an object such as {{'type': 'json_object'}}, got {type(response_format).__name__}")
    kind = response_format.get("type", "text")
    if kind not in KINDS:
        raise _fail(f"type {kind!r} is not supported; use one of {', '.join(KINDS)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _fail("json_schema.schema must be a JSON Schema object")
        return LLMatcher.grammar_from_json_schema(schema)
    text = response_format.get(kind)
    if not isinstance(text, str) or not text:
        raise _fail(f"type {kind!r} needs a non-empty string field {kind!r}")
    return LLMatcher.grammar_from_regex(text) if kind == "regex" else LLMatcher.grammar_from_lark(text)


def _ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of a Hugging Face fast tokenizer, built once per
    tokenizer, vocabulary size and EOS set (llguidance puts it at about a
    second for a large vocabulary)."""
    import llguidance.hf
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    wrapped = isinstance(tokenizer, TokenizerWrapper)
    hf = tokenizer._tokenizer if wrapped else tokenizer
    eos = sorted(tokenizer.eos_token_ids if wrapped else [hf.eos_token_id])
    built = _tokenizers.setdefault(hf, {})
    key = (vocab_size, tuple(eos))
    if key not in built:
        try:
            built[key] = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        except ValueError as e:
            raise _fail(f"needs a fast (tokenizers) tokenizer: {e}") from None
    return built[key]


def constraint_for(response_format: Optional[dict], tokenizer, vocab_size: int) -> Optional["Constraint"]:
    """A fresh ``Constraint`` for one generation, or None for plain text.
    ``response_format["after"]`` (text, e.g. a thinking model's ``</think>``)
    leaves the output free until the tokens of that text have been generated.
    A format that does not compile is a one-line DFlashError naming it."""
    from llguidance import LLMatcher

    try:
        source = grammar(response_format)
    except ValueError as e:  # llguidance: the schema is not a JSON object
        raise _fail(str(e)) from None
    if source is None:
        return None
    after = response_format.get("after", "")
    if not isinstance(after, str):
        raise _fail(f"after must be text (the grammar starts once it is generated), got {after!r}")
    lltok = _ll_tokenizer(tokenizer, vocab_size)
    matcher = LLMatcher(lltok, source, log_level=0)
    if matcher.is_error():
        raise _fail(matcher.get_error())
    constraint = Constraint(matcher, vocab_size, lltok.eos_tokens,
                            tokenizer.encode(after, add_special_tokens=False) if after else [])
    if not constraint.next_tokens().any():  # checked before any token is decoded
        raise _fail(f"the grammar cannot produce any value: {constraint.failure or STUCK}")
    return constraint


def _end_of(sequence: list[int], tokens: list[int]) -> Optional[int]:
    """The index just past the first occurrence of ``sequence`` in ``tokens``."""
    n = len(sequence)
    return next((i + n for i in range(len(tokens) - n + 1) if tokens[i : i + n] == sequence), None)


class Constraint:
    """One generation's grammar state over the committed tokens.

    ``commit`` records tokens as the loop chooses them (arrays, read only when
    a mask is next needed, so an unconstrained loop never waits for them).
    ``allowed(prefix)`` is the mask after the committed tokens and ``prefix``
    (a block's drafts): the matcher advances through the prefix and is rolled
    back to the committed tokens before the next commit is consumed. With
    ``after`` (token ids), the grammar starts only once they are generated.
    Where the grammar can go no further (llguidance fails, no token
    continues it, or a committed token is outside it) only ``eos`` is
    allowed, so the reply ends there; ``verdict`` says whether it is whole."""

    def __init__(self, matcher, vocab_size: int, eos: Sequence[int], after: Sequence[int] = ()):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = np.zeros(vocab_size, dtype=bool)
        self.eos[list(eos)] = True
        self.after = list(after)  # still to be generated before the grammar starts; [] once it has
        self.tail: list[int] = []  # the committed tokens that may begin ``after``
        self.unread: list[mx.array] = []  # committed, not yet consumed by the matcher
        self.ahead: list[int] = []  # consumed past the committed tokens
        self.memo: dict[tuple, Optional[mx.array]] = {}  # prefix -> mask, until the next commit
        self.failure: Optional[str] = None  # why the committed reply left the grammar

    def commit(self, tokens: mx.array) -> None:
        self.unread.append(tokens.reshape(-1))

    def _settle(self) -> None:
        if not self.unread:
            return
        tokens = mx.concatenate(self.unread).tolist()
        self.unread, self.memo = [], {}
        if self.after:
            tokens = self.tail + tokens
            end = _end_of(self.after, tokens)
            if end is None:
                self.tail = tokens[max(0, len(tokens) - len(self.after) + 1) :]
                return
            self.after, tokens = [], tokens[end:]
        self.matcher.rollback(len(self.ahead))
        self.ahead = []
        # tokens after the grammar's end are not consumed (generation stops at its EOS), nor an EOS
        # the grammar does not take: the only token allowed where it went no further (``verdict`` says why)
        consumed = self.matcher.try_consume_tokens(tokens)
        left = consumed < len(tokens) and not self.matcher.is_stopped() and not self.eos[tokens[consumed]]
        if left and self.failure is None:
            self.failure = self._error() or f"token {tokens[consumed]} of the reply is outside the grammar"

    def _error(self) -> Optional[str]:
        """llguidance's own error, its first line, once the matcher failed."""
        return f"llguidance failed ({self.matcher.get_error().splitlines()[0]})" if self.matcher.is_error() else None

    def next_tokens(self) -> np.ndarray:
        """bool [V]: the tokens the matcher accepts next, in its present
        state; none once it failed. A mask of a few tokens is checked token by
        token: llguidance's shortcut for text the grammar forces allows the
        tokenizer's spelling of it, which may be a token its own parser
        rejects (``<unk>`` where the tokenizer cannot encode that text as its
        vocabulary spells it); where none passes, every token is tried."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if self.matcher.is_error():
            self.failure = self.failure or self._error()
            return np.zeros_like(mask)
        few = np.flatnonzero(mask & ~self.eos)
        if len(few) <= CHECKED:
            mask[few] = [self.matcher.validate_tokens([int(t)]) == 1 for t in few]
            if len(few) and not mask.any():  # a wrong spelling: the tokens the parser accepts, one by one
                mask = np.array([self.matcher.validate_tokens([t]) == 1 for t in range(self.vocab_size)])
        return mask

    def allowed(self, prefix: list[int]) -> Optional[mx.array]:
        """bool [V]: the tokens the grammar allows after the committed tokens
        and ``prefix``; None where the row is free: before ``after`` or after
        a token the grammar rejects (no emitted token depends on that row);
        only EOS where the grammar can go no further."""
        self._settle()
        key = tuple(prefix)
        if key not in self.memo:
            if self.failure is not None:
                self.memo[key] = mx.array(self.eos)
            elif self.after:
                end = _end_of(self.after, self.tail + prefix)
                start = None if end is None else end - len(self.tail)
                self.memo[key] = None if start is None else self._mask_after(prefix[start:])
            else:
                self.memo[key] = self._mask_after(prefix)
        return self.memo[key]

    def _mask_after(self, prefix: list[int]) -> Optional[mx.array]:
        keep = 0
        while keep < min(len(self.ahead), len(prefix)) and self.ahead[keep] == prefix[keep]:
            keep += 1
        self.matcher.rollback(len(self.ahead) - keep)
        self.ahead = self.ahead[:keep]
        for token in prefix[keep:]:
            if self.matcher.try_consume_tokens([token]) != 1:
                return None
            self.ahead.append(token)
        mask = self.next_tokens()
        return mx.array(mask if mask.any() else self.eos)

    def verdict(self) -> Optional[str]:
        """None when the committed tokens are a reply the grammar accepts
        whole; else why not, in one line starting ``response_format:``."""
        self._settle()
        reason = self.failure
        if reason is None and self.after:
            reason = "the reply ended before the text its grammar starts after"
        elif reason is None and not (self.matcher.is_accepting() or self.matcher.is_stopped()):
            reason = STUCK
        return None if reason is None else _message(f"the reply stopped short of its grammar: {reason}")

    def restrict(self, logits: mx.array, drafted: list[int]) -> mx.array:
        """Rows [n, V], row i masked (-inf outside the grammar) to the tokens
        allowed after ``drafted[: len(drafted) - n + 1 + i]`` (a chain's block:
        the drafts before row i's); a free row stays as it is."""
        n, rows = logits.shape[0], []
        for i in range(n):
            mask = self.allowed(drafted[: len(drafted) - n + 1 + i])
            rows.append(logits[i : i + 1] if mask is None else mx.where(mask, logits[i : i + 1], -mx.inf))
        return mx.concatenate(rows, axis=0)

    def restrict_next(self, logits: mx.array, drafted: list[int]) -> mx.array:
        """One row [1, V] masked to the tokens allowed after all of ``drafted``;
        uniform over them where its logits give none a finite value (a draft
        over a reduced vocabulary may hold none of them)."""
        mask = self.allowed(drafted)
        if mask is None:
            return logits
        masked = mx.where(mask, logits, -mx.inf)
        return mx.where(masked.max() == -mx.inf, mx.where(mask, 0.0, -mx.inf), masked)
