// msl_check_clang.h -- strict syntax/type check of MSL kernels with clang++ -fsyntax-only; never executed.
// Uses clang's native ext_vector_type (what MSL vectors are) and real address spaces, so passing a
// threadgroup pointer where a device pointer is expected, writing through a constant reference or
// calling an atomic on the wrong address space is an error, as in Metal. Declarations only.
#pragma once
#include <stddef.h>
#include <stdint.h>
#define __METAL_VERSION__ 310
#define MSL_CLANG_CHECK 1
#define kernel
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2))) const
// Metal puts string literals in the constant address space; clang does not (hebrus_metal_common.h).
#define HEBRUS_CSTR const char*
#define threadgroup __attribute__((address_space(3)))
#define thread
#define max_total_threads_per_threadgroup(x)
namespace metal {
typedef unsigned int uint; typedef unsigned short ushort; typedef unsigned char uchar; typedef unsigned long ulong;
typedef _Float16 half;
typedef __bf16 bfloat;
template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));
#define MSLC_V(T, P) typedef T P##2 __attribute__((ext_vector_type(2))); typedef T P##3 __attribute__((ext_vector_type(3))); typedef T P##4 __attribute__((ext_vector_type(4)));
MSLC_V(float, float) MSLC_V(half, half) MSLC_V(int, int) MSLC_V(uint, uint) MSLC_V(short, short) MSLC_V(ushort, ushort)
MSLC_V(char, char) MSLC_V(uchar, uchar) MSLC_V(bool, bool) MSLC_V(long, long) MSLC_V(ulong, ulong) MSLC_V(bfloat, bfloat)
template <class T> struct vtraits { static constexpr int n = 1; using elem = T; };
template <class T, int N> struct vtraits<T __attribute__((ext_vector_type(N)))> { static constexpr int n = N; using elem = T; };
template <class V, class... A> V make(A... a) {
  static_assert(sizeof...(A) == 1 || (0 + ... + vtraits<A>::n) == vtraits<V>::n, "MSL: wrong number of components in vector constructor");
  return V{}; }
template <class T> T sqrt(T); template <class T> T rsqrt(T); template <class T> T exp(T); template <class T> T exp2(T);
template <class T> T log(T); template <class T> T log2(T); template <class T> T abs(T); template <class T> T floor(T);
template <class T> T ceil(T); template <class T> T fract(T); template <class T> T tanh(T); template <class T> T sin(T); template <class T> T cos(T);
template <class T> T min(T, T); template <class T> T max(T, T); template <class T> T clamp(T, T, T); template <class T> T fma(T, T, T);
template <class T> T mix(T, T, T); template <class T, class U> T pow(T, U); template <class T> T select(T, T, bool);
template <class T, int N> vec<T, N> select(vec<T, N>, vec<T, N>, vec<bool, N>);
template <class V> typename vtraits<V>::elem dot(V, V); template <class V> typename vtraits<V>::elem length(V); template <class V> V normalize(V);
template <class V> bool all(V); template <class V> bool any(V);
template <class To, class From> To as_type(From);
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
namespace precise { using ::metal::sqrt; using ::metal::rsqrt; using ::metal::exp; using ::metal::log; using ::metal::sin; using ::metal::cos; using ::metal::tanh; }
namespace fast { using ::metal::sqrt; using ::metal::rsqrt; using ::metal::exp; using ::metal::log; using ::metal::sin; using ::metal::cos; using ::metal::tanh; }
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wuser-defined-literals"
inline half operator""h(long double v) { return half(float(v)); }
#pragma clang diagnostic pop
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
void threadgroup_barrier(mem_flags); void simdgroup_barrier(mem_flags);
template <class T> T simd_sum(T); template <class T> T simd_max(T); template <class T> T simd_min(T); template <class T> T simd_product(T);
template <class T> T simd_prefix_inclusive_sum(T); template <class T> T simd_prefix_exclusive_sum(T);
template <class T> T simd_shuffle(T, ushort); template <class T> T simd_shuffle_down(T, ushort); template <class T> T simd_shuffle_up(T, ushort);
template <class T> T simd_shuffle_xor(T, ushort); template <class T> T simd_broadcast(T, ushort); template <class T> T simd_broadcast_first(T);
bool simd_all(bool); bool simd_any(bool); bool simd_is_first();
// simdgroup_matrix (MSL 2.3+): loads and stores from device or threadgroup memory only.
template <class T, int Cols, int Rows> struct simdgroup_matrix { vec<T, 2>& thread_elements(); };
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int C, int R> simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(const T value);
template <class T, int C, int R> void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, const device T* src,
                                                     ulong elements_per_row = C, ulong2 matrix_origin = 0,
                                                     bool transpose_matrix = false);
template <class T, int C, int R> void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, const threadgroup T* src,
                                                     ulong elements_per_row = C, ulong2 matrix_origin = 0,
                                                     bool transpose_matrix = false);
template <class T, int C, int R> void simdgroup_store(thread simdgroup_matrix<T, C, R> a, device T* dst,
                                                      ulong elements_per_row = C, ulong2 matrix_origin = 0,
                                                      bool transpose_matrix = false);
template <class T, int C, int R> void simdgroup_store(thread simdgroup_matrix<T, C, R> a, threadgroup T* dst,
                                                      ulong elements_per_row = C, ulong2 matrix_origin = 0,
                                                      bool transpose_matrix = false);
template <class T, int C, int R, int K> void simdgroup_multiply(thread simdgroup_matrix<T, C, R>& d,
                                                                thread const simdgroup_matrix<T, K, R>& a,
                                                                thread const simdgroup_matrix<T, C, K>& b);
template <class T, int C, int R, int K> void simdgroup_multiply_accumulate(thread simdgroup_matrix<T, C, R>& d,
                                                                           thread const simdgroup_matrix<T, K, R>& a,
                                                                           thread const simdgroup_matrix<T, C, K>& b,
                                                                           thread const simdgroup_matrix<T, C, R>& c);
// Atomics exist for device and threadgroup objects only, as in MSL.
enum memory_order { memory_order_relaxed };
// C11 _Atomic (a clang extension in C++): a scalar type, so threadgroup atomics need no constructor.
typedef _Atomic(int) atomic_int; typedef _Atomic(uint) atomic_uint; typedef _Atomic(float) atomic_float;
#define MSLC_ATOMIC_RMW(name) \
  template <class A, class U> U name(volatile device A* o, U v, memory_order); \
  template <class A, class U> U name(volatile threadgroup A* o, U v, memory_order);
MSLC_ATOMIC_RMW(atomic_fetch_add_explicit) MSLC_ATOMIC_RMW(atomic_fetch_sub_explicit) MSLC_ATOMIC_RMW(atomic_fetch_min_explicit)
MSLC_ATOMIC_RMW(atomic_fetch_max_explicit) MSLC_ATOMIC_RMW(atomic_fetch_and_explicit) MSLC_ATOMIC_RMW(atomic_fetch_or_explicit)
MSLC_ATOMIC_RMW(atomic_exchange_explicit)
template <class A, class U> void atomic_store_explicit(volatile device A* o, U v, memory_order);
template <class A, class U> void atomic_store_explicit(volatile threadgroup A* o, U v, memory_order);
template <class A> int atomic_load_explicit(const volatile device A* o, memory_order);
template <class A> int atomic_load_explicit(const volatile threadgroup A* o, memory_order);
}  // namespace metal
#define float2(...) ::metal::make<::metal::float2>(__VA_ARGS__)
#define float3(...) ::metal::make<::metal::float3>(__VA_ARGS__)
#define float4(...) ::metal::make<::metal::float4>(__VA_ARGS__)
#define half2(...) ::metal::make<::metal::half2>(__VA_ARGS__)
#define half3(...) ::metal::make<::metal::half3>(__VA_ARGS__)
#define half4(...) ::metal::make<::metal::half4>(__VA_ARGS__)
#define int2(...) ::metal::make<::metal::int2>(__VA_ARGS__)
#define int3(...) ::metal::make<::metal::int3>(__VA_ARGS__)
#define int4(...) ::metal::make<::metal::int4>(__VA_ARGS__)
#define uint2(...) ::metal::make<::metal::uint2>(__VA_ARGS__)
#define uint3(...) ::metal::make<::metal::uint3>(__VA_ARGS__)
#define uint4(...) ::metal::make<::metal::uint4>(__VA_ARGS__)
#define ulong2(...) ::metal::make<::metal::ulong2>(__VA_ARGS__)
#define double msl_error_double_is_not_supported_in_MSL
#define std msl_error_namespace_std_does_not_exist_in_MSL__use_metal
