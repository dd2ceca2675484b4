// GatedDeltaNet rollback: rebuild the state after the first keep[s] steps of a
// verified block (body for mx.fast.metal_kernel).
//
// Same recurrence, same lane layout and same summation order as
// gdn_verify.metal (see there), without the output: from the state before the
// block and the block's recorded k, v, g, beta it runs steps 0 .. keep[s]-1 of
// sequence s and writes that state. The result is bit for bit the state the
// verify pass held after those steps (same operations in the same order). Only
// the first keep[s] steps are read: the block's q and later steps are not
// touched. keep[s] = 0 copies the state; keep[s] = T gives the verify pass's
// final state.
//
// Inputs:   k     [B, T, Hk, Dk] InT      (recorded by the verify pass)
//           v     [B, T, Hv, Dv] InT
//           g     [B, T, Hv]     float32
//           beta  [B, T, Hv]     any float type
//           state [B, Hv, Dv, Dk] float32: the state before the block
//           keep  [B]            int32, 0 <= keep[s] <= T (clamped)
// Output:   state_out [B, Hv, Dv, Dk] float32
// Template: InT, Dk (a multiple of 32, at most 256).
// Grid (32, Dv, B * Hv), threadgroup (32, 4, 1), as the verify kernel.

constexpr int PER_LANE = Dk / 32;

const int T = k_shape[1];
const int Hk = k_shape[2];
const int Hv = v_shape[2];
const int Dv = v_shape[3];

const int n = int(thread_position_in_grid.z);
const int seq = n / Hv;
const int hv = n % Hv;
const int hk = hv / (Hv / Hk);
const int lane = int(thread_index_in_simdgroup);
const int row = int(thread_position_in_grid.y);
const int steps = min(max(int(keep[seq]), 0), T);

auto k_ = k + (size_t(seq) * T * Hk + hk) * Dk;
auto v_ = v + (size_t(seq) * T * Hv + hv) * Dv;
auto g_ = g + size_t(seq) * T * Hv;
auto beta_ = beta + size_t(seq) * T * Hv;

const size_t state_at = (size_t(n) * Dv + row) * Dk + PER_LANE * lane;
float s[PER_LANE];
for (int j = 0; j < PER_LANE; ++j) {
  s[j] = state[state_at + j];
}

for (int t = 0; t < steps; ++t) {
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

  for (int j = 0; j < PER_LANE; ++j) {
    s[j] = s[j] + k_[PER_LANE * lane + j] * delta;
  }

  k_ += Hk * Dk;
  v_ += Hv * Dv;
  g_ += Hv;
  beta_ += Hv;
}

for (int j = 0; j < PER_LANE; ++j) {
  state_out[state_at + j] = s[j];
}
