// CPU kernels of hebrus::qsa_pool and hebrus::qsa_select (SPEC §3). The executable spec is
// hebrus_torch/reference.py; pooling follows its arithmetic step by step (fp32 accumulation, casts to
// the key dtype where transformers casts), selection computes fp32 scores in the fixed order of
// cpu/hebrus_simd.h, and both mirror the messages of _validate.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/hebrus_simd.h"
#include "cpu/undispatched.h"
#include "cpu/row_math.h"
#include "hebrus_params.h"
#include "hebrus_check.h"
#include "op_checks.h"
#include "qsa_fused_checks.h"

namespace hebrus {
namespace {

// Limits of the CPU kernels (checked with clear errors): per-thread scratch is sized by them
// (written once, in mps_kernels/hebrus_params.h).
constexpr int64_t kMaxHeadDim = HEBRUS_CPU_MAX_HEAD_DIM;
constexpr int64_t kMaxQueryHeads = HEBRUS_CPU_MAX_QUERY_HEADS;
constexpr int64_t kMaxTopK = HEBRUS_CPU_MAX_TOP_K;
constexpr int64_t kGroupTile = 64;         // pooled keys per tile, reused across a block of queries
constexpr int64_t kQueryBlockBytes = 64 * 1024;
constexpr int64_t kMaxQueryBlock = 32;
constexpr int64_t kMinSplitGroups = 1024;  // smallest group range worth its own task when splitting

inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// Rounds an fp32 value to T and back: what a tensor op whose result has dtype T stores.
template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }
template <>
inline float round_to<float>(float v) { return v; }

// ---------------------------------------------------------------------------------------------
// qsa_pool
// ---------------------------------------------------------------------------------------------

// Sum of x[d]^2 in the order of ATen's CPU cascade sum over one contiguous row of fp32 (8-float
// vectors, four partial vectors, scalar tail first, then the lanes), so on x86 builds fp32 pooled
// keys equal the reference's and transformers' bit for bit; elsewhere they differ by rounding only.
inline float sum_squares(const float* x, int64_t dim) {
  constexpr int64_t V = 8;
  float sq[kMaxHeadDim];
  for (int64_t d = 0; d < dim; ++d) sq[d] = x[d] * x[d];
  if (dim < V) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const int64_t n = dim / 4;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < 4; ++k) acc[k] += sq[4 * i + k];
    for (int64_t j = 4 * n; j < dim; ++j) acc[0] += sq[j];
    return ((acc[0] + acc[1]) + acc[2]) + acc[3];
  }
  const int64_t nvec = dim / V;
  const int64_t n = nvec / 4;
  float acc[4][V] = {};
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < 4; ++k)
      for (int64_t l = 0; l < V; ++l) acc[k][l] += sq[(4 * i + k) * V + l];
  for (int64_t i = 4 * n; i < nvec; ++i)
    for (int64_t l = 0; l < V; ++l) acc[0][l] += sq[i * V + l];
  for (int64_t k = 1; k < 4; ++k)
    for (int64_t l = 0; l < V; ++l) acc[0][l] += acc[k][l];
  float total = 0.f;
  for (int64_t j = nvec * V; j < dim; ++j) total += sq[j];
  for (int64_t l = 0; l < V; ++l) total += acc[0][l];
  return total;
}

template <typename T>
void pool_kernel(const T* keys, int64_t dim, const int32_t* group_cells, int64_t groups, int64_t r,
                 const float* w_plus_one, float eps, const float* cos_f, const float* sin_f, int64_t half, T* out) {
  const float r_f = static_cast<float>(r);
  const float dim_f = static_cast<float>(dim);
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    float x[kMaxHeadDim];
    for (int64_t g = begin; g < end; ++g) {
      const int32_t* cells = group_cells + g * r;
      // mean_fp32 of the r raw keys: sum in member order, then divide (torch's CPU mean), cast to T.
      for (int64_t d = 0; d < dim; ++d) x[d] = 0.f;
      for (int64_t i = 0; i < r; ++i) {
        const T* k = keys + static_cast<int64_t>(cells[i]) * dim;
        for (int64_t d = 0; d < dim; ++d) x[d] += to_float(k[d]);
      }
      for (int64_t d = 0; d < dim; ++d) x[d] = round_to<T>(x[d] / r_f);
      // RMSNorm in fp32 with (1 + w), cast to T.
      const float inv = 1.f / std::sqrt(sum_squares(x, dim) / dim_f + eps);
      for (int64_t e = 0; e < dim; ++e) x[e] = round_to<T>((x[e] * inv) * w_plus_one[e]);
      // RoPE rotate-half on the first 2*half dims at the group's first position; every product
      // and the sum are rounded to T, as transformers' apply_rotary_pos_emb does on T tensors.
      T* o = out + g * dim;
      const float* cg = cos_f + g * half;
      const float* sg = sin_f + g * half;
      for (int64_t j = 0; j < half; ++j) {
        const float c = round_to<T>(cg[j]);
        const float s = round_to<T>(sg[j]);
        const float x1 = x[j];
        const float x2 = x[j + half];
        o[j] = static_cast<T>(round_to<T>(x1 * c) + round_to<T>(-x2 * s));
        o[j + half] = static_cast<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
      }
      for (int64_t e = 2 * half; e < dim; ++e) o[e] = static_cast<T>(x[e]);
    }
  });
}

// Lowest flat index in [0, n) for which bad(i) holds, or n.
template <typename F>
int64_t first_bad(int64_t n, F bad) {
  return at::parallel_reduce(
      0, n, 4096, n,
      [&](int64_t begin, int64_t end, int64_t found) {
        for (int64_t i = begin; i < end && i < found; ++i)
          if (bad(i)) return i;
        return found;
      },
      [](int64_t a, int64_t b) { return std::min(a, b); });
}

at::Tensor qsa_pool_cpu(const at::Tensor& keys_in, const at::Tensor& cell_pos_in, const at::Tensor& group_cells_in,
                        const at::Tensor& group_pos_in, const at::Tensor& norm_weight, double eps,
                        const at::Tensor& inv_freq_in) {
  const char* op = "qsa_pool";
  check_on_device(op, at::kCPU,
                  {{"keys", &keys_in}, {"cell_pos", &cell_pos_in}, {"group_cells", &group_cells_in},
                   {"group_pos", &group_pos_in}, {"norm_weight", &norm_weight}, {"inv_freq", &inv_freq_in}});
  const QsaPoolSizes sz =
      check_qsa_pool_args(keys_in, cell_pos_in, group_cells_in, group_pos_in, norm_weight, eps, inv_freq_in);
  const int64_t cells = sz.cells, dim = sz.dim, groups = sz.groups, r = sz.r, half = sz.half;
  HEBRUS_CHECK(dim <= kMaxHeadDim, HebrusError, "hebrus::qsa_pool: head dim D must be at most ", kMaxHeadDim,
               " on CPU, got ", dim);

  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor cell_pos = cell_pos_in.contiguous();
  const at::Tensor group_cells = group_cells_in.contiguous();
  const at::Tensor group_pos = group_pos_in.contiguous();
  const int32_t* gc = group_cells.data_ptr<int32_t>();
  const int64_t* cp = cell_pos.data_ptr<int64_t>();
  const int64_t* gp = group_pos.data_ptr<int64_t>();

  // Every group is checked before anything is computed: a failing call publishes nothing.
  const int64_t members = groups * r;
  const int64_t out_of_range = first_bad(members, [&](int64_t i) { return gc[i] < 0 || gc[i] >= cells; });
  if (out_of_range < members) {
    HEBRUS_CHECK(false, HebrusError, "hebrus::qsa_pool: group ", out_of_range / r, " cell ", out_of_range % r, " = ",
                 gc[out_of_range], " is outside [0, ", cells, ")");
  }
  auto required = [&](int64_t i) {  // wraps like the int64 tensor add of the reference
    return static_cast<int64_t>(static_cast<uint64_t>(gp[i / r]) + static_cast<uint64_t>(i % r));
  };
  const int64_t hole = first_bad(members, [&](int64_t i) { return cp[gc[i]] != required(i); });
  if (hole < members) {
    HEBRUS_CHECK(false, HoleError, "hebrus::qsa_pool: group ", hole / r, " starting at position ", gp[hole / r],
                 " has position ", cp[gc[hole]], " in member ", hole % r, " where ", required(hole),
                 " is required (a hole inside the run is not padding)");
  }

  at::Tensor out = empty_on_cpu({groups, dim}, keys.options());
  if (groups == 0 || dim == 0) return out;
  // cos/sin through ATen's own elementwise kernels, so they equal the reference's (and the
  // model's rotary embedding) bit for bit; positions are converted to fp32 first, as there.
  const at::Tensor inv_freq = inv_freq_in.contiguous();
  const at::Tensor freqs = (group_pos.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0)).contiguous();
  const at::Tensor cos_f = freqs.cos().contiguous();
  const at::Tensor sin_f = freqs.sin().contiguous();
  const at::Tensor w_plus_one = (norm_weight.to(at::kFloat) + 1.0).contiguous();
  const float eps_f = static_cast<float>(eps);

  switch (keys.scalar_type()) {
    case at::kFloat:
      pool_kernel<float>(keys.data_ptr<float>(), dim, gc, groups, r, w_plus_one.data_ptr<float>(), eps_f,
                         cos_f.data_ptr<float>(), sin_f.data_ptr<float>(), half, out.data_ptr<float>());
      break;
    case at::kHalf:
      pool_kernel<c10::Half>(keys.data_ptr<c10::Half>(), dim, gc, groups, r, w_plus_one.data_ptr<float>(), eps_f,
                             cos_f.data_ptr<float>(), sin_f.data_ptr<float>(), half, out.data_ptr<c10::Half>());
      break;
    case at::kBFloat16:
      pool_kernel<c10::BFloat16>(keys.data_ptr<c10::BFloat16>(), dim, gc, groups, r, w_plus_one.data_ptr<float>(),
                                 eps_f, cos_f.data_ptr<float>(), sin_f.data_ptr<float>(), half,
                                 out.data_ptr<c10::BFloat16>());
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "hebrus::qsa_pool: unreachable dtype");
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// qsa_select
// ---------------------------------------------------------------------------------------------

// A candidate as one integer whose order is the selection order: NaN first (torch's sort and topk
// rank NaN above every number), then higher score, then lower group index. Group indices are
// unique, so no two candidates compare equal; -0 is folded into +0 so that they tie.
inline uint64_t candidate_key(float score, int32_t group) {
  uint32_t bits;
  if (std::isnan(score)) {
    bits = 0xFFFFFFFFu;
  } else {
    const float s = score == 0.f ? 0.f : score;
    std::memcpy(&bits, &s, sizeof(bits));
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  }
  return (static_cast<uint64_t>(bits) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(group));
}

inline int32_t candidate_group(uint64_t key) {
  return static_cast<int32_t>(~static_cast<uint32_t>(key & 0xFFFFFFFFu));
}

// Bounded selection of the best k candidates: entries above the current floor are buffered (room
// for 2k); a full buffer is cut back to its best k with nth_element (O(k) on average), which
// raises the floor to the k-th best. A cut follows at least k accepted entries, so a query costs
// O(G) on average with no sort of its G scores. Exact: keys are unique, so the kept set is the
// top k of the strict order whatever the order of arrival (tiles, splits, merges).
struct TopK {
  uint64_t* buf;  // room for 2k keys
  int64_t size;
  int64_t k;
  uint64_t floor;  // every key ever pushed that is <= floor is outside the top k (0: none yet)
  float floor_score = -std::numeric_limits<float>::infinity();  // a score below it has a key below floor

  inline void push(uint64_t key) {
    if (key <= floor) return;
    buf[size++] = key;
    if (size == 2 * k) cut();
  }

  // push(candidate_key(score, group)), skipping the key for the common case of a score that is
  // already out (NaN and -0 / +0 compare false here and take the exact path).
  inline void push_score(float score, int32_t group) {
    if (score < floor_score) return;
    push(candidate_key(score, group));
  }

  void cut() {
    if (size <= k) return;
    std::nth_element(buf, buf + (k - 1), buf + size, std::greater<uint64_t>());
    floor = buf[k - 1];
    size = k;
    const uint32_t bits = static_cast<uint32_t>(floor >> 32);
    if (bits == 0xFFFFFFFFu) {
      floor_score = std::numeric_limits<float>::infinity();  // the floor is a NaN: every number is out
    } else {
      const uint32_t raw = (bits & 0x80000000u) ? (bits & 0x7FFFFFFFu) : ~bits;
      std::memcpy(&floor_score, &raw, sizeof(raw));
    }
  }

  // Selected groups (all < n_groups) in ascending order, -1 padded to top_k. `bitmap` has
  // ceil(n_groups / 64) words, all zero, and is left all zero.
  void write(int32_t* out, int64_t top_k, int64_t n_groups, uint64_t* bitmap) {
    cut();
    for (int64_t i = 0; i < size; ++i) {
      const int32_t g = candidate_group(buf[i]);
      bitmap[g >> 6] |= uint64_t{1} << (g & 63);
    }
    int64_t n = 0;
    for (int64_t w = 0; w < (n_groups + 63) / 64; ++w) {
      uint64_t bits = bitmap[w];
      bitmap[w] = 0;
      while (bits) {
        out[n++] = static_cast<int32_t>(w * 64 + __builtin_ctzll(bits));
        bits &= bits - 1;
      }
    }
    std::fill(out + n, out + top_k, -1);
  }
};

// Vec values only live inside always_inline helpers of one clone; no ABI crosses them.
#pragma GCC diagnostic ignored "-Wpsabi"

// Dot products follow hebrus_simd.h's order (dims past D count as 0 * 0). Keys are read row by row
// in place: a decode step streams the pooled rows once, in order.

// Rows ahead of the one being scored that are prefetched (pooled rows of a sequence need not be
// adjacent, and adjacent ones cross a 4 KiB page every few rows, where hardware prefetch stops).
constexpr int64_t kPrefetchRows = 8;

HEBRUS_INLINE float relu(float d) { return d < 0.f ? 0.f : d; }  // keeps NaN, like torch.relu

// Sixteen key values from storage as fp32: fp32 as is, bf16 (raw bits) by a shift.
HEBRUS_INLINE Vec load_key(const float* p) { return load_vec(p); }
HEBRUS_INLINE Vec load_key(const uint16_t* p) { return load_bf16_vec(p); }

// Scores of one query (hq heads of dp fp32 values, dp a multiple of 16, zero past D) against the n
// keys krow[0..n) (dp values each, fp32 or bf16 bits, zero past D): out[g] = sum_h relu(q_h . k_g) /
// sqrt(D), heads added in order from 0. Four keys x four heads per pass: sixteen dot products share
// one lane reduction. krow[n .. ahead) are only prefetched.
template <typename K>
HEBRUS_INLINE void score_rows_t(const float* q, int64_t hq, int64_t dp, const K* const* krow, int64_t n, int64_t ahead,
                                float sqrt_d, float* out) {
  const Vec zero = {};
  for (int64_t g0 = 0; g0 < n; g0 += 4) {
    const int64_t ng = std::min<int64_t>(4, n - g0);
    for (int64_t i = g0 + kPrefetchRows; i < std::min(ahead, g0 + kPrefetchRows + 4); ++i) {
      const char* row = reinterpret_cast<const char*>(krow[i]);
      for (int64_t b = 0; b < dp * static_cast<int64_t>(sizeof(K)); b += 64) __builtin_prefetch(row + b);
    }
    const K* k[4];
    for (int64_t j = 0; j < 4; ++j) k[j] = krow[g0 + std::min<int64_t>(j, ng - 1)];
    float total[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t h0 = 0; h0 < hq; h0 += 4) {
      const int64_t nh = std::min<int64_t>(4, hq - h0);
      const float* qh[4];
      for (int64_t hh = 0; hh < 4; ++hh) qh[hh] = q + (h0 + std::min<int64_t>(hh, nh - 1)) * dp;
      Vec acc[kLanes];
      for (auto& a : acc) a = zero;
      for (int64_t c = 0; c < dp; c += kLanes) {
        const Vec k0 = load_key(k[0] + c), k1 = load_key(k[1] + c), k2 = load_key(k[2] + c), k3 = load_key(k[3] + c);
        for (int64_t hh = 0; hh < 4; ++hh) {
          const Vec qv = load_vec(qh[hh] + c);
          acc[hh] += qv * k0;
          acc[4 + hh] += qv * k1;
          acc[8 + hh] += qv * k2;
          acc[12 + hh] += qv * k3;
        }
      }
      const Vec dots = reduce_lanes16(acc);
      if (ng == 4 && nh == 4) {  // the common case, with fixed trip counts
        for (int64_t j = 0; j < 4; ++j)
          for (int64_t hh = 0; hh < 4; ++hh) total[j] += relu(dots[4 * j + hh]);
      } else {
        for (int64_t j = 0; j < ng; ++j)
          for (int64_t hh = 0; hh < nh; ++hh) total[j] += relu(dots[4 * j + hh]);
      }
    }
    for (int64_t j = 0; j < ng; ++j) out[g0 + j] = total[j] / sqrt_d;
  }
}

// score_rows_t for keys given as fp32 rows (bf16 == false) or bf16 rows.
HEBRUS_VECTOR_CLONES
void score_rows(const float* q, int64_t hq, int64_t dp, const void* const* krow, bool bf16, int64_t n, int64_t ahead,
                float sqrt_d, float* out) {
  if (bf16) {
    score_rows_t(q, hq, dp, reinterpret_cast<const uint16_t* const*>(krow), n, ahead, sqrt_d, out);
  } else {
    score_rows_t(q, hq, dp, reinterpret_cast<const float* const*>(krow), n, ahead, sqrt_d, out);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// score_rows_t on AVX2 CPUs, with the same arithmetic in the same order: a 16-lane vector is two ymm
// registers (hebrus_simd.h), and two keys x two heads per pass keep the accumulators in registers
// (the portable code's 4 x 4 vectors are 32 ymm registers: GCC spills them).
HEBRUS_AVX2 HEBRUS_INLINE __m256 load_key8(const float* p) { return _mm256_loadu_ps(p); }
HEBRUS_AVX2 HEBRUS_INLINE __m256 load_key8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename K>
HEBRUS_AVX2 HEBRUS_INLINE void score_rows_avx2_t(const float* q, int64_t hq, int64_t dp, const K* const* krow,
                                                 int64_t n, int64_t ahead, float sqrt_d, float* out) {
  for (int64_t g0 = 0; g0 < n; g0 += 2) {
    const int64_t ng = std::min<int64_t>(2, n - g0);
    for (int64_t i = g0 + kPrefetchRows; i < std::min(ahead, g0 + kPrefetchRows + 2); ++i) {
      const char* row = reinterpret_cast<const char*>(krow[i]);
      for (int64_t b = 0; b < dp * static_cast<int64_t>(sizeof(K)); b += 64) __builtin_prefetch(row + b);
    }
    const K* k[2] = {krow[g0], krow[g0 + ng - 1]};
    float total[2] = {0.f, 0.f};
    for (int64_t h0 = 0; h0 < hq; h0 += 2) {
      const int64_t nh = std::min<int64_t>(2, hq - h0);
      const float* qh[2] = {q + h0 * dp, q + (h0 + nh - 1) * dp};
      __m256 lo[4], hi[4];
      for (int i = 0; i < 4; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
      for (int64_t c = 0; c < dp; c += kLanes) {
        const __m256 k0l = load_key8(k[0] + c), k0h = load_key8(k[0] + c + 8);
        const __m256 k1l = load_key8(k[1] + c), k1h = load_key8(k[1] + c + 8);
        for (int hh = 0; hh < 2; ++hh) {
          const __m256 ql = _mm256_loadu_ps(qh[hh] + c), qhi = _mm256_loadu_ps(qh[hh] + c + 8);
          lo[hh] = _mm256_add_ps(lo[hh], _mm256_mul_ps(ql, k0l));
          hi[hh] = _mm256_add_ps(hi[hh], _mm256_mul_ps(qhi, k0h));
          lo[2 + hh] = _mm256_add_ps(lo[2 + hh], _mm256_mul_ps(ql, k1l));
          hi[2 + hh] = _mm256_add_ps(hi[2 + hh], _mm256_mul_ps(qhi, k1h));
        }
      }
      for (int64_t j = 0; j < ng; ++j)
        for (int64_t hh = 0; hh < nh; ++hh) total[j] += relu(reduce_lanes_avx2(lo[2 * j + hh], hi[2 * j + hh]));
    }
    for (int64_t j = 0; j < ng; ++j) out[g0 + j] = total[j] / sqrt_d;
  }
}

HEBRUS_AVX2 __attribute__((noinline)) void score_rows_avx2(const float* q, int64_t hq, int64_t dp,
                                                           const void* const* krow, bool bf16, int64_t n,
                                                           int64_t ahead, float sqrt_d, float* out) {
  if (bf16) {
    score_rows_avx2_t(q, hq, dp, reinterpret_cast<const uint16_t* const*>(krow), n, ahead, sqrt_d, out);
  } else {
    score_rows_avx2_t(q, hq, dp, reinterpret_cast<const float* const*>(krow), n, ahead, sqrt_d, out);
  }
}
#endif

// Rows widened to fp32 and zero-padded to dp, as score_rows reads them.
template <typename T>
void widen_rows(const T* src, int64_t rows, int64_t dim, int64_t dp, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * dim;
    float* d = dst + r * dp;
    for (int64_t e = 0; e < dim; ++e) d[e] = to_float(s[e]);
    for (int64_t e = dim; e < dp; ++e) d[e] = 0.f;
  }
}

// Query heads of query t as fp32 [hq, dp], zero past D.
void pack_query(const at::Tensor& q, int64_t t, int64_t hq, int64_t dim, int64_t dp, float* dst) {
  const int64_t offset = t * hq * dim;
  switch (q.scalar_type()) {
    case at::kFloat: widen_rows(q.data_ptr<float>() + offset, hq, dim, dp, dst); break;
    case at::kHalf: widen_rows(q.data_ptr<c10::Half>() + offset, hq, dim, dp, dst); break;
    case at::kBFloat16: widen_rows(q.data_ptr<c10::BFloat16>() + offset, hq, dim, dp, dst); break;
    default: TORCH_INTERNAL_ASSERT(false, "hebrus::qsa_select: unreachable dtype");
  }
}

// Whether score_rows reads the pooled rows in place (fp32 or bf16 rows of a multiple of 16 dims);
// otherwise they are widened into an fp32 tile first.
bool rows_in_place(const at::Tensor& pooled, int64_t dim, int64_t dp) {
  return dp == dim && (pooled.scalar_type() == at::kFloat || pooled.scalar_type() == at::kBFloat16);
}

// Row pointers of pooled rows rows[0..n) for score_rows, plus up to kPrefetchRows more of
// rows[n..ahead) as prefetch hints. Rows not read in place are widened into `tile` ([kGroupTile,
// dp] fp32); the hints then point at the tile, and only hint.
void tile_rows(const at::Tensor& pooled, const int32_t* rows, int64_t n, int64_t ahead, int64_t dim, int64_t dp,
               float* tile, const void** krow) {
  const int64_t hinted = std::min(ahead, n + kPrefetchRows);
  if (rows_in_place(pooled, dim, dp)) {
    const char* base = static_cast<const char*>(pooled.data_ptr());
    const int64_t row_bytes = dim * static_cast<int64_t>(pooled.element_size());
    for (int64_t g = 0; g < hinted; ++g) krow[g] = base + static_cast<int64_t>(rows[g]) * row_bytes;
    return;
  }
  for (int64_t g = 0; g < n; ++g) {
    const int64_t r = rows[g];
    switch (pooled.scalar_type()) {
      case at::kFloat: widen_rows(pooled.data_ptr<float>() + r * dim, 1, dim, dp, tile + g * dp); break;
      case at::kHalf: widen_rows(pooled.data_ptr<c10::Half>() + r * dim, 1, dim, dp, tile + g * dp); break;
      case at::kBFloat16: widen_rows(pooled.data_ptr<c10::BFloat16>() + r * dim, 1, dim, dp, tile + g * dp); break;
      default: TORCH_INTERNAL_ASSERT(false, "hebrus::qsa_select: unreachable dtype");
    }
    krow[g] = tile + g * dp;
  }
  for (int64_t g = n; g < hinted; ++g) krow[g] = tile;
}

// A block of queries of one sequence against the group range [g0, g1).
struct Item {
  int64_t row;
  int64_t first;      // into `heavy`
  int64_t count;
  int64_t g0;
  int64_t g1;
  int64_t splits;     // 1: writes the output; > 1: writes candidates to slots of the block
  int64_t split;
  int64_t slot_base;  // candidates of (query i, split s) live in slot slot_base + s * count + i
  int64_t cost;
};

// A query whose group range was split: merges its `splits` candidate slots.
struct Merge {
  int64_t t;
  int64_t slot;    // slot of split 0
  int64_t stride;  // slot distance between splits (the block's query count)
  int64_t splits;
};

at::Tensor qsa_select_cpu(const at::Tensor& q_in, const at::Tensor& pooled_in, const at::Tensor& seq_groups_in,
                          const at::Tensor& q_row_in, const at::Tensor& q_groups_in, int64_t top_k) {
  const char* op = "qsa_select";
  check_on_device(op, at::kCPU,
                  {{"q", &q_in}, {"pooled", &pooled_in}, {"seq_groups", &seq_groups_in}, {"q_row", &q_row_in},
                   {"q_groups", &q_groups_in}});
  const QsaSelectSizes sz = check_qsa_select_args(q_in, pooled_in, seq_groups_in, q_row_in, q_groups_in, top_k);
  const int64_t tq = sz.tq, hq = sz.hq, dim = sz.dim, rows = sz.rows, batch = sz.batch, max_g = sz.max_groups;
  HEBRUS_CHECK(top_k <= kMaxTopK, HebrusError, "hebrus::qsa_select: top_k must be at most ", kMaxTopK,
               " on CPU, got ", top_k);
  HEBRUS_CHECK(hq <= kMaxQueryHeads, HebrusError, "hebrus::qsa_select: query heads Hq must be at most ",
               kMaxQueryHeads, " on CPU, got ", hq);
  HEBRUS_CHECK(dim <= kMaxHeadDim, HebrusError, "hebrus::qsa_select: head dim D must be at most ", kMaxHeadDim,
               " on CPU, got ", dim);

  // (at::full's -1s, filled here: full is three dispatched ops)
  at::Tensor out = empty_on_cpu({tq, top_k}, q_in.options().dtype(at::kInt));
  std::fill_n(out.mutable_data_ptr<int32_t>(), tq * top_k, -1);
  if (tq == 0) return out;

  const at::Tensor q_row_t = q_row_in.contiguous();
  const at::Tensor q_groups_t = q_groups_in.contiguous();
  const at::Tensor seq_groups_t = seq_groups_in.contiguous();
  const int32_t* q_row = q_row_t.data_ptr<int32_t>();
  const int32_t* q_groups = q_groups_t.data_ptr<int32_t>();
  const int32_t* seq_groups = seq_groups_t.data_ptr<int32_t>();

  // Values are checked in the reference's order, all before any output is written.
  for (int64_t t = 0; t < tq; ++t) {
    HEBRUS_CHECK(q_row[t] >= 0 && q_row[t] < batch, HebrusError, "hebrus::qsa_select: q_row[", t, "] = ", q_row[t],
                 " is outside [0, B=", batch, ")");
  }
  for (int64_t t = 0; t < tq; ++t) {
    HEBRUS_CHECK(q_groups[t] >= 0 && q_groups[t] <= max_g, HebrusError, "hebrus::qsa_select: q_groups[", t, "] = ",
                 q_groups[t], " is outside [0, maxG=", max_g, "]");
  }
  std::vector<int64_t> needed(batch, 0);   // groups visible to the queries of each row
  std::vector<int64_t> n_heavy(batch, 0);  // queries that must rank: more visible groups than top_k
  for (int64_t t = 0; t < tq; ++t) {
    needed[q_row[t]] = std::max<int64_t>(needed[q_row[t]], q_groups[t]);
    if (q_groups[t] > top_k) ++n_heavy[q_row[t]];
  }
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* sg = seq_groups + b * max_g;
    for (int64_t g = 0; g < needed[b]; ++g) {
      HEBRUS_CHECK(sg[g] >= 0 && sg[g] < rows, HebrusError, "hebrus::qsa_select: seq_groups[", b, ", ", g, "] = ",
                   sg[g], " is outside [0, rows=", rows, "); the first ", needed[b], " groups of row ", b,
                   " are visible to its queries");
    }
  }

  int32_t* out_p = out.data_ptr<int32_t>();
  // A query that sees at most top_k groups selects all of them, whatever the scores.
  at::parallel_for(0, tq, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (q_groups[t] > top_k) continue;
      for (int32_t g = 0; g < q_groups[t]; ++g) out_p[t * top_k + g] = g;
    }
  });

  // Queries that rank, grouped by row, ascending t within a row.
  std::vector<int64_t> row_start(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) row_start[b + 1] = row_start[b] + n_heavy[b];
  const int64_t heavy_total = row_start[batch];
  if (heavy_total == 0) return out;
  std::vector<int64_t> heavy(heavy_total);
  {
    std::vector<int64_t> fill(row_start.begin(), row_start.end() - 1);
    for (int64_t t = 0; t < tq; ++t)
      if (q_groups[t] > top_k) heavy[fill[q_row[t]]++] = t;
  }

  const int64_t q_bytes = std::max<int64_t>(1, hq * dim) * static_cast<int64_t>(sizeof(float));
  const int64_t qb = std::clamp<int64_t>(kQueryBlockBytes / q_bytes, 1, kMaxQueryBlock);
  const int64_t num_threads = std::max(1, at::get_num_threads());

  // Work items: blocks of qb queries of one row, so that a tile of pooled keys is read once per
  // block. With fewer blocks than threads (decode), a single-block row is also split into group
  // ranges whose candidates are merged afterwards.
  int64_t n_blocks = 0;
  for (int64_t b = 0; b < batch; ++b) n_blocks += (n_heavy[b] + qb - 1) / qb;
  std::vector<Item> items;
  std::vector<Merge> merges;
  int64_t slots = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t first = row_start[b]; first < row_start[b + 1]; first += qb) {
      const int64_t count = std::min(qb, row_start[b + 1] - first);
      int64_t groups_seen = 0;
      for (int64_t i = 0; i < count; ++i) groups_seen = std::max<int64_t>(groups_seen, q_groups[heavy[first + i]]);
      int64_t splits = 1;
      if (n_blocks < num_threads && n_heavy[b] <= qb) {
        splits = std::min<int64_t>((2 * num_threads + n_blocks - 1) / n_blocks,
                                   (groups_seen + kMinSplitGroups - 1) / kMinSplitGroups);
        splits = std::max<int64_t>(splits, 1);
      }
      const int64_t span = (groups_seen + splits - 1) / splits;
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t g0 = std::min(groups_seen, s * span);
        const int64_t g1 = std::min(groups_seen, g0 + span);
        items.push_back({b, first, count, g0, g1, splits, s, slots, count * (g1 - g0)});
      }
      if (splits > 1) {
        for (int64_t i = 0; i < count; ++i) merges.push_back({heavy[first + i], slots + i, count, splits});
        slots += splits * count;
      }
    }
  }
  // Longest first, so the dynamic schedule below balances causal prefill (later blocks see more).
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  std::vector<uint64_t> cand(slots * top_k);
  std::vector<int64_t> cand_size(slots, 0);

  const at::Tensor q = q_in.contiguous();
  const at::Tensor pooled = pooled_in.contiguous();
  const int64_t dp = std::max<int64_t>(kLanes, (dim + kLanes - 1) / kLanes * kLanes);
  const float sqrt_d = static_cast<float>(std::sqrt(static_cast<double>(dim)));

  [[maybe_unused]] const bool avx2 = cpu_capability() == CpuCapability::kAvx2;
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(num_threads, n_items), 1, [&](int64_t, int64_t) {
    // Per-thread scratch, reused for every item this thread takes.
    std::vector<float> qbuf(qb * hq * dp);
    std::vector<float> tile(kGroupTile * dp);
    std::vector<const void*> krow(kGroupTile + kPrefetchRows);
    const bool bf16_rows = rows_in_place(pooled, dim, dp) && pooled.scalar_type() == at::kBFloat16;
    std::vector<uint64_t> sel_buf(qb * 2 * top_k);
    std::vector<uint64_t> bitmap((max_g + 63) / 64, 0);
    TopK heaps[kMaxQueryBlock];
    float scores[kGroupTile];
    for (;;) {
      const int64_t index = next.fetch_add(1);
      if (index >= n_items) break;
      const Item& it = items[index];
      int64_t g_end = 0;
      for (int64_t i = 0; i < it.count; ++i) {
        const int64_t t = heavy[it.first + i];
        pack_query(q, t, hq, dim, dp, qbuf.data() + i * hq * dp);
        heaps[i] = TopK{sel_buf.data() + i * 2 * top_k, 0, top_k, 0};
        g_end = std::max<int64_t>(g_end, q_groups[t]);
      }
      g_end = std::min(g_end, it.g1);
      const int32_t* sg = seq_groups + it.row * max_g;
      for (int64_t gs = it.g0; gs < g_end; gs += kGroupTile) {
        const int64_t ge = std::min(gs + kGroupTile, g_end);
        tile_rows(pooled, sg + gs, ge - gs, g_end - gs, dim, dp, tile.data(), krow.data());
        for (int64_t i = 0; i < it.count; ++i) {
          const int64_t stop = std::min<int64_t>(ge, q_groups[heavy[it.first + i]]);
          if (stop <= gs) continue;
          // The block's first query brings the next rows in; the others find them cached.
          const int64_t ahead = i == 0 ? std::min(g_end, ge + kPrefetchRows) - gs : stop - gs;
#if defined(__x86_64__) && defined(__GNUC__)
          if (avx2)
            score_rows_avx2(qbuf.data() + i * hq * dp, hq, dp, krow.data(), bf16_rows, stop - gs, ahead, sqrt_d,
                            scores);
          else
#endif
            score_rows(qbuf.data() + i * hq * dp, hq, dp, krow.data(), bf16_rows, stop - gs, ahead, sqrt_d, scores);
          for (int64_t j = 0; j < stop - gs; ++j) heaps[i].push_score(scores[j], static_cast<int32_t>(gs + j));
        }
      }
      for (int64_t i = 0; i < it.count; ++i) {
        if (it.splits > 1) {
          const int64_t slot = it.slot_base + it.split * it.count + i;
          heaps[i].cut();
          std::copy(heaps[i].buf, heaps[i].buf + heaps[i].size, cand.data() + slot * top_k);
          cand_size[slot] = heaps[i].size;
        } else {
          const int64_t t = heavy[it.first + i];
          heaps[i].write(out_p + t * top_k, top_k, q_groups[t], bitmap.data());
        }
      }
    }
  });

  if (!merges.empty()) {
    // Exact merge: each split kept its own best top_k, so their union holds the overall best
    // top_k, and the strict candidate order makes the result independent of the split.
    at::parallel_for(0, static_cast<int64_t>(merges.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<uint64_t> sel_buf(2 * top_k);
      std::vector<uint64_t> bitmap((max_g + 63) / 64, 0);
      for (int64_t m = begin; m < end; ++m) {
        const Merge& mg = merges[m];
        TopK heap{sel_buf.data(), 0, top_k, 0};
        for (int64_t sp = 0; sp < mg.splits; ++sp) {
          const int64_t slot = mg.slot + sp * mg.stride;
          for (int64_t j = 0; j < cand_size[slot]; ++j) heap.push(cand[slot * top_k + j]);
        }
        heap.write(out_p + mg.t * top_k, top_k, q_groups[mg.t], bitmap.data());
      }
    });
  }
  return out;
}

// ---- qsa_token_cells (issue 37) -----------------------------------------------------------------------
// Per query: the r offsets of each selected group (-1 entries skipped, the others kept in their order),
// then the raw tail's offsets, then -1; a cell is cells[first + offset]. Every value is checked before
// anything is written; rows are independent.
std::tuple<at::Tensor, at::Tensor> qsa_token_cells_cpu(const at::Tensor& selected_in, const at::Tensor& nvis_in,
                                                       const at::Tensor& first_in, const at::Tensor& cells_in,
                                                       int64_t r) {
  const char* op = "qsa_token_cells";
  check_on_device(op, at::kCPU, {{"selected", &selected_in}, {"nvis", &nvis_in}, {"first", &first_in},
                                 {"cells", &cells_in}});
  const QsaTokenCellsSizes sz = check_qsa_token_cells_args(selected_in, nvis_in, first_in, cells_in, r);
  const at::Tensor sel_t = selected_in.contiguous(), nvis_t = nvis_in.contiguous();
  const at::Tensor first_t = first_in.contiguous(), cells_t = cells_in.contiguous();
  const int32_t* sel = sel_t.data_ptr<int32_t>();
  const int64_t* nvis = nvis_t.data_ptr<int64_t>();
  const int64_t* first = first_t.data_ptr<int64_t>();
  const int32_t* cells = cells_t.data_ptr<int32_t>();
  const int64_t tq = sz.tq, k = sz.top_k, w = sz.width, n = sz.cells;
  for (int64_t t = 0; t < tq; ++t) {
    HEBRUS_CHECK(nvis[t] >= 0 && first[t] >= 0 && first[t] <= n - nvis[t], HebrusError, "hebrus::", op,
                 ": query ", t, " sees nvis = ", nvis[t], " cells from first = ", first[t], ", outside cells [0, ",
                 n, ")");
    const int64_t q_groups = nvis[t] / r;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t g = sel[t * k + j];
      HEBRUS_CHECK(g >= -1 && g < q_groups, HebrusError, "hebrus::", op, ": selected[", t, ", ", j, "] = ", g,
                   " is outside [-1, ", q_groups, ") (the query's complete groups)");
    }
  }
  at::Tensor out_cells = empty_on_cpu({tq, w}, cells_in.options());
  at::Tensor out_offs = empty_on_cpu({tq, w}, nvis_in.options());
  int32_t* oc = out_cells.data_ptr<int32_t>();
  int64_t* oo = out_offs.data_ptr<int64_t>();
  at::parallel_for(0, tq, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int32_t* rc = oc + t * w;
      int64_t* ro = oo + t * w;
      const int32_t* run = cells + first[t];
      int64_t at_col = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t g = sel[t * k + j];
        if (g < 0) continue;
        for (int64_t i = 0; i < r; ++i, ++at_col) {
          ro[at_col] = g * r + i;
          rc[at_col] = run[g * r + i];
        }
      }
      for (int64_t off = (nvis[t] / r) * r; off < nvis[t]; ++off, ++at_col) {
        ro[at_col] = off;
        rc[at_col] = run[off];
      }
      for (; at_col < w; ++at_col) {
        ro[at_col] = -1;
        rc[at_col] = -1;
      }
    }
  });
  return {out_cells, out_offs};
}

// ---- rms_norm_rope (issue 37) -------------------------------------------------------------------------
// The norm is hc_rms_norm's row arithmetic (row_math.h: norm_rows, each head's row on its own); the RoPE is
// transformers' apply_rotary_pos_emb element by element in x's dtype: x * cos and rotate_half(x) * sin each
// rounded to it, then their sum (fp32 products of two 16-bit values are exact, so these are the bits of
// torch's mul / mul / add; no contraction: the build passes -ffp-contract=off). Rows are independent.
template <typename T>
void rope_rows_in_place(T* out, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t dim,
                        int64_t rot) {
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens * heads, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      T* x = out + row * dim;
      const T* c = cos + (row / heads) * rot;
      const T* s = sin + (row / heads) * rot;
      for (int64_t d = 0; d < half; ++d) {
        const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + half]);
        const float neg_x2 = static_cast<float>(static_cast<T>(-x2));
        const T a1 = static_cast<T>(x1 * static_cast<float>(c[d]));
        const T b1 = static_cast<T>(neg_x2 * static_cast<float>(s[d]));
        const T a2 = static_cast<T>(x2 * static_cast<float>(c[d + half]));
        const T b2 = static_cast<T>(x1 * static_cast<float>(s[d + half]));
        x[d] = static_cast<T>(static_cast<float>(a1) + static_cast<float>(b1));
        x[d + half] = static_cast<T>(static_cast<float>(a2) + static_cast<float>(b2));
      }
    }
  });
}

at::Tensor rms_norm_rope_cpu(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos_in,
                             const at::Tensor& sin_in) {
  const char* op = "rms_norm_rope";
  check_on_device(op, at::kCPU, {{"x", &x}, {"weight", &weight}, {"cos", &cos_in}, {"sin", &sin_in}});
  const RmsNormRopeSizes sz = check_rms_norm_rope_args(x, weight, eps, cos_in, sin_in);
  // (rows read in place where each is dense, as a query's half of q_proj's output is: no copy of x)
  const at::Tensor xc = x.stride(2) == 1 || sz.dim <= 1 ? x : x.contiguous();
  at::Tensor out = empty_on_cpu(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const at::Tensor w = float_weight(weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_rope", [&] {
    norm_rows_at<scalar_t>(xc.data_ptr<scalar_t>(), sz.heads, xc.stride(1), xc.stride(0), w.data_ptr<float>(),
                           out.data_ptr<scalar_t>(), sz.tokens * sz.heads, sz.dim, sz.dim, eps);
  });
  if (sz.rot == 0) return out;
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_rope", [&] {
    rope_rows_in_place<scalar_t>(out.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                                 sz.tokens, sz.heads, sz.dim, sz.rot);
  });
  return out;
}

// ---- sigmoid_gate (issue 37) --------------------------------------------------------------------------
// out = x * sigmoid(gate) (row_math.h's sigmoid rounded to the dtype, then the product, as the module's ops), each
// row of D on its own; the gate is read through its strides (a view of q_proj's output) where its last dimension
// is dense.
template <typename T>
void sigmoid_gate_rows(const at::Tensor& x, const at::Tensor& gate, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const T* xp = x.data_ptr<T>();
  const T* gp = gate.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs0 = gate.stride(0), gs1 = gate.stride(1);
  at::parallel_for(0, tokens * heads, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> g(static_cast<size_t>(dim));
    for (int64_t r = r0; r < r1; ++r) {
      widen_row(gp + (r / heads) * gs0 + (r % heads) * gs1, g.data(), dim);
      sigmoid_row(g.data(), dim);
      for (int64_t d = 0; d < dim; ++d) {
        const float gate_d = static_cast<float>(static_cast<T>(g[d]));
        op[r * dim + d] = static_cast<T>(static_cast<float>(xp[r * dim + d]) * gate_d);
      }
    }
  });
}

at::Tensor sigmoid_gate_cpu(const at::Tensor& x, const at::Tensor& gate) {
  check_on_device("sigmoid_gate", at::kCPU, {{"x", &x}, {"gate", &gate}});
  check_sigmoid_gate_args(x, gate);
  const at::Tensor xc = x.contiguous();
  const at::Tensor gc = gate.stride(2) == 1 ? gate : gate.contiguous();
  at::Tensor out = empty_on_cpu(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sigmoid_gate",
                                  [&] { sigmoid_gate_rows<scalar_t>(xc, gc, out); });
  return out;
}

// ---- qsa_plan_one_row (issue 37) ----------------------------------------------------------------------
// The selection rows of a one-row chunk (QSACache._plan_one_row: one person's decode, a speculative verify) in one
// call, where they took ~20 torch ops of the host's step plan: the run's contiguity and the chunk's cells checked
// (HoleError), then the eight index tensors qsa_select, qsa_token_cells and decode_attention_layer read.
std::vector<at::Tensor> qsa_plan_one_row_cpu(const at::Tensor& cell_pos_in, const at::Tensor& run_cells_in,
                                             const at::Tensor& run_groups_in, const at::Tensor& cells_in, int64_t p0,
                                             int64_t start, int64_t r) {
  const char* op = "qsa_plan_one_row";
  check_on_device(op, at::kCPU, {{"cell_pos", &cell_pos_in}, {"run_cells", &run_cells_in},
                                 {"run_groups", &run_groups_in}, {"cells", &cells_in}});
  const QsaPlanOneRowSizes sz = check_qsa_plan_one_row_args(cell_pos_in, run_cells_in, run_groups_in, cells_in, p0,
                                                            start, r);
  const at::Tensor pos_t = cell_pos_in.contiguous(), run_t = run_cells_in.contiguous();
  const at::Tensor groups_t = run_groups_in.contiguous(), cells_t = cells_in.contiguous();
  const int64_t* pos = pos_t.data_ptr<int64_t>();
  const int64_t* run = run_t.data_ptr<int64_t>();
  const int64_t* groups = groups_t.data_ptr<int64_t>();
  const int64_t* cells = cells_t.data_ptr<int64_t>();
  const int64_t t = sz.tokens, nvis = sz.nvis, n_groups = sz.groups, capacity = sz.capacity, skip = start - p0;
  for (int64_t j = 0; j < nvis; ++j) {
    const int64_t c = run[j];
    HEBRUS_CHECK(c >= 0 && c < capacity, HebrusError, "hebrus::", op, ": run_cells[", j, "] = ", c,
                 " is outside the table's cells [0, ", capacity, ")");
    HEBRUS_CHECK(pos[c] == p0 + j, HoleError, "hebrus::", op, ": the run starting at ", p0, " has cell ", c,
                 " at position ", pos[c], " where ", p0 + j, " is required (a hole inside the run is not padding)");
  }
  for (int64_t j = 0; j < t; ++j) {
    HEBRUS_CHECK(run[skip + j] == cells[j], HoleError, "hebrus::", op, ": the chunk's cell ", j, " is ", cells[j],
                 " but the run holds cell ", run[skip + j], " at position ", start + j);
  }
  for (int64_t g = 0; g < n_groups; ++g) {
    HEBRUS_CHECK(groups[g] >= 0 && groups[g] <= std::numeric_limits<int32_t>::max(), HebrusError, "hebrus::", op,
                 ": run_groups[", g, "] = ", groups[g], " is outside [0, 2^31)");
  }
  const at::TensorOptions i32 = cells_in.options().dtype(at::kInt), i64 = cells_in.options();
  at::Tensor sel_groups = empty_on_cpu({1, std::max<int64_t>(n_groups, 1)}, i32);
  at::Tensor sel_row = empty_on_cpu({t}, i32), q_groups = empty_on_cpu({t}, i32);
  at::Tensor cells32 = empty_on_cpu({nvis + 1}, i32);
  at::Tensor nvis_q = empty_on_cpu({t}, i64), first = empty_on_cpu({t}, i64);
  at::Tensor q_p0 = empty_on_cpu({t}, i64), q_rows = empty_on_cpu({t}, i64);
  int32_t* sg = sel_groups.data_ptr<int32_t>();
  if (n_groups == 0) sg[0] = -1;
  for (int64_t g = 0; g < n_groups; ++g) sg[g] = static_cast<int32_t>(groups[g]);
  int32_t* c32 = cells32.data_ptr<int32_t>();
  for (int64_t j = 0; j < nvis; ++j) c32[j] = static_cast<int32_t>(run[j]);
  c32[nvis] = -1;
  int32_t *sr = sel_row.data_ptr<int32_t>(), *qg = q_groups.data_ptr<int32_t>();
  int64_t *nq = nvis_q.data_ptr<int64_t>(), *fi = first.data_ptr<int64_t>();
  int64_t *qp = q_p0.data_ptr<int64_t>(), *qr = q_rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < t; ++j) {
    const int64_t seen = skip + 1 + j;        // the query's visible positions
    sr[j] = 0;
    qg[j] = static_cast<int32_t>(seen / r);
    nq[j] = seen;
    fi[j] = 0;
    qp[j] = p0;
    qr[j] = 0;
  }
  return {sel_groups, sel_row, q_groups, cells32, nvis_q, first, q_p0, q_rows};
}

// ---- qsa_claim_cells (issue 37) -----------------------------------------------------------------------
// A chunk's cells taken at the allocator's head in one call (QSACache.reserve, where the cells [start, start + T) are
// all free and none freed in this block): referenced once, given the rows' positions, flagged unwritten for every
// layer; their old values returned for the undo log. Every check runs before anything is written.
using ClaimedCells = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

ClaimedCells qsa_claim_cells_cpu(at::Tensor& cell_ref, at::Tensor& cell_pos, at::Tensor& unwritten,
                                 const at::Tensor& freed_in, int64_t start, c10::IntArrayRef starts,
                                 c10::IntArrayRef counts) {
  const char* op = "qsa_claim_cells";
  check_on_device(op, at::kCPU, {{"cell_ref", &cell_ref}, {"cell_pos", &cell_pos}, {"unwritten", &unwritten},
                                 {"freed", &freed_in}});
  const QsaClaimCellsSizes sz = check_qsa_claim_cells_args(cell_ref, cell_pos, unwritten, freed_in, start, starts,
                                                           counts);
  HEBRUS_CHECK(cell_ref.is_contiguous() && cell_pos.is_contiguous() && unwritten.stride(1) == 1, HebrusError,
               "hebrus::", op, ": cell_ref, cell_pos and unwritten's rows must be contiguous (the tables it writes)");
  const at::Tensor freed_t = freed_in.contiguous();
  int32_t* ref = cell_ref.data_ptr<int32_t>();
  int64_t* pos = cell_pos.data_ptr<int64_t>();
  bool* flags = unwritten.data_ptr<bool>();
  const bool* freed = freed_t.data_ptr<bool>();
  const int64_t t = sz.tokens, layers = sz.layers, row_stride = unwritten.stride(0);
  for (int64_t j = 0; j < t; ++j) {
    HEBRUS_CHECK(ref[start + j] == 0 && !freed[start + j], HebrusError, "hebrus::", op, ": cell ", start + j,
                 " is not free for the taking (", ref[start + j] != 0 ? "referenced" : "freed in this block", ")");
  }
  const at::TensorOptions i64 = cell_pos.options();
  at::Tensor cells = empty_on_cpu({t}, i64), positions = empty_on_cpu({t}, i64);
  at::Tensor cu = empty_on_cpu({sz.rows + 1}, cell_ref.options());
  at::Tensor old_ref = empty_on_cpu({t}, cell_ref.options()), old_pos = empty_on_cpu({t}, i64);
  at::Tensor old_flags = empty_on_cpu({layers, t}, unwritten.options().memory_format(at::MemoryFormat::Contiguous));
  int64_t *c = cells.data_ptr<int64_t>(), *p = positions.data_ptr<int64_t>(), *op_ = old_pos.data_ptr<int64_t>();
  int32_t *cu32 = cu.data_ptr<int32_t>(), *orf = old_ref.data_ptr<int32_t>();
  bool* of = old_flags.data_ptr<bool>();
  int64_t at_token = 0;
  cu32[0] = 0;
  for (int64_t i = 0; i < sz.rows; ++i) {
    for (int64_t j = 0; j < counts[i]; ++j, ++at_token) p[at_token] = starts[i] + j;
    cu32[i + 1] = static_cast<int32_t>(at_token);
  }
  for (int64_t j = 0; j < t; ++j) {
    const int64_t cell = start + j;
    c[j] = cell;
    orf[j] = ref[cell];
    op_[j] = pos[cell];
    ref[cell] = 1;
    pos[cell] = p[j];
  }
  for (int64_t l = 0; l < layers; ++l) {
    bool* row = flags + l * row_stride + start;
    std::memcpy(of + l * t, row, static_cast<size_t>(t) * sizeof(bool));
    std::fill(row, row + t, true);
  }
  return {cells, positions, cu, old_ref, old_pos, old_flags};
}

}  // namespace
}  // namespace hebrus

TORCH_LIBRARY_IMPL(hebrus, CPU, m) {
  m.impl("qsa_pool", &hebrus::qsa_pool_cpu);
  m.impl("qsa_select", &hebrus::qsa_select_cpu);
  m.impl("qsa_token_cells", &hebrus::qsa_token_cells_cpu);
  m.impl("qsa_plan_one_row", &hebrus::qsa_plan_one_row_cpu);
  m.impl("qsa_claim_cells", &hebrus::qsa_claim_cells_cpu);
  m.impl("rms_norm_rope", &hebrus::rms_norm_rope_cpu);
  m.impl("sigmoid_gate", &hebrus::sigmoid_gate_cpu);
}
