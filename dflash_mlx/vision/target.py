"""A target whose prompt holds images: the text model's own pass, with the
images' features in place of their placeholders' embeddings and the family's
positions (``qwen.py``) or masks (``gemma.py``). Everything after the
prefill (drafting, verification, rollback) is the text target's: only the
embeddings of prompt rows and the positions or masks the layers see differ."""

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask

from ..targets import Attention, Forward, Target


@dataclass
class ImagePrompt:
    """One request's images, laid over its expanded prompt of ``size`` ids."""

    features: mx.array  # [N, H]: every image row's embedding, in prompt order
    rows: list[int]  # per prompt position: its row of ``features``, or -1
    positions: Optional[mx.array] = None  # [3, P] multimodal RoPE positions (Qwen), or None
    delta: int = 0  # position of every index past the prompt: index + delta
    spans: list = field(default_factory=list)  # (begin, end) of each image whose rows attend both ways (Gemma 4)
    # the expanded ids as prompts are compared (the server's prefix cache): each image's rows
    # hold a negative id derived from its hash, which no token and no other image matches
    key: list[int] = field(default_factory=list)

    def runs(self) -> list[tuple[int, int]]:
        """(begin, end) of each run of image rows."""
        edges = [-1, *self.rows, -1]
        begins = [i for i in range(len(self.rows)) if edges[i + 1] >= 0 > edges[i]]
        ends = [i for i in range(1, len(self.rows) + 1) if edges[i] >= 0 > edges[i + 1]]
        return list(zip(begins, ends))

    def pass_positions(self, start: int, length: int) -> mx.array:
        """[3, length]: the positions of indices start..start+length."""
        size = self.positions.shape[1]
        inside = self.positions[:, start : min(start + length, size)]
        later = mx.arange(max(start, size), start + length, dtype=inside.dtype) + self.delta
        return mx.concatenate([inside, mx.broadcast_to(later, (3, later.size))], axis=1)

    def merge(self, h: mx.array, start: int) -> Optional[mx.array]:
        """``h`` [1, T, H] at indices start.. with the image rows' features in
        place (a pass may run on past the prompt, whose indices hold none);
        None where the pass holds no image row."""
        rows = self.rows[start : start + h.shape[1]]
        if not any(r >= 0 for r in rows):
            return None
        index = mx.array(rows + [-1] * (h.shape[1] - len(rows)))
        picked = self.features[mx.maximum(index, 0)].astype(h.dtype)
        return mx.where((index >= 0)[None, :, None], picked[None], h)


class VisionStack:
    """The text target's stack, told where each pass starts (``start``)."""

    def __init__(self, inner, family, prompt: ImagePrompt):
        self.inner = inner
        self.family = family
        self.prompt = prompt
        self.start = 0

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed(tokens)

    def finish_logits(self, logits: mx.array) -> mx.array:
        return self.inner.finish_logits(logits)

    def layer_calls(self, layers: list, tokens: mx.array, h: mx.array) -> list:
        merged = self.prompt.merge(h, self.start)
        if merged is None:
            calls = self.inner.layer_calls(layers, tokens, h)
        else:
            calls = self.inner.layer_calls(layers, self.family.layer_tokens(tokens), merged)
            first = calls[0]
            calls = [lambda _, mask, cache: first(merged, mask, cache)] + list(calls[1:])
        if self.prompt.positions is not None:
            calls = self.family.layer_calls(calls, layers, self.prompt.pass_positions(self.start, tokens.shape[1]))
        return calls


@dataclass(frozen=True)
class BothWays(Attention):
    """Attention whose image rows also see the later rows of their own image
    (``spans``), as mlx-vlm's Gemma 4 masks a prompt with images; causal
    (within the window) everywhere else."""

    spans: tuple = ()

    def mask(self, h: mx.array, cache: Any) -> Any:
        start, size = (cache.offset if cache is not None else 0), h.shape[1]
        inside = [(a, b) for a, b in self.spans if a < start + size and start < b]
        if not inside:
            return super().mask(h, cache)
        q, k = mx.arange(start, start + size)[:, None], mx.arange(start + size)[None]
        mask = create_causal_mask(size, start, window_size=self.window)
        for a, b in inside:
            mask = mask | ((q >= a) & (q < b) & (k >= a) & (k < b))
        return mask


class VisionTarget(Target):
    """``Target`` over the same model for one prompt with images."""

    def __init__(self, model: nn.Module, family, prompt: ImagePrompt):
        super().__init__(model)
        self.stack = VisionStack(self.stack, family, prompt)
        self.key = prompt.key
        if prompt.spans:
            spans = tuple(prompt.spans)
            self.kinds = [BothWays(k.name, k.window, spans) if isinstance(k, Attention) else k for k in self.kinds]

    def forward(self, tokens: mx.array, cache, layer_ids: list[int], record: bool = False):
        owners = [c for kind, c in zip(self.kinds, cache or []) if isinstance(kind, Attention)]
        start = self.stack.start = owners[0].offset if owners else 0
        stop, size = start + tokens.shape[1], tokens.shape[1]
        end = next((b for a, b in self.stack.prompt.spans if a < stop < b), stop)
        if end == stop:
            return super().forward(tokens, cache, layer_ids, record)
        # a pass ending inside an image whose rows see each other: its last rows
        # need the rest of the image, so it runs to the image's end and forgets the rest
        rest = mx.full((tokens.shape[0], end - stop), self.stack.family.image_token_id, dtype=tokens.dtype)
        out = super().forward(mx.concatenate([tokens, rest], axis=1), cache, layer_ids, record)
        for kind, c in zip(self.kinds, cache or []):
            kind.rollback(c, None, size, end - start)
        return Forward(out.hidden[:, :size], out.features[:, :size])
