// msl_shim.h -- compile Metal Shading Language compute kernels as host C++ (g++ >= 12 / clang++ >= 15, -std=c++20)
// and run them on the CPU: one fiber per GPU thread, one threadgroup at a time per worker OS thread.
//
// hebrus_torch's emulator harness (tests/metal). Grown from the proof of concept in
// ../shared/reference/msl-emu-poc; what this version adds for the hebrus kernels:
//   * bfloat (MSL 3.1) as a 16-bit storage type with explicit float conversions, round-to-nearest-even;
//   * every launch copies its buffers into guard-paged memory: a device access past either end of a
//     buffer faults, and the fault is reported (buffer index, byte offset, GPU thread, kernel pc);
//   * threadgroup arrays and threadgroup pointers are bounds-checked (tgarray / tgptr);
//   * strict mode: a barrier or SIMD-group function that not every live thread of the threadgroup /
//     every launched lane of the SIMD-group reaches at the same call site is an error;
//   * a small assembly context switch on x86-64 (ucontext elsewhere), ~30x faster than swapcontext.
//   * simdgroup_matrix<T, 8, 8> (float, half, bfloat): loads, stores and products as SIMD-group functions,
//     each lane holding its two elements, the 8 products of an element summed in a random binary tree.
// Covers the compute subset the hebrus kernels use (no textures, samplers).
#pragma once
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

namespace metal {
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
using std::numeric_limits; using std::is_same; using std::is_same_v; using std::enable_if; using std::enable_if_t;
using std::conditional; using std::conditional_t; using std::is_floating_point; using std::is_integral;
using std::is_signed; using std::is_unsigned; using std::remove_cv_t; using std::make_unsigned_t;

// MSL 3.1 bfloat: 1 sign, 8 exponent, 7 mantissa bits. Kept as a storage type: conversions to and from
// float are explicit and round to nearest even (as Metal and c10::BFloat16 do); kernels do their
// arithmetic in float, so no bfloat operators are provided (using one is a compile error here).
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  explicit bfloat(float f) : bits(from_float(f)) {}
  explicit operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
  static uint16_t from_float(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
};

template <class T, int N> struct vec;
template <class T, int N, int... I> struct swz;

namespace detail {
template <class A> struct vinfo { static constexpr bool is_vec = false; static constexpr int n = 1; using elem = A; };
template <class T, int N> struct vinfo<vec<T, N>> { static constexpr bool is_vec = true; static constexpr int n = N; using elem = T; };
template <class T, int N, int... I> struct vinfo<swz<T, N, I...>> { static constexpr bool is_vec = true; static constexpr int n = sizeof...(I); using elem = T; };
template <class A> using vi = vinfo<std::remove_cv_t<std::remove_reference_t<A>>>;
template <class A> constexpr bool is_vec_v = vi<A>::is_vec;
template <class A> constexpr bool is_scalar_v = std::is_arithmetic_v<std::remove_cv_t<A>> || std::is_same_v<std::remove_cv_t<A>, half> || std::is_same_v<std::remove_cv_t<A>, bfloat>;
template <class A> constexpr bool is_float_v = std::is_floating_point_v<A> || std::is_same_v<A, half> || std::is_same_v<A, bfloat>;
template <class A> using elem_t = typename vi<A>::elem;
template <int... I> constexpr bool distinct() { int a[] = {I...}; for (unsigned i = 0; i < sizeof...(I); i++) for (unsigned j = i + 1; j < sizeof...(I); j++) if (a[i] == a[j]) return false; return true; }
template <class A> constexpr int ncomp() { if constexpr (is_vec_v<A>) return vi<A>::n; else return 1; }
}  // namespace detail

template <class T, int N, int... I> struct swz {  // lives in a union with T data[N]
  T d[N];
  static constexpr int K = sizeof...(I);
  using V = vec<T, K>;
  operator V() const { return V(d[I]...); }
  T operator[](int i) const { constexpr int ix[] = {I...}; return d[ix[i]]; }
  swz& operator=(const V& v) { static_assert(detail::distinct<I...>(), "MSL: cannot assign to a swizzle with repeated components"); int k = 0; ((d[I] = v.data[k++]), ...); return *this; }
  swz& operator=(const swz& o) { return *this = V(o); }
  template <class S, std::enable_if_t<detail::is_scalar_v<S>, int> = 0> swz& operator=(S s) { return *this = V(s); }
  template <class A> swz& operator+=(const A& a) { return *this = V(*this) + a; }
  template <class A> swz& operator-=(const A& a) { return *this = V(*this) - a; }
  template <class A> swz& operator*=(const A& a) { return *this = V(*this) * a; }
  template <class A> swz& operator/=(const A& a) { return *this = V(*this) / a; }
};

template <class T, int N> struct vstore;
template <class T> struct vstore<T, 2> { union { T data[2]; struct { T x, y; }; struct { T r, g; };
#include "msl_swz2.inc"
}; };
template <class T> struct vstore<T, 3> { union { T data[3]; struct { T x, y, z; }; struct { T r, g, b; };
#include "msl_swz3.inc"
}; };
template <class T> struct vstore<T, 4> { union { T data[4]; struct { T x, y, z, w; }; struct { T r, g, b, a; };
#include "msl_swz4.inc"
}; };

namespace detail {
template <class A> inline auto comp(const A& a, int i) {
  if constexpr (is_vec_v<A>) return a[i]; else return a;
}
}  // namespace detail

// MSL vectors: float3 has the size/alignment of float4, like Metal.
template <class T, int N> struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec : vstore<T, N> {
  static constexpr int size = N;
  vec() = default;
  vec(const vec&) = default;
  vec& operator=(const vec& o) { std::memcpy(this->data, o.data, sizeof(T) * N); return *this; }
  template <class S, std::enable_if_t<detail::is_scalar_v<S>, int> = 0> vec(S s) { for (int i = 0; i < N; i++) this->data[i] = T(s); }
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0> explicit vec(const vec<U, N>& o) { for (int i = 0; i < N; i++) this->data[i] = T(o.data[i]); }
  template <class U, int M, int... I, std::enable_if_t<!std::is_same_v<U, T> && sizeof...(I) == N, int> = 0>
  explicit vec(const swz<U, M, I...>& s) : vec(vec<U, N>(s)) {}
  template <class A, class B, class... R> vec(const A& a, const B& b, const R&... r) {
    static_assert(detail::ncomp<A>() + detail::ncomp<B>() + (0 + ... + detail::ncomp<R>()) == N, "MSL: wrong number of components in vector constructor");
    int k = 0; auto put = [&](const auto& v) { for (int i = 0; i < detail::ncomp<std::decay_t<decltype(v)>>(); i++) this->data[k++] = T(detail::comp(v, i)); };
    put(a); put(b); (put(r), ...);
  }
  T& operator[](int i) { return this->data[i]; }
  const T& operator[](int i) const { return this->data[i]; }
  template <class A> vec& operator+=(const A& a) { return *this = *this + a; }
  template <class A> vec& operator-=(const A& a) { return *this = *this - a; }
  template <class A> vec& operator*=(const A& a) { return *this = *this * a; }
  template <class A> vec& operator/=(const A& a) { return *this = *this / a; }
  template <class A> vec& operator%=(const A& a) { return *this = *this % a; }
  template <class A> vec& operator&=(const A& a) { return *this = *this & a; }
  template <class A> vec& operator|=(const A& a) { return *this = *this | a; }
  template <class A> vec& operator^=(const A& a) { return *this = *this ^ a; }
  template <class A> vec& operator<<=(const A& a) { return *this = *this << a; }
  template <class A> vec& operator>>=(const A& a) { return *this = *this >> a; }
  vec& operator++() { return *this = *this + T(1); }
  vec& operator--() { return *this = *this - T(1); }
};

namespace detail {
template <class A, class B, class = void> struct binres {};
template <class A, class B> struct binres<A, B, std::enable_if_t<(is_vec_v<A> || is_vec_v<B>) && (is_vec_v<A> || is_scalar_v<A>) && (is_vec_v<B> || is_scalar_v<B>)>> {
  static constexpr int n = is_vec_v<A> ? vi<A>::n : vi<B>::n;
  using E = std::conditional_t<is_vec_v<A>, elem_t<A>, elem_t<B>>;
  static_assert(!(is_vec_v<A> && is_vec_v<B>) || (vi<A>::n == vi<B>::n), "MSL: vector size mismatch");
  static_assert(!(is_vec_v<A> && is_vec_v<B>) || std::is_same_v<elem_t<A>, elem_t<B>>, "MSL: no implicit conversion between vector types with different element types");
  using type = vec<E, n>;
  using btype = vec<bool, n>;
};
}  // namespace detail

#define MSL_BINOP(op)                                                                              \
  template <class A, class B, class R = typename detail::binres<A, B>::type>                        \
  inline R operator op(const A& a, const B& b) {                                                   \
    R r; using E = typename detail::binres<A, B>::E;                                               \
    for (int i = 0; i < R::size; i++) r.data[i] = E(E(detail::comp(a, i)) op E(detail::comp(b, i))); \
    return r;                                                                                      \
  }
MSL_BINOP(+) MSL_BINOP(-) MSL_BINOP(*) MSL_BINOP(/) MSL_BINOP(%) MSL_BINOP(&) MSL_BINOP(|) MSL_BINOP(^) MSL_BINOP(<<) MSL_BINOP(>>)
#define MSL_CMPOP(op)                                                                              \
  template <class A, class B, class R = typename detail::binres<A, B>::btype>                       \
  inline R operator op(const A& a, const B& b) {                                                   \
    R r; using E = typename detail::binres<A, B>::E;                                               \
    for (int i = 0; i < R::size; i++) r.data[i] = E(detail::comp(a, i)) op E(detail::comp(b, i));  \
    return r;                                                                                      \
  }
MSL_CMPOP(<) MSL_CMPOP(>) MSL_CMPOP(<=) MSL_CMPOP(>=) MSL_CMPOP(==) MSL_CMPOP(!=) MSL_CMPOP(&&) MSL_CMPOP(||)
template <class A, std::enable_if_t<detail::is_vec_v<A>, int> = 0> inline auto operator-(const A& a) { vec<detail::elem_t<A>, detail::vi<A>::n> r = a; for (auto& e : r.data) e = -e; return r; }
template <class A, std::enable_if_t<detail::is_vec_v<A>, int> = 0> inline auto operator+(const A& a) { vec<detail::elem_t<A>, detail::vi<A>::n> r = a; return r; }
template <class A, std::enable_if_t<detail::is_vec_v<A>, int> = 0> inline auto operator~(const A& a) { vec<detail::elem_t<A>, detail::vi<A>::n> r = a; for (auto& e : r.data) e = ~e; return r; }
template <class A, std::enable_if_t<detail::is_vec_v<A>, int> = 0> inline auto operator!(const A& a) { vec<bool, detail::vi<A>::n> r; for (int i = 0; i < r.size; i++) r.data[i] = !detail::comp(a, i); return r; }

#define MSL_VEC_TYPEDEFS(T, P) typedef vec<T, 2> P##2; typedef vec<T, 3> P##3; typedef vec<T, 4> P##4;
MSL_VEC_TYPEDEFS(float, float) MSL_VEC_TYPEDEFS(half, half) MSL_VEC_TYPEDEFS(int, int) MSL_VEC_TYPEDEFS(uint, uint)
MSL_VEC_TYPEDEFS(short, short) MSL_VEC_TYPEDEFS(ushort, ushort) MSL_VEC_TYPEDEFS(char, char) MSL_VEC_TYPEDEFS(uchar, uchar)
MSL_VEC_TYPEDEFS(bool, bool) MSL_VEC_TYPEDEFS(long, long) MSL_VEC_TYPEDEFS(ulong, ulong) MSL_VEC_TYPEDEFS(bfloat, bfloat)
struct packed_float3 { float x, y, z; packed_float3() = default; packed_float3(float3 v) : x(v.x), y(v.y), z(v.z) {} operator float3() const { return float3(x, y, z); } float& operator[](int i) { return (&x)[i]; } };
struct packed_half4 { half x, y, z, w; };

// ---- math / common / geometric / integer functions (element-wise) ----
namespace detail {
template <class A> using vres = vec<elem_t<A>, vi<A>::n>;
template <class F, class A> inline auto map1(F f, const A& a) { if constexpr (is_vec_v<A>) { vres<A> r; for (int i = 0; i < r.size; i++) r.data[i] = f(a[i]); return r; } else return f(a); }
template <class F, class A, class B> inline auto map2(F f, const A& a, const B& b) {
  if constexpr (is_vec_v<A> || is_vec_v<B>) { typename binres<A, B>::type r; using E = typename binres<A, B>::E; for (int i = 0; i < r.size; i++) r.data[i] = f(E(comp(a, i)), E(comp(b, i))); return r; }
  else { using E = std::common_type_t<A, B>; return f(E(a), E(b)); } }
template <class F, class A, class B, class C> inline auto map3(F f, const A& a, const B& b, const C& c) {
  constexpr int n = std::max({ncomp<A>(), ncomp<B>(), ncomp<C>()});
  using E = std::conditional_t<is_vec_v<A>, elem_t<A>, std::conditional_t<is_vec_v<B>, elem_t<B>, std::conditional_t<is_vec_v<C>, elem_t<C>, A>>>;
  if constexpr (n > 1) { vec<E, n> r; for (int i = 0; i < n; i++) r.data[i] = f(E(comp(a, i)), E(comp(b, i)), E(comp(c, i))); return r; }
  else return f(E(a), E(b), E(c)); }
}  // namespace detail
#define MSL_FN1(name, expr) template <class A, std::enable_if_t<detail::is_vec_v<A> || detail::is_float_v<A>, int> = 0> \
  inline auto name(const A& a) { return detail::map1([](auto x) { using E = decltype(x); return E(expr); }, a); }
MSL_FN1(sqrt, std::sqrt(float(x))) MSL_FN1(rsqrt, 1.0f / std::sqrt(float(x))) MSL_FN1(exp, std::exp(float(x))) MSL_FN1(exp2, std::exp2(float(x)))
MSL_FN1(log, std::log(float(x))) MSL_FN1(log2, std::log2(float(x))) MSL_FN1(sin, std::sin(float(x))) MSL_FN1(cos, std::cos(float(x)))
MSL_FN1(tan, std::tan(float(x))) MSL_FN1(tanh, std::tanh(float(x))) MSL_FN1(floor, std::floor(float(x))) MSL_FN1(ceil, std::ceil(float(x)))
MSL_FN1(round, std::round(float(x))) MSL_FN1(rint, std::rint(float(x))) MSL_FN1(trunc, std::trunc(float(x))) MSL_FN1(fract, float(x) - std::floor(float(x)))
MSL_FN1(fabs, std::fabs(float(x))) MSL_FN1(erf, std::erf(float(x))) MSL_FN1(log10, std::log10(float(x))) MSL_FN1(exp10, std::pow(10.0f, float(x)))
MSL_FN1(saturate, std::min(std::max(float(x), 0.0f), 1.0f))
template <class A, std::enable_if_t<detail::is_vec_v<A> || detail::is_scalar_v<A>, int> = 0> inline auto abs(const A& a) { return detail::map1([](auto x) { using E = decltype(x); return E(x < E(0) ? E(-x) : x); }, a); }
#define MSL_FN2(name, expr) template <class A, class B, std::enable_if_t<(detail::is_vec_v<A> || detail::is_scalar_v<A>) && (detail::is_vec_v<B> || detail::is_scalar_v<B>), int> = 0> \
  inline auto name(const A& a, const B& b) { return detail::map2([](auto x, auto y) { using E = decltype(x); return E(expr); }, a, b); }
MSL_FN2(min, y < x ? y : x) MSL_FN2(max, x < y ? y : x) MSL_FN2(fmin, std::fmin(float(x), float(y))) MSL_FN2(fmax, std::fmax(float(x), float(y)))
MSL_FN2(pow, std::pow(float(x), float(y))) MSL_FN2(powr, std::pow(float(x), float(y))) MSL_FN2(fmod, std::fmod(float(x), float(y)))
MSL_FN2(atan2, std::atan2(float(x), float(y))) MSL_FN2(step, float(y) < float(x) ? 0.0f : 1.0f) MSL_FN2(copysign, std::copysign(float(x), float(y)))
#define MSL_FN3(name, expr) template <class A, class B, class C> inline auto name(const A& a, const B& b, const C& c) { \
  return detail::map3([](auto x, auto y, auto z) { using E = decltype(x); return E(expr); }, a, b, c); }
MSL_FN3(clamp, std::min(std::max(x, y), z)) MSL_FN3(fma, std::fma(float(x), float(y), float(z))) MSL_FN3(mix, float(x) + (float(y) - float(x)) * float(z))
MSL_FN3(smoothstep, [](float e0, float e1, float v) { float t = std::min(std::max((v - e0) / (e1 - e0), 0.0f), 1.0f); return t * t * (3 - 2 * t); }(x, y, z))
template <class A, class B> inline auto dot(const A& a, const B& b) { auto p = a * b; detail::elem_t<A> s = 0; for (int i = 0; i < p.size; i++) s += p[i]; return s; }
template <class A> inline auto length(const A& a) { return sqrt(dot(a, a)); }
template <class A> inline auto length_squared(const A& a) { return dot(a, a); }
template <class A, class B> inline auto distance(const A& a, const B& b) { return length(a - b); }
template <class A> inline auto normalize(const A& a) { return a * rsqrt(dot(a, a)); }
template <class T> inline vec<T, 3> cross(vec<T, 3> a, vec<T, 3> b) { return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x); }
template <class A> inline bool all(const A& a) { if constexpr (detail::is_vec_v<A>) { for (int i = 0; i < detail::vi<A>::n; i++) if (!a[i]) return false; return true; } else return bool(a); }
template <class A> inline bool any(const A& a) { if constexpr (detail::is_vec_v<A>) { for (int i = 0; i < detail::vi<A>::n; i++) if (a[i]) return true; return false; } else return bool(a); }
template <class A, class B, class C> inline auto select(const A& a, const B& b, const C& c) { return detail::map3([](auto x, auto y, auto z) { return z ? y : x; }, a, b, c); }
template <class A> inline auto isnan(const A& a) { return detail::map1([](auto x) { return (bool)std::isnan(float(x)); }, a); }
template <class A> inline auto isinf(const A& a) { return detail::map1([](auto x) { return (bool)std::isinf(float(x)); }, a); }
template <class A> inline auto isfinite(const A& a) { return detail::map1([](auto x) { return (bool)std::isfinite(float(x)); }, a); }
template <class A> inline auto popcount(const A& a) { return detail::map1([](auto x) { return decltype(x)(__builtin_popcountll((unsigned long long)(std::make_unsigned_t<decltype(x)>)x)); }, a); }
template <class A> inline auto clz(const A& a) { return detail::map1([](auto x) { using E = decltype(x); auto u = (unsigned long long)(std::make_unsigned_t<E>)x; return E(u ? __builtin_clzll(u) - (64 - 8 * (int)sizeof(E)) : 8 * sizeof(E)); }, a); }
template <class A> inline auto ctz(const A& a) { return detail::map1([](auto x) { using E = decltype(x); auto u = (unsigned long long)(std::make_unsigned_t<E>)x; return E(u ? __builtin_ctzll(u) : 8 * sizeof(E)); }, a); }
template <class A, class B> inline auto mulhi(const A& a, const B& b) { return detail::map2([](auto x, auto y) { using E = decltype(x); return E(((long long)x * (long long)y) >> (8 * sizeof(E))); }, a, b); }
template <class To, class From> inline To as_type(const From& f) { static_assert(sizeof(To) == sizeof(From), "MSL: as_type requires equal sizes"); To t; std::memcpy((void*)&t, (const void*)&f, sizeof(To)); return t; }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpragmas"
#pragma GCC diagnostic ignored "-Wunknown-warning-option"
#pragma GCC diagnostic ignored "-Wliteral-suffix"
#pragma GCC diagnostic ignored "-Wuser-defined-literals"
inline half operator""h(long double v) { return half(float(v)); }   // MSL half literals: 1.0h
inline half operator""h(unsigned long long v) { return half(float(v)); }
#pragma GCC diagnostic pop
namespace precise { using namespace metal; }
// fast:: math is refused: on the GPU it runs at reduced accuracy, so a precise:: -> fast:: change would
// make results differ from the reference by more than any test allows; the emulator does not guess how
// much, it stops the build.
namespace fast {
template <class... A> inline constexpr bool msl_fast_refused = false;
#define MSL_FAST_REFUSED(name)                                                                              \
  template <class... A> inline float name(A...) {                                                           \
    static_assert(msl_fast_refused<A...>, "fast::" #name " is refused by the emulator: fast math runs at "   \
                  "reduced accuracy on the GPU; use precise:: (or metal:: under math_mode(safe))");         \
    return 0.0f;                                                                                            \
  }
MSL_FAST_REFUSED(exp) MSL_FAST_REFUSED(exp2) MSL_FAST_REFUSED(exp10) MSL_FAST_REFUSED(log) MSL_FAST_REFUSED(log2)
MSL_FAST_REFUSED(log10) MSL_FAST_REFUSED(sin) MSL_FAST_REFUSED(cos) MSL_FAST_REFUSED(tan) MSL_FAST_REFUSED(rsqrt)
MSL_FAST_REFUSED(sqrt) MSL_FAST_REFUSED(pow) MSL_FAST_REFUSED(powr) MSL_FAST_REFUSED(tanh) MSL_FAST_REFUSED(divide)
MSL_FAST_REFUSED(sincos) MSL_FAST_REFUSED(atan) MSL_FAST_REFUSED(atan2) MSL_FAST_REFUSED(sinh) MSL_FAST_REFUSED(cosh)
#undef MSL_FAST_REFUSED
}  // namespace fast

// ---- atomics ----
enum memory_order { memory_order_relaxed = 0, memory_order_seq_cst = 5 };
enum class thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
template <class T> struct _atomic { std::atomic<T> v; };
template <class T> using atomic = _atomic<T>;
typedef _atomic<int> atomic_int; typedef _atomic<uint> atomic_uint; typedef _atomic<bool> atomic_bool; typedef _atomic<float> atomic_float; typedef _atomic<ulong> atomic_ulong;
template <class T, class U> inline void atomic_store_explicit(volatile _atomic<T>* o, U v, memory_order) { const_cast<_atomic<T>*>(o)->v.store(T(v)); }
template <class T> inline T atomic_load_explicit(const volatile _atomic<T>* o, memory_order) { return const_cast<_atomic<T>*>(o)->v.load(); }
template <class T, class U> inline T atomic_exchange_explicit(volatile _atomic<T>* o, U v, memory_order) { return const_cast<_atomic<T>*>(o)->v.exchange(T(v)); }
template <class T, class U> inline T atomic_fetch_add_explicit(volatile _atomic<T>* o, U v, memory_order) { return const_cast<_atomic<T>*>(o)->v.fetch_add(T(v)); }
template <class T, class U> inline T atomic_fetch_sub_explicit(volatile _atomic<T>* o, U v, memory_order) { return const_cast<_atomic<T>*>(o)->v.fetch_sub(T(v)); }
template <class T, class U> inline T atomic_fetch_and_explicit(volatile _atomic<T>* o, U v, memory_order) { return const_cast<_atomic<T>*>(o)->v.fetch_and(T(v)); }
template <class T, class U> inline T atomic_fetch_or_explicit(volatile _atomic<T>* o, U v, memory_order) { return const_cast<_atomic<T>*>(o)->v.fetch_or(T(v)); }
template <class T, class U> inline T atomic_fetch_xor_explicit(volatile _atomic<T>* o, U v, memory_order) { return const_cast<_atomic<T>*>(o)->v.fetch_xor(T(v)); }
template <class T, class U> inline T atomic_fetch_max_explicit(volatile _atomic<T>* o, U v, memory_order) { auto& a = const_cast<_atomic<T>*>(o)->v; T c = a.load(); while (c < T(v) && !a.compare_exchange_weak(c, T(v))) {} return c; }
template <class T, class U> inline T atomic_fetch_min_explicit(volatile _atomic<T>* o, U v, memory_order) { auto& a = const_cast<_atomic<T>*>(o)->v; T c = a.load(); while (T(v) < c && !a.compare_exchange_weak(c, T(v))) {} return c; }
template <class T, class U> inline bool atomic_compare_exchange_weak_explicit(volatile _atomic<T>* o, T* expected, U desired, memory_order, memory_order) { return const_cast<_atomic<T>*>(o)->v.compare_exchange_strong(*expected, T(desired)); }

// ---- barriers ----
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8, mem_object_data = 16 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
void threadgroup_barrier(mem_flags f, const char* file = __builtin_FILE(), int line = __builtin_LINE());
void simdgroup_barrier(mem_flags f, const char* file = __builtin_FILE(), int line = __builtin_LINE());
}  // namespace metal

// =====================================================================================================
// Runtime: fibers, scheduler, SIMD-group exchange, guarded buffers, launch API
// =====================================================================================================
namespace msl_rt {
using namespace metal;
constexpr int SIMD = 32, SLOT = 64;
enum State { READY, AT_BARRIER, AT_SIMD, DONE };
struct Fiber {
  void* sp; ucontext_t uc; State st; const char* file; int line;
  uint lin; uint3 lid;
  alignas(16) unsigned char slot[SLOT];
  alignas(16) unsigned char view[SIMD][SLOT]; uint32_t view_mask;  // snapshot of the SIMD-group exchange
  int bflags = 0;        // mem_flags of the threadgroup_barrier the fiber waits at
};
struct LaunchDesc {  // C ABI, mirrored in msl_emu.py
  uint32_t grid[3], tg[3]; int32_t mode;  // mode 0: grid = threadgroups per grid; 1: grid = threads per grid (dispatchThreads)
  void** buffers; const uint64_t* buf_len; int32_t nbuf; const uint64_t* tg_len; int32_t ntg;
  int32_t workers, sched; uint32_t seed; int32_t strict; uint64_t stack_kb;
  int32_t guard;  // 0: each buffer ends at a guard page; 1: each buffer starts right after one
  char* err; int32_t errlen;
  uint32_t simd_seed;   // 0: SIMD-group reductions in lane order; else in a random tree order drawn from it
  int32_t device_vis;   // 1: device stores become visible to other threads only at a mem_device barrier
  double watchdog_s;    // > 0: CPU seconds a worker may spend on the launch before it is aborted (the GPU's watchdog)
};
constexpr uint64_t TG_MEMORY_LIMIT = 32768;  // threadgroup memory of every Apple GPU family
struct Group {
  const LaunchDesc* L; void (*kernel)(); std::vector<Fiber> f; std::vector<char*> stacks; size_t stack_sz = 0;
  void* sched_sp = nullptr; ucontext_t sched_uc; int cur = -1; uint3 tgid, tgsz, dispatch_tg, ngroups; uint nthreads = 0;
  std::vector<std::vector<unsigned char>> tg_args; std::unordered_map<int, std::vector<unsigned char>> tg_locals;
  std::unordered_map<int, std::vector<unsigned char>> tg_snap;  // threadgroup memory at the last mem_threadgroup barrier
  std::vector<std::vector<unsigned char>> dev_snap;              // device buffers at the last mem_device barrier
  uint64_t tg_bytes = 0;                                         // threadgroup memory in use
  void** bufs = nullptr;  // guarded copies of the launch buffers
  std::string err; std::mt19937 rng; sigjmp_buf escape; bool escape_set = false;
};
inline thread_local Group* G = nullptr;
inline Fiber& me() { return G->f[G->cur]; }
inline std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string fmt(const char* f, ...) { char b[1024]; va_list ap; va_start(ap, f); vsnprintf(b, sizeof b, f, ap); va_end(ap); return b; }

// Abort the running launch from inside a GPU thread with a message (bounds errors, misuse).
[[noreturn]] inline void fail(const std::string& msg) {
  if (G && G->escape_set) {
    const Fiber& f = me();
    G->err = fmt("threadgroup %u,%u,%u thread %u,%u,%u: ", G->tgid.x, G->tgid.y, G->tgid.z, f.lid.x, f.lid.y, f.lid.z) + msg;
    siglongjmp(G->escape, 1);
  }
  fprintf(stderr, "msl_emu: %s\n", msg.c_str()); abort();
}

// ---- context switch -------------------------------------------------------------------------------
#if defined(__x86_64__) && defined(__linux__) && !defined(MSL_EMU_UCONTEXT)
#define MSL_EMU_ASM_SWITCH 1
extern "C" void msl_rt_ctx_switch(void** save_sp, void* to_sp);
asm(R"(
  .text
  .p2align 4
  .globl msl_rt_ctx_switch
  .hidden msl_rt_ctx_switch
  .type msl_rt_ctx_switch,@function
msl_rt_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size msl_rt_ctx_switch, .-msl_rt_ctx_switch
)");
#endif

inline void to_scheduler() {
#ifdef MSL_EMU_ASM_SWITCH
  msl_rt_ctx_switch(&me().sp, G->sched_sp);
#else
  swapcontext(&me().uc, &G->sched_uc);
#endif
}
inline void to_fiber(Group& g, int i) {
  g.cur = i;
#ifdef MSL_EMU_ASM_SWITCH
  msl_rt_ctx_switch(&g.sched_sp, g.f[i].sp);
#else
  swapcontext(&g.sched_uc, &g.f[i].uc);
#endif
}
inline void block(State s, const char* file, int line) { Fiber& m = me(); m.st = s; m.file = file; m.line = line; to_scheduler(); }
inline void fiber_main() {
  G->kernel();
  me().st = DONE;
  to_scheduler();  // never resumed
  abort();
}
inline void init_fiber(Group& g, uint i) {
  Fiber& f = g.f[i];
#ifdef MSL_EMU_ASM_SWITCH
  uintptr_t top = (uintptr_t)(g.stacks[i] + g.stack_sz) & ~uintptr_t(15);
  uint64_t* s = (uint64_t*)top;
  s[-1] = 0;                               // fake return address of fiber_main's frame
  s[-2] = (uint64_t)(uintptr_t)&fiber_main;  // popped by `ret`
  for (int k = 3; k <= 8; k++) s[-k] = 0;  // rbp rbx r12 r13 r14 r15
  uint32_t* csr = (uint32_t*)&s[-9];
  csr[0] = 0x1F80; csr[1] = 0x037F;        // default MXCSR and x87 control word
  f.sp = &s[-9];
#else
  getcontext(&f.uc); f.uc.uc_stack.ss_sp = g.stacks[i]; f.uc.uc_stack.ss_size = g.stack_sz; f.uc.uc_link = &g.sched_uc;
  makecontext(&f.uc, fiber_main, 0);
#endif
}

// SIMD-group exchange: deposit a value, wait until the SIMD-group's lanes are at this call site,
// then read the snapshot of every participating lane's value.
template <class T> inline Fiber& exchange(const T& v, const char* file, int line) {
  static_assert(sizeof(T) <= SLOT, "value too large for simd exchange");
  std::memcpy(me().slot, (const void*)&v, sizeof(T));
  block(AT_SIMD, file, line);
  return me();
}
template <class T> inline T lane_val(const Fiber& f, int lane) { T t; std::memcpy((void*)&t, f.view[lane], sizeof(T)); return t; }

inline bool same_site(const Fiber& a, const Fiber& b) { return a.line == b.line && !std::strcmp(a.file, b.file); }

// SIMD-groups progress independently, as on a GPU: as soon as every lane of a SIMD-group waits at
// the same SIMD-group function, that function is resolved and the SIMD-group runs on at once, before
// the other SIMD-groups of the threadgroup get to run (resolving it only once every fiber of the
// threadgroup had blocked made each SIMD-group function act as a threadgroup barrier, which hid
// races on threadgroup memory between SIMD-groups).
inline void run_simd_group_on(Group& g, uint s0) {
  const uint s1 = std::min(g.nthreads, s0 + SIMD);
  for (;;) {
    const Fiber* site = nullptr;
    for (uint i = s0; i < s1; i++) {
      const Fiber& f = g.f[i];
      if (f.st != AT_SIMD) return;
      if (site == nullptr) site = &f;
      else if (!same_site(f, *site)) return;
    }
    if (site == nullptr) return;
    uint32_t mask = 0;
    for (uint j = s0; j < s1; j++) mask |= 1u << (j - s0);
    for (uint j = s0; j < s1; j++) {
      Fiber& d = g.f[j];
      d.view_mask = mask;
      std::memset(d.view, 0xFF, sizeof d.view);
      for (uint k = s0; k < s1; k++) std::memcpy(d.view[k - s0], g.f[k].slot, SLOT);
    }
    for (uint j = s0; j < s1; j++) g.f[j].st = READY;
    for (uint j = s0; j < s1; j++) if (g.f[j].st == READY) to_fiber(g, j);
  }
}

// Memory visibility at a threadgroup barrier, as Metal defines it: stores to threadgroup memory become
// visible to the other threads only at a barrier whose flags include mem_threadgroup (device memory:
// mem_device, when the launch asks for it). At a barrier without the flag, every byte stored since the
// last barrier with it is poisoned (0xFF), for its writer too: stricter than a GPU, never looser.
constexpr int MEM_DEVICE = 1, MEM_THREADGROUP = 2;
inline void poison_unpublished(std::vector<unsigned char>& mem, std::vector<unsigned char>& snap, bool publish) {
  if (publish) { snap = mem; return; }
  if (snap.size() != mem.size()) snap.assign(mem.size(), 0xFF);  // nothing published yet: threadgroup memory starts as poison
  for (size_t i = 0; i < mem.size(); i++) if (mem[i] != snap[i]) mem[i] = 0xFF;
}
inline void barrier_visibility(Group& g, int flags) {
  const bool tg = flags & MEM_THREADGROUP;
  for (auto& kv : g.tg_locals) poison_unpublished(kv.second, g.tg_snap[kv.first], tg);
  for (size_t i = 0; i < g.tg_args.size(); i++) poison_unpublished(g.tg_args[i], g.tg_snap[-1 - int(i)], tg);
  if (g.L->device_vis) {
    for (int i = 0; i < g.L->nbuf; i++) {
      const size_t len = g.L->buf_len ? g.L->buf_len[i] : 0;
      unsigned char* d = (unsigned char*)g.bufs[i];
      auto& snap = g.dev_snap[i];
      if (flags & MEM_DEVICE) { snap.assign(d, d + len); continue; }
      for (size_t k = 0; k < len; k++) if (d[k] != snap[k]) d[k] = 0xFF;
    }
  }
}

inline bool run_group(Group& g) {
  const LaunchDesc& L = *g.L; uint n = g.nthreads;
  for (uint i = 0; i < n; i++) {
    Fiber& f = g.f[i]; f.st = READY; f.lin = i; f.file = "?"; f.line = 0; f.bflags = 0;
    f.lid = uint3(i % g.tgsz.x, (i / g.tgsz.x) % g.tgsz.y, i / (g.tgsz.x * g.tgsz.y));
    init_fiber(g, i);
  }
  std::vector<int> order(n); for (uint i = 0; i < n; i++) order[i] = i;
  for (;;) {
    if (L.sched == 1) std::reverse(order.begin(), order.end());
    else if (L.sched == 2) std::shuffle(order.begin(), order.end(), g.rng);
    bool ran = false;
    for (int i : order) {
      if (g.f[i].st == READY) {
        to_fiber(g, i);
        ran = true;
        run_simd_group_on(g, i - i % SIMD);
      }
    }
    if (ran) continue;
    uint done = 0, atb = 0, ats = 0;
    for (uint i = 0; i < n; i++) { done += g.f[i].st == DONE; atb += g.f[i].st == AT_BARRIER; ats += g.f[i].st == AT_SIMD; }
    if (done == n) return true;
    if (ats) {  // resolve SIMD-group functions, one SIMD-group at a time
      for (uint s0 = 0; s0 < n; s0 += SIMD) {
        uint s1 = std::min(n, s0 + SIMD);
        const Fiber* pick = nullptr; bool divergent = false; uint exited = 0, elsewhere = 0;
        for (uint i = s0; i < s1; i++) {
          const Fiber& f = g.f[i];
          if (f.st == DONE) { exited++; continue; }
          if (f.st == AT_BARRIER) { divergent = true; elsewhere++; continue; }
          if (!pick) { pick = &f; continue; }
          if (!same_site(f, *pick)) {
            divergent = true; elsewhere++;
            int c = f.line != pick->line ? f.line - pick->line : std::strcmp(f.file, pick->file);
            if (c < 0) pick = &f;  // non-strict heuristic: the textually earliest site runs first
          }
        }
        if (!pick) continue;
        if (L.strict && (divergent || exited)) {
          g.err = fmt("threadgroup %u,%u,%u simdgroup %u: SIMD-group function at %s:%d called in divergent control flow "
                      "(%u lanes of the simdgroup already returned, %u wait at another call site or barrier); "
                      "rerun with strict=False for GPU-like active-lane semantics",
                      g.tgid.x, g.tgid.y, g.tgid.z, s0 / SIMD, pick->file, pick->line, exited, elsewhere);
          return false; }
        uint32_t mask = 0; std::vector<uint> members;
        for (uint j = s0; j < s1; j++) if (g.f[j].st == AT_SIMD && same_site(g.f[j], *pick)) { mask |= 1u << (j - s0); members.push_back(j); }
        for (uint j : members) { Fiber& d = g.f[j]; d.view_mask = mask; std::memset(d.view, 0xFF, sizeof d.view);
          for (uint k : members) std::memcpy(d.view[k - s0], g.f[k].slot, SLOT); }
        for (uint j : members) g.f[j].st = READY;
      }
      continue;
    }
    // everybody still alive waits at a threadgroup barrier
    const Fiber* first = nullptr;
    for (uint i = 0; i < n; i++) if (g.f[i].st == AT_BARRIER) {
      if (!first) first = &g.f[i];
      else if (!same_site(g.f[i], *first)) {
        g.err = fmt("threadgroup %u,%u,%u: threads wait at different threadgroup_barrier calls (%s:%d thread %u vs %s:%d thread %u)",
                    g.tgid.x, g.tgid.y, g.tgid.z, first->file, first->line, first->lin, g.f[i].file, g.f[i].line, i);
        return false; }
    }
    if (done && L.strict) {
      g.err = fmt("threadgroup %u,%u,%u: threadgroup_barrier at %s:%d reached by %u of %u threads; the others already returned "
                  "(undefined behaviour in Metal)", g.tgid.x, g.tgid.y, g.tgid.z, first->file, first->line, atb, n);
      return false; }
    barrier_visibility(g, first->bflags);
    for (uint i = 0; i < n; i++) if (g.f[i].st == AT_BARRIER) g.f[i].st = READY;
  }
}

// ---- guarded device buffers -----------------------------------------------------------------------
struct Guarded { char* map = nullptr; size_t map_len = 0; char* data = nullptr; uint64_t len = 0; char* lo_guard = nullptr; char* hi_guard = nullptr; };
inline std::vector<Guarded>& guarded() { static std::vector<Guarded> v; return v; }
inline std::mutex& launch_mutex() { static std::mutex m; return m; }
inline struct sigaction& prev_segv() { static struct sigaction a; return a; }
inline struct sigaction& prev_bus() { static struct sigaction a; return a; }

// The program counter a signal interrupted (0 where the platform's context is not known here).
inline uintptr_t interrupted_pc(void* uctx) {
#if defined(__x86_64__) && defined(__linux__)
  return (uintptr_t)((ucontext_t*)uctx)->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__) && defined(__linux__)
  return (uintptr_t)((ucontext_t*)uctx)->uc_mcontext.pc;
#else
  (void)uctx;
  return 0;
#endif
}

inline void on_fault(int sig, siginfo_t* si, void* uctx) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  char* a = (char*)si->si_addr;
  auto& gv = guarded();
  const bool in_kernel = G && G->escape_set && G->cur >= 0;
  if (in_kernel) {
    const uintptr_t pc = interrupted_pc(uctx);
    Dl_info info{}; uintptr_t rel = pc;
    if (pc && dladdr((void*)pc, &info) && info.dli_fbase) rel = pc - (uintptr_t)info.dli_fbase;
    const Fiber& f = G->f[G->cur];
    uint3 gpos = G->tgid * G->dispatch_tg + f.lid;
    for (size_t i = 0; i < gv.size(); i++) {
      const Guarded& b = gv[i];
      bool lo = a >= b.lo_guard && a < b.lo_guard + page, hi = a >= b.hi_guard && a < b.hi_guard + page;
      if (!(lo || hi)) continue;
      long long off = (long long)(a - b.data);
      G->err = fmt("out-of-bounds device memory access: buffer(%zu) holds %llu bytes, accessed at byte offset %lld (%s) "
                   "by thread_position_in_grid %u,%u,%u (threadgroup %u,%u,%u) [pc=+0x%llx]",
                   i, (unsigned long long)b.len, off, lo ? "before the start" : "past the end",
                   gpos.x, gpos.y, gpos.z, G->tgid.x, G->tgid.y, G->tgid.z, (unsigned long long)rel);
      siglongjmp(G->escape, 1);
    }
    // Not next to any buffer: a wild pointer (an index far outside every buffer, e.g. a negative
    // cell index scaled by a row size). Reported the same way instead of crashing the process.
    G->err = fmt("invalid memory access at address %p, not next to any bound buffer (an index far outside a buffer) "
                 "by thread_position_in_grid %u,%u,%u (threadgroup %u,%u,%u) [pc=+0x%llx]",
                 (void*)a, gpos.x, gpos.y, gpos.z, G->tgid.x, G->tgid.y, G->tgid.z, (unsigned long long)rel);
    siglongjmp(G->escape, 1);
  }
  // not ours: hand the fault to whoever was installed before (pytest's faulthandler, or the default)
  sigaction(sig, sig == SIGSEGV ? &prev_segv() : &prev_bus(), nullptr);
}

inline void guard_buffers(const LaunchDesc* L) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  auto& gv = guarded(); gv.assign(L->nbuf, Guarded{});
  for (int i = 0; i < L->nbuf; i++) {
    Guarded& b = gv[i]; b.len = L->buf_len ? L->buf_len[i] : 0;
    size_t body = ((b.len ? b.len : 1) + page - 1) / page * page;
    b.map_len = body + 2 * page;
    b.map = (char*)mmap(nullptr, b.map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (b.map == MAP_FAILED) { fprintf(stderr, "msl_emu: mmap failed\n"); abort(); }
    b.lo_guard = b.map; b.hi_guard = b.map + page + body;
    mprotect(b.lo_guard, page, PROT_NONE); mprotect(b.hi_guard, page, PROT_NONE);
    std::memset(b.map + page, 0xA5, body);  // slack bytes, checked after the launch for stray writes
    b.data = L->guard == 1 ? b.map + page : b.hi_guard - b.len;
    if (b.len) std::memcpy(b.data, L->buffers[i], b.len);
  }
}
// Copies the buffers back and unmaps them; returns "" or a description of a write into the slack
// bytes between a buffer and its guard page (an out-of-bounds write that did not reach the guard).
inline std::string unguard_buffers(const LaunchDesc* L) {
  std::string err;
  auto& gv = guarded();
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  for (size_t i = 0; i < gv.size(); i++) {
    Guarded& b = gv[i];
    if (b.len) std::memcpy(L->buffers[i], b.data, b.len);
    for (char* p = b.map + page; p < b.hi_guard && err.empty(); p++) {
      if (p >= b.data && p < b.data + b.len) { p = b.data + b.len - 1; continue; }
      if ((unsigned char)*p != 0xA5)
        err = fmt("out-of-bounds device memory write: buffer(%zu) holds %llu bytes, byte offset %lld was written",
                  i, (unsigned long long)b.len, (long long)(p - b.data));
    }
    munmap(b.map, b.map_len);
  }
  gv.clear();
  return err;
}

// ---- the watchdog -----------------------------------------------------------------------------------
// A GPU aborts a command buffer whose kernel runs too long; here each worker thread gets a timer on its
// own CPU clock (so a loaded machine does not trip it) that sends SIGVTALRM to that thread once the
// launch has used `watchdog_s` CPU seconds. The handler leaves through the threadgroup's escape, as a
// fault does, with the GPU thread and the kernel's program counter (msl_emu.py turns it into the
// source line). Interrupted outside this module (libc, libm: a malloc holding its lock, say), it
// re-arms for a millisecond later instead, so the escape never leaves a library's state half-done.
#ifndef sigev_notify_thread_id
#define sigev_notify_thread_id _sigev_un._tid
#endif
struct Watchdog { timer_t id{}; bool armed = false; double budget = 0; };
inline thread_local Watchdog* WD = nullptr;
inline struct sigaction& prev_vtalrm() { static struct sigaction a; return a; }

inline void arm_watchdog(Watchdog& w, double seconds) {
  struct itimerspec its; std::memset(&its, 0, sizeof its);
  its.it_value.tv_sec = (time_t)seconds; its.it_value.tv_nsec = (long)((seconds - (double)(time_t)seconds) * 1e9);
  if (its.it_value.tv_sec == 0 && its.it_value.tv_nsec == 0) its.it_value.tv_nsec = 1;
  timer_settime(w.id, 0, &its, nullptr);
}

inline void on_watchdog(int, siginfo_t*, void* uctx) {
  if (!WD) return;                                       // the launch is over
  if (!G || !G->escape_set) { arm_watchdog(*WD, 1e-3); return; }  // between threadgroups: stop the next one
  const uintptr_t pc = interrupted_pc(uctx);
  Dl_info here{}, info{};
  dladdr((void*)&on_watchdog, &here);
  if (!pc || !dladdr((void*)pc, &info) || info.dli_fbase != here.dli_fbase) { arm_watchdog(*WD, 1e-3); return; }
  uintptr_t rel = pc - (uintptr_t)info.dli_fbase;
  const Fiber* f = G->cur >= 0 ? &G->f[G->cur] : nullptr;
  if (f) {
    uint3 gpos = G->tgid * G->dispatch_tg + f->lid;
    G->err = fmt("watchdog: the launch ran past its budget of %g CPU seconds (a GPU aborts the command buffer): "
                 "thread_position_in_grid %u,%u,%u (threadgroup %u,%u,%u) was running [pc=+0x%llx]", WD->budget,
                 gpos.x, gpos.y, gpos.z, G->tgid.x, G->tgid.y, G->tgid.z, (unsigned long long)rel);
  } else {
    G->err = fmt("watchdog: the launch ran past its budget of %g CPU seconds (a GPU aborts the command buffer) "
                 "in threadgroup %u,%u,%u", WD->budget, G->tgid.x, G->tgid.y, G->tgid.z);
  }
  siglongjmp(G->escape, 1);
}

inline bool start_watchdog(Watchdog& w, double seconds) {
  clockid_t cpu;
  if (seconds <= 0 || pthread_getcpuclockid(pthread_self(), &cpu) != 0) return false;
  struct sigevent ev; std::memset(&ev, 0, sizeof ev);
  ev.sigev_notify = SIGEV_THREAD_ID; ev.sigev_signo = SIGVTALRM; ev.sigev_notify_thread_id = (pid_t)syscall(SYS_gettid);
  if (timer_create(cpu, &ev, &w.id) != 0) return false;
  w.armed = true; w.budget = seconds; WD = &w;
  arm_watchdog(w, seconds);
  return true;
}

inline void stop_watchdog(Watchdog& w) {
  WD = nullptr;
  if (w.armed) timer_delete(w.id);
  w.armed = false;
}

inline int launch(const LaunchDesc* L, void (*kernel)()) {
  std::lock_guard<std::mutex> lock(launch_mutex());
  uint3 tg(L->tg[0], L->tg[1], L->tg[2]), ng, gridthreads;
  if (L->mode == 0) { ng = uint3(L->grid[0], L->grid[1], L->grid[2]); gridthreads = ng * tg; }
  else { gridthreads = uint3(L->grid[0], L->grid[1], L->grid[2]); ng = (gridthreads + tg - 1u) / tg; }
  uint total = ng.x * ng.y * ng.z;
  guard_buffers(L);
  struct sigaction sa; std::memset(&sa, 0, sizeof sa); sa.sa_sigaction = on_fault; sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &prev_segv()); sigaction(SIGBUS, &sa, &prev_bus());
  struct sigaction wa; std::memset(&wa, 0, sizeof wa); wa.sa_sigaction = on_watchdog; wa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&wa.sa_mask);
  if (L->watchdog_s > 0) sigaction(SIGVTALRM, &wa, &prev_vtalrm());
  std::vector<void*> gbufs(L->nbuf); for (int i = 0; i < L->nbuf; i++) gbufs[i] = guarded()[i].data;
  std::atomic<uint> next{0}; std::atomic<bool> failed{false}; std::string err; std::mutex err_mu;
  std::vector<uint> gorder(total); for (uint i = 0; i < total; i++) gorder[i] = i;
  if (L->sched == 2) std::shuffle(gorder.begin(), gorder.end(), std::mt19937(L->seed));
  else if (L->sched == 1) std::reverse(gorder.begin(), gorder.end());
  auto worker = [&](int wid) {
    stack_t alt; alt.ss_size = 1 << 16; alt.ss_flags = 0; alt.ss_sp = malloc(alt.ss_size); stack_t old_alt; sigaltstack(&alt, &old_alt);
    Group g; g.L = L; g.kernel = kernel; g.bufs = gbufs.data(); g.rng.seed(L->seed * 7919u + wid);
    uint maxn = tg.x * tg.y * tg.z; g.f.resize(maxn); g.stack_sz = (L->stack_kb ? L->stack_kb : 256) * 1024;
    for (uint i = 0; i < maxn; i++) g.stacks.push_back((char*)mmap(nullptr, g.stack_sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    G = &g;
    Watchdog wd; start_watchdog(wd, L->watchdog_s);
    for (uint k; !failed && (k = next++) < total;) {
      uint gi = gorder[k];
      g.tgid = uint3(gi % ng.x, (gi / ng.x) % ng.y, gi / (ng.x * ng.y)); g.ngroups = ng; g.dispatch_tg = tg;
      g.tgsz = L->mode == 0 ? tg : min(tg, gridthreads - g.tgid * tg);  // partial edge groups with dispatchThreads
      g.nthreads = g.tgsz.x * g.tgsz.y * g.tgsz.z;
      g.tg_args.assign(L->ntg, {}); for (int i = 0; i < L->ntg; i++) g.tg_args[i].assign(L->tg_len[i], 0xFF);  // poison
      g.tg_locals.clear(); g.tg_snap.clear(); g.cur = -1; g.err.clear();
      g.tg_bytes = 0; for (int i = 0; i < L->ntg; i++) g.tg_bytes += L->tg_len[i];
      if (L->device_vis) {  // this threadgroup's stores are tracked from its start
        g.dev_snap.assign(L->nbuf, {});
        for (int i = 0; i < L->nbuf; i++) { unsigned char* d = (unsigned char*)gbufs[i]; g.dev_snap[i].assign(d, d + (L->buf_len ? L->buf_len[i] : 0)); }
      }
      bool ok;
      if (sigsetjmp(g.escape, 1) == 0) { g.escape_set = true; ok = run_group(g); }
      else ok = false;  // escaped from a fiber: fault or failed check; g.err says which
      g.escape_set = false;
      if (!ok) { std::lock_guard<std::mutex> l(err_mu); if (!failed.exchange(true)) err = g.err; }
    }
    stop_watchdog(wd);
    for (char* s : g.stacks) munmap(s, g.stack_sz);
    G = nullptr;
    sigaltstack(&old_alt, nullptr); free(alt.ss_sp);
  };
  int nw = std::max(1, L->workers);
  if (nw == 1) worker(0);
  else { std::vector<std::thread> ts; for (int w = 0; w < nw; w++) ts.emplace_back(worker, w); for (auto& t : ts) t.join(); }
  sigaction(SIGSEGV, &prev_segv(), nullptr); sigaction(SIGBUS, &prev_bus(), nullptr);
  if (L->watchdog_s > 0) sigaction(SIGVTALRM, &prev_vtalrm(), nullptr);
  std::string werr = unguard_buffers(L);
  if (!failed && !werr.empty()) { failed = true; err = werr; }
  if (failed) { if (L->err) snprintf(L->err, L->errlen, "%s", err.c_str()); return 1; }
  return 0;
}

// ---- bounds-checked threadgroup memory --------------------------------------------------------------
// `threadgroup T name[A][B];` in a kernel body becomes `auto& name = tg_local<tgarray<T, A, B>>(id);`
// and `threadgroup T*` becomes `tgptr<T>` (msl_emu.py rewrites both), so every index is checked.
template <class T> struct tgptr;
template <class T, size_t N, size_t... R> struct tgarray;
template <class T, size_t... R> struct tg_elem { using type = tgarray<T, R...>; };
template <class T> struct tg_elem<T> { using type = T; };
template <class T, size_t N, size_t... R> struct tgarray {
  using Elem = typename tg_elem<T, R...>::type;
  Elem a[N];
  template <class I> static void check(I i) {
    if constexpr (std::is_signed_v<I>) { if (i < 0) fail(fmt("threadgroup array index %lld out of bounds [0, %zu)", (long long)i, N)); }
    if ((unsigned long long)i >= N) fail(fmt("threadgroup array index %llu out of bounds [0, %zu)", (unsigned long long)i, N));
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0> Elem& operator[](I i) { check(i); return a[i]; }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0> const Elem& operator[](I i) const { check(i); return a[i]; }
};
template <class T> struct tgptr {
  T* base = nullptr; size_t n = 0; ptrdiff_t off = 0;
  tgptr() = default;
  tgptr(T* b, size_t len, ptrdiff_t o) : base(b), n(len), off(o) {}
  template <class U, size_t N, std::enable_if_t<std::is_same_v<std::remove_const_t<T>, U>, int> = 0>
  tgptr(tgarray<U, N>& arr) : base(arr.a), n(N), off(0) {}
  template <class U, std::enable_if_t<std::is_same_v<std::remove_const_t<T>, std::remove_const_t<U>> && !std::is_same_v<T, U>, int> = 0>
  tgptr(const tgptr<U>& o) : base(o.base), n(o.n), off(o.off) {}
  template <class I> T& at(I i) const {
    long long k = (long long)off + (long long)i;
    if (k < 0 || (unsigned long long)k >= n) fail(fmt("threadgroup pointer access at element %lld out of bounds [0, %zu)", k, n));
    return base[k];
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0> T& operator[](I i) const { return at(i); }
  T& operator*() const { return at(0); }
  T* operator->() const { return &at(0); }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0> tgptr operator+(I i) const { return tgptr(base, n, off + (ptrdiff_t)i); }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0> tgptr operator-(I i) const { return tgptr(base, n, off - (ptrdiff_t)i); }
  template <class I> tgptr& operator+=(I i) { off += (ptrdiff_t)i; return *this; }
  template <class I> tgptr& operator-=(I i) { off -= (ptrdiff_t)i; return *this; }
  tgptr& operator++() { ++off; return *this; }
  ptrdiff_t operator-(const tgptr& o) const { return off - o.off; }
};

// ---- kernel parameter binding (default arguments produced by the attribute macros) ----
constexpr int zero_idx[1] = {0};
struct BufArg {
  void* p; size_t len;
  template <class T, std::enable_if_t<std::is_pointer_v<T>, int> = 0> operator T() const { return (T)p; }
  template <class T, std::enable_if_t<!std::is_pointer_v<T>, int> = 0> operator T&() const { return *(T*)p; }
  template <class T> operator tgptr<T>() const { return tgptr<T>((T*)p, len / sizeof(T), 0); }
};
struct BufTable { void* base; size_t len; BufArg operator[](int) const { return BufArg{base, len}; } };
inline BufTable buffer_arg(int i) {
  if (i >= G->L->nbuf) fail(fmt("buffer(%d) is not bound (the launch binds %d buffers)", i, G->L->nbuf));
  return BufTable{G->bufs[i], (size_t)(G->L->buf_len ? G->L->buf_len[i] : 0)};
}
inline BufTable tg_arg(int i) {
  if (i >= (int)G->tg_args.size() || G->tg_args[i].empty()) fail(fmt("threadgroup(%d) memory length not set", i));
  return BufTable{G->tg_args[i].data(), G->tg_args[i].size()};
}
template <class T> inline T& tg_local(int id) {  // threadgroup variables declared in the kernel body: one poisoned copy per threadgroup
  auto& v = G->tg_locals[id];
  if (v.empty()) {
    G->tg_bytes += sizeof(T);
    if (G->tg_bytes > TG_MEMORY_LIMIT)
      fail(fmt("threadgroup memory of %llu bytes exceeds the %llu bytes of an Apple GPU", (unsigned long long)G->tg_bytes,
               (unsigned long long)TG_MEMORY_LIMIT));
    v.assign(sizeof(T), 0xFF);
  }
  return *reinterpret_cast<T*>(v.data()); }
enum BI { tpig, tpitg, tgpig, tptg, tgpg, tpg, tiitg, tiisg, siitg, tpsg, sgptg, dtptg };
struct BuiltinVal {
  uint3 v;
  template <class T> operator T() const {
    if constexpr (detail::is_vec_v<T>) { T r; for (int i = 0; i < T::size; i++) r.data[i] = typename detail::vi<T>::elem(v[i]); return r; }
    else return T(v.x);
  }
};
struct Builtin { BI b; BuiltinVal operator[](int) const {
  const Fiber& f = me(); uint3 r;
  switch (b) {
    case tpig: r = G->tgid * G->dispatch_tg + f.lid; break;
    case tpitg: r = f.lid; break;
    case tgpig: r = G->tgid; break;
    case tptg: r = G->tgsz; break;
    case dtptg: r = G->dispatch_tg; break;
    case tgpg: r = G->ngroups; break;
    case tpg: r = G->L->mode == 0 ? G->ngroups * G->dispatch_tg : uint3(G->L->grid[0], G->L->grid[1], G->L->grid[2]); break;
    case tiitg: r = uint3(f.lin); break;
    case tiisg: r = uint3(f.lin % SIMD); break;
    case siitg: r = uint3(f.lin / SIMD); break;
    case tpsg: r = uint3(SIMD); break;
    case sgptg: r = uint3((G->nthreads + SIMD - 1) / SIMD); break;
  }
  return BuiltinVal{r}; } };
}  // namespace msl_rt

// ---- barriers and SIMD-group functions ----
namespace metal {
inline void threadgroup_barrier(mem_flags flags, const char* file, int line) { msl_rt::me().bflags = int(flags); msl_rt::block(msl_rt::AT_BARRIER, file, line); }
inline void simdgroup_barrier(mem_flags, const char* file, int line) { msl_rt::exchange(0, file, line); }
#define MSL_SIMD_ARGS const char* file = __builtin_FILE(), int line = __builtin_LINE()
#define MSL_SIMD_REDUCE(name, init, op)                                                                \
  template <class T> inline T name(T v, MSL_SIMD_ARGS) {                                                \
    auto& f = msl_rt::exchange(v, file, line); T acc = init;                                           \
    for (int l = 0; l < msl_rt::SIMD; l++) if (f.view_mask >> l & 1) { T x = msl_rt::lane_val<T>(f, l); acc = op; } \
    return acc; }
}  // namespace metal
namespace msl_rt {
// Sum / product of lanes [0, upto] of the exchange in a random binary tree (adjacent partial results
// merged in an order drawn from the launch's simd_seed, the call site, the active lanes and `salt`),
// as a GPU's reduction tree may combine them; lane order when simd_seed is 0. Like a GPU, the same
// function at the same site over the same lanes combines them the same way in every SIMD-group.
template <class T, class Op> inline T tree_reduce(const Fiber& f, uint upto, uint salt, Op op) {
  T vals[SIMD]; int n = 0;
  for (uint l = 0; l <= upto && l < (uint)SIMD; l++) if (f.view_mask >> l & 1) vals[n++] = lane_val<T>(f, l);
  if (n == 0) return T(0);
  if (G->L->simd_seed == 0) { T acc = vals[0]; for (int i = 1; i < n; i++) acc = op(acc, vals[i]); return acc; }
  uint64_t h = G->L->simd_seed * 0x9E3779B97F4A7C15ull ^ uint64_t(f.line) * 0xC2B2AE3D27D4EB4Full;
  for (const char* c = f.file; c && *c; ++c) h = h * 1099511628211ull ^ uint64_t((unsigned char)*c);
  h ^= uint64_t(f.view_mask) * 0x165667B19E3779F9ull ^ salt;
  std::mt19937_64 r(h);
  while (n > 1) {
    const int i = int(r() % uint64_t(n - 1));
    vals[i] = op(vals[i], vals[i + 1]);
    for (int k = i + 1; k + 1 < n; k++) vals[k] = vals[k + 1];
    n--;
  }
  return vals[0];
}
}  // namespace msl_rt
namespace metal {
template <class T> inline T simd_sum(T v, MSL_SIMD_ARGS) {
  auto& f = msl_rt::exchange(v, file, line); return msl_rt::tree_reduce<T>(f, msl_rt::SIMD - 1, 0, [](T a, T b) { return T(a + b); }); }
template <class T> inline T simd_product(T v, MSL_SIMD_ARGS) {
  auto& f = msl_rt::exchange(v, file, line); return msl_rt::tree_reduce<T>(f, msl_rt::SIMD - 1, 0, [](T a, T b) { return T(a * b); }); }
MSL_SIMD_REDUCE(simd_max, (msl_rt::lane_val<T>(f, __builtin_ctz(f.view_mask))), max(acc, x))
MSL_SIMD_REDUCE(simd_min, (msl_rt::lane_val<T>(f, __builtin_ctz(f.view_mask))), min(acc, x))
MSL_SIMD_REDUCE(simd_and, T(~T(0)), acc & x) MSL_SIMD_REDUCE(simd_or, T(0), acc | x) MSL_SIMD_REDUCE(simd_xor, T(0), acc ^ x)
template <class T> inline T simd_prefix_inclusive_sum(T v, MSL_SIMD_ARGS) { auto& f = msl_rt::exchange(v, file, line); uint me = msl_rt::me().lin % msl_rt::SIMD;
  return msl_rt::tree_reduce<T>(f, me, me + 1, [](T a, T b) { return T(a + b); }); }
template <class T> inline T simd_prefix_exclusive_sum(T v, MSL_SIMD_ARGS) { auto& f = msl_rt::exchange(v, file, line); uint me = msl_rt::me().lin % msl_rt::SIMD;
  return me == 0 ? T(0) : msl_rt::tree_reduce<T>(f, me - 1, me + 1, [](T a, T b) { return T(a + b); }); }
template <class T> inline T simd_shuffle(T v, ushort lane, MSL_SIMD_ARGS) { auto& f = msl_rt::exchange(v, file, line); return msl_rt::lane_val<T>(f, lane % msl_rt::SIMD); }  // inactive source lane -> poison (0xFF bytes)
template <class T> inline T simd_broadcast(T v, ushort lane, MSL_SIMD_ARGS) { return simd_shuffle(v, lane, file, line); }
template <class T> inline T simd_shuffle_xor(T v, ushort m, MSL_SIMD_ARGS) { auto& f = msl_rt::exchange(v, file, line); return msl_rt::lane_val<T>(f, (msl_rt::me().lin % msl_rt::SIMD) ^ m); }
template <class T> inline T simd_shuffle_down(T v, ushort d, MSL_SIMD_ARGS) { auto& f = msl_rt::exchange(v, file, line); uint l = msl_rt::me().lin % msl_rt::SIMD + d; return l < (uint)msl_rt::SIMD ? msl_rt::lane_val<T>(f, l) : v; }
template <class T> inline T simd_shuffle_up(T v, ushort d, MSL_SIMD_ARGS) { auto& f = msl_rt::exchange(v, file, line); int l = int(msl_rt::me().lin % msl_rt::SIMD) - d; return l >= 0 ? msl_rt::lane_val<T>(f, l) : v; }
template <class T> inline T simd_broadcast_first(T v, MSL_SIMD_ARGS) { auto& f = msl_rt::exchange(v, file, line); return msl_rt::lane_val<T>(f, __builtin_ctz(f.view_mask)); }
inline bool simd_all(bool b, MSL_SIMD_ARGS) { auto& f = msl_rt::exchange(b, file, line); for (int l = 0; l < msl_rt::SIMD; l++) if ((f.view_mask >> l & 1) && !msl_rt::lane_val<bool>(f, l)) return false; return true; }
inline bool simd_any(bool b, MSL_SIMD_ARGS) { auto& f = msl_rt::exchange(b, file, line); for (int l = 0; l < msl_rt::SIMD; l++) if ((f.view_mask >> l & 1) && msl_rt::lane_val<bool>(f, l)) return true; return false; }
inline bool simd_is_first(MSL_SIMD_ARGS) { auto& f = msl_rt::exchange(0, file, line); return int(msl_rt::me().lin % msl_rt::SIMD) == __builtin_ctz(f.view_mask); }
}  // namespace metal

// ---- simdgroup_matrix<T, 8, 8> ------------------------------------------------------------------------
// An 8x8 matrix spread over the 32 lanes of a SIMD-group: each lane holds two elements, (row, col) and
// (row, col + 1) of simd_matrix_coord() (the layout MLX's steel kernels assume for Apple GPUs; only the
// hardware is authoritative, so a kernel that touches thread_elements() depends on it). Every
// function below is a SIMD-group function: it exchanges the lanes' elements (or arguments) through
// the SIMD-group exchange, so in strict mode every lane must reach the same call site, and a load or
// store whose pointer, elements_per_row, origin or transpose flag differ between lanes is refused.
// Loads and stores go through the lane's own pointer (device: guard-paged buffers; threadgroup: the
// bounds-checked tgptr), each lane touching its two elements. A default-constructed matrix is poison
// (NaN), as uninitialised registers would be. The 8 products of an output element (and, for
// multiply_accumulate, the addend c) are summed in a random binary tree drawn from simd_seed and the
// call site (lane order when simd_seed is 0), each product and sum rounded to T: a kernel whose bits
// depend on the hardware's order, or that assumes a wider accumulator than T, shows.
namespace metal {
template <class T, int Cols, int Rows> struct simdgroup_matrix;
template <class T> struct simdgroup_matrix<T, 8, 8> {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat>,
                "MSL: simdgroup_matrix element types are float, half and bfloat");
  vec<T, 2> e;
  simdgroup_matrix() { std::memset((void*)&e, 0xFF, sizeof e); }
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
}  // namespace metal
namespace msl_rt {
// (row, first column) of the two elements lane `lane` holds.
inline void simd_matrix_coord(uint lane, uint& row, uint& col) {
  const uint qid = lane / 4;
  row = (qid & 4u) + (lane / 2) % 4;
  col = (qid & 2u) * 2 + (lane % 2) * 2;
}
inline float mat_f(float x) { return x; }
inline float mat_f(half x) { return float(x); }
inline float mat_f(bfloat x) { return float(x); }
template <class T> inline T mat_t(float x) { return T(x); }
// Arguments of a load / store, deposited in the exchange so every lane can compare them.
struct MatArgs { uint64_t ptr; uint64_t epr; uint64_t ox, oy; uint32_t transpose; uint32_t kind; };
inline void check_uniform_args(const Fiber& f, const char* what) {
  const MatArgs mine = lane_val<MatArgs>(f, int(me().lin % SIMD));
  for (int l = 0; l < SIMD; l++) {
    if (!(f.view_mask >> l & 1)) continue;
    const MatArgs o = lane_val<MatArgs>(f, l);
    if (std::memcmp(&o, &mine, sizeof o) != 0)
      fail(fmt("%s at %s:%d: its arguments (pointer, elements_per_row, matrix_origin, transpose) differ between the "
               "lanes of the SIMD-group (lane %d vs lane %u); they must be uniform", what, f.file, f.line, l,
               me().lin % SIMD));
  }
}
// The source / destination element of matrix element (r, c).
inline uint64_t mat_index(uint r, uint c, uint64_t epr, uint64_t ox, uint64_t oy, bool transpose) {
  return transpose ? (oy + c) * epr + ox + r : (oy + r) * epr + ox + c;
}
inline uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z += 0x9E3779B97F4A7C15ull; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// The merge sequence of the random binary tree over n leaves (in order) at a call site: step s merges
// the partial results at positions m[s] and m[s] + 1 (as tree_reduce does).
inline void mat_tree(const Fiber& f, int n, uint salt, int* m) {
  if (G->L->simd_seed == 0) { for (int s = 0; s < n - 1; s++) m[s] = 0; return; }
  uint64_t h = G->L->simd_seed * 0x9E3779B97F4A7C15ull ^ uint64_t(f.line) * 0xC2B2AE3D27D4EB4Full ^ salt;
  for (const char* c = f.file; c && *c; ++c) h = h * 1099511628211ull ^ uint64_t((unsigned char)*c);
  for (int s = 0, left = n; s < n - 1; s++, left--) { h = mix64(h); m[s] = int(h % uint64_t(left - 1)); }
}
template <class T> inline T mat_tree_sum(T* v, int n, const int* m) {
  for (int s = 0, left = n; s < n - 1; s++, left--) {
    const int i = m[s];
    v[i] = mat_t<T>(mat_f(v[i]) + mat_f(v[i + 1]));
    for (int k = i + 1; k + 1 < left; k++) v[k] = v[k + 1];
  }
  return v[0];
}
template <class T> struct MatOps { vec<T, 2> a, b, c; };
// D = A B (+ C): every lane gathers A, B (and C) from the exchange and computes its own two elements.
template <class T> inline void mat_multiply(metal::simdgroup_matrix<T, 8, 8>& d, const metal::simdgroup_matrix<T, 8, 8>& a,
                                            const metal::simdgroup_matrix<T, 8, 8>& b, const metal::simdgroup_matrix<T, 8, 8>* c,
                                            const char* file, int line) {
  MatOps<T> mine{a.e, b.e, c ? c->e : vec<T, 2>(T(0))};
  auto& f = exchange(mine, file, line);
  if (f.view_mask != 0xFFFFFFFFu) fail(fmt("simdgroup_multiply at %s:%d with %d of 32 lanes of the SIMD-group", file, line, __builtin_popcount(f.view_mask)));
  T A[8][8], B[8][8], C[8][8];
  for (uint l = 0; l < uint(SIMD); l++) {
    const MatOps<T> o = lane_val<MatOps<T>>(f, int(l));
    uint r, col; simd_matrix_coord(l, r, col);
    for (int k = 0; k < 2; k++) { A[r][col + k] = o.a[k]; B[r][col + k] = o.b[k]; C[r][col + k] = o.c[k]; }
  }
  const int n = c ? 9 : 8;
  int m[8]; mat_tree(f, n, c ? 0x5A5Au : 0xA5A5u, m);
  uint r, col; simd_matrix_coord(me().lin % SIMD, r, col);
  vec<T, 2> out;
  for (int k = 0; k < 2; k++) {
    T v[9]; int i = 0;
    if (c) v[i++] = C[r][col + k];
    for (int j = 0; j < 8; j++) v[i++] = mat_t<T>(mat_f(A[r][j]) * mat_f(B[j][col + k]));
    out[k] = mat_tree_sum(v, n, m);
  }
  d.e = out;
}
template <class P> inline uint64_t mat_ptr_id(const P* p) { return (uint64_t)(uintptr_t)p; }
template <class P> inline uint64_t mat_ptr_id(const tgptr<P>& p) { return (uint64_t)(uintptr_t)(p.base + p.off); }
template <class T, class P> inline void mat_load(metal::simdgroup_matrix<T, 8, 8>& d, const P& src, uint64_t epr, metal::ulong2 o,
                                                 bool transpose, const char* file, int line) {
  MatArgs args{mat_ptr_id(src), epr, (uint64_t)o.x, (uint64_t)o.y, uint32_t(transpose), 1u};
  auto& f = exchange(args, file, line);
  check_uniform_args(f, "simdgroup_load");
  uint r, c; simd_matrix_coord(me().lin % SIMD, r, c);
  for (uint k = 0; k < 2; k++) d.e[k] = src[mat_index(r, c + k, epr, o.x, o.y, transpose)];
}
template <class T, class P> inline void mat_store(const metal::simdgroup_matrix<T, 8, 8>& s, const P& dst, uint64_t epr, metal::ulong2 o,
                                                  bool transpose, const char* file, int line) {
  MatArgs args{mat_ptr_id(dst), epr, (uint64_t)o.x, (uint64_t)o.y, uint32_t(transpose), 2u};
  auto& f = exchange(args, file, line);
  check_uniform_args(f, "simdgroup_store");
  uint r, c; simd_matrix_coord(me().lin % SIMD, r, c);
  for (uint k = 0; k < 2; k++) dst[mat_index(r, c + k, epr, o.x, o.y, transpose)] = s.e[k];
}
}  // namespace msl_rt
namespace metal {
template <class T, int C, int R> inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(const T value) {
  simdgroup_matrix<T, C, R> m; m.e = vec<T, 2>(value); return m; }
// device memory (the guarded buffers)
template <class T> inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const T* src, ulong elements_per_row = 8,
                                              ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false, MSL_SIMD_ARGS) {
  msl_rt::mat_load(d, src, elements_per_row, matrix_origin, transpose_matrix, file, line); }
template <class T> inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& s, T* dst, ulong elements_per_row = 8,
                                               ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false, MSL_SIMD_ARGS) {
  msl_rt::mat_store(s, dst, elements_per_row, matrix_origin, transpose_matrix, file, line); }
// threadgroup memory (bounds-checked pointers)
template <class T, class P, std::enable_if_t<std::is_same_v<std::remove_const_t<P>, T>, int> = 0>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const msl_rt::tgptr<P>& src, ulong elements_per_row = 8,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false, MSL_SIMD_ARGS) {
  msl_rt::mat_load(d, src, elements_per_row, matrix_origin, transpose_matrix, file, line); }
template <class T>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& s, const msl_rt::tgptr<T>& dst, ulong elements_per_row = 8,
                            ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false, MSL_SIMD_ARGS) {
  msl_rt::mat_store(s, dst, elements_per_row, matrix_origin, transpose_matrix, file, line); }
template <class T> inline void simdgroup_multiply(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<T, 8, 8>& a,
                                                  const simdgroup_matrix<T, 8, 8>& b, MSL_SIMD_ARGS) {
  msl_rt::mat_multiply<T>(d, a, b, nullptr, file, line); }
template <class T> inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<T, 8, 8>& a,
                                                             const simdgroup_matrix<T, 8, 8>& b, const simdgroup_matrix<T, 8, 8>& c,
                                                             MSL_SIMD_ARGS) {
  msl_rt::mat_multiply(d, a, b, &c, file, line); }
}  // namespace metal

// =====================================================================================================
// MSL keywords and attributes.  Every kernel parameter gets a default argument that pulls its value from
// the launch (buffer table, builtins), so the runtime calls each kernel as `name()`.
//   uint3 gid [[thread_position_in_grid]]  ->  uint3 gid [[ ]] = ::msl_rt::Builtin{tpig}[::msl_rt::zero_idx[0]]
// =====================================================================================================
// `#pragma METAL fp contract(off)` (rewritten to this by msl_emu.py): contraction off for the rest of
// the file whatever -ffp-contract says.
#if defined(__clang__)
#define MSL_FP_CONTRACT_OFF _Pragma("clang fp contract(off)")
#else
#define MSL_FP_CONTRACT_OFF _Pragma("GCC optimize(\"fp-contract=off\")")
#endif
#define __METAL_VERSION__ 320  /* MSL 3.2 (macOS 15): the kernels' fp pragmas are modelled, see msl_emu.rewrite */
#define MSL_EMULATOR 1
#define kernel
#define device
#define thread
#define constant const
#define HEBRUS_CSTR const char*  /* hebrus_metal_common.h: `constant const char*` on Metal */
#define threadgroup                                  /* references; locals and pointers are rewritten by msl_emu.py */
#define MSL_BI(x) ]] = ::msl_rt::Builtin{::msl_rt::x}[::msl_rt::zero_idx[0
#define thread_position_in_grid MSL_BI(tpig)
#define thread_position_in_threadgroup MSL_BI(tpitg)
#define threadgroup_position_in_grid MSL_BI(tgpig)
#define threads_per_threadgroup MSL_BI(tptg)
#define dispatch_threads_per_threadgroup MSL_BI(dtptg)
#define threadgroups_per_grid MSL_BI(tgpg)
#define threads_per_grid MSL_BI(tpg)
#define thread_index_in_threadgroup MSL_BI(tiitg)
#define thread_index_in_simdgroup MSL_BI(tiisg)
#define simdgroup_index_in_threadgroup MSL_BI(siitg)
#define threads_per_simdgroup MSL_BI(tpsg)
#define simdgroups_per_threadgroup MSL_BI(sgptg)
#define buffer(n) ]] = ::msl_rt::buffer_arg(n)[::msl_rt::zero_idx[0
#define msl_threadgroup_arg(n) ]] = ::msl_rt::tg_arg(n)[::msl_rt::zero_idx[0
#define host_name(x)
#define max_total_threads_per_threadgroup(x)
// Things MSL does not have: make them compile errors in kernel code.
#define double msl_error_double_is_not_supported_in_MSL
#define std msl_error_namespace_std_does_not_exist_in_MSL__use_metal
