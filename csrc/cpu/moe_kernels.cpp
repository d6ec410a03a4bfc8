// CPU kernel of hebrus::moe_experts: the routed experts of a MoE block over packed rows, one call
// whatever the experts hit. hebrus_torch/reference/moe.py is the spec; the metadata checks are
// csrc/moe_checks.h, mirrored in hebrus_torch/moe/checks.py with the same messages.
//
// Per (row t, slot j) pair with expert e = topk_ids[t, j] and weight w = topk_weights[t, j]:
//   g, u = gate_up[e] x_t (rounded to x's dtype), a = round(round(silu(g)) * u),
//   y = round(down[e] a), p = y * w (rounded to x's dtype where topk_weights has x's dtype),
//   out[t] = round(((0 + p_0) + p_1) + ... + p_{k-1}) in fp32, slot order.
// Every dot product sums its 16 lanes (lane l: the inputs d = l mod 16, ascending d), then
// reduce_lanes (hebrus_simd.h). The roundings are where transformers' grouped_mm experts round; the
// order of each sum is fixed, so a row's output depends only on its own inputs (not on the other
// rows, how pairs are grouped by expert, the thread count or the CPU's vector width).
//
// Quantized weights (moe_experts_quantized, quantized_linear) are never dequantized: each group's dot product is
// folded as MLX's qmv folds it, s * sum(q * x) + b * sum(x) (per lane: the group's q * x and x summed in
// ascending d, then acc + (qx * s + xs * b)); the lane sums of x per group (xs) are computed once per row of x.
//
// Work: pairs sorted by expert (a stable counting sort), then three passes over a chunk of rows:
// A (expert, block of I) -> activations, B (expert, block of H) -> weighted outputs, C (row) -> sums.
// Grouping the pairs of an expert reads each of its weight rows once per chunk for all of them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu/hebrus_simd.h"
#include "cpu/hebrus_widen.h"
#include "hebrus_check.h"
#include "moe_checks.h"
#include "op_checks.h"

namespace hebrus {
namespace {

using at::Tensor;

constexpr int64_t kPairTile = 4;           // pairs sharing one load of a weight row
constexpr int64_t kInterBlock = 32;        // intermediate outputs (gate and up rows) per pass-A item
constexpr int64_t kHiddenBlock = 64;       // hidden outputs (down rows) per pass-B item
constexpr int64_t kChunkBytes = 64 << 20;  // fp32 scratch of one chunk of rows

// The lambdas of the hot loops are inlined into each vector clone that calls them (a lambda is a function
// of its own, which GCC would otherwise compile for the baseline target).
#if defined(__GNUC__)
#define HEBRUS_LAMBDA_INLINE __attribute__((always_inline))
#else
#define HEBRUS_LAMBDA_INLINE
#endif

HEBRUS_INLINE int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// v rounded to T (round to nearest even) and widened back.
template <typename T>
HEBRUS_INLINE float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <>
HEBRUS_INLINE float round_to<float>(float v) {
  return v;
}

// Rows of dense expert matrices W [E, rows, cols] of T, contiguous.
template <typename T>
struct DenseRows {
  static constexpr bool kQuantized = false;
  const T* base;
  int64_t rows, cols;

  HEBRUS_INLINE const T* row(int64_t e, int64_t r) const { return base + (e * rows + r) * cols; }
  // Columns [c, c + kLanes) of row r of expert e (c + kLanes <= cols).
  HEBRUS_INLINE Vec load(int64_t e, int64_t r, int64_t c) const { return load_row<T>(row(e, r) + c); }
  // Columns [c, cols), zero-padded to kLanes.
  HEBRUS_INLINE Vec load_tail(int64_t e, int64_t r, int64_t c) const {
    T buf[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) buf[i] = c + i < cols ? row(e, r)[c + i] : T(0);
    return load_row<T>(buf);
  }
};

// Rows of quantized expert matrices (hebrus_torch/moe/quantize.py): codes packed into int32 words
// [E, rows, cols * BITS / 32], scales and biases [E, rows, cols / group] in T. cols is a multiple of the group
// (>= 32), so kLanes columns from a multiple of kLanes lie in one group and no row has a tail. The kernels read
// codes (as floats) and each group's scale and bias, never a dequantized value (the fold above).
typedef uint32_t VecU __attribute__((vector_size(kLanes * sizeof(uint32_t))));

template <typename T, int BITS>
struct QuantRows {
  static constexpr bool kQuantized = true;
  const uint32_t* codes_base;
  const T* scales;
  const T* biases;
  int64_t rows, cols;
  int group_shift;  // log2 of the group size (32, 64 or 128): no division in the loop

  // The codes of columns [c, c + kLanes) of row r of expert e, as floats.
  HEBRUS_INLINE Vec codes(int64_t e, int64_t r, int64_t c) const {
    constexpr int kPerWord = 32 / BITS;
    constexpr uint32_t kMask = (1u << BITS) - 1u;
    const uint32_t* w = codes_base + (e * rows + r) * (cols / kPerWord) + c / kPerWord;
    // Lane i holds its word, shifted by its place in it: one vector shift and mask, then a signed
    // conversion (codes < 256: exact; AVX2 has no unsigned one).
    VecU words;
    if constexpr (BITS == 4) {
      const uint32_t w0 = w[0], w1 = w[1];
      words = VecU{w0, w0, w0, w0, w0, w0, w0, w0, w1, w1, w1, w1, w1, w1, w1, w1};
    } else {
      const uint32_t w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
      words = VecU{w0, w0, w0, w0, w1, w1, w1, w1, w2, w2, w2, w2, w3, w3, w3, w3};
    }
    constexpr VecU kShifts = BITS == 4 ? VecU{0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28}
                                       : VecU{0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24};
    return __builtin_convertvector(reinterpret_cast<VecIdx>((words >> kShifts) & kMask), Vec);
  }
  // The scale and bias of the group of column c of row r of expert e.
  HEBRUS_INLINE float scale(int64_t e, int64_t r, int64_t c) const {
    return static_cast<float>(scales[((e * rows + r) * cols + c) >> group_shift]);
  }
  HEBRUS_INLINE float bias(int64_t e, int64_t r, int64_t c) const {
    return static_cast<float>(biases[((e * rows + r) * cols + c) >> group_shift]);
  }
};

// Quantized rows staged in fp32 scratch (codes as floats, one scale and bias per group): the values QuantRows
// gives, so the bits of reading the codes in place. Rows are numbered from 0; e is ignored.
struct StagedQuantRows {
  static constexpr bool kQuantized = true;
  const float* q;   // [rows, cols]
  const float* sb;  // [rows, 2 * cols / group]: each group's scale, then its bias
  int64_t rows, cols;
  int group_shift;

  HEBRUS_INLINE Vec codes(int64_t, int64_t r, int64_t c) const { return load_vec(q + r * cols + c); }
  HEBRUS_INLINE float scale(int64_t, int64_t r, int64_t c) const {
    return sb[2 * ((r * cols + c) >> group_shift)];
  }
  HEBRUS_INLINE float bias(int64_t, int64_t r, int64_t c) const {
    return sb[2 * ((r * cols + c) >> group_shift) + 1];
  }
};

// The lane sums of x per group: xs[g][l] = sum of x[g * group + c + l] over c = 0, kLanes, ... (ascending),
// the x side of the fold. x has cols values (a multiple of the group).
HEBRUS_INLINE void group_lane_sums(const float* x, int64_t cols, int group_shift, float* xs) {
  const int64_t group = int64_t{1} << group_shift;
  for (int64_t g0 = 0; g0 < cols; g0 += group) {
    Vec acc{};
    for (int64_t c = g0; c < g0 + group; c += kLanes) acc += load_vec(x + c);
    std::memcpy(xs + (g0 >> group_shift) * kLanes, &acc, sizeof(acc));
  }
}

// out[p][o] = sum over columns of W[e, wrows[o]] * xs[p] for P pairs and O weight rows, each sum in
// the fixed lane order. The xs rows are fp32 and zero-padded to a multiple of kLanes. Quantized W: the fold,
// with xsums[p] the group lane sums of xs[p] (group_lane_sums); dense W ignores xsums.
template <int P, int O, typename W>
HEBRUS_INLINE void tile_dots(const W& w, int64_t e, const int64_t (&wrows)[O], const float* const (&xs)[P],
                             const float* const (&xsums)[P], float (&out)[P][O]) {
  Vec acc[P][O];
  for (int p = 0; p < P; ++p)
    for (int o = 0; o < O; ++o) acc[p][o] = Vec{};
  const int64_t n = w.cols;
  if constexpr (W::kQuantized) {
    const int64_t group = int64_t{1} << w.group_shift;
    for (int64_t g0 = 0; g0 < n; g0 += group) {
      Vec qx[P][O];
      for (int p = 0; p < P; ++p)
        for (int o = 0; o < O; ++o) qx[p][o] = Vec{};
      for (int64_t c = g0; c < g0 + group; c += kLanes) {
        Vec qv[O];
        for (int o = 0; o < O; ++o) qv[o] = w.codes(e, wrows[o], c);
        for (int p = 0; p < P; ++p) {
          const Vec xv = load_vec(xs[p] + c);
          for (int o = 0; o < O; ++o) qx[p][o] += qv[o] * xv;
        }
      }
      for (int o = 0; o < O; ++o) {
        const float s = w.scale(e, wrows[o], g0), b = w.bias(e, wrows[o], g0);
        for (int p = 0; p < P; ++p) {
          const Vec xsum = load_vec(xsums[p] + (g0 >> w.group_shift) * kLanes);
          acc[p][o] += qx[p][o] * s + xsum * b;
        }
      }
    }
  } else {
    const int64_t full = n / kLanes * kLanes;
    for (int64_t c = 0; c < full; c += kLanes) {
      Vec wv[O];
      for (int o = 0; o < O; ++o) wv[o] = w.load(e, wrows[o], c);
      for (int p = 0; p < P; ++p) {
        const Vec xv = load_vec(xs[p] + c);
        for (int o = 0; o < O; ++o) acc[p][o] += wv[o] * xv;
      }
    }
    if (full < n) {
      for (int o = 0; o < O; ++o) {
        const Vec wv = w.load_tail(e, wrows[o], full);
        for (int p = 0; p < P; ++p) acc[p][o] += wv * load_vec(xs[p] + full);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int o = 0; o < O; ++o) out[p][o] = reduce_lanes(acc[p][o]);
}

// One chunk's pairs sorted by expert: pairs of expert e are order[start[e] .. start[e + 1]), each as
// its index p = t * k + j within the chunk, ascending.
struct ExpertGroups {
  std::vector<int64_t> start, order;
  std::vector<int64_t> hit;  // experts with at least one pair, ascending
};

ExpertGroups group_pairs(const int64_t* ids, int64_t pairs, int64_t experts) {
  ExpertGroups g;
  g.start.assign(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) ++g.start[ids[p] + 1];
  for (int64_t e = 0; e < experts; ++e) {
    if (g.start[e + 1] > 0) g.hit.push_back(e);
    g.start[e + 1] += g.start[e];
  }
  g.order.resize(pairs);
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) g.order[next[ids[p]]++] = p;
  return g;
}

struct Item {
  int64_t expert, begin, end;  // outputs [begin, end) of one expert
};

std::vector<Item> items_of(const std::vector<int64_t>& hit, int64_t outputs, int64_t block) {
  std::vector<Item> items;
  for (int64_t e : hit)
    for (int64_t b = 0; b < outputs; b += block) items.push_back({e, b, std::min(outputs, b + block)});
  return items;
}

template <typename T>
struct Problem {
  const T* x;             // [T, H]
  const int64_t* ids;     // [T, k]
  const float* weights;   // [T, k]
  bool round_product;     // topk_weights has x's dtype: the product is rounded to it
  int64_t rows, hidden, top_k, experts, inter;
  T* out;                 // [T, H]
};

// Quantized rows read by more than one tile of pairs are staged once into fp32 scratch (StagedQuantRows: the
// same values, so the bits of reading them in place); dense rows are read in place.
template <typename W>
HEBRUS_INLINE bool stage_rows(int64_t n) {
  return W::kQuantized && n > kPairTile;
}

// Row r of expert e staged as row `slot` of a StagedQuantRows over q and sb.
template <typename W>
HEBRUS_INLINE void stage_row(const W& w, int64_t e, int64_t r, float* q, float* sb, int64_t slot) {
  const int64_t groups = w.cols >> w.group_shift;
  for (int64_t c = 0; c < w.cols; c += kLanes) {
    const Vec v = w.codes(e, r, c);
    std::memcpy(q + slot * w.cols + c, &v, sizeof(v));
  }
  for (int64_t g = 0; g < groups; ++g) {
    sb[2 * (slot * groups + g)] = w.scale(e, r, g << w.group_shift);
    sb[2 * (slot * groups + g) + 1] = w.bias(e, r, g << w.group_shift);
  }
}

// Scratch of a pass item: `rows` staged rows of `cols` values (codes, then scales and biases).
struct StageScratch {
  std::vector<float> q, sb;
  void reserve(int64_t rows, int64_t cols) {
    q.resize(rows * cols);
    sb.resize(rows * 2 * cols / 32);
  }
};

// Pass A for the pairs [0, n) of one item: act[p][i] for i in [begin, end). xsums: group lane sums of xf's rows
// (quantized W), gsp floats a row.
template <typename T, typename W>
HEBRUS_INLINE void gate_up_item(const W& gate_up, const Item& it, const int64_t* pairs, int64_t n, const float* xf,
                                int64_t hp, const float* xsums, int64_t gsp, int64_t top_k, int64_t inter, float* act,
                                int64_t ip, StageScratch& scratch) {
  for (int64_t i = it.begin; i < it.end; ++i) {
    auto finish = [&](int64_t p, const float (&gu)[2]) HEBRUS_LAMBDA_INLINE {
      const float g = round_to<T>(gu[0]), u = round_to<T>(gu[1]);
      act[p * ip + i] = round_to<T>(round_to<T>(silu(g)) * u);
    };
    auto run_pairs = [&](const auto& rows, int64_t e, const int64_t (&wrows)[2]) HEBRUS_LAMBDA_INLINE {
      int64_t q = 0;
      for (; q + kPairTile <= n; q += kPairTile) {
        const float* xs[kPairTile];
        const float* ss[kPairTile];
        for (int64_t r = 0; r < kPairTile; ++r) {
          xs[r] = xf + (pairs[q + r] / top_k) * hp;
          ss[r] = xsums + (pairs[q + r] / top_k) * gsp;
        }
        float out[kPairTile][2];
        tile_dots<kPairTile, 2>(rows, e, wrows, xs, ss, out);
        for (int64_t r = 0; r < kPairTile; ++r) finish(pairs[q + r], out[r]);
      }
      for (; q < n; ++q) {
        const float* xs[1] = {xf + (pairs[q] / top_k) * hp};
        const float* ss[1] = {xsums + (pairs[q] / top_k) * gsp};
        float out[1][2];
        tile_dots<1, 2>(rows, e, wrows, xs, ss, out);
        finish(pairs[q], out[0]);
      }
    };
    if constexpr (W::kQuantized) {
      if (stage_rows<W>(n)) {
        stage_row(gate_up, it.expert, i, scratch.q.data(), scratch.sb.data(), 0);
        stage_row(gate_up, it.expert, inter + i, scratch.q.data(), scratch.sb.data(), 1);
        run_pairs(StagedQuantRows{scratch.q.data(), scratch.sb.data(), 2, gate_up.cols, gate_up.group_shift}, 0,
                  {0, 1});
        continue;
      }
    }
    run_pairs(gate_up, it.expert, {i, inter + i});
  }
}

// Pass B for the pairs [0, n) of one item: y[p][d] = weighted down-projection outputs, d in [begin, end).
// asums: group lane sums of the act rows (quantized W), gsi floats a pair.
template <typename T, typename W>
HEBRUS_INLINE void down_item(const W& down, const Item& it, const int64_t* pairs, int64_t n, const float* act,
                             int64_t ip, const float* asums, int64_t gsi, const float* w, bool round_product,
                             float* y, int64_t hidden, StageScratch& scratch) {
  for (int64_t d = it.begin; d < it.end; ++d) {
    auto finish = [&](int64_t p, float v) HEBRUS_LAMBDA_INLINE {
      const float prod = round_to<T>(v) * w[p];
      y[p * hidden + d] = round_product ? round_to<T>(prod) : prod;
    };
    auto run_pairs = [&](const auto& rows, int64_t e, const int64_t (&wrows)[1]) HEBRUS_LAMBDA_INLINE {
      int64_t q = 0;
      for (; q + kPairTile <= n; q += kPairTile) {
        const float* xs[kPairTile];
        const float* ss[kPairTile];
        for (int64_t r = 0; r < kPairTile; ++r) {
          xs[r] = act + pairs[q + r] * ip;
          ss[r] = asums + pairs[q + r] * gsi;
        }
        float out[kPairTile][1];
        tile_dots<kPairTile, 1>(rows, e, wrows, xs, ss, out);
        for (int64_t r = 0; r < kPairTile; ++r) finish(pairs[q + r], out[r][0]);
      }
      for (; q < n; ++q) {
        const float* xs[1] = {act + pairs[q] * ip};
        const float* ss[1] = {asums + pairs[q] * gsi};
        float out[1][1];
        tile_dots<1, 1>(rows, e, wrows, xs, ss, out);
        finish(pairs[q], out[0][0]);
      }
    };
    if constexpr (W::kQuantized) {
      if (stage_rows<W>(n)) {
        stage_row(down, it.expert, d, scratch.q.data(), scratch.sb.data(), 0);
        run_pairs(StagedQuantRows{scratch.q.data(), scratch.sb.data(), 1, down.cols, down.group_shift}, 0, {0});
        continue;
      }
    }
    run_pairs(down, it.expert, {d});
  }
}

template <typename T, typename W>
HEBRUS_TEMPLATE_VECTOR_CLONES void gate_up_items(const W& gate_up, const std::vector<Item>& items, const ExpertGroups& g,
                                                 int64_t begin, int64_t end, const float* xf, int64_t hp,
                                                 const float* xsums, int64_t gsp, int64_t top_k, int64_t inter,
                                                 float* act, int64_t ip) {
  StageScratch scratch;
  if (W::kQuantized) scratch.reserve(2, gate_up.cols);
  for (int64_t i = begin; i < end; ++i) {
    const Item& it = items[i];
    const int64_t s = g.start[it.expert], n = g.start[it.expert + 1] - s;
    gate_up_item<T>(gate_up, it, g.order.data() + s, n, xf, hp, xsums, gsp, top_k, inter, act, ip, scratch);
  }
}

template <typename T, typename W>
HEBRUS_TEMPLATE_VECTOR_CLONES void down_items(const W& down, const std::vector<Item>& items, const ExpertGroups& g,
                                              int64_t begin, int64_t end, const float* act, int64_t ip,
                                              const float* asums, int64_t gsi, const float* w, bool round_product,
                                              float* y, int64_t hidden) {
  StageScratch scratch;
  if (W::kQuantized) scratch.reserve(1, down.cols);
  for (int64_t i = begin; i < end; ++i) {
    const Item& it = items[i];
    const int64_t s = g.start[it.expert], n = g.start[it.expert + 1] - s;
    down_item<T>(down, it, g.order.data() + s, n, act, ip, asums, gsi, w, round_product, y, hidden, scratch);
  }
}

// Group lane sums of `count` rows of `cols` values (stride `stride`) into sums (`cols / group * kLanes` a row),
// for quantized W; nothing for dense W.
template <typename W>
void row_group_sums(const W& w, const float* rows, int64_t count, int64_t cols, int64_t stride,
                    std::vector<float>& sums) {
  if constexpr (W::kQuantized) {
    const int64_t per_row = (cols >> w.group_shift) * kLanes;
    sums.resize(count * per_row);
    at::parallel_for(0, count, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) group_lane_sums(rows + r * stride, cols, w.group_shift, sums.data() + r * per_row);
    });
  } else {
    (void)w, (void)rows, (void)count, (void)cols, (void)stride;
    sums.clear();
  }
}

// The three passes over rows [t0, t1), with the expert matrices read through GU and DN (dense or
// quantized rows).
template <typename T, typename GU, typename DN>
void run_chunk(const Problem<T>& pr, const GU& gate_up, const DN& down, int64_t t0, int64_t t1, std::vector<float>& xf,
               std::vector<float>& act, std::vector<float>& y) {
  const int64_t k = pr.top_k, H = pr.hidden, I = pr.inter;
  const int64_t hp = round_up(H, kLanes), ip = round_up(I, kLanes);
  const int64_t rows = t1 - t0, pairs = rows * k;
  xf.assign(rows * hp, 0.f);
  act.assign(pairs * ip, 0.f);
  y.resize(pairs * H);
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t d = 0; d < H; ++d) xf[r * hp + d] = static_cast<float>(pr.x[(t0 + r) * H + d]);
  });
  const ExpertGroups g = group_pairs(pr.ids + t0 * k, pairs, pr.experts);
  const float* w = pr.weights + t0 * k;
  std::vector<float> xsums, asums;
  row_group_sums(gate_up, xf.data(), rows, H, hp, xsums);
  const int64_t gsp = rows > 0 && !xsums.empty() ? static_cast<int64_t>(xsums.size()) / rows : 0;
  const std::vector<Item> a_items = items_of(g.hit, I, kInterBlock);
  at::parallel_for(0, static_cast<int64_t>(a_items.size()), 1, [&](int64_t b, int64_t e) {
    gate_up_items<T>(gate_up, a_items, g, b, e, xf.data(), hp, xsums.data(), gsp, k, I, act.data(), ip);
  });
  row_group_sums(down, act.data(), pairs, I, ip, asums);
  const int64_t gsi = pairs > 0 && !asums.empty() ? static_cast<int64_t>(asums.size()) / pairs : 0;
  const std::vector<Item> b_items = items_of(g.hit, H, kHiddenBlock);
  at::parallel_for(0, static_cast<int64_t>(b_items.size()), 1, [&](int64_t b, int64_t e) {
    down_items<T>(down, b_items, g, b, e, act.data(), ip, asums.data(), gsi, w, pr.round_product, y.data(), H);
  });
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* o = pr.out + (t0 + r) * H;
      for (int64_t d = 0; d < H; ++d) {
        float s = 0.f;
        for (int64_t j = 0; j < k; ++j) s += y[(r * k + j) * H + d];
        o[d] = static_cast<T>(s);
      }
    }
  });
}

template <typename T, typename GU, typename DN>
void run_moe(const Problem<T>& pr, const GU& gate_up, const DN& down) {
  const int64_t per_row =
      (round_up(pr.hidden, kLanes) + pr.top_k * (round_up(pr.inter, kLanes) + pr.hidden)) * int64_t{sizeof(float)};
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / per_row);
  std::vector<float> xf, act, y;
  for (int64_t t0 = 0; t0 < pr.rows; t0 += chunk)
    run_chunk(pr, gate_up, down, t0, std::min(pr.rows, t0 + chunk), xf, act, y);
}

// The expert ids as int64, each in [0, E) (checked before anything is computed).
Tensor checked_ids(const char* op, const Tensor& topk_ids, int64_t experts) {
  Tensor ids = topk_ids.to(at::kLong).contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  const int64_t k = ids.size(1);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    HEBRUS_CHECK(p[i] >= 0 && p[i] < experts, HebrusError, "hebrus::", op, ": topk_ids[", i / k, ", ", i % k,
                 "] = ", p[i], " is not an expert id in [0, E=", experts, ")");
  }
  return ids;
}

Tensor moe_experts_cpu(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& gate_up,
                       const Tensor& down) {
  const char* op = "moe_experts";
  check_on_device(op, at::kCPU,
                  {{"x", &x}, {"topk_ids", &topk_ids}, {"topk_weights", &topk_weights}, {"gate_up", &gate_up},
                   {"down", &down}});
  const MoeSizes sz = check_moe_experts_args(x, topk_ids, topk_weights, gate_up, down);
  Tensor out = at::empty({sz.rows, sz.hidden}, x.options());
  if (sz.rows == 0 || sz.hidden == 0) return out;
  if (sz.top_k == 0) return out.zero_();
  const Tensor ids = checked_ids(op, topk_ids, sz.experts);
  const Tensor wts = topk_weights.to(at::kFloat).contiguous();
  const Tensor xc = x.contiguous(), gu = gate_up.contiguous(), dn = down.contiguous();
  const bool round_product = topk_weights.scalar_type() == x.scalar_type();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const Problem<T> pr{xc.data_ptr<T>(), ids.data_ptr<int64_t>(), wts.data_ptr<float>(), round_product,
                        sz.rows, sz.hidden, sz.top_k, sz.experts, sz.inter, out.data_ptr<T>()};
    run_moe(pr, DenseRows<T>{gu.data_ptr<T>(), 2 * sz.inter, sz.hidden}, DenseRows<T>{dn.data_ptr<T>(), sz.hidden, sz.inter});
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: run(c10::BFloat16{}); break;
  }
  return out;
}

// run(T{}, std::integral_constant<int, BITS>{}) for x's dtype (float, half or bfloat16) and bits (4 or 8).
template <typename F>
void dispatch_quantized(at::ScalarType dtype, int64_t bits, const F& run) {
  auto run_bits = [&](auto tag) {
    if (bits == 4) {
      run(tag, std::integral_constant<int, 4>{});
    } else {
      run(tag, std::integral_constant<int, 8>{});
    }
  };
  switch (dtype) {
    case at::kFloat: run_bits(float{}); break;
    case at::kHalf: run_bits(c10::Half{}); break;
    default: run_bits(c10::BFloat16{}); break;
  }
}

Tensor moe_experts_quantized_cpu(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                                 const Tensor& gate_up_q, const Tensor& gate_up_scales, const Tensor& gate_up_biases,
                                 const Tensor& down_q, const Tensor& down_scales, const Tensor& down_biases,
                                 int64_t group_size, int64_t bits) {
  const char* op = "moe_experts_quantized";
  check_on_device(op, at::kCPU,
                  {{"x", &x}, {"topk_ids", &topk_ids}, {"topk_weights", &topk_weights}, {"gate_up_q", &gate_up_q},
                   {"gate_up_scales", &gate_up_scales}, {"gate_up_biases", &gate_up_biases}, {"down_q", &down_q},
                   {"down_scales", &down_scales}, {"down_biases", &down_biases}});
  const MoeSizes sz = check_moe_experts_quantized_args(x, topk_ids, topk_weights, gate_up_q, gate_up_scales,
                                                       gate_up_biases, down_q, down_scales, down_biases, group_size,
                                                       bits);
  Tensor out = at::empty({sz.rows, sz.hidden}, x.options());
  if (sz.rows == 0 || sz.hidden == 0) return out;
  if (sz.top_k == 0) return out.zero_();
  const Tensor ids = checked_ids(op, topk_ids, sz.experts);
  const Tensor wts = topk_weights.to(at::kFloat).contiguous();
  const Tensor xc = x.contiguous(), guq = gate_up_q.contiguous(), gus = gate_up_scales.contiguous(),
               gub = gate_up_biases.contiguous(), dq = down_q.contiguous(), ds = down_scales.contiguous(),
               db = down_biases.contiguous();
  const bool round_product = topk_weights.scalar_type() == x.scalar_type();
  auto codes = [](const Tensor& t) { return reinterpret_cast<const uint32_t*>(t.data_ptr<int32_t>()); };
  const int shift = group_size == 32 ? 5 : group_size == 64 ? 6 : 7;
  auto run = [&](auto tag, auto bits_tag) {
    using T = decltype(tag);
    constexpr int B = decltype(bits_tag)::value;
    const Problem<T> pr{xc.data_ptr<T>(), ids.data_ptr<int64_t>(), wts.data_ptr<float>(), round_product,
                        sz.rows, sz.hidden, sz.top_k, sz.experts, sz.inter, out.data_ptr<T>()};
    run_moe(pr,
            QuantRows<T, B>{codes(guq), gus.data_ptr<T>(), gub.data_ptr<T>(), 2 * sz.inter, sz.hidden, shift},
            QuantRows<T, B>{codes(dq), ds.data_ptr<T>(), db.data_ptr<T>(), sz.hidden, sz.inter, shift});
  };
  dispatch_quantized(x.scalar_type(), bits, run);
  return out;
}

// hebrus::quantized_linear: out[t][o] = round(dot(W[o], x_t)) folded as the MoE kernel folds it (QuantRows,
// tile_dots), so each output depends only on its own row of x. Work items are blocks of kLinearBlock outputs;
// inside one, kLinearRows weight rows are read at a time against tiles of kPairTile rows of x, the weight rows
// staged once into fp32 scratch when more than one tile reads them (the same values, so the same bits).
constexpr int64_t kLinearRows = 4;    // weight rows per tile (independent sums in flight at decode)
constexpr int64_t kLinearBlock = 64;  // outputs per work item

template <typename T, typename W, int O>
HEBRUS_INLINE void linear_rows(const W& w, const int64_t (&wrows)[O], const float* xf, const float* xsums,
                               int64_t gs, int64_t rows, int64_t in, T* out, int64_t out_dim) {
  int64_t t = 0;
  auto store = [&](int64_t t0, int p, const float (&v)[O]) HEBRUS_LAMBDA_INLINE {
    for (int o = 0; o < O; ++o) out[(t0 + p) * out_dim + wrows[o]] = static_cast<T>(v[o]);
  };
  for (; t + kPairTile <= rows; t += kPairTile) {
    const float* xs[kPairTile];
    const float* ss[kPairTile];
    for (int64_t p = 0; p < kPairTile; ++p) {
      xs[p] = xf + (t + p) * in;
      ss[p] = xsums + (t + p) * gs;
    }
    float acc[kPairTile][O];
    tile_dots<kPairTile, O>(w, 0, wrows, xs, ss, acc);
    for (int p = 0; p < kPairTile; ++p) store(t, p, acc[p]);
  }
  for (; t < rows; ++t) {
    const float* xs[1] = {xf + t * in};
    const float* ss[1] = {xsums + t * gs};
    float acc[1][O];
    tile_dots<1, O>(w, 0, wrows, xs, ss, acc);
    store(t, 0, acc[0]);
  }
}

template <typename T, typename W>
HEBRUS_TEMPLATE_VECTOR_CLONES void linear_block(const W& w, int64_t begin, int64_t end, const float* xf,
                                                const float* xsums, int64_t gs, int64_t rows, int64_t in, T* out,
                                                int64_t out_dim) {
  const bool staged = rows > kPairTile;
  StageScratch scratch;
  if (staged) scratch.reserve(kLinearRows, in);
  // Outputs [o0, o0 + O); staged, they are scratch rows 0 .. O - 1, stored through out + o0.
  auto run = [&](auto count, int64_t o0) HEBRUS_LAMBDA_INLINE {
    constexpr int O = decltype(count)::value;
    if (staged) {
      int64_t local[O];
      for (int o = 0; o < O; ++o) {
        stage_row(w, 0, o0 + o, scratch.q.data(), scratch.sb.data(), o);
        local[o] = o;
      }
      linear_rows<T>(StagedQuantRows{scratch.q.data(), scratch.sb.data(), O, in, w.group_shift}, local, xf, xsums,
                     gs, rows, in, out + o0, out_dim);
    } else {
      int64_t wrows[O];
      for (int o = 0; o < O; ++o) wrows[o] = o0 + o;
      linear_rows<T>(w, wrows, xf, xsums, gs, rows, in, out, out_dim);
    }
  };
  int64_t o = begin;
  for (; o + kLinearRows <= end; o += kLinearRows) run(std::integral_constant<int, kLinearRows>{}, o);
  for (; o < end; ++o) run(std::integral_constant<int, 1>{}, o);
}

Tensor quantized_linear_cpu(const Tensor& x, const Tensor& wq, const Tensor& scales, const Tensor& biases,
                            int64_t group_size, int64_t bits) {
  check_on_device("quantized_linear", at::kCPU, {{"x", &x}, {"wq", &wq}, {"scales", &scales}, {"biases", &biases}});
  const QuantLinearSizes sz = check_quantized_linear_args(x, wq, scales, biases, group_size, bits);
  Tensor out = at::empty({sz.rows, sz.out}, x.options());
  if (sz.rows == 0 || sz.out == 0) return out;
  if (sz.in == 0) return out.zero_();
  const Tensor xc = x.contiguous(), q = wq.contiguous(), sc = scales.contiguous(), bi = biases.contiguous();
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(q.data_ptr<int32_t>());
  const int shift = group_size == 32 ? 5 : group_size == 64 ? 6 : 7;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (sz.in * int64_t{sizeof(float)}));
  auto run = [&](auto tag, auto bits_tag) {
    using T = decltype(tag);
    constexpr int B = decltype(bits_tag)::value;
    const QuantRows<T, B> w{codes, sc.data_ptr<T>(), bi.data_ptr<T>(), sz.out, sz.in, shift};
    const T* xp = xc.data_ptr<T>();
    T* op = out.data_ptr<T>();
    std::vector<float> xf, xsums;
    const int64_t gs = (sz.in >> shift) * kLanes;
    for (int64_t t0 = 0; t0 < sz.rows; t0 += chunk) {
      const int64_t rows = std::min(sz.rows, t0 + chunk) - t0;
      xf.resize(rows * sz.in);
      for (int64_t i = 0; i < rows * sz.in; ++i) xf[i] = static_cast<float>(xp[t0 * sz.in + i]);
      row_group_sums(w, xf.data(), rows, sz.in, sz.in, xsums);
      const int64_t blocks = (sz.out + kLinearBlock - 1) / kLinearBlock;
      at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
        for (int64_t blk = b; blk < e; ++blk)
          linear_block<T>(w, blk * kLinearBlock, std::min(sz.out, (blk + 1) * kLinearBlock), xf.data(),
                          xsums.data(), gs, rows, sz.in, op + t0 * sz.out, sz.out);
      });
    }
  };
  dispatch_quantized(x.scalar_type(), bits, run);
  return out;
}

// hebrus::moe_route (issue 37): transformers' Qwen4ExpTextTopKRouter after its linear, and the shared expert's
// sigmoid gate, as the modules' own ATen sequence in C++ (so their bits, and torch.topk's order among equal
// probabilities), without the dispatcher and Python round trips of their seven ops.
std::tuple<Tensor, Tensor> moe_route_cpu(const Tensor& logits, const std::optional<Tensor>& shared, int64_t top_k,
                                         bool norm_topk_prob) {
  const Tensor* sh = shared.has_value() ? &*shared : nullptr;
  if (sh != nullptr) {
    check_on_device("moe_route", at::kCPU, {{"router_logits", &logits}, {"shared_gate_logits", sh}});
  } else {
    check_on_device("moe_route", at::kCPU, {{"router_logits", &logits}});
  }
  check_moe_route_args(logits, sh, top_k);
  const Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto [values, ids] = at::topk(probs, top_k, -1);
  if (norm_topk_prob) values = values.div(values.sum(-1, /*keepdim=*/true));
  Tensor weights = values.to(logits.scalar_type());
  if (sh != nullptr) weights = at::cat({weights, at::sigmoid(*sh)}, 1);
  return {ids, weights};
}

// hebrus::moe_shared_expert (issue 37): transformers' Qwen4ExpTextMLP (the shared expert) times its sigmoid gate,
// added to the routed experts' output, as the block's own ATen sequence in C++ (so its bits).
Tensor moe_shared_expert_cpu(const Tensor& x, const Tensor& routed, const Tensor& gate_proj, const Tensor& up_proj,
                             const Tensor& down_proj, const Tensor& gate) {
  check_on_device("moe_shared_expert", at::kCPU,
                  {{"x", &x}, {"routed", &routed}, {"gate_proj", &gate_proj}, {"up_proj", &up_proj},
                   {"down_proj", &down_proj}, {"gate", &gate}});
  check_moe_shared_expert_args(x, routed, gate_proj, up_proj, down_proj, gate);
  const Tensor act = at::silu(at::linear(x, gate_proj)).mul(at::linear(x, up_proj));
  return routed.add(gate.mul(at::linear(act, down_proj)));
}

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("moe_experts", &hebrus::moe_experts_cpu);
  m.impl("moe_experts_quantized", &hebrus::moe_experts_quantized_cpu);
  m.impl("quantized_linear", &hebrus::quantized_linear_cpu);
  m.impl("moe_route", &hebrus::moe_route_cpu);
  m.impl("moe_shared_expert", &hebrus::moe_shared_expert_cpu);
}
