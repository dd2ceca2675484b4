// GatedDeltaNet verify pass over a block (body for mx.fast.metal_kernel).
//
// The gated delta recurrence of mlx-lm's qwen3_5 layers, for the b tokens of a
// verified block, per sequence s, value head h (key head h / (Hv / Hk)), value
// row i, with the state S [Dv, Dk] of that head:
//
//   S      = S * g[t]                           (decay)
//   kv     = sum_j S[i, j] k[t, j]
//   delta  = (v[t, i] - kv) * beta[t]
//   S[i,:] = S[i,:] + k[t, :] * delta
//   y[t,i] = sum_j S[i, j] q[t, j]
//
// Semantics: mlx_lm/models/gated_delta.py (`_gated_delta_step_ops`, and the
// Metal kernels `gated_delta_update` dispatches to); g and beta are computed
// outside, by mlx-lm's own `compute_g` and `mx.sigmoid`, so they are exactly
// what `gated_delta_update` uses.
//
// Inputs:   q, k  [B, T, Hk, Dk] InT     (normalized by mlx-lm's normalize_qk)
//           v     [B, T, Hv, Dv] InT
//           g     [B, T, Hv]     float32
//           beta  [B, T, Hv]     any float type
//           state [B, Hv, Dv, Dk] float32: the state before the block
// Outputs:  y         [B, T, Hv, Dv]  InT
//           state_out [B, Hv, Dv, Dk] float32: the state after the block
// Template: InT, Dk (a multiple of 32, at most 256).
// Grid (32, Dv, B * Hv), threadgroup (32, 4, 1): one SIMD-group per value row,
// each lane holding Dk / 32 consecutive state elements in registers.
//
// Rollback needs nothing more from this kernel: it replays the first a+1 steps
// from q/k/v/g/beta, which the pass has anyway (gdn_replay.metal; metal/README.md
// says why that beats storing every step's state). Summation order: each lane
// sums its Dk / 32 elements in order, then the SIMD-group adds the lanes with
// the butterfly shuffle_xor 1, 2, 4, 8, 16 written out, the order mlx-lm's
// kernels use (its `_make_gated_delta_kernel_xtree` documents it); the replay
// kernel does the same arithmetic, so it rebuilds the very states this pass
// went through.

constexpr int PER_LANE = Dk / 32;

const int T = q_shape[1];
const int Hk = q_shape[2];
const int Hv = v_shape[2];
const int Dv = v_shape[3];

const int n = int(thread_position_in_grid.z);  // sequence * Hv + value head
const int seq = n / Hv;
const int hv = n % Hv;
const int hk = hv / (Hv / Hk);
const int lane = int(thread_index_in_simdgroup);
const int row = int(thread_position_in_grid.y);  // value row i

auto q_ = q + (size_t(seq) * T * Hk + hk) * Dk;
auto k_ = k + (size_t(seq) * T * Hk + hk) * Dk;
auto v_ = v + (size_t(seq) * T * Hv + hv) * Dv;
auto y_ = y + (size_t(seq) * T * Hv + hv) * Dv;
auto g_ = g + size_t(seq) * T * Hv;
auto beta_ = beta + size_t(seq) * T * Hv;

const size_t state_at = (size_t(n) * Dv + row) * Dk + PER_LANE * lane;
float s[PER_LANE];
for (int j = 0; j < PER_LANE; ++j) {
  s[j] = state[state_at + j];
}

for (int t = 0; t < T; ++t) {
  const float decay = g_[hv];
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

  const float delta = (v_[row] - kv) * beta_[hv];

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
    y_[row] = static_cast<InT>(out);
  }

  q_ += Hk * Dk;
  k_ += Hk * Dk;
  v_ += Hv * Dv;
  y_ += Hv * Dv;
  g_ += Hv;
  beta_ += Hv;
}

for (int j = 0; j < PER_LANE; ++j) {
  state_out[state_at + j] = s[j];
}
