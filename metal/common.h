// dflash-mlx: helpers shared by the kernels in this folder.
//
// The registry (dflash_mlx/kernels) passes this file as the `header` argument
// of mx.fast.metal_kernel, so it lands after MLX's own preamble
// (<metal_stdlib>, bfloat16_t, ...) and before the generated kernel function.
// Every name here starts with dfl_ to stay clear of MLX's utilities.

// A key whose unsigned order is the float order used by mx.argmax: larger
// floats get larger keys, every NaN gets the largest key (mx.argmax returns the
// first NaN), and -0.0 gets the key of +0.0 (they compare equal, so the first
// one wins). Real values never map to 0, which marks "no element".
inline uint dfl_argmax_key(float v) {
  uint bits = as_type<uint>(v);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return 0xffffffffu;
  }
  if ((bits & 0x7fffffffu) == 0u) {
    bits = 0u;
  }
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
