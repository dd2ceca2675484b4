// GatedDeltaNet recurrence over a DDTree (body for mx.fast.metal_kernel).
//
// The N nodes of a flattened draft tree are verified in one target pass. Each
// node's state is its parent's state advanced one step by the node's own
// q, k, v, g, beta; the root's parent is the context state. Per value head h
// (key head h / (Hv / Hk)) and value row i the step is gdn_verify.metal's:
//
//   S      = S_parent * g[n]
//   kv     = sum_j S[i, j] k[n, j]
//   S[i,:] = S[i,:] + k[n, :] * (v[n, i] - kv) * beta[n]
//   y[n,i] = sum_j S[i, j] q[n, j]
//
// with the same operations in the same order (lane sums, then the butterfly
// shuffle_xor 1, 2, 4, 8, 16), so a node's output is bit for bit what the
// verify kernel gives for the last token of the node's path.
//
// No per-node state is written to device memory. Each thread walks the tree
// depth first, as the host-made schedule orders it, with its share of the
// state (Dk / 32 elements) in registers and up to Slots saved states in
// thread memory. The schedule gives, per step i, the node, the slot its
// parent's state is read from (-1: the registers, which hold the previous
// node's state, i.e. the parent for a first child) and the slot its own state
// is saved to (-1: none; only nodes with two or more children are saved).
// Children are visited largest subtree last, and a parent's slot is free
// again when its last child starts, so a tree of N nodes needs at most
// log2(N) slots (dflash_mlx/kernels/gdn_tree.py makes the schedule; a chain
// uses none and runs exactly gdn_verify's loop).
//
// Inputs:   q, k     [1, N, Hk, Dk] InT   (normalized by mlx-lm's normalize_qk)
//           v        [1, N, Hv, Dv] InT
//           g        [1, N, Hv]     float32
//           beta     [1, N, Hv]     any float type
//           state    [1, Hv, Dv, Dk] float32: the context state (the root's parent)
//           schedule [N, 3]         int32: (node, read slot, save slot) per step
// Output:   y        [1, N, Hv, Dv] InT, in node order
// Template: InT, Dk (a multiple of 32, at most 256), Slots (saved states per thread).
// Grid (32, Dv, Hv), threadgroup (32, 4, 1): one SIMD-group per value row.

constexpr int PER_LANE = Dk / 32;

const int N = q_shape[1];
const int Hk = q_shape[2];
const int Hv = v_shape[2];
const int Dv = v_shape[3];

const int hv = int(thread_position_in_grid.z);
const int hk = hv / (Hv / Hk);
const int lane = int(thread_index_in_simdgroup);
const int row = int(thread_position_in_grid.y);

const size_t state_at = (size_t(hv) * Dv + row) * Dk + PER_LANE * lane;
float s[PER_LANE];
for (int j = 0; j < PER_LANE; ++j) {
  s[j] = state[state_at + j];
}
float saved[Slots][PER_LANE];

for (int i = 0; i < N; ++i) {
  const int node = schedule[3 * i];
  const int from = schedule[3 * i + 1];
  const int to = schedule[3 * i + 2];
  if (from >= 0) {
    for (int j = 0; j < PER_LANE; ++j) {
      s[j] = saved[from][j];
    }
  }

  auto q_ = q + (size_t(node) * Hk + hk) * Dk;
  auto k_ = k + (size_t(node) * Hk + hk) * Dk;
  const size_t at = size_t(node) * Hv + hv;

  const float decay = g[at];
  float kv = 0.0f;
  for (int j = 0; j < PER_LANE; ++j) {
    s[j] = s[j] * decay;
    kv += s[j] * k_[PER_LANE * lane + j];
  }
  kv += simd_shuffle_xor(kv, 1);
  kv += simd_shuffle_xor(kv, 2);
  kv += simd_shuffle_xor(kv, 4);
  kv += simd_shuffle_xor(kv, 8);
  kv += simd_shuffle_xor(kv, 16);

  const float delta = (v[at * Dv + row] - kv) * beta[at];

  float out = 0.0f;
  for (int j = 0; j < PER_LANE; ++j) {
    s[j] = s[j] + k_[PER_LANE * lane + j] * delta;
    out += s[j] * q_[PER_LANE * lane + j];
  }
  out += simd_shuffle_xor(out, 1);
  out += simd_shuffle_xor(out, 2);
  out += simd_shuffle_xor(out, 4);
  out += simd_shuffle_xor(out, 8);
  out += simd_shuffle_xor(out, 16);
  if (lane == 0) {
    y[at * Dv + row] = static_cast<InT>(out);
  }

  if (to >= 0) {
    for (int j = 0; j < PER_LANE; ++j) {
      saved[to][j] = s[j];
    }
  }
}
