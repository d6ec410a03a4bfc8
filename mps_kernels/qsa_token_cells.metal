// hebrus::qsa_token_cells on Apple GPUs (issue 37): the cells each query attends, from qsa_select's
// groups, in one launch (hebrus_torch/reference/qsa.py qsa_token_cells is the spec; it replaces the
// ~20 ATen ops of QSACache.plan's offsets, compaction and gather).
//
// Thread layout (hebrus_launch.h): one SIMD-group (32 lanes) per query, 8 per threadgroup; the last
// threadgroup may hold fewer SIMD-groups, never a partial one. The lanes walk the query's selected
// entries 32 at a time: simd_prefix_exclusive_sum of "entry >= 0" gives each kept entry its place after
// the kept ones before it (the -1 entries are skipped wherever they are), and its lane writes that
// group's r offsets and cells. Then the lanes write the raw tail and the -1 padding. A query whose run
// lies outside `cells`, or with a selected group outside [-1, its complete groups), is reported
// through the error slots and its row is written as -1 only (the op's output is then not used).
#include "hebrus_metal_common.h"

// T: the offsets' type (long: int64, as QSAPlan.token_offsets), the kernel's one instantiation.
template <typename T>
[[kernel, max_total_threads_per_threadgroup(HEBRUS_QSA_TOKEN_CELLS_TG)]] void qsa_token_cells(
    device const int* selected [[buffer(0)]],    // [Tq, top_k]
    device const T* nvis [[buffer(1)]],          // [Tq]
    device const T* first [[buffer(2)]],         // [Tq]
    device const int* cells [[buffer(3)]],       // [N]
    device int* token_cells [[buffer(4)]],       // [Tq, W]
    device T* token_offsets [[buffer(5)]],       // [Tq, W]
    device HebrusErrorMessages* err [[buffer(6)]],  // the stream's error buffer
    constant QsaTokenCellsParams& p [[buffer(7)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const long t = long(tid) / HEBRUS_SIMD_WIDTH;
  if (t >= p.queries) {
    return;  // whole SIMD-groups only: the grid is Tq * 32 threads
  }
  const long r = p.group_size, k = p.top_k, w = p.width;
  const long n = long(nvis[t]), start = long(first[t]);
  device int* out_cells = token_cells + t * w;
  device T* out_offs = token_offsets + t * w;
  bool broken = !(n >= 0 && start >= 0 && start <= p.cells - n);
  if (broken && lane == 0) {
    HEBRUS_REPORT_ERROR(err, "qsa_token_cells", "hebrus::qsa_token_cells: query ", t, " sees nvis = ", n,
                        " cells from first = ", start, ", outside cells [0, ", p.cells, ")");
  }
  const long q_groups = broken ? 0 : n / r;
  for (long j = long(lane); j < k && !broken; j += HEBRUS_SIMD_WIDTH) {
    const long g = selected[t * k + j];
    if (g < -1 || g >= q_groups) {
      HEBRUS_REPORT_ERROR(err, "qsa_token_cells", "hebrus::qsa_token_cells: selected[", t, ", ", j, "] = ", g,
                          " is outside [-1, ", q_groups, ") (the query's complete groups)");
      broken = true;
    }
  }
  if (simd_any(broken)) {
    for (long i = long(lane); i < w; i += HEBRUS_SIMD_WIDTH) {
      out_cells[i] = -1;
      out_offs[i] = T(-1);
    }
    return;  // the whole SIMD-group leaves together
  }
  device const int* run = cells + start;
  long kept = 0;  // kept entries before this round of 32, the same in every lane
  for (long j0 = 0; j0 < k; j0 += HEBRUS_SIMD_WIDTH) {
    const long j = j0 + long(lane);
    const long g = j < k ? long(selected[t * k + j]) : -1;
    const int keep = g >= 0 ? 1 : 0;
    const long at = (kept + long(simd_prefix_exclusive_sum(keep))) * r;
    if (keep) {
      for (long i = 0; i < r; ++i) {
        out_offs[at + i] = T(g * r + i);
        out_cells[at + i] = run[g * r + i];
      }
    }
    kept += long(simd_sum(keep));
  }
  const long tail0 = q_groups * r;  // the raw tail: offsets [tail0, n), then -1
  for (long i = kept * r + long(lane); i < w; i += HEBRUS_SIMD_WIDTH) {
    const long off = tail0 + (i - kept * r);
    const bool in_tail = off < n;
    out_offs[i] = T(in_tail ? off : -1);
    out_cells[i] = in_tail ? run[off] : -1;
  }
}

HEBRUS_INSTANTIATE(qsa_token_cells, long, long)
