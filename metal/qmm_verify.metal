// Block-verify quantized matmul (body for mx.fast.metal_kernel).
//
//   y[M, N] = x[M, K] @ dequant(w)[N, K]^T,   M = 1 .. 32 (a verified block, or a tree)
//
// Inputs:   x      [M, K]              T (float, float16_t or bfloat16_t), row-contiguous
//           w      [N, K * BITS / 32]  uint32: MLX's affine packing (mx.quantize): value j of
//                                      row n sits in word j / (32 / BITS) at bit
//                                      BITS * (j % (32 / BITS)), lowest bits first
//           scales [N, K / GROUP_SIZE] S
//           biases [N, K / GROUP_SIZE] S:  dequant(w)[n, j] = scale * q + bias, with the
//                                      scale and bias of group j / GROUP_SIZE of row n
// Output:   y      [M, N]              T
// Template: T, S, BITS (4 or 8), GROUP_SIZE (32, 64 or 128), MT = ceil(M / 8) (1 .. 4).
// Grid (128, ceil(N / 64), 1) threads, threadgroup (128, 1, 1): one threadgroup per
// 64 output columns, four SIMD-groups of 16 columns each.
//
// Per K step of 32: the threads stage the x tile [8 MT, 32] (rows >= M are zero)
// and the dequantized weight tile [64, 32] (rows >= N are zero) in threadgroup
// memory as float, then each SIMD-group multiplies with 8 x 8 simdgroup_matrix
// tiles: acc[m][j] += X[m-tile, k-tile] * W[j-tile, k-tile]^T (the W tile is loaded
// transposed). Dequantization and accumulation are in float; y is rounded to T
// once. One scale and bias serve a whole 32-wide step (GROUP_SIZE >= 32 and
// divides K), so each thread unpacks one uint32 (4-bit) or two (8-bit) per step.
//
// Sources: the packing is that of mx.quantize / mx.dequantize (MLX
// docs, "quantize"; checked in tests against mx.dequantize); simdgroup_matrix
// semantics from the Metal Shading Language Specification (SIMD-group matrix
// functions). No code is taken from MLX's own quantized kernels.

constexpr int BN = 64;                  // output columns per threadgroup
constexpr int BK = 32;                  // K per step
constexpr int ROWS = 8 * MT;            // x rows staged (zero-padded past M)
constexpr int PACK = 32 / BITS;         // quantized values per uint32
constexpr int STEP_WORDS = BK / PACK;   // words of one row per step: 4 (4-bit) or 8 (8-bit)
constexpr uint QMASK = (1u << BITS) - 1u;
constexpr int THREADS = 128;

threadgroup float x_tile[ROWS * BK];
threadgroup float w_tile[BN * BK];      // row n, column k; reused for the output tile

const int tid = int(thread_position_in_threadgroup.x);
const int sg = int(simdgroup_index_in_threadgroup);
const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_shape[0];
const int n0 = int(threadgroup_position_in_grid.y) * BN;
const int row_words = K / PACK;
const int row_groups = K / GROUP_SIZE;

simdgroup_float8x8 acc[MT][2];
for (int m = 0; m < MT; ++m) {
  acc[m][0] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  acc[m][1] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

for (int k0 = 0; k0 < K; k0 += BK) {
  // x tile, as float; rows past M are zero
  for (int i = tid; i < ROWS * BK; i += THREADS) {
    const int r = i / BK;
    x_tile[i] = r < M ? static_cast<float>(x[size_t(r) * K + k0 + (i % BK)]) : 0.0f;
  }
  // weight tile, dequantized: one scale and bias per row for the whole step
  const int group = k0 / GROUP_SIZE;
  for (int i = tid; i < BN * STEP_WORDS; i += THREADS) {
    const int r = i / STEP_WORDS;
    const int word = i % STEP_WORDS;
    const int n = n0 + r;
    threadgroup float* dst = w_tile + r * BK + word * PACK;
    if (n < N) {
      const uint packed = w[size_t(n) * row_words + k0 / PACK + word];
      const float scale = static_cast<float>(scales[size_t(n) * row_groups + group]);
      const float bias = static_cast<float>(biases[size_t(n) * row_groups + group]);
      for (int j = 0; j < PACK; ++j) {
        dst[j] = scale * static_cast<float>((packed >> (BITS * j)) & QMASK) + bias;
      }
    } else {
      for (int j = 0; j < PACK; ++j) {
        dst[j] = 0.0f;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int kk = 0; kk < BK; kk += 8) {
    simdgroup_float8x8 b0;
    simdgroup_float8x8 b1;
    // B[k][n] = W[n][k]: the weight rows of this SIMD-group's columns, transposed
    simdgroup_load(b0, w_tile + (sg * 16) * BK + kk, BK, ulong2(0, 0), true);
    simdgroup_load(b1, w_tile + (sg * 16 + 8) * BK + kk, BK, ulong2(0, 0), true);
    for (int m = 0; m < MT; ++m) {
      simdgroup_float8x8 a;
      simdgroup_load(a, x_tile + (m * 8) * BK + kk, BK);
      simdgroup_multiply_accumulate(acc[m][0], a, b0, acc[m][0]);
      simdgroup_multiply_accumulate(acc[m][1], a, b1, acc[m][1]);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// the output tile [ROWS, BN] through threadgroup memory (w_tile has room: ROWS <= BK),
// then the rows < M and columns < N to y
for (int m = 0; m < MT; ++m) {
  simdgroup_store(acc[m][0], w_tile + (m * 8) * BN + sg * 16, BN);
  simdgroup_store(acc[m][1], w_tile + (m * 8) * BN + sg * 16 + 8, BN);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int i = tid; i < ROWS * BN; i += THREADS) {
  const int r = i / BN;
  const int n = n0 + (i % BN);
  if (r < M && n < N) {
    y[size_t(r) * N + n] = static_cast<T>(w_tile[i]);
  }
}
