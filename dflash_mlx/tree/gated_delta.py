"""GatedDeltaNet layers over a flattened DDTree: each node follows its own path.

A node's short convolution reads the K-1 inputs before it *on its path* (its
ancestors, then the layer's conv window from the context), and its recurrent
state is its parent's state advanced by one step. ``tree_layer`` runs the
layer's own submodules (as ``gated_delta.recording_attention`` does): the
projections and the convolution for all nodes at once, the convolution over
each node's gathered window, and the recurrence through the
``gdn_tree_verify`` kernel (:mod:`dflash_mlx.kernels.gdn_tree`), which writes
each node's output and no per-node state; where it does not run, its
reference steps one depth level at a time, each node from its parent's state
(two levels of states alive at once). Nothing per node outlives the layer but
its q, k, v, a, b and conv input.

The pass leaves the cache untouched; ``commit`` sets it to the accepted
path's end: the conv window is the path's last K-1 inputs and the state is
the context state advanced along the path by what the chain's verify pass
runs (the ``gdn_verify`` kernel where active, else mlx-lm's
``gated_delta_update``), so it is bit for bit the state the chain would hold.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_update

from ..kernels import gdn as gdn_kernels
from ..kernels.gdn_tree import KERNEL as TREE_KERNEL
from ..kernels.gdn_tree import TreeIndex
from ..targets import project, split_qkv, sum_heads
from .build import Tree


@dataclass
class TreePlan:
    """Host-side indices of one tree, shared by every GatedDeltaNet layer of a pass."""

    windows: mx.array  # [N, K]: rows of [conv window ; nodes] each node's conv reads
    index: TreeIndex  # the recurrence's: depth levels and the kernel's walk


def plan(tree: Tree, kernel_size: int) -> TreePlan:
    window = kernel_size - 1
    windows = []
    for node in range(len(tree)):
        rows = list(range(window)) + [window + i for i in tree.path(node)]
        windows.append(rows[-kernel_size:])
    return TreePlan(mx.array(windows), TreeIndex.of(tree.parents))


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
    state: mx.array  # [1, Hv, Dv, Dk] float32: the context state the pass started from
    layer: nn.Module


def tree_attention(gdn: nn.Module, x: mx.array, tree_plan: TreePlan, cache: ArraysCache):
    """The GatedDeltaNet over the flattened tree [1, N, H]; (output, record)."""
    _, N, _ = x.shape
    qkv, z, b, a = project(gdn, x)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((1, gdn.conv_kernel_size - 1, gdn.conv_dim), dtype=x.dtype)
    rows = mx.concatenate([conv_state, qkv], axis=1)[0]
    conv_out = nn.silu(gdn.conv1d(rows[tree_plan.windows])).reshape(1, N, -1)
    q, k, v = split_qkv(gdn, conv_out)
    state = cache[1]
    if state is None:
        state = mx.zeros((1, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim), dtype=mx.float32)
    g, beta = compute_g(gdn.A_log, a, gdn.dt_bias), mx.sigmoid(b)
    recurrence = TREE_KERNEL.reference if gdn.training else TREE_KERNEL
    (out,) = recurrence(q, k, v, g, beta, state, tree=tree_plan.index)
    out = sum_heads(gdn, gdn.out_proj(gdn.norm(out, z).reshape(1, N, -1)))
    return out, TreeRecord(conv_state, qkv, q, k, v, a, b, state, gdn)


def tree_layer(layer: nn.Module, x: mx.array, tree_plan: TreePlan, cache: ArraysCache):
    """A qwen3_5 or qwen3_next decoder layer over the flattened tree; (output, record)."""
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
    q, k, v, a, b = (t[:, rows] for t in (record.q, record.k, record.v, record.a, record.b))
    if not gdn.training:  # as gated_delta.recording_attention runs a verified block
        g, beta = compute_g(gdn.A_log, a, gdn.dt_bias), mx.sigmoid(b)
        if gdn_kernels.VERIFY.active(q, k, v, g, beta, record.state):
            _, cache[1] = gdn_kernels.VERIFY.launch(q, k, v, g, beta, record.state)
            return
    _, cache[1] = gated_delta_update(q, k, v, a, b, gdn.A_log, gdn.dt_bias, record.state, None,
                                     use_kernel=not gdn.training)
