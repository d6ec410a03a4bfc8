// 16-lane fp32 vectors (GCC / clang vector extensions) shared by the CPU kernels, and the lane
// reduction that every dot product of qsa_select and qsa_attention ends with, so that summation
// order is written down once: lane j sums the dims d = j mod 16 in ascending d, then the lanes
// combine pairwise (j and j + 8, then + 4, + 2, + 1). Fixed, so a result never depends on
// blocking, threads or the vector width of the CPU.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#if defined(__GNUC__)
#define HEBRUS_INLINE inline __attribute__((always_inline))
#else
#define HEBRUS_INLINE inline
#endif

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
// One binary for every x86 CPU; the clones differ in vector width only. -ffp-contract=off holds in
// every clone and the source fixes every summation order, so all of them produce the same bits.
// Everything a hot loop calls is always_inline, so it is compiled inside each clone. The 256-bit
// clone is x86-64-v3 (AVX2 with FMA) so that the fused multiply-adds the source asks for
// (FusedMulAdd) are instructions there; only the baseline clone, for pre-2013 CPUs, calls libm's
// fmaf for them (same bits, slowly).
#define HEBRUS_VECTOR_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define HEBRUS_VECTOR_CLONES
#endif

// target_clones on a function template: GCC only (clang does not multiversion templates yet: "attribute
// 'target_clones' multiversioned functions do not yet support function templates"). A clang build compiles
// such a template once, for the baseline target: the same bits, narrower vectors.
#if defined(__clang__)
#define HEBRUS_TEMPLATE_VECTOR_CLONES
#else
#define HEBRUS_TEMPLATE_VECTOR_CLONES HEBRUS_VECTOR_CLONES
#endif

// Lanes of two vectors by index into their concatenation: clang and GCC >= 12 spell it
// __builtin_shufflevector, older GCC __builtin_shuffle with an index vector.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define HEBRUS_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define HEBRUS_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, ::hebrus::VecIdx{__VA_ARGS__})
#endif

namespace hebrus {

constexpr int64_t kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecIdx __attribute__((vector_size(kLanes * sizeof(int32_t))));

// A vector of floats from any address (no alignment assumed).
template <typename V>
HEBRUS_INLINE V load_vector(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

HEBRUS_INLINE Vec load_vec(const float* p) { return load_vector<Vec>(p); }

HEBRUS_INLINE float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

HEBRUS_INLINE uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// Sixteen bf16 values, given as their raw bits, widened to fp32 (the bits shifted into the high
// half: exact).
HEBRUS_INLINE Vec load_bf16_vec(const uint16_t* p) {
  uint16_t raw[kLanes];
  std::memcpy(raw, p, sizeof(raw));
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = bits_to_float(static_cast<uint32_t>(raw[i]) << 16);
  return v;
}

// Lane 0 of the pairwise sum: lanes i and i + 8 first, then i and i + 4, i + 2, i + 1.
HEBRUS_INLINE float reduce_lanes(const Vec& lanes) {
  Vec a = lanes;
  a += HEBRUS_SHUFFLE(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  a += HEBRUS_SHUFFLE(a, a, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
  a += HEBRUS_SHUFFLE(a, a, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  return a[0] + a[1];
}

// Half of a 16-lane chunk: lanes [0, 8) or [8, 16). Loops whose accumulators GCC 12 would keep on the stack in the
// AVX2 (x86-64-v3) clone as 16-lane vectors (a 64-byte object stored and reloaded through xmm pieces every chunk:
// the dense expert passes ran at ~1.5 GMAC/s, warm) keep them as two halves instead. Each half lane adds what the
// same lane of the 16-lane vector added, and reduce_halves adds as reduce_lanes does, so the bits are the same.
typedef float Half __attribute__((vector_size(kLanes / 2 * sizeof(float))));

// reduce_lanes of the 16 lanes (lo, hi), with the same additions: lane i + lane i + 8, then + 4, + 2, + 1.
HEBRUS_INLINE float reduce_halves(Half lo, Half hi) {
  const Half a = lo + hi;
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// Lane i is reduce_lanes(a[i]), with the same additions, for sixteen dot products at once: each
// level adds the two halves of every group of lanes, two sums packed per vector.
HEBRUS_INLINE Vec reduce_lanes16(const Vec (&a)[kLanes]) {
  Vec b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)
    b[i] = HEBRUS_SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           HEBRUS_SHUFFLE(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = HEBRUS_SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           HEBRUS_SHUFFLE(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = HEBRUS_SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           HEBRUS_SHUFFLE(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return HEBRUS_SHUFFLE(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         HEBRUS_SHUFFLE(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Which hand-written x86 kernels may run. HEBRUS_CPU_CAPABILITY (like ATen's ATEN_CPU_CAPABILITY)
// lowers it: "default" runs only the portable code (what arm64 runs), "avx2" the AVX2 kernels,
// "avx512" the AVX-512F kernels, "avx512_bf16" those and the bf16 dot-product instruction. All of
// them give the same bits, except that the instruction flushes subnormal bf16 inputs and partial sums
// to zero (see dots in attention_kernels.cpp).
enum class CpuCapability { kDefault = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// The capability the kernels run (attention_kernels.cpp): the CPU's best, capped by
// HEBRUS_CPU_CAPABILITY; an unknown value raises HebrusError at every call.
CpuCapability cpu_capability();

#if defined(__x86_64__) && defined(__GNUC__)
// Hand-written AVX2 kernels (x86-64-v3 CPUs without AVX-512) keep a 16-lane vector as two ymm registers
// (lanes 0-7, 8-15): GCC 12 builds the portable code's two-register vectors through the stack.
#define HEBRUS_AVX2 __attribute__((target("avx2,fma,f16c")))

// reduce_lanes of the 16 lanes (lo, hi): lane i + lane i + 8, then + 4, + 2, + 1.
HEBRUS_AVX2 HEBRUS_INLINE float reduce_lanes_avx2(__m256 lo, __m256 hi) {
  const __m256 a = _mm256_add_ps(lo, hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}
#endif

// a * b + c, rounded twice (MulAdd) or once (FusedMulAdd: std::fma's result, an instruction
// wherever the CPU has FMA, including every arm64 CPU); floats or vectors of floats.
struct MulAdd {
  template <typename V, typename C>
  static HEBRUS_INLINE V apply(V a, V b, C c) {
    return a * b + c;
  }
};

struct FusedMulAdd {
  static HEBRUS_INLINE float apply(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

  // Lane by lane; one vector instruction in every clone whose target has FMA.
  template <typename V>
  static HEBRUS_INLINE V apply(V a, V b, V c) {
#if defined(__clang__)
    return __builtin_elementwise_fma(a, b, c);
#else
    V r;
    for (int i = 0; i < static_cast<int>(sizeof(V) / sizeof(float)); ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
#endif
  }
};

// Cephes' expf polynomial: exp(r) for a reduced argument |r| <= ln(2) / 2, as 1 + r + r^2 P(r),
// with M's multiply-adds. V is float or a vector of floats; every lane gets the same operations.
template <typename M = MulAdd, typename V>
HEBRUS_INLINE V exp_reduced(V r) {
  V y = V{} + 1.9875691500e-4f;
  y = M::apply(y, r, 1.3981999507e-3f);
  y = M::apply(y, r, 8.3334519073e-3f);
  y = M::apply(y, r, 4.1665795894e-2f);
  y = M::apply(y, r, 1.6666665459e-1f);
  y = M::apply(y, r, 5.0000001201e-1f);
  return M::apply(y, r * r, r) + 1.f;
}

// exp(x) for SiLU, over the whole float range: within about 1 ulp for x >= -87, 0 below (where expf
// is under 2e-38: 1 + exp(x) is 1 either way), inf above 88.72; NaN gives a finite value (silu
// keeps NaN through its numerator). Cephes' expf polynomial with round-to-nearest range reduction
// through the 1.5 * 2^23 trick (no float-to-int conversion, so it vectorises and has no undefined
// behaviour on inf or NaN). Its multiply-adds are fused (std::fma, the same bits on every CPU):
// half the instructions of separate ones, in the larger part of the conv's arithmetic (measured:
// silu conv ~25% faster in cache, 2.7 -> 3.4 G outputs/s on one core). x is clamped to [-87.5, 89]
// on its bit pattern with integer minima: a float compare-and-select there lets GCC's PRE split the
// loop tail into branches (one arm is all constants), which blocks vectorisation. The clamp keeps n
// in [-126, 128]; 2^n is applied as 2^(n-1) * 2, whose first factor is +0 for n = -126 and finite
// for n = 128, so overflow and underflow need no select.
HEBRUS_INLINE float exp_silu(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr uint32_t kMinus87_5 = 0xC2AF0000u;  // bits of -87.5f
  constexpr uint32_t k89 = 0x42B20000u;         // bits of 89.f
  constexpr uint32_t kSign = 0x80000000u;
  const uint32_t b = float_to_bits(x);
  const uint32_t neg_capped = b < kMinus87_5 ? b : kMinus87_5;  // caps negative magnitudes
  const uint32_t flipped = neg_capped ^ kSign;  // now positive floats order above negative ones
  const uint32_t capped = flipped < (k89 ^ kSign) ? flipped : (k89 ^ kSign);  // caps positive values
  const float xc = bits_to_float(capped ^ kSign);
  const float t = FusedMulAdd::apply(xc, kLog2e, kMagic);
  const float n = t - kMagic;
  const uint32_t ni = float_to_bits(t) - float_to_bits(kMagic);  // n as a two's complement integer
  const float r = FusedMulAdd::apply(n, -kLn2Lo, FusedMulAdd::apply(n, -kLn2Hi, xc));
  return (exp_reduced<FusedMulAdd>(r) * bits_to_float((ni + 126u) << 23)) * 2.f;
}

// x * sigmoid(x) as x / (1 + exp(-x)): silu(+inf) = inf, silu(x < -88.7) = -0, silu(NaN) = NaN.
HEBRUS_INLINE float silu(float x) { return x / (1.f + exp_silu(-x)); }

}  // namespace hebrus
