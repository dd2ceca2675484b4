// Rejection-sampling block verification, in one launch (body for mx.fast.metal_kernel).
//
// Inputs:   target_logprobs [B, b, V]    T: warped target log-probabilities log p_0 .. log p_{b-1}
//           draft_logprobs  [B, b-1, V]  Q: warped draft log-probabilities log q_1 .. log q_{b-1}
//           drafted         [B, b-1]     int32: the draft's tokens d_1 .. d_{b-1}, d_i ~ q_i
//           uniforms        [B, b+1]     float: MLX uniforms in [0, 1); columns 0 .. b-2 decide
//                                        the drafts, columns b-1 and b draw the next token
// Output:   packed          [B]          int32, (a << 24) | token
// Template: T, Q.  Grid (TG, B, 1) threads, threadgroup (TG, 1, 1), TG a multiple of 32 and
// <= 1024: one threadgroup per sequence.  Needs V <= 2^24 and 2 <= b <= 64.
//
// The kernel is deterministic given its inputs; the randomness is MLX's. For sequence s:
//
// 1. Draft i (0-based, d = drafted[s, i]) is accepted iff 0 <= d < V and
//        u_i * q < p,   p = exp(target[s, i, d]), q = exp(draft[s, i, d])   (float32)
//    which happens with probability min(1, p / q); p = 0 is never accepted.  a is the number of
//    leading accepted drafts.
// 2. The next token is drawn from one row, in 2^-39 fixed point (integers, so every sum is exact
//    whatever the order of the threads):  F(x) = floor(clamp(x, 0, 1) * 2^39),
//        P_j = F(exp(target[s, a, j])),  and for a < b-1:  Q_j = F(exp(draft[s, a, j])),
//        R_j = max(P_j - Q_j, 0)   (the residual max(p - q, 0)).
//    The weights are w = R if a < b-1 and sum(R) > 0, otherwise P (the bonus row when every draft
//    was accepted, and p itself when the residual has no mass).
// 3. Inverse CDF with a 48-bit uniform U = floor(u_{b-1} 2^24) 2^24 + floor(u_b 2^24):
//        goal = floor(U * W / 2^48),  W = sum(w),   token = min{ j : w_0 + ... + w_j > goal }.
//    goal < W, so the token has w_j > 0: never outside the support. (W = 0, which a normalized p
//    cannot give, yields V - 1.)
//
// exp is metal::precise::exp, which is what mx.exp runs on Metal, so the pure-MLX reference
// (dflash_mlx/kernels/verify_sampled.py) gives the same bits.
//
// Work: one pass over row a of p and q (each SIMD-group sums a contiguous segment), a pass over the
// segment that holds the goal (split among the SIMD-groups), then one SIMD-group scans 1/TG of the
// row with prefix sums. 64-bit values cross lanes as uint2 (SIMD-group functions take 32-bit types).

#define DFL_FIX_ONE 549755813888.0f  // 2^39
#define DFL_FIX(x) ((x) > 0.0f ? ((x) < 1.0f ? ulong((x) * DFL_FIX_ONE) : ulong(549755813888ul)) : ulong(0))
#define DFL_P(j) DFL_FIX(metal::precise::exp(static_cast<float>(trow[j])))
#define DFL_Q(j) DFL_FIX(metal::precise::exp(static_cast<float>(qrow[j])))
#define DFL_R(pj, qj) ((pj) > (qj) ? (pj) - (qj) : ulong(0))
#define DFL_SHUFFLE64(f, v, k) as_type<ulong>(f(as_type<uint2>(v), ushort(k)))

threadgroup int dfl_accepted[64];
threadgroup ulong dfl_p_sum[32];
threadgroup ulong dfl_r_sum[32];
threadgroup ulong dfl_sub_sum[32];

const uint seq = threadgroup_position_in_grid.y;
const uint tid = thread_position_in_threadgroup.x;
const uint width = threads_per_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint n_sg = simdgroups_per_threadgroup;
const uint block = uint(target_logprobs_shape[1]);
const uint vocab = uint(target_logprobs_shape[2]);
const uint n_draft = block - 1;
const uint n_u = block + 1;

// 1. the drafts, one thread each
for (uint i = tid; i < n_draft; i += width) {
  const int d = drafted[seq * n_draft + i];
  bool ok = false;
  if (d >= 0 && uint(d) < vocab) {
    const float p = metal::precise::exp(static_cast<float>(target_logprobs[(size_t(seq) * block + i) * vocab + uint(d)]));
    const float q = metal::precise::exp(static_cast<float>(draft_logprobs[(size_t(seq) * n_draft + i) * vocab + uint(d)]));
    ok = uniforms[seq * n_u + i] * q < p;
  }
  dfl_accepted[i] = ok ? 1 : 0;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
uint a = 0;
while (a < n_draft && dfl_accepted[a] != 0) {
  a++;
}
const bool has_q = a < n_draft;
// auto: MLX passes inputs of fewer than 8 elements in the constant address space, not device
const auto trow = target_logprobs + (size_t(seq) * block + a) * vocab;
const auto qrow = draft_logprobs + (size_t(seq) * n_draft + (has_q ? a : 0u)) * vocab;

// 2. per SIMD-group segment: sums of P and R over [seg_lo, seg_hi)
const uint seg_len = ((vocab + n_sg - 1) / n_sg + 31) / 32 * 32;
ulong p_sum = 0;
ulong r_sum = 0;
{
  const uint lo = min(sg * seg_len, vocab);
  const uint hi = min(lo + seg_len, vocab);
  for (uint j = lo + lane; j < hi; j += 32) {
    const ulong pj = DFL_P(j);
    p_sum += pj;
    if (has_q) {
      const ulong qj = DFL_Q(j);
      r_sum += DFL_R(pj, qj);
    }
  }
}
for (uint off = 16; off > 0; off >>= 1) {
  p_sum += DFL_SHUFFLE64(simd_shuffle_xor, p_sum, off);
  r_sum += DFL_SHUFFLE64(simd_shuffle_xor, r_sum, off);
}
if (lane == 0) {
  dfl_p_sum[sg] = p_sum;
  dfl_r_sum[sg] = r_sum;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
ulong p_total = 0;
ulong r_total = 0;
for (uint g = 0; g < n_sg; ++g) {
  p_total += dfl_p_sum[g];
  r_total += dfl_r_sum[g];
}
const bool use_r = has_q && r_total > 0;
const ulong total = use_r ? r_total : p_total;
if (total == 0) {
  if (tid == 0) {
    packed[seq] = int((a << 24) | (vocab - 1));
  }
  return;
}
// 3. goal = floor(U * total / 2^48) = high 64 bits of (U << 16) * total, in 32-bit limbs
ulong goal;
{
  const ulong u_hi = ulong(uint(uniforms[seq * n_u + n_draft] * 16777216.0f));
  const ulong u_lo = ulong(uint(uniforms[seq * n_u + n_draft + 1] * 16777216.0f));
  const ulong u = (u_hi << 40) | (u_lo << 16);
  const ulong m = 0xffffffffu;
  const ulong u1 = u >> 32, u0 = u & m, t1 = total >> 32, t0 = total & m;
  const ulong hl = u1 * t0, lh = u0 * t1;
  goal = u1 * t1 + (hl >> 32) + (lh >> 32) + (((hl & m) + (lh & m) + ((u0 * t0) >> 32)) >> 32);
}

// the segment that holds the goal (sums are exact: goal < total, so the last one if no other)
uint g = 0;
for (; g + 1 < n_sg; ++g) {
  const ulong s = use_r ? dfl_r_sum[g] : dfl_p_sum[g];
  if (s > goal) {
    break;
  }
  goal -= s;
}
const uint seg_lo = min(g * seg_len, vocab);
const uint seg_hi = min(seg_lo + seg_len, vocab);

// 4. split that segment among the SIMD-groups
const uint sub_len = ((seg_hi - seg_lo + n_sg - 1) / n_sg + 31) / 32 * 32;
{
  const uint lo = min(seg_lo + sg * sub_len, seg_hi);
  const uint hi = min(lo + sub_len, seg_hi);
  ulong w_sum = 0;
  for (uint j = lo + lane; j < hi; j += 32) {
    const ulong pj = DFL_P(j);
    if (use_r) {
      const ulong qj = DFL_Q(j);
      w_sum += DFL_R(pj, qj);
    } else {
      w_sum += pj;
    }
  }
  for (uint off = 16; off > 0; off >>= 1) {
    w_sum += DFL_SHUFFLE64(simd_shuffle_xor, w_sum, off);
  }
  if (lane == 0) {
    dfl_sub_sum[sg] = w_sum;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
uint h = 0;
for (; h + 1 < n_sg; ++h) {
  const ulong s = dfl_sub_sum[h];
  if (s > goal) {
    break;
  }
  goal -= s;
}

// 5. one SIMD-group scans that part, 32 weights at a time, with 64-bit prefix sums
if (sg == 0) {
  const uint lo = min(seg_lo + h * sub_len, seg_hi);
  const uint hi = min(lo + sub_len, seg_hi);
  uint token = hi - 1;
  for (uint base = lo; base < hi; base += 32) {
    const uint j = base + lane;
    ulong w = 0;
    if (j < hi) {
      const ulong pj = DFL_P(j);
      if (use_r) {
        const ulong qj = DFL_Q(j);
        w = DFL_R(pj, qj);
      } else {
        w = pj;
      }
    }
    ulong incl = w;
    for (uint off = 1; off < 32; off <<= 1) {
      const ulong v = DFL_SHUFFLE64(simd_shuffle_up, incl, off);
      if (lane >= off) {
        incl += v;
      }
    }
    const ulong tile = DFL_SHUFFLE64(simd_shuffle, incl, 31);
    if (tile > goal) {
      token = simd_min(incl > goal ? j : 0xffffffffu);
      break;
    }
    goal -= tile;
  }
  if (lane == 0) {
    packed[seq] = int((a << 24) | token);
  }
}
#undef DFL_SHUFFLE64
#undef DFL_R
#undef DFL_Q
#undef DFL_P
#undef DFL_FIX
#undef DFL_FIX_ONE
