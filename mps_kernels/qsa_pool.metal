// hebrus::qsa_pool on Apple GPUs: pooled, normed, roped key of every group (SPEC section 3;
// hebrus_torch/reference.py is the spec, transformers' Qwen4ExpTextQSAIndexer the model).
//
// Thread layout (hebrus_launch.h): one SIMD-group (32 lanes) per group, 8 groups per threadgroup;
// the last threadgroup may hold fewer SIMD-groups, never a partial one. Steps per group:
//   1. lanes check the group's r cells: in [0, cells) and holding positions group_pos + i. A
//      broken group is reported through the error slots (smallest flat index g * r + i, so the
//      glue names the same member the reference does) and writes nothing; the glue raises
//      HoleError / HebrusError and publishes no output.
//   2. mean over the r raw keys in fp32, in member order, rounded to the key dtype (torch's
//      .float().mean(1).to(dtype)); the rounded value is parked in the output row.
//   3. RMSNorm: simd_sum of the squares, x * rsqrt(mean + eps) * (1 + w) in fp32, rounded.
//   4. RoPE at the group's first position on the first R dims (rotate-half), rounding to the key
//      dtype after every product and the sum, as torch does for half / bfloat tensors.
// Each lane owns the rotary pairs (d, d + R/2) for d = lane, lane + 32, ... and the tail dims
// R + lane, R + lane + 32, ...; it reads back only what it wrote itself, so no barrier is needed.
#include "hebrus_metal_common.h"

template <typename T>
inline float hebrus_pool_dim(device const T* keys, device const int* cells, long r, long dim, long d,
                             device T* out) {
  float acc = 0.0f;
  for (long i = 0; i < r; ++i) {
    acc = acc + static_cast<float>(keys[long(cells[i]) * dim + d]);
  }
  const T mean = static_cast<T>(acc / float(r));
  out[d] = mean;
  const float v = static_cast<float>(mean);
  return v * v;
}

template <typename T>
inline T hebrus_norm_dim(device const T* out, device const float* w, long d, float inv_rms) {
  return static_cast<T>((static_cast<float>(out[d]) * inv_rms) * (1.0f + w[d]));
}

// x * c + rot * s with a rounding to T after each product and after the sum.
template <typename T>
inline T hebrus_rope(T x, T c, T rot, T s) {
  const T a = static_cast<T>(static_cast<float>(x) * static_cast<float>(c));
  const T b = static_cast<T>(static_cast<float>(rot) * static_cast<float>(s));
  return static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
}

template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_QSA_POOL_TG)]] void qsa_pool(
    device const T* keys [[buffer(0)]],          // [cells, D]
    device const long* cell_pos [[buffer(1)]],   // [cells]
    device const int* group_cells [[buffer(2)]], // [G, r]
    device const long* group_pos [[buffer(3)]],  // [G]
    device const float* norm_weight [[buffer(4)]], // [D], as fp32
    device const float* inv_freq [[buffer(5)]],  // [R / 2]
    device T* pooled [[buffer(6)]],              // [G, D]
    device HebrusErrorMessages* err [[buffer(7)]], // the stream's error buffer
    constant QsaPoolParams& p [[buffer(8)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long g = long(tid) / HEBRUS_SIMD_WIDTH;
  if (g >= p.groups) {
    return;  // whole SIMD-groups only: the grid is groups * 32 threads
  }
  const long r = p.group_size, dim = p.dim, half_rot = p.rot_half, rot = 2 * p.rot_half;
  device const int* cells = group_cells + g * r;
  const long first = group_pos[g];

  bool broken = false;
  for (long i = long(lane); i < r; i += HEBRUS_SIMD_WIDTH) {
    const long c = cells[i];
    if (c < 0 || c >= p.cells) {
      HEBRUS_REPORT_ERROR(err, "qsa_pool", "hebrus::qsa_pool: group ", g, " cell ", i, " = ", c, " is outside [0, ",
                          p.cells, ")");
      broken = true;
    } else if (cell_pos[c] != long(ulong(first) + ulong(i))) {  // wraps like the reference's int64 add
      HEBRUS_REPORT_ERROR(err, "qsa_pool", "hebrus::qsa_pool: group ", g, " starting at position ", first,
                          " has position ", cell_pos[c], " in member ", i, " where ", long(ulong(first) + ulong(i)),
                          " is required (a hole inside the run is not padding)");
      broken = true;
    }
  }
  if (simd_any(broken)) {
    return;  // the whole SIMD-group leaves together
  }

  device T* out = pooled + g * dim;
  float sum_sq = 0.0f;
  for (long d = long(lane); d < half_rot; d += HEBRUS_SIMD_WIDTH) {
    sum_sq += hebrus_pool_dim(keys, cells, r, dim, d, out);
    sum_sq += hebrus_pool_dim(keys, cells, r, dim, d + half_rot, out);
  }
  for (long d = rot + long(lane); d < dim; d += HEBRUS_SIMD_WIDTH) {
    sum_sq += hebrus_pool_dim(keys, cells, r, dim, d, out);
  }
  const float inv_rms = precise::rsqrt(simd_sum(sum_sq) / float(dim) + p.eps);

  const float position = float(first);
  for (long d = long(lane); d < half_rot; d += HEBRUS_SIMD_WIDTH) {
    const T x1 = hebrus_norm_dim(out, norm_weight, d, inv_rms);
    const T x2 = hebrus_norm_dim(out, norm_weight, d + half_rot, inv_rms);
    const float angle = position * inv_freq[d];
    const T c = static_cast<T>(precise::cos(angle));
    const T s = static_cast<T>(precise::sin(angle));
    const T neg_x2 = static_cast<T>(-static_cast<float>(x2));
    out[d] = hebrus_rope(x1, c, neg_x2, s);
    out[d + half_rot] = hebrus_rope(x2, c, x1, s);
  }
  for (long d = rot + long(lane); d < dim; d += HEBRUS_SIMD_WIDTH) {
    out[d] = hebrus_norm_dim(out, norm_weight, d, inv_rms);
  }
}

HEBRUS_INSTANTIATE(qsa_pool, float, float)
HEBRUS_INSTANTIATE(qsa_pool, half, half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_INSTANTIATE(qsa_pool, bfloat, bfloat)
#endif
