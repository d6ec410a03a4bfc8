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
// folded as MLX's qmv folds it, s * sum(q * x) + b * sum(x) (per lane: the group's qx = fma(q, x, qx) and xs = xs + x
// in ascending d, then acc + (qx * s + xs * b)); the lane sums of x per group (xs) are computed once per row of x.
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
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu/claim_pool.h"
#include "cpu/hebrus_simd.h"
#include "cpu/hebrus_widen.h"
#include "cpu/quantized_linear.h"
#include "cpu/row_math.h"
#include "cpu/dense_mm.h"
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
constexpr int64_t kRowGrain = 16;          // rows a unit of the per-row loops (fewer rows: no threads)

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
  using Elem = T;
  static constexpr bool kQuantized = false;
  const T* base;
  int64_t rows, cols;

  HEBRUS_INLINE const T* row(int64_t e, int64_t r) const { return base + (e * rows + r) * cols; }
  static HEBRUS_INLINE int64_t place(int64_t d) { return d; }
};

// ---- The quantized dot products ----
//
// The order of the 16 columns of a chunk in the kernels' registers: each chunk's codes are read without a shuffle,
// as 64-bit pieces broadcast to every pair of 32-bit lanes, each lane shifting its word by its place in it. A
// 4-bit chunk is one piece and lane i holds column (i & 1) * 8 + (i >> 1); an 8-bit chunk is two pieces, one a
// half of 8 lanes, and lane i holds column (i & 8) + (i & 1) * 4 + ((i >> 1) & 3). The rows of x are stored in the
// same order (place), so lane i multiplies the code and the value of one column and sums, as before, the columns
// of one lane of the file's order in ascending order; each accumulator is put back in column order (unpermute)
// before reduce_lanes.
template <int BITS>
struct CodeOrder {
  static constexpr int kBits = BITS;
  // The lane column d mod 16 is read into.
  static HEBRUS_INLINE int64_t place(int64_t d) {
    const int64_t l = d & 15, chunk = d & ~int64_t{15};
    if constexpr (BITS == 4) {
      return chunk | (l < 8 ? 2 * l : 2 * (l - 8) + 1);
    } else {
      return chunk | (l & 8) | (2 * (l & 3) + ((l >> 2) & 1));
    }
  }
  static HEBRUS_INLINE Vec unpermute(Vec v) {
    if constexpr (BITS == 4) {
      return HEBRUS_SHUFFLE(v, v, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    } else {
      return HEBRUS_SHUFFLE(v, v, 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    }
  }
};

// Quantized expert matrices (hebrus_torch/moe/quantize.py): codes packed into int32 words [E, rows, cols * BITS / 32],
// scales and biases [E, rows, cols / group] in T. cols is a multiple of the group (>= 32), so every 16 columns from a
// multiple of 16 lie in one group and no row has a tail. The kernels (quant_tile_dots) read codes as floats and
// each group's scale and bias, never a dequantized value (the fold above).
template <typename T, int BITS>
struct QuantRows {
  static constexpr bool kQuantized = true;
  static constexpr int kBits = BITS;
  const uint32_t* codes_base;
  const T* scales;
  const T* biases;
  int64_t rows, cols;
  int group_shift;  // log2 of the group size (32, 64 or 128)

  HEBRUS_INLINE int64_t groups() const { return cols >> group_shift; }
  HEBRUS_INLINE const uint32_t* row_codes(int64_t e, int64_t r) const {
    return codes_base + (e * rows + r) * (cols * BITS / 32);
  }
  // Where column d of a row of x goes in the kernels' fp32 copy of that row.
  static HEBRUS_INLINE int64_t place(int64_t d) { return CodeOrder<BITS>::place(d); }

  // The scales and biases of rows [r0, r0 + count) of expert e in fp32: s[(r - r0) * groups + g].
  void widen_params(int64_t e, int64_t r0, int64_t count, float* s, float* b) const {
    const int64_t first = (e * rows + r0) * groups(), n = count * groups();
    for (int64_t i = 0; i < n; ++i) {
      s[i] = static_cast<float>(scales[first + i]);
      b[i] = static_cast<float>(biases[first + i]);
    }
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

// Code readers: chunk c (columns [16c, 16c + 16)) of a row of packed codes as floats in CodeOrder's lanes, as V
// (16 lanes, or 8: then part h of 2 gives lanes [8h, 8h + 8)). The codes are < 256, so every conversion is exact
// and every reader gives the same floats. (GCC 12 builds a 16-lane vector from two 64-bit pieces, or widens bytes,
// through the stack or lane by lane: an 8-bit chunk is read as two 8-lane halves everywhere.)
typedef uint32_t VecU __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint64_t VecU64 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef float VecH __attribute__((vector_size(kLanes / 2 * sizeof(float))));
typedef int32_t VecHI __attribute__((vector_size(kLanes / 2 * sizeof(int32_t))));
typedef uint32_t VecHU __attribute__((vector_size(kLanes / 2 * sizeof(uint32_t))));
typedef uint64_t VecHU64 __attribute__((vector_size(kLanes / 2 * sizeof(uint32_t))));

HEBRUS_INLINE uint64_t load_u64(const uint32_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Lane i's shift of the broadcast 4-bit piece: 4 * (i >> 1).
constexpr VecU kCodeShift4 = {0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28};

// 4-bit codes, 16 lanes: one broadcast, shift, mask and conversion.
struct Codes4Wide : CodeOrder<4> {
  using V = Vec;
  static HEBRUS_INLINE V codes(const uint32_t* row, int64_t c, int) {
    const VecU words = (VecU)(VecU64{} + load_u64(row + 2 * c));
    return __builtin_convertvector((VecIdx)((words >> kCodeShift4) & 15u), Vec);
  }
};

// 4-bit codes, 16 lanes, where a vector permute takes its index modulo 16 (AVX-512's vpermps): the shifted word
// indexes a table of the 16 codes' floats, with no mask and no conversion. GCC only (clang's vector extensions have
// no permute by a variable index): elsewhere Codes4Wide.
struct Codes4Permute : Codes4Wide {
#if defined(__GNUC__) && !defined(__clang__)
  static HEBRUS_INLINE Vec codes(const uint32_t* row, int64_t c, int) {
    constexpr Vec kValues = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const VecU words = (VecU)(VecU64{} + load_u64(row + 2 * c));
    return __builtin_shuffle(kValues, (VecIdx)(words >> kCodeShift4));
  }
#endif
};

// 8 lanes a register: part h of the 16 (one 64-bit piece of an 8-bit chunk, or the 4-bit chunk's piece with the
// shifts of lanes [8h, 8h + 8)).
template <int BITS>
struct CodesHalf : CodeOrder<BITS> {
  using V = VecH;
  static HEBRUS_INLINE V codes(const uint32_t* row, int64_t c, int h) {
    constexpr uint32_t kMask = (1u << BITS) - 1u;
    if constexpr (BITS == 4) {
      constexpr VecHU kShift = {0, 0, 4, 4, 8, 8, 12, 12};
      const VecHU words = (VecHU)(VecHU64{} + load_u64(row + 2 * c));
      return __builtin_convertvector((VecHI)((words >> (kShift + 16u * h)) & kMask), VecH);
    } else {
      constexpr VecHU kShift = {0, 0, 8, 8, 16, 16, 24, 24};
      const VecHU words = (VecHU)(VecHU64{} + load_u64(row + 4 * c + 2 * h));
      return __builtin_convertvector((VecHI)((words >> kShift) & kMask), VecH);
    }
  }
};

// The fused multiply-adds of the quantized dot products, a register of V (Vec or VecH) at a time, each one rounding
// (std::fma's bits). The portable kernel's is FusedMulAdd's lane loop; the x86 kernels' are single instructions
// (GCC does not turn a 16-lane loop of fmaf into one inside the tile loops' unrolled bodies).
struct PortableFma {
  template <typename V>
  static HEBRUS_INLINE V apply(V a, V b, V c) {
    return FusedMulAdd::apply(a, b, c);
  }
};

#if defined(__x86_64__) && defined(__GNUC__)
// The instructions' builtins rather than their intrinsics: the tile loops' lambdas are compiled for the baseline
// target and inlined into the ISA's kernel, and GCC refuses to inline a target("avx512f") intrinsic into them; a
// builtin is checked where it is expanded, inside the kernel.
struct Avx2Fma {
  static HEBRUS_INLINE VecH apply(VecH a, VecH b, VecH c) {
    return (VecH)__builtin_ia32_vfmaddps256((__v8sf)a, (__v8sf)b, (__v8sf)c);
  }
};

#define HEBRUS_AVX512 __attribute__((target("avx512f,avx512vl,fma")))
struct Avx512Fma {
  static HEBRUS_INLINE Vec apply(Vec a, Vec b, Vec c) {
    return (Vec)__builtin_ia32_vfmaddps512_mask((__v16sf)a, (__v16sf)b, (__v16sf)c, (__mmask16)-1, 4);
  }
  static HEBRUS_INLINE VecH apply(VecH a, VecH b, VecH c) { return Avx2Fma::apply(a, b, c); }
};
#endif

constexpr int kTileRows = 4;  // weight rows of a tile: their dot products with one row of x run side by side
constexpr int kTilePairs = 4; // rows of x a tile reads each loaded chunk of codes against, at most

// Weight rows of a tile: packed codes, and each group's scale and bias widened to fp32. While a tile runs, the
// codes kPrefetchBytes past each of its rows are prefetched: the next tiles' rows (a work item's tiles walk its
// rows in address order), which a decode step's short rows (320 bytes for a 4-bit down row) would not give the
// hardware's stream prefetcher time to find.
constexpr int64_t kPrefetchBytes = 4096;

// CODE: uint32_t (packed codes, read by a code reader) or float (the codes already widened: WidenedCodes).
template <typename CODE>
struct TileOf {
  const CODE* codes[kTileRows];
  const float* scales[kTileRows];
  const float* biases[kTileRows];
};
using QuantTile = TileOf<uint32_t>;

// out[p * kTileRows + o] = the folded dot product of weight row o with x[p], P rows of x, each of them with its group
// lane sums xsums[p] (group_lane_sums), both in CodeOrder's lanes. Per lane, as the file's header says: in each
// group qx = fma(q, x, qx) over its columns in ascending order from qx = 0 (the first product stands for
// fma(q, x, 0): qx's sign of zero is lost in acc + (qx * s + xs * b), as acc is never -0), then
// acc = acc + (qx * s + xs * b). F: the fused multiply-add (PortableFma, Avx2Fma, Avx512Fma: the same bits).
template <typename C, int P, typename F, typename CODE>
HEBRUS_INLINE void quant_tile_dots(const TileOf<CODE>& w, const float* const* x, const float* const* xsums,
                                   int64_t groups, int64_t group_chunks, float* out) {
  using V = typename C::V;
  constexpr int kWidth = sizeof(V) / sizeof(float), kParts = kLanes / kWidth;
  V acc[P][kTileRows][kParts];
  for (int p = 0; p < P; ++p)
    for (int o = 0; o < kTileRows; ++o)
      for (int h = 0; h < kParts; ++h) acc[p][o][h] = V{};
  constexpr int64_t kCodeBytes = kLanes * (C::kBits) / 8;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * group_chunks;
    if constexpr (std::is_same_v<CODE, uint32_t>) {
      for (int o = 0; o < kTileRows; ++o)
        __builtin_prefetch(reinterpret_cast<const char*>(w.codes[o]) + c0 * kCodeBytes + kPrefetchBytes);
    }
    // Each chunk of x is loaded once for the tile's rows, each chunk of codes once for the tile's rows of x.
    V qx[P][kTileRows][kParts];
    auto chunk = [&](int64_t c, auto first) HEBRUS_LAMBDA_INLINE {
      for (int h = 0; h < kParts; ++h) {
        V xv[P];
        for (int p = 0; p < P; ++p) xv[p] = load_vector<V>(x[p] + c * kLanes + h * kWidth);
        for (int o = 0; o < kTileRows; ++o) {
          const V q = C::codes(w.codes[o], c, h);
          for (int p = 0; p < P; ++p) {
            if constexpr (decltype(first)::value) {
              qx[p][o][h] = q * xv[p];
            } else {
              qx[p][o][h] = F::apply(q, xv[p], qx[p][o][h]);
            }
          }
        }
      }
    };
    chunk(c0, std::true_type{});
    for (int64_t c = c0 + 1; c < c0 + group_chunks; ++c) chunk(c, std::false_type{});
    for (int o = 0; o < kTileRows; ++o) {
      const float s = w.scales[o][g], b = w.biases[o][g];
      for (int p = 0; p < P; ++p)
        for (int h = 0; h < kParts; ++h)
          acc[p][o][h] += qx[p][o][h] * s + load_vector<V>(xsums[p] + g * kLanes + h * kWidth) * b;
    }
  }
  for (int p = 0; p < P; ++p) {
    for (int o = 0; o < kTileRows; ++o) {
      Vec lanes;
      std::memcpy(&lanes, acc[p][o], sizeof(lanes));
      out[p * kTileRows + o] = reduce_lanes(C::unpermute(lanes));
    }
  }
}

// The codes of a tile's rows widened to floats once (WIDEN's reader, CodeOrder's lanes), so that a batch's row tiles
// load them instead of unpacking them again: V-wide parts of the 16 floats of a chunk from a row of the scratch.
template <int BITS, typename V_>
struct WidenedCodes : CodeOrder<BITS> {
  using V = V_;
  static HEBRUS_INLINE V codes(const float* row, int64_t c, int h) {
    return load_vector<V>(row + c * kLanes + h * int64_t{sizeof(V) / sizeof(float)});
  }
};

// scratch[o * chunks * kLanes + c * kLanes + l] = lane l of chunk c of weight row o's codes as floats (exact: the
// codes are < 256), with C's reader; a short tile's repeated last row is widened once.
template <typename C>
HEBRUS_INLINE void widen_tile(const QuantTile& w, int64_t chunks, float* scratch, TileOf<float>& wide) {
  using V = typename C::V;
  constexpr int kWidth = sizeof(V) / sizeof(float), kParts = kLanes / kWidth;
  constexpr int64_t kCodeWords = kLanes * C::kBits / 32;
  for (int o = 0; o < kTileRows; ++o) {
    wide.scales[o] = w.scales[o];
    wide.biases[o] = w.biases[o];
    if (o > 0 && w.codes[o] == w.codes[o - 1]) {
      wide.codes[o] = wide.codes[o - 1];
      continue;
    }
    float* row = scratch + o * chunks * kLanes;
    wide.codes[o] = row;
    for (int64_t c = 0; c < chunks; ++c) {
      if ((c & 3) == 0) __builtin_prefetch(reinterpret_cast<const char*>(w.codes[o] + c * kCodeWords) + kPrefetchBytes);
      for (int h = 0; h < kParts; ++h) {
        const V q = C::codes(w.codes[o], c, h);
        std::memcpy(row + c * kLanes + h * kWidth, &q, sizeof(q));
      }
    }
  }
}

// A tile against n rows of x, PAIRS (4, 2 or 1: what the registers hold) at a time: out [n, kTileRows].
template <typename C, int PAIRS, typename F, typename CODE>
HEBRUS_INLINE void quant_tile_row_tiles(const TileOf<CODE>& w, const float* const* x, const float* const* xsums,
                                        int64_t n, int64_t groups, int64_t group_chunks, float* out) {
  int64_t p = 0;
  for (; p + PAIRS <= n; p += PAIRS)
    quant_tile_dots<C, PAIRS, F>(w, x + p, xsums + p, groups, group_chunks, out + p * kTileRows);
  if (PAIRS > 2 && p + 2 <= n) {
    quant_tile_dots<C, 2, F>(w, x + p, xsums + p, groups, group_chunks, out + p * kTileRows);
    p += 2;
  }
  if (PAIRS > 1 && p < n) quant_tile_dots<C, 1, F>(w, x + p, xsums + p, groups, group_chunks, out + p * kTileRows);
}

// The tile against n rows of x. Up to PACKED_UP_TO rows read the packed codes with C's reader, PAIRS at a time (a
// decode step: each chunk unpacked once for every PAIRS rows); more rows would unpack every chunk again for each
// PAIRS of them, so the tile's codes are widened once into scratch (kTileRows * groups * group_chunks * kLanes
// floats, L1/L2-sized) and the rows read them WIDE_PAIRS at a time with W's reader. Each row's arithmetic is the
// same either way (the same floats in the same lanes, the same operations in the same order): only where a code's
// float comes from differs.
template <typename C, int PAIRS, int PACKED_UP_TO, typename W, int WIDE_PAIRS, typename F>
HEBRUS_INLINE void quant_tile_rows(const QuantTile& w, const float* const* x, const float* const* xsums, int64_t n,
                                   int64_t groups, int64_t group_chunks, float* out, float* scratch) {
  if (n <= PACKED_UP_TO) {
    quant_tile_row_tiles<C, PAIRS, F>(w, x, xsums, n, groups, group_chunks, out);
    return;
  }
  TileOf<float> wide;
  widen_tile<C>(w, groups * group_chunks, scratch, wide);
  quant_tile_row_tiles<W, WIDE_PAIRS, F>(wide, x, xsums, n, groups, group_chunks, out);
}

using QuantTileKernel = void (*)(const QuantTile&, const float* const*, const float* const*, int64_t, int64_t,
                                 int64_t, float*, float*);

// One function per instruction set, each compiling the same source (so the same bits: -ffp-contract=off and a
// fixed order of every sum); cpu_capability() picks one, HEBRUS_CPU_CAPABILITY lowers it.
#define HEBRUS_TILE_KERNEL_ARGS                                                                                  \
  const QuantTile &w, const float *const *x, const float *const *xsums, int64_t n, int64_t groups,               \
      int64_t group_chunks, float *out, float *scratch
#define HEBRUS_TILE_KERNEL_CALL w, x, xsums, n, groups, group_chunks, out, scratch

template <int BITS>
__attribute__((noinline)) void quant_tile_rows_portable(HEBRUS_TILE_KERNEL_ARGS) {
  quant_tile_rows<std::conditional_t<BITS == 4, Codes4Wide, CodesHalf<8>>, 1, 1, WidenedCodes<BITS, Vec>, 1,
                  PortableFma>(HEBRUS_TILE_KERNEL_CALL);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <int BITS>
HEBRUS_AVX2 __attribute__((noinline)) void quant_tile_rows_avx2(HEBRUS_TILE_KERNEL_ARGS) {
  quant_tile_rows<CodesHalf<BITS>, 1, 1, WidenedCodes<BITS, VecH>, 1, Avx2Fma>(HEBRUS_TILE_KERNEL_CALL);
}

// 4-bit chunks are unpacked by a table lookup (Codes4Permute), 4 rows of x a tile, at any row count: the unpacking
// is two instructions a chunk for 4 rows' 8 products, and the tile's codes stay in L1 where a widened tile would
// not (measured: widening made 64 rows 1.25x slower in the MoE, 8 rows 1.4x slower in quantized_linear). 8-bit
// chunks are unpacked as 8-lane halves (CodesHalf): AVX-512VL's 32 ymm registers hold the running sums of 2 rows of
// x against 4 weight rows, two halves each; from 5 rows of x they are widened, and read as 16-lane registers, 4
// rows of x a tile.
template <int BITS>
HEBRUS_AVX512 __attribute__((noinline)) void quant_tile_rows_avx512(HEBRUS_TILE_KERNEL_ARGS) {
  if constexpr (BITS == 4) {
    (void)scratch;
    quant_tile_row_tiles<Codes4Permute, kTilePairs, Avx512Fma>(w, x, xsums, n, groups, group_chunks, out);
  } else {
    quant_tile_rows<CodesHalf<8>, 2, 4, WidenedCodes<8, Vec>, kTilePairs, Avx512Fma>(HEBRUS_TILE_KERNEL_CALL);
  }
}
#endif
#undef HEBRUS_TILE_KERNEL_ARGS
#undef HEBRUS_TILE_KERNEL_CALL

template <int BITS>
QuantTileKernel quant_tile_kernel() {
#if defined(__x86_64__) && defined(__GNUC__)
  const CpuCapability isa = cpu_capability();
  if (isa >= CpuCapability::kAvx512 && __builtin_cpu_supports("avx512vl")) return &quant_tile_rows_avx512<BITS>;
  if (isa >= CpuCapability::kAvx512) return &quant_tile_rows_avx2<BITS>;  // no VL (Xeon Phi)
  if (isa == CpuCapability::kAvx2) return &quant_tile_rows_avx2<BITS>;
#endif
  return &quant_tile_rows_portable<BITS>;
}

// What a pass item needs besides its inputs. Quantized rows: the kernel, the widened scales and biases of the
// item's rows, its pairs' rows of x and the results of a tile; both kinds: pass A's dot products of an item, before
// its activations (store_acts).
struct QuantScratch {
  QuantTileKernel kernel;
  std::vector<float> scales, biases, out;
  std::vector<float> codes;  // a tile's codes widened (quant_tile_rows): kTileRows rows of the weight's columns
  std::vector<const float*> x, xsums;
  std::vector<float> dots;   // pass A's: [pair][gate / up][intermediate of the item]
};

// The calling thread's scratch, kept between calls (a work unit is as short as one block of a decode step's
// projection: its vectors are not allocated again for each).
QuantScratch& thread_scratch() {
  thread_local QuantScratch scratch;
  return scratch;
}

// How far past the chunk it reads each row of a dense tile prefetches: the rows that the work item's next tiles read
// (its rows walk up in address order). A decode step's tiles are a few rows of 1-2 KB each, too short for the
// hardware's stream prefetcher to reach DRAM's rate on its own. An expert with fewer pairs than a tile (a decode
// step's one token) does one dot product per row loaded, not a tile's P, so its rows stream faster and its requests
// go further ahead (kFewPairsPrefetchBytes): measured on one core, 8 KB there made a 1-request decode step ~1% shorter
// than 2 KB, while 8 KB in the tiles made a 64-request step ~1.5% longer (benchmarks/RESULTS.md, session 36).
constexpr int64_t kDensePrefetchBytes = 2048;
constexpr int64_t kFewPairsPrefetchBytes = 8192;

template <typename T>
HEBRUS_INLINE Half load_half(const T* p) {
  Half v;
  for (int i = 0; i < kLanes / 2; ++i) v[i] = widen<T>(p[i]);
  return v;
}

template <>
HEBRUS_INLINE Half load_half<float>(const float* p) {
  return load_vector<Half>(p);
}

// out[p][o] = sum over columns of W[e, wrows[o]] * xs[p] for P pairs and O rows of a dense W, each sum in
// the fixed lane order (reduce_lanes of 16-lane accumulators, kept as halves: hebrus_simd.h's Half). The xs rows
// are fp32 and zero-padded to a multiple of kLanes.
template <int P, int O, typename W, int64_t kAhead = kDensePrefetchBytes>
HEBRUS_INLINE void tile_dots(const W& w, int64_t e, const int64_t (&wrows)[O], const float* const (&xs)[P],
                             float (&out)[P][O]) {
  using T = typename W::Elem;
  constexpr int64_t kHalf = kLanes / 2;
  Half acc[P][O][2];
  for (int p = 0; p < P; ++p)
    for (int o = 0; o < O; ++o) acc[p][o][0] = acc[p][o][1] = Half{};
  const T* rows[O];
  for (int o = 0; o < O; ++o) rows[o] = w.row(e, wrows[o]);
  const int64_t n = w.cols;
  const int64_t full = n / kLanes * kLanes;
  auto chunk = [&](const T* const (&src)[O], int64_t c, int64_t xc) HEBRUS_LAMBDA_INLINE {
    for (int h = 0; h < 2; ++h) {
      Half wv[O];
      for (int o = 0; o < O; ++o) wv[o] = load_half<T>(src[o] + c + h * kHalf);
      for (int p = 0; p < P; ++p) {
        const Half xv = load_vector<Half>(xs[p] + xc + h * kHalf);
        for (int o = 0; o < O; ++o) acc[p][o][h] += wv[o] * xv;
      }
    }
  };
  for (int64_t c = 0; c < full; c += kLanes) {
    for (int o = 0; o < O; ++o)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[o] + c) + kAhead);
    chunk(rows, c, c);
  }
  if (full < n) {  // the last columns, zero-padded to a chunk
    T buf[O][kLanes];
    const T* src[O];
    for (int o = 0; o < O; ++o) {
      for (int64_t i = 0; i < kLanes; ++i) buf[o][i] = full + i < n ? rows[o][full + i] : T(0);
      src[o] = buf[o];
    }
    chunk(src, 0, full);
  }
  for (int p = 0; p < P; ++p)
    for (int o = 0; o < O; ++o) out[p][o] = reduce_halves(acc[p][o][0], acc[p][o][1]);
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

// The finishing step of pass A for one pair and the intermediates [begin, begin + width) of an item: the
// activations from their gate and up dot products, stored at place(i) of the pair's act row (the down
// projection's reading order). A plain loop that the compiler vectorises (silu's exp_silu 16 lanes at a time:
// the same operations per element, so the same bits as one at a time; scalar, they were about a third of the
// dense pass A). Quantized rows place a column away from its index (CodeOrder), a scatter that would keep the
// loop scalar: there the activations of a block of 64 go to a contiguous buffer first, then to their places.
template <typename T>
HEBRUS_INLINE float activation(float gate, float up) {
  return round_to<T>(round_to<T>(silu(round_to<T>(gate))) * round_to<T>(up));
}

template <typename T, typename W>
HEBRUS_INLINE void store_acts(float* row, int64_t begin, const float* gates, const float* ups, int64_t width) {
  if constexpr (W::kQuantized) {
    constexpr int64_t kBlock = 64;
    float buf[kBlock];
    for (int64_t j0 = 0; j0 < width; j0 += kBlock) {
      const int64_t n = std::min(kBlock, width - j0);
      for (int64_t j = 0; j < n; ++j) buf[j] = activation<T>(gates[j0 + j], ups[j0 + j]);
      for (int64_t j = 0; j < n; ++j) row[W::place(begin + j0 + j)] = buf[j];
    }
  } else {
    for (int64_t j = 0; j < width; ++j) row[W::place(begin + j)] = activation<T>(gates[j], ups[j]);
  }
}

// The finishing step of pass B: output d of pair p, weighted.
template <typename T>
HEBRUS_INLINE void store_weighted(float* y, int64_t hidden, int64_t p, int64_t d, float v, const float* w,
                                  bool round_product) {
  const float prod = round_to<T>(v) * w[p];
  y[p * hidden + d] = round_product ? round_to<T>(prod) : prod;
}

// Pass A for the pairs [0, n) of one item, dense rows: act[p][i] for i in [begin, end). The dot products of the
// item go to a scratch block first ([pair][gate / up][i]); the activations then run over each pair's row of it
// (store_acts).
template <typename T, typename W>
HEBRUS_INLINE void gate_up_item(const W& gate_up, const Item& it, const int64_t* pairs, int64_t n, const float* xf,
                                int64_t hp, int64_t top_k, int64_t inter, float* act, int64_t ip) {
  const int64_t width = it.end - it.begin;
  std::vector<float>& scratch = thread_scratch().dots;
  scratch.resize(static_cast<size_t>(2 * n * width));
  float* dots = scratch.data();  // pair q: gates at dots[2 q width + j], ups at dots[(2 q + 1) width + j]
  if (n < kPairTile) {
    // Fewer pairs than a tile (a decode step's one token): each pair alone over two intermediates at a time, so
    // that four weight rows stream at once (one row pair per call left the loads too few to keep up with memory).
    // Every dot product is the same one (tile_dots' fixed order), so the bits are those of the loop below.
    for (int64_t q = 0; q < n; ++q) {
      const float* xs[1] = {xf + (pairs[q] / top_k) * hp};
      float* gates = dots + 2 * q * width;
      float* ups = gates + width;
      int64_t i = it.begin;
      for (; i + 2 <= it.end; i += 2) {
        const int64_t wrows[4] = {i, i + 1, inter + i, inter + i + 1}, j = i - it.begin;
        float out[1][4];
        tile_dots<1, 4, W, kFewPairsPrefetchBytes>(gate_up, it.expert, wrows, xs, out);
        gates[j] = out[0][0];
        gates[j + 1] = out[0][1];
        ups[j] = out[0][2];
        ups[j + 1] = out[0][3];
      }
      for (; i < it.end; ++i) {
        const int64_t wrows[2] = {i, inter + i}, j = i - it.begin;
        float out[1][2];
        tile_dots<1, 2>(gate_up, it.expert, wrows, xs, out);
        gates[j] = out[0][0];
        ups[j] = out[0][1];
      }
    }
  } else {
    for (int64_t i = it.begin; i < it.end; ++i) {
      const int64_t wrows[2] = {i, inter + i}, j = i - it.begin;
      int64_t q = 0;
      for (; q + kPairTile <= n; q += kPairTile) {
        const float* xs[kPairTile];
        for (int64_t r = 0; r < kPairTile; ++r) xs[r] = xf + (pairs[q + r] / top_k) * hp;
        float out[kPairTile][2];
        tile_dots<kPairTile, 2>(gate_up, it.expert, wrows, xs, out);
        for (int64_t r = 0; r < kPairTile; ++r) {
          dots[2 * (q + r) * width + j] = out[r][0];
          dots[(2 * (q + r) + 1) * width + j] = out[r][1];
        }
      }
      for (; q < n; ++q) {
        const float* xs[1] = {xf + (pairs[q] / top_k) * hp};
        float out[1][2];
        tile_dots<1, 2>(gate_up, it.expert, wrows, xs, out);
        dots[2 * q * width + j] = out[0][0];
        dots[(2 * q + 1) * width + j] = out[0][1];
      }
    }
  }
  for (int64_t q = 0; q < n; ++q) {
    const float* gates = dots + 2 * q * width;
    store_acts<T, W>(act + pairs[q] * ip, it.begin, gates, gates + width, width);
  }
}

// Pass B for the pairs [0, n) of one item, dense rows: y[p][d] = weighted down-projection outputs, d in [begin, end).
template <typename T, typename W>
HEBRUS_INLINE void down_item(const W& down, const Item& it, const int64_t* pairs, int64_t n, const float* act,
                             int64_t ip, const float* w, bool round_product, float* y, int64_t hidden) {
  if (n < kPairTile) {
    // Fewer pairs than a tile: each pair alone over four outputs at a time (as gate_up_item: four weight rows
    // streaming at once; the same dot products, so the same bits).
    for (int64_t q = 0; q < n; ++q) {
      const float* xs[1] = {act + pairs[q] * ip};
      int64_t d = it.begin;
      for (; d + 4 <= it.end; d += 4) {
        const int64_t wrows[4] = {d, d + 1, d + 2, d + 3};
        float out[1][4];
        tile_dots<1, 4, W, kFewPairsPrefetchBytes>(down, it.expert, wrows, xs, out);
        for (int64_t o = 0; o < 4; ++o) store_weighted<T>(y, hidden, pairs[q], d + o, out[0][o], w, round_product);
      }
      for (; d < it.end; ++d) {
        const int64_t wrows[1] = {d};
        float out[1][1];
        tile_dots<1, 1>(down, it.expert, wrows, xs, out);
        store_weighted<T>(y, hidden, pairs[q], d, out[0][0], w, round_product);
      }
    }
    return;
  }
  for (int64_t d = it.begin; d < it.end; ++d) {
    const int64_t wrows[1] = {d};
    int64_t q = 0;
    for (; q + kPairTile <= n; q += kPairTile) {
      const float* xs[kPairTile];
      for (int64_t r = 0; r < kPairTile; ++r) xs[r] = act + pairs[q + r] * ip;
      float out[kPairTile][1];
      tile_dots<kPairTile, 1>(down, it.expert, wrows, xs, out);
      for (int64_t r = 0; r < kPairTile; ++r) store_weighted<T>(y, hidden, pairs[q + r], d, out[r][0], w, round_product);
    }
    for (; q < n; ++q) {
      const float* xs[1] = {act + pairs[q] * ip};
      float out[1][1];
      tile_dots<1, 1>(down, it.expert, wrows, xs, out);
      store_weighted<T>(y, hidden, pairs[q], d, out[0][0], w, round_product);
    }
  }
}

template <typename T, typename W>
HEBRUS_TEMPLATE_VECTOR_CLONES void gate_up_items(const W& gate_up, const std::vector<Item>& items, const ExpertGroups& g,
                                                 int64_t begin, int64_t end, const float* xf, int64_t hp,
                                                 int64_t top_k, int64_t inter, float* act, int64_t ip) {
  for (int64_t i = begin; i < end; ++i) {
    const Item& it = items[i];
    const int64_t s = g.start[it.expert], n = g.start[it.expert + 1] - s;
    gate_up_item<T>(gate_up, it, g.order.data() + s, n, xf, hp, top_k, inter, act, ip);
  }
}

template <typename T, typename W>
HEBRUS_TEMPLATE_VECTOR_CLONES void down_items(const W& down, const std::vector<Item>& items, const ExpertGroups& g,
                                              int64_t begin, int64_t end, const float* act, int64_t ip, const float* w,
                                              bool round_product, float* y, int64_t hidden) {
  for (int64_t i = begin; i < end; ++i) {
    const Item& it = items[i];
    const int64_t s = g.start[it.expert], n = g.start[it.expert + 1] - s;
    down_item<T>(down, it, g.order.data() + s, n, act, ip, w, round_product, y, hidden);
  }
}

// An item's pairs (pairs[0 .. n), each p = t * k + j) with their rows of x (or act) and group lane sums gathered
// into sc for the quantized kernel, and sc's room for the widened scales and biases of param_rows weight rows and
// for a tile's codes widened (codes_cols columns a row).
struct ItemPairs {
  const int64_t* pairs;
  int64_t n;
};

HEBRUS_INLINE ItemPairs start_item(QuantScratch& sc, const ExpertGroups& g, const Item& it, int64_t divisor,
                                   const float* rows, int64_t stride, const float* sums, int64_t sums_stride,
                                   int64_t param_rows, int64_t groups, int64_t codes_cols) {
  const int64_t s = g.start[it.expert], n = g.start[it.expert + 1] - s;
  const int64_t* pairs = g.order.data() + s;
  sc.x.resize(n);
  sc.xsums.resize(n);
  for (int64_t q = 0; q < n; ++q) {
    sc.x[q] = rows + (pairs[q] / divisor) * stride;
    sc.xsums[q] = sums + (pairs[q] / divisor) * sums_stride;
  }
  sc.out.resize(n * kTileRows);
  if (n > 1) sc.codes.resize(kTileRows * codes_cols);  // only a batch widens codes
  sc.scales.resize(param_rows * groups);
  sc.biases.resize(param_rows * groups);
  return {pairs, n};
}

// Pass A over quantized rows: each tile is the gate and up rows of two intermediates, i and i + 1; the item's dot
// products go to a scratch block, then its activations run per pair (store_acts). Cloned per vector ISA for the
// activations' silu: its fused multiply-adds are instructions there, calls to libm's fmaf in the baseline target
// (the same bits; the calls were ~3% of a 1-row 4-bit call).
template <typename T, int BITS>
HEBRUS_TEMPLATE_VECTOR_CLONES void quant_gate_up_items(const QuantRows<T, BITS>& w, const std::vector<Item>& items, const ExpertGroups& g,
                         int64_t begin, int64_t end, const float* xf, int64_t hp, const float* xsums, int64_t gsp,
                         int64_t top_k, int64_t inter, float* act, int64_t ip, QuantTileKernel kernel) {
  using W = QuantRows<T, BITS>;
  QuantScratch& sc = thread_scratch();
  const int64_t groups = w.groups(), chunks = (int64_t{1} << w.group_shift) / kLanes;
  for (int64_t k = begin; k < end; ++k) {
    const Item& it = items[k];
    const int64_t count = it.end - it.begin;
    const auto [pairs, n] = start_item(sc, g, it, top_k, xf, hp, xsums, gsp, 2 * count, groups, w.cols);
    sc.dots.resize(static_cast<size_t>(2 * n * count));
    float* dots = sc.dots.data();  // pair q: gates at dots[2 q count + j], ups at dots[(2 q + 1) count + j]
    w.widen_params(it.expert, it.begin, count, sc.scales.data(), sc.biases.data());
    w.widen_params(it.expert, inter + it.begin, count, sc.scales.data() + count * groups,
                   sc.biases.data() + count * groups);
    for (int64_t i = it.begin; i < it.end; i += 2) {
      const int64_t pair_end = std::min(i + 2, it.end);
      QuantTile tile;
      for (int o = 0; o < kTileRows; ++o) {
        const int64_t r = std::min(i + o / 2, pair_end - 1), up = o % 2;  // a lone i is read twice
        tile.codes[o] = w.row_codes(it.expert, up * inter + r);
        tile.scales[o] = sc.scales.data() + (up * count + r - it.begin) * groups;
        tile.biases[o] = sc.biases.data() + (up * count + r - it.begin) * groups;
      }
      kernel(tile, sc.x.data(), sc.xsums.data(), n, groups, chunks, sc.out.data(), sc.codes.data());
      for (int64_t q = 0; q < n; ++q) {
        const float* o = sc.out.data() + q * kTileRows;
        for (int64_t r = i; r < pair_end; ++r) {
          dots[2 * q * count + (r - it.begin)] = o[2 * (r - i)];
          dots[(2 * q + 1) * count + (r - it.begin)] = o[2 * (r - i) + 1];
        }
      }
    }
    for (int64_t q = 0; q < n; ++q) {
      const float* gates = dots + 2 * q * count;
      store_acts<T, W>(act + pairs[q] * ip, it.begin, gates, gates + count, count);
    }
  }
}

// Pass B over quantized rows: tiles of kTileRows consecutive down rows.
template <typename T, int BITS>
void quant_down_items(const QuantRows<T, BITS>& down, const std::vector<Item>& items, const ExpertGroups& g,
                      int64_t begin, int64_t end, const float* act, int64_t ip, const float* asums, int64_t gsi,
                      const float* w, bool round_product, float* y, int64_t hidden, QuantTileKernel kernel) {
  QuantScratch& sc = thread_scratch();
  const int64_t groups = down.groups(), chunks = (int64_t{1} << down.group_shift) / kLanes;
  for (int64_t k = begin; k < end; ++k) {
    const Item& it = items[k];
    const int64_t count = it.end - it.begin;
    const auto [pairs, n] = start_item(sc, g, it, 1, act, ip, asums, gsi, count, groups, down.cols);
    down.widen_params(it.expert, it.begin, count, sc.scales.data(), sc.biases.data());
    for (int64_t d = it.begin; d < it.end; d += kTileRows) {
      const int64_t tile_end = std::min(d + kTileRows, it.end);
      QuantTile tile;
      for (int o = 0; o < kTileRows; ++o) {
        const int64_t r = std::min(d + o, tile_end - 1);  // a short tile repeats its last row
        tile.codes[o] = down.row_codes(it.expert, r);
        tile.scales[o] = sc.scales.data() + (r - it.begin) * groups;
        tile.biases[o] = sc.biases.data() + (r - it.begin) * groups;
      }
      kernel(tile, sc.x.data(), sc.xsums.data(), n, groups, chunks, sc.out.data(), sc.codes.data());
      for (int64_t q = 0; q < n; ++q)
        for (int64_t r = d; r < tile_end; ++r)
          store_weighted<T>(y, hidden, pairs[q], r, sc.out[q * kTileRows + (r - d)], w, round_product);
    }
  }
}

// Group lane sums of `count` rows of `cols` values (stride `stride`) into sums (`cols / group * kLanes` a row).
inline void row_group_sums(int group_shift, const float* rows, int64_t count, int64_t cols, int64_t stride,
                           std::vector<float>& sums) {
  const int64_t per_row = (cols >> group_shift) * kLanes;
  sums.resize(count * per_row);
  claim_parallel_for(count, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) group_lane_sums(rows + r * stride, cols, group_shift, sums.data() + r * per_row);
  });
}

// The three passes over rows [t0, t1), with the expert matrices read through GU and DN (dense or
// quantized rows, both of one kind: the activations are stored in the order DN reads them, GU::place).
template <typename T, typename GU, typename DN>
void run_chunk(const Problem<T>& pr, const GU& gate_up, const DN& down, int64_t t0, int64_t t1, std::vector<float>& xf,
               std::vector<float>& act, std::vector<float>& y) {
  static_assert(std::is_same_v<GU, DN>, "gate_up and down rows of one kind");
  const int64_t k = pr.top_k, H = pr.hidden, I = pr.inter;
  const int64_t hp = round_up(H, kLanes), ip = round_up(I, kLanes);
  const int64_t rows = t1 - t0, pairs = rows * k;
  xf.assign(rows * hp, 0.f);
  act.assign(pairs * ip, 0.f);
  y.resize(pairs * H);
  claim_parallel_for(rows, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t d = 0; d < H; ++d) xf[r * hp + GU::place(d)] = static_cast<float>(pr.x[(t0 + r) * H + d]);
  });
  const ExpertGroups g = group_pairs(pr.ids + t0 * k, pairs, pr.experts);
  const float* w = pr.weights + t0 * k;
  const std::vector<Item> a_items = items_of(g.hit, I, kInterBlock);
  const std::vector<Item> b_items = items_of(g.hit, H, kHiddenBlock);
  const int64_t a_count = static_cast<int64_t>(a_items.size()), b_count = static_cast<int64_t>(b_items.size());
  if constexpr (GU::kQuantized) {
    const QuantTileKernel kernel = quant_tile_kernel<GU::kBits>();
    std::vector<float> xsums, asums;
    row_group_sums(gate_up.group_shift, xf.data(), rows, H, hp, xsums);
    const int64_t gsp = (H >> gate_up.group_shift) * kLanes, gsi = (I >> down.group_shift) * kLanes;
    claim_parallel_for(a_count, 1, [&](int64_t b, int64_t e) {
      quant_gate_up_items(gate_up, a_items, g, b, e, xf.data(), hp, xsums.data(), gsp, k, I, act.data(), ip, kernel);
    });
    row_group_sums(down.group_shift, act.data(), pairs, I, ip, asums);
    claim_parallel_for(b_count, 1, [&](int64_t b, int64_t e) {
      quant_down_items(down, b_items, g, b, e, act.data(), ip, asums.data(), gsi, w, pr.round_product, y.data(), H,
                       kernel);
    });
  } else {
    claim_parallel_for(a_count, 1, [&](int64_t b, int64_t e) {
      gate_up_items<T>(gate_up, a_items, g, b, e, xf.data(), hp, k, I, act.data(), ip);
    });
    claim_parallel_for(b_count, 1, [&](int64_t b, int64_t e) {
      down_items<T>(down, b_items, g, b, e, act.data(), ip, w, pr.round_product, y.data(), H);
    });
  }
  claim_parallel_for(rows, kRowGrain, [&](int64_t b, int64_t e) {
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
  Tensor ids = as_dtype(topk_ids, at::kLong).contiguous();
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
  Tensor out = empty_on_cpu({sz.rows, sz.hidden}, x.options());
  if (sz.rows == 0 || sz.hidden == 0) return out;
  if (sz.top_k == 0) return out.zero_();
  const Tensor ids = checked_ids(op, topk_ids, sz.experts);
  const Tensor wts = as_dtype(topk_weights, at::kFloat).contiguous();
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
  Tensor out = empty_on_cpu({sz.rows, sz.hidden}, x.options());
  if (sz.rows == 0 || sz.hidden == 0) return out;
  if (sz.top_k == 0) return out.zero_();
  const Tensor ids = checked_ids(op, topk_ids, sz.experts);
  const Tensor wts = as_dtype(topk_weights, at::kFloat).contiguous();
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

// hebrus::quantized_linear: out[t][o] = round(dot(W[o], x_t)) folded as the MoE kernel folds it (quant_tile_dots),
// so each output depends only on its own row of x, however many rows come with it: a tile of kTileRows weight rows
// reads each chunk of codes once for up to kTilePairs rows of x (the tile's codes then stay in L1 for the next rows).
// Work items are blocks of kLinearBlock outputs, their scales and biases widened once.
constexpr int64_t kLinearBlock = 64;  // outputs per work item

template <typename T, int BITS>
void linear_block(const QuantRows<T, BITS>& w, QuantTileKernel kernel, int64_t begin, int64_t end, const float* xf,
                  const float* xsums, int64_t rows, T* out, int64_t out_dim) {
  QuantScratch& sc = thread_scratch();
  const int64_t groups = w.groups(), chunks = (int64_t{1} << w.group_shift) / kLanes, count = end - begin;
  sc.x.resize(rows);
  sc.xsums.resize(rows);
  for (int64_t t = 0; t < rows; ++t) {
    sc.x[t] = xf + t * w.cols;
    sc.xsums[t] = xsums + t * groups * kLanes;
  }
  sc.out.resize(rows * kTileRows);
  if (rows > 1) sc.codes.resize(kTileRows * w.cols);  // only a batch widens codes
  sc.scales.resize(count * groups);
  sc.biases.resize(count * groups);
  w.widen_params(0, begin, count, sc.scales.data(), sc.biases.data());
  for (int64_t o0 = begin; o0 < end; o0 += kTileRows) {
    const int64_t tile_end = std::min(o0 + kTileRows, end);
    QuantTile tile;
    for (int o = 0; o < kTileRows; ++o) {
      const int64_t r = std::min(o0 + o, tile_end - 1);  // a short tile repeats its last row
      tile.codes[o] = w.row_codes(0, r);
      tile.scales[o] = sc.scales.data() + (r - begin) * groups;
      tile.biases[o] = sc.biases.data() + (r - begin) * groups;
    }
    kernel(tile, sc.x.data(), sc.xsums.data(), rows, groups, chunks, sc.out.data(), sc.codes.data());
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t o = o0; o < tile_end; ++o) out[t * out_dim + o] = static_cast<T>(sc.out[t * kTileRows + (o - o0)]);
  }
}

}  // namespace

// Outside the anonymous namespace: hc_premix_quantized's CPU kernel (hc_kernels.cpp) runs it as the module's
// QuantizedLinear does (cpu/quantized_linear.h).
Tensor quantized_linear_cpu(const Tensor& x, const Tensor& wq, const Tensor& scales, const Tensor& biases,
                            int64_t group_size, int64_t bits) {
  check_on_device("quantized_linear", at::kCPU, {{"x", &x}, {"wq", &wq}, {"scales", &scales}, {"biases", &biases}});
  const QuantLinearSizes sz = check_quantized_linear_args(x, wq, scales, biases, group_size, bits);
  Tensor out = empty_on_cpu({sz.rows, sz.out}, x.options());
  if (sz.rows == 0 || sz.out == 0) return out;
  if (sz.in == 0) return out.zero_();
  const Tensor xc = x.contiguous(), q = wq.contiguous(), sc = scales.contiguous(), bi = biases.contiguous();
  const uint32_t* codes = reinterpret_cast<const uint32_t*>(q.data_ptr<int32_t>());
  const int shift = group_size == 32 ? 5 : group_size == 64 ? 6 : 7;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (sz.in * int64_t{sizeof(float)}));
  auto run = [&](auto tag, auto bits_tag) {
    using T = decltype(tag);
    constexpr int B = decltype(bits_tag)::value;
    using W = QuantRows<T, B>;
    const W w{codes, sc.data_ptr<T>(), bi.data_ptr<T>(), sz.out, sz.in, shift};
    const QuantTileKernel kernel = quant_tile_kernel<B>();
    const T* xp = xc.data_ptr<T>();
    T* op = out.data_ptr<T>();
    std::vector<float> xf, xsums;
    for (int64_t t0 = 0; t0 < sz.rows; t0 += chunk) {
      const int64_t rows = std::min(sz.rows, t0 + chunk) - t0;
      xf.resize(rows * sz.in);
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t d = 0; d < sz.in; ++d) xf[t * sz.in + W::place(d)] = static_cast<float>(xp[(t0 + t) * sz.in + d]);
      row_group_sums(shift, xf.data(), rows, sz.in, sz.in, xsums);
      const int64_t blocks = (sz.out + kLinearBlock - 1) / kLinearBlock;
      claim_parallel_for(blocks, 1, [&](int64_t b, int64_t e) {
        for (int64_t blk = b; blk < e; ++blk)
          linear_block<T>(w, kernel, blk * kLinearBlock, std::min(sz.out, (blk + 1) * kLinearBlock), xf.data(),
                          xsums.data(), rows, op + t0 * sz.out, sz.out);
      });
    }
  };
  dispatch_quantized(x.scalar_type(), bits, run);
  return out;
}

namespace {

// at::topk(probs, k, -1) (largest, sorted) of fp32 probabilities [rows, E] where its answer is the only one: in every row
// the k largest are distinct and larger than every other, none NaN. Then the values and their order do not depend on
// how they are found, so a selection by insertion gives topk's bits without its dispatch and sort (several microseconds
// inside a step); where equal probabilities meet at or inside the top k (topk's own order among them), false.
bool top_k_by_hand(const Tensor& probs, int64_t k, Tensor& values, Tensor& ids) {
  if (probs.scalar_type() != at::kFloat || probs.dim() != 2 || !probs.is_contiguous() || k < 1 || k > 64 ||
      k > probs.size(1))
    return false;
  const int64_t rows = probs.size(0), n = probs.size(1);
  Tensor v = empty_on_cpu({rows, k}, probs.options());
  Tensor i = empty_on_cpu({rows, k}, probs.options().dtype(at::kLong));
  const float* p = probs.const_data_ptr<float>();
  float* vp = v.mutable_data_ptr<float>();
  int64_t* ip = i.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = p + r * n;
    float* top = vp + r * k;        // descending
    int64_t* at = ip + r * k;
    int64_t held = 0;
    float rest = -std::numeric_limits<float>::infinity();   // the largest value left out (n > k: one is)
    for (int64_t e = 0; e < n; ++e) {
      const float x = row[e];
      if (std::isnan(x)) return false;
      if (held == k && !(x > top[k - 1])) {
        rest = std::max(rest, x);
        continue;
      }
      if (held == k)
        rest = std::max(rest, top[k - 1]);
      else
        ++held;
      int64_t j = held - 1;
      for (; j > 0 && top[j - 1] < x; --j) {
        top[j] = top[j - 1];
        at[j] = at[j - 1];
      }
      top[j] = x;
      at[j] = e;
    }
    for (int64_t j = 1; j < k; ++j)
      if (!(top[j - 1] > top[j])) return false;         // equal probabilities inside the top k
    if (n > k && !(top[k - 1] > rest)) return false;     // or at its edge
  }
  values = v;
  ids = i;
  return true;
}

// values.div_(sums) for topk's fp32 values [rows, k] by their row sums [rows, 1], as one loop: a division is correctly
// rounded in ATen's vector body and scalar tail alike, so these are its bits, without its dispatch (several
// microseconds inside a step). Another layout takes ATen's.
void divide_rows_by(Tensor& values, const Tensor& sums) {
  if (values.scalar_type() != at::kFloat || sums.scalar_type() != at::kFloat || values.dim() != 2 ||
      !values.is_contiguous() || !sums.is_contiguous() || sums.numel() != values.size(0)) {
    values = values.div(sums);
    return;
  }
  const int64_t rows = values.size(0), k = values.size(1);
  float* v = values.mutable_data_ptr<float>();
  const float* s = sums.const_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k; ++j) v[r * k + j] /= s[r];
}

// hebrus::moe_route (issue 37): transformers' Qwen4ExpTextTopKRouter after its linear as the module's own ATen
// sequence (softmax in fp32, torch.topk with its order among equal probabilities, the renormalisation, the cast:
// the module's bits, each row on its own), and the shared expert's sigmoid gate in hebrus's own row arithmetic
// (row_math.h): ATen's sigmoid of a [T, 1] column gives a row other bits by where it falls in the vector body or
// tail, which made the gate a module call on CPU before.
std::tuple<Tensor, Tensor> moe_route_cpu(const Tensor& logits, const std::optional<Tensor>& shared, int64_t top_k,
                                         bool norm_topk_prob) {
  const Tensor* sh = shared.has_value() ? &*shared : nullptr;
  if (sh != nullptr) {
    check_on_device("moe_route", at::kCPU, {{"router_logits", &logits}, {"shared_gate_logits", sh}});
  } else {
    check_on_device("moe_route", at::kCPU, {{"router_logits", &logits}});
  }
  check_moe_route_args(logits, sh, top_k);
  // (softmax's dtype argument is a to() of the input before the kernel: float logits skip that dispatch, same bits)
  const Tensor probs =
      logits.scalar_type() == at::kFloat ? at::softmax(logits, -1) : at::softmax(logits, -1, at::kFloat);
  Tensor values, ids;
  if (!top_k_by_hand(probs, top_k, values, ids)) std::tie(values, ids) = at::topk(probs, top_k, -1);
  if (norm_topk_prob) divide_rows_by(values, values.sum(-1, /*keepdim=*/true));
  if (sh == nullptr) return {ids, as_dtype(values, logits.scalar_type())};
  const int64_t rows = logits.size(0), gates = sh->size(1), width = top_k + gates;
  Tensor weights = empty_on_cpu({rows, width}, logits.options());
  const Tensor vc = values.contiguous();      // (fp32: topk's values, or them renormalised)
  const Tensor sc = sh->contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "moe_route", [&] {
    scalar_t* wp = weights.data_ptr<scalar_t>();
    const float* vp = vc.const_data_ptr<float>();
    // weights[:, :top_k] = values in the logits' dtype: copy_'s conversion (round to nearest even), an element each
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < top_k; ++j) wp[r * width + j] = static_cast<scalar_t>(vp[r * top_k + j]);
    if (gates == 0) return;
    std::vector<float> g(static_cast<size_t>(gates));
    for (int64_t r = 0; r < rows; ++r) {
      widen_row(sc.data_ptr<scalar_t>() + r * gates, g.data(), gates);
      sigmoid_row(g.data(), gates);
      narrow_row(g.data(), wp + r * width + top_k, gates);
    }
  });
  return {ids, weights};
}

// The shared expert's elementwise parts, each row on its own (row_math.h's silu), rounding to the dtype where the
// modules' ops do: act = silu(g) * u in place of g, and out = routed + gate * d.
template <typename T>
void silu_mul_rows(T* g, const T* u, int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(static_cast<size_t>(dim));
    for (int64_t r = r0; r < r1; ++r) {
      widen_row(g + r * dim, row.data(), dim);
      silu_row(row.data(), dim);
      for (int64_t i = 0; i < dim; ++i) {
        const float act = static_cast<float>(static_cast<T>(row[i]));
        g[r * dim + i] = static_cast<T>(act * static_cast<float>(u[r * dim + i]));
      }
    }
  });
}

template <typename T>
void gated_add_rows(const T* routed, const T* gate, const T* d, T* out, int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float w = static_cast<float>(gate[r]);
      for (int64_t i = 0; i < dim; ++i)
        out[r * dim + i] = static_cast<T>(static_cast<float>(routed[r * dim + i]) +
                                          static_cast<float>(static_cast<T>(w * static_cast<float>(d[r * dim + i]))));
    }
  });
}

// routed + gate * down(silu(gate_proj(x)) * up_proj(x)), the projections `project(input, which)` (0: gate_proj,
// 1: up_proj, 2: down_proj), the rest as above.
template <typename Project>
Tensor shared_expert_rows(const Tensor& x, const Tensor& routed, const Tensor& gate, Project project) {
  Tensor act = project(x, 0).contiguous();
  const Tensor up = project(x, 1).contiguous();
  const int64_t rows = x.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_shared_expert", [&] {
    silu_mul_rows<scalar_t>(act.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), rows, act.size(1));
  });
  const Tensor d = project(act, 2).contiguous();
  const Tensor rc = routed.contiguous(), gc = gate.contiguous();
  Tensor out = empty_on_cpu({rows, d.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_shared_expert", [&] {
    gated_add_rows<scalar_t>(rc.data_ptr<scalar_t>(), gc.data_ptr<scalar_t>(), d.data_ptr<scalar_t>(),
                             out.data_ptr<scalar_t>(), rows, d.size(1));
  });
  return out;
}

// hebrus::moe_shared_expert (issue 37): transformers' Qwen4ExpTextMLP (the shared expert) times its sigmoid gate,
// added to the routed experts' output: the projections ATen's mm, the rest shared_expert_rows.
Tensor moe_shared_expert_cpu(const Tensor& x, const Tensor& routed, const Tensor& gate_proj, const Tensor& up_proj,
                             const Tensor& down_proj, const Tensor& gate) {
  check_on_device("moe_shared_expert", at::kCPU,
                  {{"x", &x}, {"routed", &routed}, {"gate_proj", &gate_proj}, {"up_proj", &up_proj},
                   {"down_proj", &down_proj}, {"gate", &gate}});
  check_moe_shared_expert_args(x, routed, gate_proj, up_proj, down_proj, gate);
  const Tensor* weights[3] = {&gate_proj, &up_proj, &down_proj};
  return shared_expert_rows(x, routed, gate,
                            [&](const Tensor& in, int which) { return dense_mm(in, *weights[which]); });
}

// hebrus::moe_shared_expert_quantized (issue 37): moe_shared_expert over a shared expert whose projections are
// QuantizedLinear modules: each projection hebrus::quantized_linear's CPU kernel, the rest shared_expert_rows.
Tensor moe_shared_expert_quantized_cpu(const Tensor& x, const Tensor& routed, const Tensor& gate_proj_q,
                                       const Tensor& gate_proj_scales, const Tensor& gate_proj_biases,
                                       const Tensor& up_proj_q, const Tensor& up_proj_scales,
                                       const Tensor& up_proj_biases, const Tensor& down_proj_q,
                                       const Tensor& down_proj_scales, const Tensor& down_proj_biases,
                                       const Tensor& gate, int64_t group_size, int64_t bits) {
  check_on_device("moe_shared_expert_quantized", at::kCPU,
                  {{"x", &x}, {"routed", &routed}, {"gate_proj_q", &gate_proj_q},
                   {"gate_proj_scales", &gate_proj_scales}, {"gate_proj_biases", &gate_proj_biases},
                   {"up_proj_q", &up_proj_q}, {"up_proj_scales", &up_proj_scales}, {"up_proj_biases", &up_proj_biases},
                   {"down_proj_q", &down_proj_q}, {"down_proj_scales", &down_proj_scales},
                   {"down_proj_biases", &down_proj_biases}, {"gate", &gate}});
  check_moe_shared_expert_quantized_args(x, routed, gate_proj_q, gate_proj_scales, gate_proj_biases, up_proj_q,
                                         up_proj_scales, up_proj_biases, down_proj_q, down_proj_scales,
                                         down_proj_biases, gate, group_size, bits);
  const Tensor* q[3][3] = {{&gate_proj_q, &gate_proj_scales, &gate_proj_biases},
                           {&up_proj_q, &up_proj_scales, &up_proj_biases},
                           {&down_proj_q, &down_proj_scales, &down_proj_biases}};
  return shared_expert_rows(x, routed, gate, [&](const Tensor& in, int which) {
    return quantized_linear_cpu(in, *q[which][0], *q[which][1], *q[which][2], group_size, bits);
  });
}

}  // namespace
}  // namespace hebrus


TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("moe_experts", &hebrus::moe_experts_cpu);
  m.impl("moe_experts_quantized", &hebrus::moe_experts_quantized_cpu);
  m.impl("quantized_linear", &hebrus::quantized_linear_cpu);
  m.impl("moe_route", &hebrus::moe_route_cpu);
  m.impl("moe_shared_expert", &hebrus::moe_shared_expert_cpu);
  m.impl("moe_shared_expert_quantized", &hebrus::moe_shared_expert_quantized_cpu);
}
