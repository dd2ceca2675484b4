// Greedy block verification, in one launch (body for mx.fast.metal_kernel).
//
// Inputs:   logits  [B, b, V]  T (float, float16_t or bfloat16_t)
//           drafted [B, b-1]   int32: the draft's tokens d_1 .. d_{b-1}
// Outputs:  argmax  [B, b]     int32, first index of each row's maximum
//           packed  [B]        int32, (a << 24) | token: a drafts accepted,
//                              token = argmax[s, a] (the correction/bonus)
// Template: T.  atomic_outputs = true; init_value = 2^30 (above any packed value).
// Grid (TG, b, B) threads, threadgroup (TG, 1, 1), TG a multiple of 32 and
// <= 1024: one threadgroup per row (i, s).  Needs V <= 2^24 and b <= 64.
//
// Row i is a mismatch when i < b-1 and argmax[s, i] != drafted[s, i]. The
// accepted length a is the first mismatch, or b-1 if there is none, and the
// token is argmax[s, a]. Each mismatching row, and the last row, offers
// (i << 24) | argmax[s, i] to atomic_min on packed[s]; the smallest offer is
// exactly (a << 24) | argmax[s, a]. So one tiny array carries the result.

threadgroup uint dfl_keys[32];
threadgroup uint dfl_index[32];

const uint row = threadgroup_position_in_grid.y;
const uint seq = threadgroup_position_in_grid.z;
const uint tid = thread_position_in_threadgroup.x;
const uint width = threads_per_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint n_sg = simdgroups_per_threadgroup;
const uint block = uint(logits_shape[1]);
const uint vocab = uint(logits_shape[2]);

// 1. each thread: best key (first index on ties) over a strided slice of the row
auto x = logits + (size_t(seq) * block + row) * vocab;
uint best_key = 0u;
uint best_index = 0xffffffffu;
for (uint j = tid; j < vocab; j += width) {
  uint key = dfl_argmax_key(static_cast<float>(x[j]));
  if (key > best_key) {
    best_key = key;
    best_index = j;
  }
}

// 2. SIMD-group: the largest key, then the smallest index that holds it
uint sg_key = simd_max(best_key);
uint sg_index = simd_min(best_key == sg_key ? best_index : 0xffffffffu);
if (lane == 0) {
  dfl_keys[sg] = sg_key;
  dfl_index[sg] = sg_index;
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// 3. first SIMD-group: the same over the SIMD-group results, then publish
if (sg == 0) {
  uint key = lane < n_sg ? dfl_keys[lane] : 0u;
  uint index = lane < n_sg ? dfl_index[lane] : 0xffffffffu;
  uint top = simd_max(key);
  uint arg = simd_min(key == top ? index : 0xffffffffu);
  if (lane == 0) {
    atomic_store_explicit(&argmax[seq * block + row], int(arg), memory_order_relaxed);
    bool last = row + 1 == block;
    if (last || drafted[seq * (block - 1) + row] != int(arg)) {
      atomic_fetch_min_explicit(&packed[seq], int((row << 24) | arg), memory_order_relaxed);
    }
  }
}
