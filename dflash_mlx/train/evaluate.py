"""Held-out evaluation of a draft during and after training: tau with the real
generation loop."""

import time

import numpy as np

from ..draft import DFlashDraft


def evaluate_tau(model, draft: DFlashDraft, tokenizer, prompts, max_tokens: int, block_size=None) -> dict:
    """Mean acceptance length tau over held-out prompts, with the real loop."""
    from ..generate import generate

    lengths = []
    tokens = 0
    t0 = time.perf_counter()
    for p in prompts:
        r = generate(model, draft, tokenizer, list(p), max_tokens=max_tokens, block_size=block_size)
        lengths += r.acceptance_lengths
        tokens += len(r.tokens)
    hist = np.bincount(np.array(lengths, np.int64) - 1, minlength=(block_size or draft.config.block_size))
    return {
        "tau": float(np.mean(lengths)) if lengths else 0.0,
        "cycles": len(lengths),
        "tokens": tokens,
        "accepted_histogram": hist.tolist(),  # index a: cycles that accepted a drafts
        "seconds": time.perf_counter() - t0,
    }
