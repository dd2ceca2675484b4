"""GatedDeltaNet layers over a flattened DDTree: each node follows its own path.

A node's short convolution reads the K-1 inputs before it *on its path* (its
ancestors, then the layer's conv window from the context), and its recurrent
state is its parent's state advanced by one step. ``tree_layer`` runs the
layer's own submodules (as ``gated_delta.recording_attention`` does): the
projections and the convolution for all nodes at once, the convolution over
each node's gathered window, and the recurrence one depth level at a time,
vectorised across the level's nodes, each gathering its parent's state. Only
two levels of states are alive at once; nothing per node outlives the layer
but its q, k, v, a, b and conv input.

The pass leaves the cache untouched; ``commit`` sets it to the accepted
path's end: the conv window is the path's last K-1 inputs and the state is
the context state advanced along the path by mlx-lm's ``gated_delta_update``,
the same steps the chain would have taken. (Reference path only: the Metal
``gdn_tree_verify`` kernel is not written.)
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_update

from .gated_delta import split_qkv
from .tree import Tree


@dataclass
class TreePlan:
    """Host-side indices of one tree, shared by every GatedDeltaNet layer of a pass."""

    windows: mx.array  # [N, K]: rows of [conv window ; nodes] each node's conv reads
    levels: list[mx.array]  # per depth: the node indices at that depth
    parent_rows: list[mx.array]  # per depth > 0: each node's parent's row in the level above
    order: mx.array  # [N]: position of each node in the levels laid end to end


def plan(tree: Tree, kernel_size: int) -> TreePlan:
    window = kernel_size - 1
    windows = []
    for node in range(len(tree)):
        rows = list(range(window)) + [window + i for i in tree.path(node)]
        windows.append(rows[-kernel_size:])
    by_depth: list[list[int]] = [[] for _ in range(max(tree.depths) + 1)]
    for node, depth in enumerate(tree.depths):
        by_depth[depth].append(node)
    row_of = {node: r for level in by_depth for r, node in enumerate(level)}
    parent_rows = [mx.array([row_of[tree.parents[n]] for n in level]) for level in by_depth[1:]]
    flat = [n for level in by_depth for n in level]
    order = [0] * len(flat)
    for position, node in enumerate(flat):
        order[node] = position
    return TreePlan(mx.array(windows), [mx.array(level) for level in by_depth], parent_rows, mx.array(order))


@dataclass
class TreeRecord:
    """What ``commit`` needs: the pre-pass conv window and state, and per node
    the conv input and recurrence inputs."""

    conv_state: mx.array  # [1, K-1, conv_dim]
    qkv: mx.array  # [1, N, conv_dim]
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    state: Optional[mx.array]
    layer: nn.Module


def tree_attention(gdn: nn.Module, x: mx.array, tree_plan: TreePlan, cache: ArraysCache):
    """The GatedDeltaNet over the flattened tree [1, N, H]; (output, record)."""
    _, N, _ = x.shape
    qkv = gdn.in_proj_qkv(x)
    z = gdn.in_proj_z(x).reshape(1, N, gdn.num_v_heads, gdn.head_v_dim)
    b, a = gdn.in_proj_b(x), gdn.in_proj_a(x)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((1, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype)
    rows = mx.concatenate([conv_state, qkv], axis=1)[0]
    conv_out = nn.silu(gdn.conv1d(rows[tree_plan.windows])).reshape(1, N, -1)
    q, k, v = split_qkv(gdn, conv_out)
    state = cache[1]
    states = state  # [nodes of the level above, Hv, Dv, Dk]; the context's for the root
    outputs = []
    for depth, level in enumerate(tree_plan.levels):
        parents = states if depth == 0 else states[tree_plan.parent_rows[depth - 1]]
        step = [t[0, level][:, None] for t in (q, k, v, a, b)]  # each [n, 1, ...]: one step per node
        out, states = gated_delta_update(*step, gdn.A_log, gdn.dt_bias, parents, None,
                                         use_kernel=not gdn.training)
        outputs.append(out[:, 0])
    out = mx.concatenate(outputs, axis=0)[tree_plan.order][None]
    out = gdn.out_proj(gdn.norm(out, z).reshape(1, N, -1))
    return out, TreeRecord(conv_state, qkv, q, k, v, a, b, state, gdn)


def tree_layer(layer: nn.Module, x: mx.array, tree_plan: TreePlan, cache: ArraysCache):
    """A qwen3_5 decoder layer over the flattened tree; (output, record)."""
    r, record = tree_attention(layer.linear_attn, layer.input_layernorm(x), tree_plan, cache)
    h = x + r
    return h + layer.mlp(layer.post_attention_layernorm(h)), record


def commit(cache: ArraysCache, record: TreeRecord, path: list[int]) -> None:
    """Set ``cache`` to its conv window and state after feeding the ``path`` nodes."""
    rows = mx.array(path)
    window = record.conv_state.shape[1]
    inputs = mx.concatenate([record.conv_state, record.qkv[:, rows]], axis=1)
    cache[0] = mx.contiguous(inputs[:, -window:, :])
    gdn = record.layer
    steps = [t[:, rows] for t in (record.q, record.k, record.v, record.a, record.b)]
    _, cache[1] = gated_delta_update(*steps, gdn.A_log, gdn.dt_bias, record.state, None,
                                     use_kernel=not gdn.training)
