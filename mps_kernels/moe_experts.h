#pragma once
// What the moe_experts kernels (moe_experts.metal, moe_experts_quantized.metal; moe_shared_expert.metal too)
// share: the CPU kernels' silu, the rounding to the storage type, the half-SIMD-group reduction in the CPU
// kernels' order, the grouped path's tile staging and lane sums, the quantized codes and their group fold, and
// the sum over each row's slots (instantiated in
// moe_experts.metal with the route kernel; the quantized op launches both from there).
#include "hebrus_metal_common.h"
#include "hebrus_quant.h"

// exp(x) of the CPU kernels' silu (hebrus_simd.h exp_silu), operation for operation.
inline float hebrus_moe_exp_silu(float x) {
  const float log2e = 1.44269504088896341f;
  const float ln2_hi = 0.693359375f;
  const float ln2_lo = -2.12194440e-4f;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const uint minus_87_5 = 0xC2AF0000u;
  const uint bits_89 = 0x42B20000u;
  const uint sign = 0x80000000u;
  const uint b = as_type<uint>(x);
  const uint neg_capped = b < minus_87_5 ? b : minus_87_5;
  const uint flipped = neg_capped ^ sign;
  const uint capped = flipped < (bits_89 ^ sign) ? flipped : (bits_89 ^ sign);
  const float xc = as_type<float>(capped ^ sign);
  const float t = fma(xc, log2e, magic);
  const float n = t - magic;
  const uint ni = as_type<uint>(t) - as_type<uint>(magic);
  const float r = fma(n, -ln2_lo, fma(n, -ln2_hi, xc));
  float y = 1.9875691500e-4f;
  y = fma(y, r, 1.3981999507e-3f);
  y = fma(y, r, 8.3334519073e-3f);
  y = fma(y, r, 4.1665795894e-2f);
  y = fma(y, r, 1.6666665459e-1f);
  y = fma(y, r, 5.0000001201e-1f);
  const float e = fma(y, r * r, r) + 1.0f;
  return (e * as_type<float>((ni + 126u) << 23)) * 2.0f;
}

inline float hebrus_moe_silu(float x) { return x / (1.0f + hebrus_moe_exp_silu(-x)); }

// v rounded to T and widened back.
template <typename T>
inline float hebrus_moe_round(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// The sum of the 16 lane partials of a half SIMD-group, at its lane 0, in reduce_lanes' order. Every lane
// of the SIMD-group calls it (uniform control flow at the shuffles).
inline float hebrus_moe_reduce(float v) {
  v = v + simd_shuffle_down(v, ushort(8));
  v = v + simd_shuffle_down(v, ushort(4));
  v = v + simd_shuffle_down(v, ushort(2));
  return v + simd_shuffle_down(v, ushort(1));
}

// The act value of a pair and intermediate output from its reduced gate and up sums g, u (decode and grouped).
template <typename T>
inline float hebrus_moe_act_value(float g, float u) {
  return hebrus_moe_round<T>(hebrus_moe_round<T>(hebrus_moe_silu(hebrus_moe_round<T>(g))) * hebrus_moe_round<T>(u));
}

// A pair's weighted output from its reduced down sum y and router weight w (decode and grouped).
template <typename T>
inline float hebrus_moe_weighted(float y, float w, int round_product) {
  const float prod = hebrus_moe_round<T>(y) * w;
  return round_product != 0 ? hebrus_moe_round<T>(prod) : prod;
}

// ---- the grouped (prefill) path: tiles of one expert's pairs, inputs staged in threadgroup memory ----------
// A tile's threadgroup (HEBRUS_MOE_TG threads) sums HEBRUS_MOE_TILE_ROWS rows against HEBRUS_MOE_TILE_COLS
// outputs: thread tid is lane tid % 16 of cell tid / 16, which sums tile row (cell % 8) against the cell's 8
// outputs. Lane l adds the products of inputs l, l + 16, ... in ascending order into one fp32 accumulator per
// output, exactly as a decode half SIMD-group's lane l does, and the cells reduce with hebrus_moe_reduce: so
// every (pair, output) sum has the decode kernels' bits, whatever else the tile holds.

// The pairs of tile `tile` (from moe_experts_route's table: tiles[0] = count, then (expert, begin, end) per
// tile, begin / end indexing `order`) into pairs_tg (-1 past the tile's end) and its expert; false for a
// threadgroup past the route's tiles (the whole threadgroup returns: tiles[0] is uniform).
inline bool hebrus_moe_tile_pairs(device const long* tiles, device const long* order, long tile,
                                  threadgroup long* pairs_tg, thread long& expert, uint tid) {
  if (tile >= tiles[0]) {
    return false;
  }
  device const long* t = tiles + 1 + 3 * tile;
  expert = t[0];
  if (tid < HEBRUS_MOE_TILE_ROWS) {
    pairs_tg[tid] = t[1] + long(tid) < t[2] ? order[t[1] + long(tid)] : -1;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return true;
}

// Inputs [k0, k0 + TILE_K) of the tile's rows (row pairs_tg[r] / div of src, `width` values each) as fp32,
// zero past width and for rows past the tile.
template <typename S>
inline void hebrus_moe_stage_rows(threadgroup float* dst, device const S* src, threadgroup const long* pairs_tg,
                                  long div, long width, long k0, uint tid) {
  for (uint v = tid; v < HEBRUS_MOE_TILE_ROWS * HEBRUS_MOE_TILE_K; v += HEBRUS_MOE_TG) {
    const long pair = pairs_tg[v / HEBRUS_MOE_TILE_K], d = k0 + long(v % HEBRUS_MOE_TILE_K);
    dst[v] = pair >= 0 && d < width ? static_cast<float>(src[(pair / div) * width + d]) : 0.0f;
  }
}

// Inputs [k0, k0 + TILE_K) of weight rows base + o0 + c, c < TILE_COLS (`width` values each), zero past
// width and for outputs o0 + c >= count.
template <typename T>
inline void hebrus_moe_stage_weights(threadgroup T* dst, device const T* w, long base, long o0, long count,
                                     long width, long k0, uint tid) {
  for (uint v = tid; v < HEBRUS_MOE_TILE_COLS * HEBRUS_MOE_TILE_K; v += HEBRUS_MOE_TG) {
    const long o = o0 + long(v / HEBRUS_MOE_TILE_K), d = k0 + long(v % HEBRUS_MOE_TILE_K);
    dst[v] = o < count && d < width ? w[(base + o) * width + d] : static_cast<T>(0.0f);
  }
}

// acc[j] = acc[j] + w[j][m] * xrow[m] for m = l, l + 16, ... < len (len a multiple of 16): lane l's part of
// the cell's 8 dot products over one staged step, in the decode kernels' order.
template <typename W>
inline void hebrus_moe_tile_dots(thread float* acc, threadgroup const W* w, threadgroup const float* xrow, long len,
                                 uint l) {
  for (long m = long(l); m < len; m += HEBRUS_MOE_LANES) {
    const float xv = xrow[m];
    for (int j = 0; j < HEBRUS_MOE_CELL_COLS; ++j) {
      acc[j] = acc[j] + static_cast<float>(w[j * HEBRUS_MOE_TILE_K + m]) * xv;
    }
  }
}

// The sum launch: one thread per (row, d): out = round(((0 + ywt[t, 0]) + ywt[t, 1]) + ...), slot order.
template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_MOE_SUM_TG)]] void moe_experts_sum(
    device const float* ywt [[buffer(0)]],     // [T * k, H]
    device T* out [[buffer(1)]],               // [T, H]
    device HebrusErrorMessages* err [[buffer(2)]],
    constant MoeExpertsParams& p [[buffer(3)]],
    uint tid [[thread_position_in_grid]]) {
  const long t = long(tid) / p.hidden, d = long(tid) % p.hidden;
  if (t >= p.rows) {
    return;
  }
  float s = 0.0f;
  for (long j = 0; j < p.top_k; ++j) {
    s = s + ywt[(t * p.top_k + j) * p.hidden + d];
  }
  out[t * p.hidden + d] = static_cast<T>(s);
}

// ---- affine-quantized weights (moe_experts_quantized.metal, moe_shared_expert.metal) -------------------------

// (the code read and the group fold: hebrus_quant.h, shared with hc_premix.metal's quantized pre-mix)

// The rows of an affine-quantized matrix W [rows, cols] (codes [rows, cols * BITS / 32], scales / biases
// [rows, cols / group_size] of T; cols a multiple of group_size): dot(r, v, l) is lane l's part of W[r] . v,
// folded per group as the CPU kernels fold it (the lane's values d = l, l + 16, ... of each group in ascending
// order, then hebrus_moe_fold). quantized_linear's and moe_shared_expert_quantized's weight reads.
template <int BITS, typename T>
struct HebrusMoeQuantRows {
  device const uint* codes;
  device const T* scales;
  device const T* biases;
  long cols, group_size;

  template <typename V>
  float dot(long r, device const V* v, long l) const {
    const long words = cols * BITS / 32, groups = cols / group_size;
    float acc = 0.0f;
    for (long g0 = 0; g0 < cols; g0 += group_size) {
      float qx = 0.0f, xs = 0.0f;
      for (long d = g0 + l; d < g0 + group_size; d += HEBRUS_MOE_LANES) {
        const float xv = static_cast<float>(v[d]);
        qx = fma(hebrus_moe_code<BITS>(codes + r * words, d), xv, qx);
        xs = xs + xv;
      }
      acc = hebrus_moe_fold(acc, qx, xs, scales + r * groups, biases + r * groups, g0 / group_size);
    }
    return acc;
  }
};
