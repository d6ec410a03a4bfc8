// hebrus::rms_norm_rope on Apple GPUs (issue 37): Qwen4Exp's RMSNorm of every head of x [T, H, D], then
// transformers' rotate-half RoPE of its first R dims at the token's cos/sin [T, R] (x's dtype), in one
// launch: attention's q_norm / k_norm and the indexer's q_layernorm with their RoPE
// (hebrus_torch/reference/hc.py rms_norm_rope is the spec).
//
// Thread layout (hebrus_launch.h): one SIMD-group (32 lanes) per (token, head), 8 per threadgroup; the
// last threadgroup may hold fewer SIMD-groups, never a partial one. Each lane sums the squares of the
// dims lane, lane + 32, ... in fp32, simd_sum adds the lanes; the normed value of a dim is
// (x * rsqrt(sum / D + eps)) * (1 + w) in fp32 rounded to T (the module's norm). Each lane then owns the
// rotary pairs (d, d + R/2) for d = lane, lane + 32, ... < R/2 and writes x*cos + rotate_half(x)*sin with
// a rounding to T after each product and after the sum (torch's mul, mul, add in T), and the dims past R
// as normed. x is read through the strides of its first two dims (its last dim is contiguous), so q cut
// from a wider projection is read in place; a lane reads only x and writes only its own dims of out.
#include "hebrus_metal_common.h"

template <typename T>
inline T hebrus_normed(device const T* x, device const float* w, long d, float inv_rms) {
  return static_cast<T>((static_cast<float>(x[d]) * inv_rms) * (1.0f + w[d]));
}

// a * c + b * s with a rounding to T after each product and after the sum.
template <typename T>
inline T hebrus_rotate(T a, T c, T b, T s) {
  const T ac = static_cast<T>(static_cast<float>(a) * static_cast<float>(c));
  const T bs = static_cast<T>(static_cast<float>(b) * static_cast<float>(s));
  return static_cast<T>(static_cast<float>(ac) + static_cast<float>(bs));
}

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_NORM_ROPE_TG)]] void rms_norm_rope(
    device const T* x [[buffer(0)]],              // [T, H, D] through strides (x_stride0, x_stride1, 1)
    device const float* weight [[buffer(1)]],     // [D], as fp32
    device const T* cos [[buffer(2)]],            // [T, R]
    device const T* sin [[buffer(3)]],            // [T, R]
    device T* out [[buffer(4)]],                  // [T, H, D]
    device HebrusErrorMessages* err [[buffer(5)]],  // the stream's error buffer (no value to check)
    constant RmsNormRopeParams& p [[buffer(6)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long row = long(tid) / HEBRUS_SIMD_WIDTH;
  if (row >= p.tokens * p.heads) {
    return;  // whole SIMD-groups only: the grid is a multiple of 32 threads
  }
  const long t = row / p.heads, h = row % p.heads, dim = p.dim, half = p.rot / 2;
  device const T* xr = x + t * p.x_stride0 + h * p.x_stride1;
  device T* o = out + row * dim;
  device const T* c = cos + t * p.rot;
  device const T* s = sin + t * p.rot;
  float sum_sq = 0.0f;
  for (long d = long(lane); d < dim; d += HEBRUS_SIMD_WIDTH) {
    const float v = static_cast<float>(xr[d]);
    sum_sq = sum_sq + v * v;
  }
  const float inv = precise::rsqrt(simd_sum(sum_sq) / float(dim) + p.eps);
  for (long d = long(lane); d < half; d += HEBRUS_SIMD_WIDTH) {
    const T x1 = hebrus_normed(xr, weight, d, inv);
    const T x2 = hebrus_normed(xr, weight, d + half, inv);
    o[d] = hebrus_rotate(x1, c[d], static_cast<T>(-static_cast<float>(x2)), s[d]);
    o[d + half] = hebrus_rotate(x2, c[d + half], x1, s[d + half]);
  }
  for (long d = p.rot + long(lane); d < dim; d += HEBRUS_SIMD_WIDTH) {
    o[d] = hebrus_normed(xr, weight, d, inv);
  }
}

HEBRUS_INSTANTIATE(rms_norm_rope, float, float)
HEBRUS_INSTANTIATE(rms_norm_rope, half, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(rms_norm_rope, bfloat, bfloat)
#endif
