"""The DDTree cycle: draft a tree, verify it in one target pass, walk, commit.

Beside the chain (``loop.SpeculativeDecoder``, whose prefill and bookkeeping
it reuses): the proposer's b-1 per-position distributions (a DFlash2
proposer's selector transitions, ``tree_candidates``; a DSpark proposer's
Markov z after each node's token, ``tree_rows``) become a tree of up
to ``budget`` nodes (``build.py``); the root y and the nodes run through the
target as one flat sequence (``tree_forward``), each attention layer with the
tree's mask and per-node RoPE positions (``attention.py``), a quantized
target's matmuls through the verify kernel as in the chain; from the root
the walk follows the target's greedy choice while it is a child; the path plus
the target's choice after it are committed, the attention caches compacted to
the path, GatedDeltaNet layers set to the path's end (``gated_delta.py``),
and the path's features handed to the proposer in order.

Every node's choice is the target's own: its argmax, or at temperature > 0 a
draw from its warped distribution (logits processors see the node's own path
as history). Walking while the draw is a child is recursive rejection
sampling (SpecInfer) with the tree's candidates as the proposal: they are
fixed, not drawn from the draft, so each child is a point mass q = 1 on its
token, accepted with probability p_res(c) and, on rejection, removed from the
residual; trying a node's children in turn and drawing the bonus from what is
left is exactly one draw from p. (Using the draft's q in min(1, p/q) would be
lossy here, since the children were not sampled from q.) The output is
therefore distributed as the target's own sampling.
"""

from typing import Callable, Optional

import mlx.core as mx

from ..errors import DFlashError
from ..kv_quantization import KVQuantization
from ..loop import NON_FINITE, BlockSampler, Cycle, Proposer, SpeculativeDecoder, sound_logits
from ..targets import Attention, Forward, GatedDelta, Target
from . import gated_delta
from .attention import check_rope, compact, positioned, tree_mask
from .build import Tree, build_node_tree, build_transition_tree, build_tree, top_candidates, walk


def check_tree_target(target: Target) -> None:
    """DFlashError unless every layer of the target can verify a tree."""
    for layer, kind in zip(target.layers, target.kinds):
        if isinstance(kind, Attention):
            check_rope(layer)
        elif not isinstance(kind, GatedDelta):
            raise DFlashError(f"tree verification does not support the target's {kind.name} layers "
                              f"(model type '{target.model_type}'); use the chain (no tree budget)")


def context_length(target: Target, cache: list) -> int:
    """Positions the attention caches hold (every target has an attention layer)."""
    return next(c.offset for kind, c in zip(target.kinds, cache) if isinstance(kind, Attention))


def tree_forward(target: Target, tree: Tree, cache: list, layer_ids: list[int]) -> Forward:
    """Run the flattened tree [1, N] through the target after the cache's
    context; GatedDeltaNet layers leave their cache as it was and return what
    ``commit`` needs."""
    offset = context_length(target, cache)
    masks = {kind.name: tree_mask(tree.parents, tree.depths, offset, kind.window)
             for kind in target.kinds if isinstance(kind, Attention)}
    positions = offset + mx.array(tree.depths)
    recurrent = [layer for layer, kind in zip(target.layers, target.kinds) if isinstance(kind, GatedDelta)]
    plan = gated_delta.plan(tree, recurrent[0].linear_attn.conv_kernel_size) if recurrent else None
    wanted, records = {}, [None] * target.num_layers
    tokens = mx.array(tree.tokens)[None]
    h = target.embed(tokens)
    layers = target.stack.layer_calls(
        [positioned(layer, positions) if isinstance(kind, Attention) else layer
         for layer, kind in zip(target.layers, target.kinds)], tokens, h)
    h = target.stage_input(h)
    cache = list(cache) + [None] * (target.num_layers - len(cache))  # layers reading another's K/V own none
    with target.verify_matmuls():
        for i, (layer, kind, c) in enumerate(zip(layers, target.kinds, cache)):
            if isinstance(kind, Attention):
                h, _ = kind(layer, h, masks[kind.name], c, False)
            else:
                h, records[i] = gated_delta.tree_layer(layer, h, plan, c)
            if target.first_layer + i in layer_ids:
                wanted[target.first_layer + i] = h
    h, features = target.stage_output(h, wanted, layer_ids)
    return Forward(target.final_norm(h), features, records)


def commit(target: Target, cache: list, forward: Forward, offset: int, path: list[int]) -> None:
    """Leave every layer's cache as if the ``path`` nodes had been fed after ``offset``."""
    for kind, c, record in zip(target.kinds, cache, forward.records):
        if isinstance(kind, Attention):
            compact(c, offset, path)
        else:
            gated_delta.commit(c, record, path)


class TreeDecoder(SpeculativeDecoder):
    """Prefill, then tree verify-and-commit cycles over one target cache."""

    def __init__(
        self,
        target: Target,
        proposer: Proposer,
        layer_ids: list[int],
        block_size: int,
        budget: int,
        prefill_step_size: int = 2048,
        sampler: Optional[BlockSampler] = None,
        cache: Optional[list] = None,
        tokens: Optional[list[int]] = None,
        kv: Optional[KVQuantization] = None,
    ):
        check_tree_target(target)
        super().__init__(target, proposer, layer_ids, block_size, prefill_step_size, sampler, cache, tokens, kv)
        self.tree_block = block_size  # the tree is tree_block - 1 deep, unless kv cuts it at quantized_kv_start
        self.budget = budget
        self.build: Optional[Callable[[int, int], Tree]] = None  # (root, budget) -> the cycle's tree

    def _queue_draft(self) -> None:
        if self.kv:
            self.block_size = self.kv.block(len(self.tokens), self.tree_block)
        if self.block_size == 1:  # cut at quantized_kv_start: the root alone, a plain step
            self.build = lambda root, budget: Tree([root], [-1], [0])
            self.draft_finite = mx.array(True)
            return
        rows = getattr(self.proposer, "tree_rows", None)  # children from z after their parent's token
        own = getattr(self.proposer, "tree_candidates", None)  # children ranked after their parent
        if rows:
            logits, z = rows(self.pending, self.block_size)
            ready, depth = (logits,), logits.shape[0]
            self.build = lambda root, budget: build_node_tree(root, z, depth, budget)
        else:
            if own:
                build, ready = build_transition_tree, own(self.pending, self.block_size)
            else:
                logits = self.proposer.propose(self.pending, self.block_size)
                build, ready = build_tree, top_candidates(logits, self.budget)
            self.build = lambda root, budget: build(root, *(a.tolist() for a in ready), budget)
        self.draft_finite = getattr(self.proposer, "finite", mx.array(True)) if rows or own else sound_logits(logits)
        mx.async_eval(ready, self.draft_finite)

    def _process(self, logits: mx.array, tree: Tree) -> mx.array:
        """Logits processors (and a constraint's mask) per node, each seeing the
        committed tokens then its path, whose nodes below the root are drafts."""
        if not self.sampler.processors and self.sampler.constraint is None:
            return logits
        recent = self.recent
        rows = []
        for i in range(len(tree)):
            path = [tree.tokens[j] for j in tree.path(i)]
            rows.append(self.sampler.process(logits[i : i + 1], mx.array(recent + path, dtype=mx.int32), len(path) - 1))
        return mx.concatenate(rows, axis=0)

    def _choose(self, logits: mx.array, tree: Tree) -> list[int]:
        """The target's token at every node, from processed logits [N, V]: its
        argmax, or one independent draw per node from its warped distribution
        (the sampler's draw of a token from target logits, row by row)."""
        return self.sampler.next_token(logits).tolist()

    def cycle(self) -> Cycle:
        """One draft-tree + verify + walk + commit cycle; returns the committed tokens."""
        if not self.draft_finite.item():  # ready with the candidates, read just below
            # no tree of NaN-chosen tokens: y (emitted, not yet fed) stays out of the caches and ``tokens``
            raise DFlashError(NON_FINITE)
        tree = self.build(self.pending.item(), self.budget)
        self._quantize_kv()
        offset = context_length(self.target, self.cache)
        out = tree_forward(self.target, tree, self.cache, self.layer_ids)
        logits = self._process(self.target.logits(out.hidden)[0], tree)
        choices = self._choose(logits, tree)  # the cycle's sync
        path, bonus = walk(tree, choices)
        self._keep(logits[mx.array(path)])
        commit(self.target, self.cache, out, offset, path)
        committed = [tree.tokens[i] for i in path]
        self.proposer.observe(out.features[:, mx.array(path)], mx.array(committed, dtype=mx.int32))
        self.tokens.extend(committed)
        self._remember(committed)
        self.pending = mx.array([bonus], dtype=mx.int32)
        self.sampler.commit(mx.array(committed[1:] + [bonus], dtype=mx.int32))
        self._queue_draft()
        return Cycle(committed[1:] + [bonus], len(path) - 1)
