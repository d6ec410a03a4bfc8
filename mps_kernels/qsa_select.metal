// hebrus::qsa_select on Apple GPUs: per query, the top-k groups by sum_h relu(q_h . k_g) / sqrt(D)
// in fp32, ties to the lower group index, returned ascending and -1 padded (SPEC section 3;
// hebrus_torch/reference.py is the spec).
//
// Thread layout (hebrus_launch.h): one threadgroup of 256 threads per block of QB consecutive
// queries. The sequences present in the block are handled one after the other; for each, the
// threadgroup streams that sequence's pooled keys once, in tiles of 256 groups (thread i scores
// group g0 + i against every query of the block that belongs to the sequence), and each query
// keeps its running top-k in threadgroup memory:
//   * a candidate is the 64-bit key (orderable fp32 score << 32) | (0xFFFFFFFF - group), so one
//     integer comparison is the rule "score descending, then group ascending", and all keys differ;
//   * a full top-k drops candidates below its last entry before anything is sorted;
//   * the tile's candidates are bitonic-sorted, then merged into the sorted top-k by rank (each
//     entry's output slot is its own index plus the number of entries of the other list above it);
//   * at the end the kept groups are sorted ascending and written, -1 past the kept count.
// The result depends only on the keys, never on thread timing: no atomics decide anything (they
// only record bad input in the error slots, which the glue raises). Variants (QB, KMAX): k512
// (4 queries, top-k <= 512) and k2048 (1 query, top-k <= 2048); the glue picks by min(top_k, maxG).
#include "hebrus_metal_common.h"

// (score desc, group asc) as one unsigned integer; 0 is "no entry" (any real key is larger). Every
// NaN ranks first, whatever its sign and payload (as the CPU kernel's candidate_key and torch.sort
// descending do), then by group.
inline ulong hebrus_select_key(float score, uint group) {
  uint bits = as_type<uint>(score);
  if ((bits & 0x7fffffffu) == 0u) {
    bits = 0u;  // -0 ranks as +0: the two compare equal, so the lower group must win
  }
  uint ordered = (bits & 0x80000000u) != 0u ? ~bits : (bits | 0x80000000u);
  if (score != score) {
    ordered = 0xFFFFFFFFu;
  }
  return (ulong(ordered) << 32) | ulong(0xFFFFFFFFu - group);
}

inline uint hebrus_key_group(ulong key) {
  return 0xFFFFFFFFu - uint(key & 0xFFFFFFFFul);
}

template <typename T>
inline float hebrus_select_score(device const T* q, device const T* k, long heads, long dim, float sqrt_dim) {
  float total = 0.0f;
  for (long h = 0; h < heads; ++h) {
    float dot = 0.0f;
    for (long d = 0; d < dim; ++d) {
      dot = dot + static_cast<float>(q[h * dim + d]) * static_cast<float>(k[d]);
    }
    total = total + (dot < 0.0f ? 0.0f : dot);  // relu that keeps NaN (Metal's max may drop it), as torch's
  }
  return total / sqrt_dim;
}

// Bitonic sort of a[0, n), n a power of two, by the whole threadgroup (uniform call). Ends with a
// barrier when n > 1; callers order the writes before it themselves.
inline void hebrus_bitonic(threadgroup ulong* a, uint n, bool descending, uint lid) {
  for (uint k = 2; k <= n; k <<= 1) {
    for (uint j = k >> 1; j > 0; j >>= 1) {
      for (uint i = lid; i < n; i += HEBRUS_QSA_SELECT_TG) {
        const uint l = i ^ j;
        if (l > i) {
          const ulong x = a[i], y = a[l];
          const bool ascending = ((i & k) == 0u) != descending;
          if (ascending ? (x > y) : (x < y)) {
            a[i] = y;
            a[l] = x;
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
}

// Number of entries of the descending a[0, n) that are greater than x.
inline uint hebrus_count_above(threadgroup ulong* a, uint n, ulong x) {
  uint lo = 0, hi = n;
  while (lo < hi) {
    const uint mid = (lo + hi) >> 1;
    if (a[mid] > x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

inline uint hebrus_pow2_at_least(uint n) {
  uint p = 1;
  while (p < n) {
    p <<= 1;
  }
  return p;
}

template <typename T, int QB, int KMAX>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_QSA_SELECT_TG)]] void qsa_select(
    device const T* q [[buffer(0)]],             // [Tq, Hq, D]
    device const T* pooled [[buffer(1)]],        // [rows, D]
    device const int* seq_groups [[buffer(2)]],  // [B, maxG]
    device const int* q_row [[buffer(3)]],       // [Tq]
    device const int* q_groups [[buffer(4)]],    // [Tq]
    device int* selected [[buffer(5)]],          // [Tq, top_k]
    device HebrusErrorMessages* err [[buffer(6)]], // the stream's error buffer
    constant QsaSelectParams& p [[buffer(7)]],
    uint block_id [[threadgroup_position_in_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint TG = HEBRUS_QSA_SELECT_TG;
  constexpr uint TILE = HEBRUS_QSA_SELECT_TILE;
  constexpr uint NSG = TG / HEBRUS_SIMD_WIDTH;
  constexpr uint PER_THREAD = (KMAX + TG - 1) / TG + (TILE + TG - 1) / TG;  // merge entries per thread

  threadgroup ulong best[QB][KMAX];      // running top-k of each query, descending
  threadgroup ulong cand[QB][TILE];      // the current tile's candidates of each query
  threadgroup uint cand_any[QB][NSG];    // a SIMD-group produced a candidate for the query
  threadgroup int q_seq[QB];             // the query's sequence; -1 when absent, invalid or done
  threadgroup int q_vis[QB];             // groups visible to the query
  threadgroup int q_keep[QB];            // min(top_k, visible)
  threadgroup int q_have[QB];            // entries in best[i]

  const long q0 = long(block_id) * QB;
  if (lid < uint(QB)) {
    const long t = q0 + long(lid);
    int seq = -1, vis = 0;
    if (t < p.queries) {
      seq = q_row[t];
      vis = q_groups[t];
      if (seq < 0 || long(seq) >= p.batch) {
        HEBRUS_REPORT_ERROR(err, "qsa_select", "hebrus::qsa_select: q_row[", t, "] = ", long(seq),
                            " is outside [0, B=", p.batch, ")");
        seq = -1;
      } else if (vis < 0 || long(vis) > p.max_groups) {
        HEBRUS_REPORT_ERROR(err, "qsa_select", "hebrus::qsa_select: q_groups[", t, "] = ", long(vis),
                            " is outside [0, maxG=", p.max_groups, "]");
        seq = -1;
      }
    }
    q_seq[lid] = seq;
    q_vis[lid] = vis;
    q_keep[lid] = seq < 0 ? 0 : int(hebrus_min(hebrus_min(long(vis), p.top_k), long(KMAX)));
    q_have[lid] = 0;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (;;) {
    int seq = -1;
    for (int i = 0; i < QB; ++i) {
      if (q_seq[i] >= 0) {
        seq = q_seq[i];
        break;
      }
    }
    if (seq < 0) {
      break;
    }
    long need = 0;  // groups any of the block's queries of this sequence can see
    for (int i = 0; i < QB; ++i) {
      if (q_seq[i] == seq) {
        need = hebrus_max(need, long(q_vis[i]));
      }
    }

    for (long g0 = 0; g0 < need; g0 += TILE) {
      // Score: thread lid takes group g0 + lid for every query of the sequence.
      const long g = g0 + long(lid);
      long key_row = -1;
      if (g < need) {
        const int v = seq_groups[long(seq) * p.max_groups + g];
        if (v < 0 || long(v) >= p.rows) {
          HEBRUS_REPORT_ERROR(err, "qsa_select", "hebrus::qsa_select: seq_groups[", long(seq), ", ", g, "] = ", long(v),
                              " is outside [0, rows=", p.rows, "); the first ", need, " groups of row ", long(seq),
                              " are visible to its queries");
        } else {
          key_row = v;
        }
      }
      for (int i = 0; i < QB; ++i) {
        ulong key = 0;
        if (q_seq[i] == seq && g < long(q_vis[i]) && key_row >= 0) {
          const float score = hebrus_select_score(q + (q0 + i) * p.query_heads * p.dim, pooled + key_row * p.dim,
                                                  p.query_heads, p.dim, p.sqrt_dim);
          key = hebrus_select_key(score, uint(g));
          const int have = q_have[i];
          if (have == q_keep[i] && key < best[i][have - 1]) {
            key = 0;  // below the last entry of a full top-k: cannot enter
          }
        }
        cand[i][lid] = key;
        const bool produced = simd_any(key != 0ul);
        if (lane == 0) {
          cand_any[i][sg] = produced ? 1u : 0u;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      // Merge each query's candidates into its top-k.
      const uint tile_n = uint(hebrus_min(long(TILE), need - g0));
      const uint sort_n = hebrus_pow2_at_least(tile_n);
      for (int i = 0; i < QB; ++i) {
        if (q_seq[i] != seq) {
          continue;
        }
        uint produced = 0;
        for (uint s = 0; s < NSG; ++s) {
          produced |= cand_any[i][s];
        }
        if (produced == 0u) {
          continue;  // no candidate can enter this query's top-k in this tile
        }
        threadgroup ulong* c = cand[i];
        threadgroup ulong* top = best[i];
        hebrus_bitonic(c, sort_n, true, lid);
        const uint m = hebrus_count_above(c, sort_n, 0ul);
        const uint have = uint(q_have[i]);
        const uint total = min(uint(q_keep[i]), have + m);
        ulong value[PER_THREAD];
        uint slot[PER_THREAD];
        uint count = 0;
        for (uint a = lid; a < have; a += TG) {
          const uint at = a + hebrus_count_above(c, m, top[a]);
          if (at < total) {
            value[count] = top[a];
            slot[count] = at;
            ++count;
          }
        }
        for (uint b = lid; b < m; b += TG) {
          const uint at = b + hebrus_count_above(top, have, c[b]);
          if (at < total) {
            value[count] = c[b];
            slot[count] = at;
            ++count;
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint e = 0; e < count; ++e) {
          top[slot[e]] = value[e];
        }
        if (lid == 0) {
          q_have[i] = int(total);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
      // SIMD-groups run on independently: without this, one could write the next tile's cand_any
      // while another still reads this tile's (when every query skipped the merge above).
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // Emit: the kept groups in ascending order, then -1.
    for (int i = 0; i < QB; ++i) {
      if (q_seq[i] != seq) {
        continue;
      }
      threadgroup ulong* top = best[i];
      const uint have = uint(q_have[i]);
      const uint sort_n = hebrus_pow2_at_least(have);
      for (uint e = lid; e < sort_n; e += TG) {
        top[e] = e < have ? ulong(hebrus_key_group(top[e])) : ~0ul;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      hebrus_bitonic(top, sort_n, false, lid);
      const long t = q0 + i;
      for (long e = long(lid); e < p.top_k; e += TG) {
        selected[t * p.top_k + e] = e < long(have) ? int(top[e]) : -1;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lid < uint(QB) && q_seq[lid] == seq) {
      q_seq[lid] = -1;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

#define HEBRUS_QSA_SELECT_INSTANTIATE(type)                                                                   \
  HEBRUS_INSTANTIATE_VARIANT(qsa_select, k512, type, type, HEBRUS_QSA_SELECT_K512_QB, HEBRUS_QSA_SELECT_K512_KMAX) \
  HEBRUS_INSTANTIATE_VARIANT(qsa_select, k2048, type, type, HEBRUS_QSA_SELECT_K2048_QB, HEBRUS_QSA_SELECT_K2048_KMAX)

HEBRUS_QSA_SELECT_INSTANTIATE(float)
HEBRUS_QSA_SELECT_INSTANTIATE(half)
#if HEBRUS_HAS_BFLOAT
HEBRUS_QSA_SELECT_INSTANTIATE(bfloat)
#endif
