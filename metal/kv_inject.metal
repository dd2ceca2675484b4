// KV injection for every draft layer in one launch (body for mx.fast.metal_kernel).
//
// Inputs:   kv       [B, T, L*2*H*D]  T: the stacked K/V projection of the fused
//                                     context. For layer l, columns
//                                     [2lHD, 2lHD + HD) are k_proj_l(ctx) (H heads
//                                     of D) and the next HD are v_proj_l(ctx).
//           norm_w   [L, D]   T       every layer's k_norm weight
//           inv_freq [D/2]    float   RoPE inverse frequencies
//           params   [3]      float   (eps, pos_scale, mscale)
//           offset   scalar   int32   absolute position of the first of the T tokens
// Outputs:  keys   [L, B, H, T, D]  T  rope(mscale * k_norm_l(k)), the rotation of
//                                      pair (j, j + D/2) by angle
//                                      pos_scale * (offset + t) * inv_freq[j]
//                                      (non-interleaved, as nn.RoPE by default)
//           values [L, B, H, T, D]  T  v, unchanged
// Template: T, HEAD_DIM (D, even, <= 512). L comes from norm_w, H from kv's width.
// Grid (32 * 2*L*H, T, B), threadgroup (<= 256, 1, 1): one SIMD-group per
// (layer, k|v, head) row of D elements of one (b, t).
//
// Rounding follows the pure-MLX path (fast.rms_norm, then the mscale multiply,
// then fast.rope): the normalised value is rounded to T, multiplied by the
// weight in T, by mscale in T, and the rotation is done in float and rounded
// to T once.

constexpr int HALF = HEAD_DIM / 2;
constexpr int PER_LANE = (HALF + 31) / 32;
const uint n_layers = uint(norm_w_shape[0]);
const uint row_width = uint(kv_shape[2]);
const uint n_kv = row_width / (2 * n_layers * HEAD_DIM);
const uint units = 2 * n_layers * n_kv;

const uint lane = thread_index_in_simdgroup;
const uint unit = thread_position_in_grid.x / 32;
const uint t = thread_position_in_grid.y;
const uint b = thread_position_in_grid.z;
const uint n_tok = uint(kv_shape[1]);
const uint n_batch = uint(kv_shape[0]);
if (unit >= units) {
  return;  // whole SIMD-groups only: the grid's x extent is a multiple of 32
}
const uint layer = unit / (2 * n_kv);
const uint part = unit % (2 * n_kv);
const uint head = part % n_kv;
auto src = kv + (size_t(b) * n_tok + t) * row_width + size_t(unit) * HEAD_DIM;
const size_t dst = (((size_t(layer) * n_batch + b) * n_kv + head) * n_tok + t) * HEAD_DIM;

if (part >= n_kv) {
  for (uint j = lane; j < uint(HEAD_DIM); j += 32) {
    values[dst + j] = src[j];
  }
  return;
}

float lo[PER_LANE];
float hi[PER_LANE];
float sum_sq = 0.0f;
for (int m = 0; m < PER_LANE; ++m) {
  const uint j = lane + 32 * m;
  lo[m] = 0.0f;
  hi[m] = 0.0f;
  if (j < uint(HALF)) {
    lo[m] = static_cast<float>(src[j]);
    hi[m] = static_cast<float>(src[j + HALF]);
    sum_sq += lo[m] * lo[m] + hi[m] * hi[m];
  }
}
sum_sq = simd_sum(sum_sq);

const float eps = params[0];
const float pos_scale = params[1];
const float mscale = params[2];
const float inv_rms = metal::rsqrt(sum_sq / float(HEAD_DIM) + eps);
const float position = pos_scale * static_cast<float>(offset + int(t));
auto w = norm_w + size_t(layer) * HEAD_DIM;

for (int m = 0; m < PER_LANE; ++m) {
  const uint j = lane + 32 * m;
  if (j < uint(HALF)) {
    float a = static_cast<float>(static_cast<T>(lo[m] * inv_rms));
    float c = static_cast<float>(static_cast<T>(hi[m] * inv_rms));
    a = static_cast<float>(static_cast<T>(a * static_cast<float>(w[j])));
    c = static_cast<float>(static_cast<T>(c * static_cast<float>(w[j + HALF])));
    if (mscale != 1.0f) {
      a = static_cast<float>(static_cast<T>(a * mscale));
      c = static_cast<float>(static_cast<T>(c * mscale));
    }
    const float theta = position * inv_freq[j];
    const float cs = metal::cos(theta);
    const float sn = metal::sin(theta);
    keys[dst + j] = static_cast<T>(a * cs - c * sn);
    keys[dst + j + HALF] = static_cast<T>(a * sn + c * cs);
  }
}
