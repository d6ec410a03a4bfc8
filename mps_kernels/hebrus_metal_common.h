#pragma once
// Helpers shared by the hebrus Metal kernels (Metal side only; keep ASCII).
#include <metal_stdlib>

#include "hebrus_launch.h"
#include "hebrus_params.h"

using namespace metal;

// Safe floating-point math whatever the compile options say. The kernels' NaN and -inf handling
// (x != x, a max that stays -inf) is part of their contract, and PYTORCH_MPS_FAST_MATH=1 makes
// PyTorch compile every library in fast mode, where the compiler may assume neither occurs. The
// pragma exists from MSL 3.2 (macOS 15); on macOS 14 that setting still applies (see README.md).
#if __METAL_VERSION__ >= 320
#pragma METAL fp math_mode(safe)
#endif

// Kernel names: "<op>_<type>" and "<op>_<variant>_<type>", instantiated MLX-style from decltype so
// the signature is never retyped. hebrus::metal::kernel_name() (hebrus_launch.h) builds the same
// strings on the host. The type names are MSL's: float, half, bfloat.
#define HEBRUS_INSTANTIATE(op, type, ...) \
  template [[host_name(#op "_" #type)]] [[kernel]] decltype(op<__VA_ARGS__>) op<__VA_ARGS__>;
#define HEBRUS_INSTANTIATE_VARIANT(op, variant, type, ...) \
  template [[host_name(#op "_" #variant "_" #type)]] [[kernel]] decltype(op<__VA_ARGS__>) op<__VA_ARGS__>;

// bfloat needs MSL 3.1 (macOS 14); the glue defines HEBRUS_METAL_BFLOAT when the extension was
// built with HEBRUS_METAL_BFLOAT=1 (the default).
#if defined(HEBRUS_METAL_BFLOAT) && __METAL_VERSION__ >= 310
#define HEBRUS_HAS_BFLOAT 1
#else
#define HEBRUS_HAS_BFLOAT 0
#endif

// 64-bit min / max spelled out, so no overload question arises for long operands.
inline long hebrus_min(long a, long b) { return a < b ? a : b; }
inline long hebrus_max(long a, long b) { return a > b ? a : b; }

// Records `index` in error slot `slot` unless a smaller index is there already.
inline void hebrus_report(device atomic_uint* err, uint slot, uint index) {
  atomic_fetch_min_explicit(err + slot, index, memory_order_relaxed);
}

// The row b in [0, batch) with cu[b] <= t < cu[b + 1] for valid (non-decreasing) cu_seqlens; the
// caller checks the bounds it gets, so garbage cu_seqlens never lead to an out-of-bounds access.
inline long hebrus_row_of(device const int* cu, long batch, long t) {
  long lo = 0, hi = batch;
  while (hi - lo > 1) {
    const long mid = lo + (hi - lo) / 2;
    if (long(cu[mid]) <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// cu_seqlens of row b are valid: 0 first, T last, non-decreasing.
inline bool hebrus_row_valid(device const int* cu, long batch, long tokens, long b) {
  const long start = cu[b], end = cu[b + 1];
  return start >= 0 && start <= end && end <= tokens && (b != 0 || start == 0) && (b != batch - 1 || end == tokens);
}
