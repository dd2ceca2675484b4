"""Log-probabilities of a reply's tokens in OpenAI's shapes.

The worker reads, per cycle, each emitted token's log-probability and the
``top`` most likely alternatives from the rows ``stream_generate(logprobs=True)``
hands it (``picked``); the routes write them as a chat choice's
``logprobs.content`` or a text completion's ``logprobs`` (``Logprobs``).
A token's text is its id decoded alone; its bytes are that text's UTF-8.
"""

import math
from dataclasses import dataclass

import mlx.core as mx

from ..top_k import ranked_top_k

MAX_TOP = 20  # OpenAI's limit on top_logprobs


@dataclass
class Picked:
    """One emitted token: its log-probability and the top alternatives (id, logprob), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def picked(rows: mx.array, tokens: list[int], top: int) -> list[Picked]:
    """Read rows [n, V] at the n emitted ``tokens`` and their ``top`` best ids
    (fewer where fewer are possible), in one sync."""
    if not tokens:
        return []
    rows = rows.astype(mx.float32)
    chosen = mx.take_along_axis(rows, mx.array(tokens)[:, None], axis=-1)[:, 0]
    if top:
        best_values, best = ranked_top_k(rows, min(top, rows.shape[-1]))
        mx.eval(chosen, best, best_values)
        # ids a response_format's grammar rules out (-inf) are no alternatives: JSON has no -inf
        alternatives = [[(i, v) for i, v in zip(ids, values) if v != -math.inf]
                        for ids, values in zip(best.tolist(), best_values.tolist())]
    else:
        alternatives = [[] for _ in tokens]
    return [Picked(t, lp, alt) for t, lp, alt in zip(tokens, chosen.tolist(), alternatives)]


class Logprobs:
    """Formats one reply's picked tokens with its tokenizer; tracks the text
    offsets a text completion reports."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.offset = 0

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _entry(self, token: int, logprob: float) -> dict:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, tokens: list[Picked]) -> dict:
        """A chat choice's ``logprobs``: ``{"content": [...]}``."""
        return {"content": [
            self._entry(p.token, p.logprob) | {"top_logprobs": [self._entry(i, lp) for i, lp in p.top]}
            for p in tokens
        ]}

    def completion(self, tokens: list[Picked]) -> dict:
        """A text completion choice's ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset)."""
        texts = [self._text(p.token) for p in tokens]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [p.logprob for p in tokens],
            # the sampled token always among them, as OpenAI's legacy API has it
            "top_logprobs": [{self._text(i): lp for i, lp in p.top} | {text: p.logprob}
                             for p, text in zip(tokens, texts)],
            "text_offset": offsets,
        }
