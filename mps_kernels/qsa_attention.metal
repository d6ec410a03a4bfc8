// hebrus::qsa_attention on Apple GPUs: for every query, softmax(scale * q . k) . v over exactly the
// cells its token_cells row selects (issue 6; hebrus_torch/reference.py is the spec). Grouped-query
// attention: query head h reads KV head h / rep, rep = Hq / Hkv. fp32 accumulation, output in q's
// dtype.
//
// Thread layout (hebrus_launch.h): one threadgroup of 256 threads (8 SIMD-groups) per (query t,
// KV head g), so the rep query heads of g share every key and value row read. Within a pass over
// HB of those query heads:
//   * the pass's q rows are parked in threadgroup memory as fp32;
//   * SIMD-group s walks the entries j = s, s + 8, s + 16, ... of token_cells[t] (every negative
//     entry is padding, wherever it is); for a selected cell c the 32 lanes read k[c, g] and
//     v[c, g] once, lane l owning dims d = l + 32 i (each load of the SIMD-group is one contiguous
//     run of the row; rows are addressed through the element strides p.k_stride0/1, p.v_stride0/1,
//     so k and v may be views such as a cache row [Hkv, cells, D] transposed, read in place), and
//     for each of the HB heads: score = simd_sum(q . k) * scale, then an online softmax step on
//     the SIMD-group's own running state (max m, sum l, acc[Dv]) in fp32;
//   * the 8 partial states are merged in the fixed order s = 0..7 (M = max m_s, weights
//     exp(m_s - M)), thread d writing out[t, h, d] = sum_s w_s acc_s[d] / sum_s w_s l_s.
// Both steps subtract 0 instead of a max that is -inf (every score so far -inf, e.g. finite inputs
// whose dot product overflows): such scores get weight exactly 0, as in the reference.
// Which SIMD-group takes which entry, the order each takes them in and the merge order are fixed,
// so the output does not depend on thread timing, on the other queries of the launch or on the
// launch size. No atomic decides anything: atomics only record bad input in the error slots
// (an entry >= cells, a query without any entry >= 0), which the glue raises with the reference's
// messages. Variants h<HB>_d<DMAX>: HB in {1, 2, 4, 8} heads per pass, DMAX in {64, 128, 256}.
#include "hebrus_metal_common.h"

inline void hebrus_attention_bad_cell(device HebrusErrorMessages* err, long t, long j, long c, long cells) {
  HEBRUS_REPORT_ERROR(err, "qsa_attention", "hebrus::qsa_attention: query ", t, " selects cell ", c, " (token_cells[", t,
                      ", ", j, "]), outside [0, cells=", cells, "); negative entries are padding");
}

inline void hebrus_attention_empty(device HebrusErrorMessages* err, long t) {
  HEBRUS_REPORT_ERROR(err, "qsa_attention", "hebrus::qsa_attention: query ", t,
                      " selects no cell (every entry of token_cells[", t,
                      "] is negative padding); attention over an empty selection is undefined");
}

template <typename T, int HB, int DPL>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_QSA_ATTN_TG)]] void qsa_attention(
    device const T* q [[buffer(0)]],              // [Tq, Hq, Dh]
    device const T* k [[buffer(1)]],              // [cells, Hkv, Dh], strides (k_stride0, k_stride1, 1)
    device const T* v [[buffer(2)]],              // [cells, Hkv, Dv], strides (v_stride0, v_stride1, 1)
    device const int* token_cells [[buffer(3)]],  // [Tq, W]
    device T* out [[buffer(4)]],                  // [Tq, Hq, Dv]
    device HebrusErrorMessages* err [[buffer(5)]], // the stream's error buffer
    constant QsaAttentionParams& p [[buffer(6)]],
    uint item [[threadgroup_position_in_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint TG = HEBRUS_QSA_ATTN_TG;
  constexpr uint NSG = TG / HEBRUS_SIMD_WIDTH;
  constexpr int DMAX = DPL * HEBRUS_SIMD_WIDTH;
  static_assert(DMAX <= int(TG), "one merging thread per output dim");
  static_assert(HB <= HEBRUS_QSA_ATTN_MAX_HB, "heads per pass");

  threadgroup float q_tile[HB][DMAX];     // the pass's query heads, fp32
  threadgroup float part_acc[NSG][DMAX];  // one head's accumulators of every SIMD-group
  threadgroup float part_m[NSG][HB];      // running max of every SIMD-group and head
  threadgroup float part_l[NSG][HB];      // running sum of exp(score - max)
  threadgroup uint part_n[NSG];           // entries >= 0 the SIMD-group met

  const long t = long(item) / p.kv_heads;
  const long g = long(item) % p.kv_heads;
  const long dh = p.head_dim, dv = p.value_dim, width = p.width;
  device const int* row = token_cells + t * width;

  for (long h0 = 0; h0 < p.rep; h0 += HB) {
    const long hb = hebrus_min(long(HB), p.rep - h0);  // heads of this pass
    const long head0 = t * p.query_heads + g * p.rep + h0;  // first (query, head) row of the pass
    for (long h = 0; h < hb; ++h) {
      for (long d = long(lid); d < dh; d += TG) {
        q_tile[h][d] = static_cast<float>(q[(head0 + h) * dh + d]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float m[HB], l[HB], acc[HB][DPL];
    for (int h = 0; h < HB; ++h) {
      m[h] = -INFINITY;
      l[h] = 0.0f;
      for (int i = 0; i < DPL; ++i) {
        acc[h][i] = 0.0f;
      }
    }
    uint met = 0;
    for (long j = long(sg); j < width; j += NSG) {  // uniform in the SIMD-group
      const int c = row[j];
      if (c < 0) {
        continue;  // padding
      }
      ++met;
      if (long(c) >= p.cells) {
        if (lane == 0 && g == 0) {
          hebrus_attention_bad_cell(err, t, j, long(c), p.cells);
        }
        continue;
      }
      device const T* krow = k + (long(c) * p.k_stride0 + g * p.k_stride1);
      device const T* vrow = v + (long(c) * p.v_stride0 + g * p.v_stride1);
      float kx[DPL], vx[DPL];
      for (int i = 0; i < DPL; ++i) {
        const long d = long(lane) + long(i) * HEBRUS_SIMD_WIDTH;
        kx[i] = d < dh ? static_cast<float>(krow[d]) : 0.0f;
        vx[i] = d < dv ? static_cast<float>(vrow[d]) : 0.0f;
      }
      for (int h = 0; h < HB; ++h) {
        if (h < hb) {
          float part = 0.0f;
          for (int i = 0; i < DPL; ++i) {
            const long d = long(lane) + long(i) * HEBRUS_SIMD_WIDTH;
            if (d < dh) {
              part = part + q_tile[h][d] * kx[i];
            }
          }
          const float s = simd_sum(part) * p.scale;
          const float m_new = (s > m[h] || s != s) ? s : m[h];  // NaN propagates, as in the reference
          // While every score so far is -inf (finite inputs whose dot product overflows), m_new is
          // -inf: subtract 0 then, not m_new (exp(-inf - -inf) is NaN), so that such cells get
          // weight 0 as in the reference. A +inf score gives exp(+inf - +inf) = NaN, as there.
          const float m_sub = m_new == -INFINITY ? 0.0f : m_new;
          const float alpha = precise::exp(m[h] - m_sub);  // 0 for the first finite score (m = -inf)
          const float w = precise::exp(s - m_sub);
          l[h] = l[h] * alpha + w;
          for (int i = 0; i < DPL; ++i) {
            acc[h][i] = acc[h][i] * alpha + w * vx[i];
          }
          m[h] = m_new;
        }
      }
    }

    if (lane == 0) {
      for (int h = 0; h < HB; ++h) {
        if (h < hb) {
          part_m[sg][h] = m[h];
          part_l[sg][h] = l[h];
        }
      }
      part_n[sg] = met;
    }
    for (int h = 0; h < HB; ++h) {
      if (h < hb) {  // uniform in the threadgroup
        for (int i = 0; i < DPL; ++i) {
          const long d = long(lane) + long(i) * HEBRUS_SIMD_WIDTH;
          if (d < dv) {
            part_acc[sg][d] = acc[h][i];
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        uint total = 0;
        for (uint s = 0; s < NSG; ++s) {
          total += part_n[s];
        }
        if (total == 0u) {  // the same in every thread: the whole threadgroup leaves together
          if (lid == 0 && g == 0) {
            hebrus_attention_empty(err, t);
          }
          return;
        }
        if (long(lid) < dv) {
          float mx = part_m[0][h];
          for (uint s = 1; s < NSG; ++s) {
            const float ms = part_m[s][h];
            mx = (ms > mx || ms != ms) ? ms : mx;
          }
          // Every partial max -inf (every score -inf): weights exp(-inf - 0) = 0, so the output is
          // 0 / 0 = NaN, what the reference's softmax over only -inf scores gives.
          const float mx_sub = mx == -INFINITY ? 0.0f : mx;
          float sum = 0.0f, o = 0.0f;
          for (uint s = 0; s < NSG; ++s) {
            const float w = precise::exp(part_m[s][h] - mx_sub);  // 0 for a SIMD-group without cells
            sum = sum + part_l[s][h] * w;
            o = o + part_acc[s][lid] * w;
          }
          out[(head0 + h) * dv + long(lid)] = static_cast<T>(o / sum);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
    }
  }
}

// token_cells checked where qsa_attention launches no threadgroup that reads it (Hq = 0, Dv = 0 or no
// cells): one thread per query, the first entry >= cells of the row, else the row without any cell.
[[kernel]] void qsa_attention_check_cells(device const int* token_cells [[buffer(0)]],
                                          device HebrusErrorMessages* err [[buffer(1)]],
                                          constant HebrusCheckParams& p [[buffer(2)]],
                                          uint tid [[thread_position_in_grid]]) {
  const long t = long(tid);
  if (t >= p.rows) {
    return;
  }
  bool any = false;
  for (long j = 0; j < p.width; ++j) {
    const int c = token_cells[t * p.width + j];
    if (long(c) >= p.tokens) {
      hebrus_attention_bad_cell(err, t, j, long(c), p.tokens);
      return;
    }
    any = any || c >= 0;
  }
  if (!any) {
    hebrus_attention_empty(err, t);
  }
}

#define HEBRUS_QSA_ATTN_INSTANTIATE(type)                              \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h1_d64, type, type, 1, 2)  \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h1_d128, type, type, 1, 4) \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h1_d256, type, type, 1, 8) \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h2_d64, type, type, 2, 2)  \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h2_d128, type, type, 2, 4) \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h2_d256, type, type, 2, 8) \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h4_d64, type, type, 4, 2)  \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h4_d128, type, type, 4, 4) \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h4_d256, type, type, 4, 8) \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h8_d64, type, type, 8, 2)  \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h8_d128, type, type, 8, 4) \
  HEBRUS_INSTANTIATE_VARIANT(qsa_attention, h8_d256, type, type, 8, 8)

HEBRUS_QSA_ATTN_INSTANTIATE(float)
HEBRUS_QSA_ATTN_INSTANTIATE(half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_QSA_ATTN_INSTANTIATE(bfloat)
#endif
