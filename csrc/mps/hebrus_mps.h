#pragma once
// Shared glue of the hebrus MPS kernels (csrc/mps/*.mm, built only on macOS with MPS).
//
// Plain C++ on purpose: PyTorch's MetalShaderLibrary / MetalKernelFunction API
// (ATen/native/mps/MetalShaderLibrary.h) hides every Objective-C type behind #ifdef __OBJC__, so
// these files also compile as C++ on Linux (tests/metal/check_mm_syntax.py type-checks them there).
//
// Each mps_kernels/<op>.metal is embedded at build time (build/generated/hebrus_metal_sources.h,
// written by mps_kernels/embed_metal.py) and compiled into its own MetalShaderLibrary at first use;
// the library caches its pipeline states. Kernels are encoded on PyTorch's current MPS stream
// through MetalKernelFunction::runCommandBlock / startEncoding / setArg / dispatch, exactly as
// PyTorch's own ops do: we never create a queue, end an encoder or commit. Tensors are bound with
// setArg(idx, tensor), which passes the buffer with the tensor's storage offset and nothing of its
// strides: a kernel that reads a strided view takes the strides in its parameter block (qsa_attention's
// K and V); every other input is made contiguous first.
//
// Values that only the kernel sees (token ids, holes, cu_seqlens) are checked in the kernel, which
// records the first offending index in an error-slot buffer (hebrus_params.h). After the launch the
// glue reads the slots back (a copy to the CPU, which waits for the stream) and raises the
// reference's error; no output is returned when a slot is set.
#include <ATen/core/Tensor.h>
#include <ATen/native/mps/MetalShaderLibrary.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>

#include "hebrus_check.h"
#include "hebrus_launch.h"
#include "op_checks.h"
#include "hebrus_metal_sources.h"  // generated

namespace hebrus::mps {

using at::Tensor;
using at::native::mps::MetalKernelFunction;
using at::native::mps::MetalShaderLibrary;

#if defined(HEBRUS_METAL_BFLOAT) && HEBRUS_METAL_BFLOAT
constexpr bool kHasBFloat = true;
inline const char* source_prefix() { return "#define HEBRUS_METAL_BFLOAT 1\n"; }
#else
constexpr bool kHasBFloat = false;
inline const char* source_prefix() { return ""; }
#endif

inline std::string embedded_source(const char* stem) {
  for (const auto& s : hebrus::metal::k_embedded_sources) {
    if (std::string(s.name) == stem) return std::string(source_prefix()) + s.text;
  }
  TORCH_INTERNAL_ASSERT(false, "hebrus: no embedded Metal source named ", stem);
}

inline std::mutex& library_mutex() {
  static std::mutex m;
  return m;
}

// The library of one kernel file, created (and later compiled by Metal) once per process.
inline MetalShaderLibrary& library(const char* stem) {
  static std::map<std::string, std::unique_ptr<MetalShaderLibrary>> libraries;
  std::lock_guard<std::mutex> lock(library_mutex());
  auto& slot = libraries[stem];
  if (!slot) slot = std::make_unique<MetalShaderLibrary>(embedded_source(stem));
  return *slot;
}

// A kernel of that library; the pipeline state is cached by the library. Checks that the pipeline
// can run the threadgroup size the launch plan asks for, in SIMD-groups of the width the kernels assume.
inline std::shared_ptr<MetalKernelFunction> kernel(const char* op, const char* stem, const std::string& name,
                                                   uint64_t group) {
  MetalShaderLibrary& lib = library(stem);
  std::shared_ptr<MetalKernelFunction> fn;
  {
    std::lock_guard<std::mutex> lock(library_mutex());
    fn = lib.getKernelFunction(name);  // compiles the library at first use; pipeline states are cached
  }
  // The kernels' SIMD-group reductions and lane-to-dim layouts assume 32 lanes, as on every Apple GPU.
  HEBRUS_CHECK(fn->getThreadExecutionWidth() == HEBRUS_SIMD_WIDTH, HebrusError, "hebrus::", op,
               ": the Metal kernels assume SIMD-groups of ", HEBRUS_SIMD_WIDTH, " threads; this GPU runs ",
               name, " with ", fn->getThreadExecutionWidth());
  HEBRUS_CHECK(fn->getMaxThreadsPerThreadgroup() >= group, HebrusError, "hebrus::", op, ": the Metal kernel ", name,
               " runs at most ", fn->getMaxThreadsPerThreadgroup(), " threads per threadgroup on this GPU, the ",
               "launch needs ", group);
  return fn;
}

// MSL type name of a floating dtype, as the kernels' host_name suffixes spell it.
inline const char* metal_type(const char* op, at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float";
    case at::kHalf:
      return "half";
    case at::kBFloat16:
      HEBRUS_CHECK(kHasBFloat, HebrusError, "hebrus::", op, ": this build has no bfloat16 Metal kernels ",
                   "(built with HEBRUS_METAL_BFLOAT=0); rebuild with HEBRUS_METAL_BFLOAT=1 on macOS 14 or newer, ",
                   "or use float16 / float32");
      return "bfloat";
    default:
      HEBRUS_CHECK(false, HebrusError, "hebrus::", op, ": no Metal kernel for dtype ", t);
  }
  return "";
}

// ---- checks (messages as hebrus_torch/_validate.py and the CPU kernels word them; the metadata checks
// shared with the CPU kernels are in csrc/op_checks.h) -----------------------------------------------

inline void check_on_mps(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  check_on_device(op, c10::DeviceType::MPS, tensors);
}

inline void check_plan(const char* op, const char* error) {
  HEBRUS_CHECK(error == nullptr, HebrusError, "hebrus::", op, " on MPS: ", error ? error : "");
}

// ---- error slots ------------------------------------------------------------------------------------

// HEBRUS_ERR_SLOTS int32 entries of HEBRUS_ERR_NONE (-1) on the device of `like`.
inline Tensor error_slots(const Tensor& like) {
  return at::full({HEBRUS_ERR_SLOTS}, -1, like.options().dtype(at::kInt));
}

struct ErrorSlots {
  std::array<int64_t, HEBRUS_ERR_SLOTS> index{};  // -1: no error of that kind
  bool any() const {
    for (auto v : index)
      if (v >= 0) return true;
    return false;
  }
};

// Waits for the stream (the copy to the CPU synchronizes) and decodes the slots.
inline ErrorSlots read_error_slots(const Tensor& err) {
  const Tensor host = err.to(at::kCPU);
  const int32_t* p = host.data_ptr<int32_t>();
  ErrorSlots out;
  for (int i = 0; i < HEBRUS_ERR_SLOTS; ++i) {
    const uint32_t v = static_cast<uint32_t>(p[i]);
    out.index[i] = v == HEBRUS_ERR_NONE ? -1 : static_cast<int64_t>(v);
  }
  return out;
}

// Launches `fn` over the plan's dispatch, binding `tensors` to buffers 0.. and `params` after them.
template <typename Params>
inline void launch(const std::shared_ptr<MetalKernelFunction>& fn, std::initializer_list<const Tensor*> tensors,
                   const Params& params, const hebrus::metal::Dispatch& dispatch) {
  if (dispatch.threads == 0) return;
  fn->runCommandBlock([&] {
    fn->startEncoding();
    unsigned idx = 0;
    for (const Tensor* t : tensors) fn->setArg(idx++, *t);
    fn->setArg(idx, params);
    fn->dispatch(dispatch.threads, dispatch.group);
  });
}

}  // namespace hebrus::mps
