#pragma once
// fp32 values of the kernels' storage types, shared by attention_kernels.cpp and moe_kernels.cpp: one
// element (widen) or kLanes elements of a row into a vector (load_row; bf16: the bits shifted into the
// high half, exact), so that fp16/bf16 rows are read in place like fp32 ones.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "cpu/hebrus_simd.h"

namespace hebrus {

template <typename T>
HEBRUS_INLINE float widen(T v) {
  return static_cast<float>(v);
}

template <>
HEBRUS_INLINE float widen<c10::BFloat16>(c10::BFloat16 v) {
  return bits_to_float(static_cast<uint32_t>(v.x) << 16);
}

template <typename T>
HEBRUS_INLINE Vec load_row(const T* p) {
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = widen<T>(p[i]);
  return v;
}

template <>
HEBRUS_INLINE Vec load_row<float>(const float* p) {
  return load_vec(p);
}

template <>
HEBRUS_INLINE Vec load_row<c10::BFloat16>(const c10::BFloat16* p) {
  return load_bf16_vec(reinterpret_cast<const uint16_t*>(p));
}

}  // namespace hebrus
