"""Kernel: the GatedDeltaNet recurrence over a DDTree (``metal/gdn_tree_verify.metal``).

A tree of N draft nodes is verified in one target pass. In a GatedDeltaNet
layer each node's state is its parent's state advanced one step (the root's
parent is the context state), and its output is read from that state. The
kernel walks the tree depth first per value row and writes only the outputs:
no per-node state reaches device memory, each thread keeps at most ``SLOTS``
saved states of its Dk/32 elements (``TreeIndex`` orders the walk so that N
nodes need at most log2(N)). The reference runs the same recurrence one depth
level at a time with mlx-lm's ops, vectorised over the level, gathering each
node's parent state from the level above. Memory of both: ``metal/README.md``.

The step is ``gdn_verify``'s arithmetic, so a node's output is bit for bit
the verify kernel's for the last token of the node's path; inputs, checks and
tolerances are shared with it (:mod:`.gdn`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .gdn import launch_shape, make_inputs, state_tolerance, unsupported_inputs, y_mismatch
from .registry import Kernel, Launch

SLOTS = 8  # saved states per thread: every tree of fewer than 512 nodes fits


@dataclass(frozen=True)
class TreeIndex:
    """Host-made indices of one tree (node 0 the root), shared by every layer of a pass."""

    levels: list[mx.array]  # per depth: the nodes at that depth
    parent_rows: list[mx.array]  # per depth: each node's parent's row in the level above (depth 0: the context's)
    order: mx.array  # [N]: each node's position in the levels laid end to end
    schedule: mx.array  # [N, 3] int32: the kernel's walk, (node, read slot, save slot) per step
    slots: int  # saved states the walk needs per thread

    def __len__(self) -> int:
        return self.schedule.shape[0]

    @classmethod
    def of(cls, parents: Sequence[int]) -> "TreeIndex":
        """From each node's parent (-1 for the root, node 0)."""
        n = len(parents)
        if n < 1 or parents[0] != -1 or any(not 0 <= p < n for p in parents[1:]):
            raise ValueError(f"not a tree rooted at node 0: parents {list(parents)}")
        children: list[list[int]] = [[] for _ in range(n)]
        for node in range(1, n):
            children[parents[node]].append(node)
        reached, depth = [0], [0] * n
        for node in reached:
            for child in children[node]:
                depth[child] = depth[node] + 1
                reached.append(child)
        if len(reached) != n:
            raise ValueError(f"parents {list(parents)} hold a cycle")
        size = [1] * n
        for node in reversed(reached[1:]):
            size[parents[node]] += size[node]

        by_depth: list[list[int]] = [[] for _ in range(max(depth) + 1)]
        for node in range(n):
            by_depth[depth[node]].append(node)
        row_of = {node: r for level in by_depth for r, node in enumerate(level)}
        parent_rows = [[0]] + [[row_of[parents[node]] for node in level] for level in by_depth[1:]]
        order = np.argsort([node for level in by_depth for node in level])  # node -> position

        schedule, slots = _walk(children, size)
        return cls([mx.array(level) for level in by_depth], [mx.array(rows) for rows in parent_rows],
                   mx.array(order), mx.array(np.array(schedule, dtype=np.int32)), slots)


def _walk(children: list[list[int]], size: list[int]) -> tuple[list[tuple[int, int, int]], int]:
    """Depth-first steps (node, read slot, save slot) and the slots they use.
    A node with two or more children saves its state in the lowest free slot;
    its first child reads the registers (the previous step's state), the others
    its slot, which the last one frees. Children go in increasing subtree size,
    so every child but the last holds at most half its parent's subtree and the
    slots in use never exceed log2(N)."""
    steps, most = [], 0
    todo = [(0, -1, 0)]  # (node, slot with its parent's state or -1, slots in use)
    while todo:
        node, read, used = todo.pop()
        kids = sorted(children[node], key=lambda c: (size[c], c))
        save = used if len(kids) > 1 else -1
        steps.append((node, read, save))
        most = max(most, used + (save >= 0))
        for rank in reversed(range(len(kids))):
            last = rank == len(kids) - 1
            todo.append((kids[rank], -1 if rank == 0 else save, used if last else used + (save >= 0)))
    return steps, most


def random_parents(rng: np.random.Generator, n: int) -> list[int]:
    """A random tree of ``n`` nodes, parents before children."""
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


class GdnTreeVerify(Kernel):
    name = "gdn_tree_verify"
    source_file = "gdn_tree_verify.metal"
    input_names = ("q", "k", "v", "g", "beta", "state", "schedule")
    output_names = ("y",)
    description = "GatedDeltaNet recurrence over a DDTree, parent-indexed (each node's output)"

    def reference(self, q, k, v, g, beta, state, tree: TreeIndex) -> tuple[mx.array]:
        """One depth level at a time with mlx-lm's ops, each node from its parent's state."""
        from mlx_lm.models.gated_delta import gated_delta_ops

        states, outputs = state, []
        for level, rows in zip(tree.levels, tree.parent_rows):
            step = [t[0, level][:, None] for t in (q, k, v, g, beta)]  # each [n, 1, ...]: one step per node
            out, states = gated_delta_ops(*step, states[rows])
            outputs.append(out[:, 0])
        return (mx.concatenate(outputs, axis=0)[tree.order][None],)

    def kernel_inputs(self, q, k, v, g, beta, state, tree: TreeIndex) -> list:
        return [q, k, v, g, beta, state, tree.schedule]

    def configure(self, q, k, v, g, beta, state, tree: TreeIndex) -> Launch:
        grid, tg = launch_shape(k, v)
        Hv, Dv = v.shape[2], v.shape[3]
        return Launch(
            grid=grid, threadgroup=tg,
            output_shapes=[(1, k.shape[1], Hv, Dv)],
            output_dtypes=[q.dtype],
            template=[("InT", q.dtype), ("Dk", k.shape[-1]), ("Slots", SLOTS)],
        )

    def unsupported(self, q, k, v, g, beta, state, tree: TreeIndex) -> Optional[str]:
        problem = unsupported_inputs(q, k, v, g, beta, state)
        if problem:
            return problem
        if k.shape[0] != 1:
            return f"B = {k.shape[0]} (kernel: one tree, B = 1)"
        if k.shape[1] != len(tree):
            return f"{k.shape[1]} nodes of inputs for a tree of {len(tree)}"
        if tree.slots > SLOTS:
            return f"the tree needs {tree.slots} saved states per thread (kernel: at most {SLOTS})"
        return None

    def compare(self, got, want, inputs, params) -> Optional[str]:
        q, k, v, g, beta, state = inputs
        return y_mismatch(got[0], want[0], state_tolerance(k, state, len(params["tree"].levels)))

    def sample(self, rng: np.random.Generator) -> tuple[tuple, dict]:
        """A random tree of 9 nodes, gates raised to the power 0.02 (about [0.35, 0.99]):
        states that forget little, so a node started from the wrong parent shows."""
        n = 9
        q, k, v, g, beta, state = make_inputs(rng, B=1, T=n, Hk=1, Hv=2, Dk=64, Dv=8)
        return (q, k, v, g**0.02, beta, state), {"tree": TreeIndex.of(random_parents(rng, n))}


KERNEL = GdnTreeVerify()

__all__ = ["KERNEL", "SLOTS", "GdnTreeVerify", "TreeIndex", "random_parents"]
