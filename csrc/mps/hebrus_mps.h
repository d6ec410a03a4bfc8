#pragma once
// Shared glue of the hebrus MPS kernels (csrc/mps/*.mm, built only on macOS with MPS): the one part
// that needs a Mac. Every decision (checks, kernel, buffers, parameter block, dispatch) is made by
// hebrus_glue.h, which the Linux emulator runs too; this file only turns a hebrus::glue::Call into
// MetalKernelFunction calls.
//
// Plain C++ on purpose: PyTorch's MetalShaderLibrary / MetalKernelFunction API
// (ATen/native/mps/MetalShaderLibrary.h) hides every Objective-C type behind #ifdef __OBJC__, so
// these files also compile as C++ on Linux (tests/metal/check_mm_syntax.py type-checks them there).
//
// Each mps_kernels/<op>.metal is embedded at build time (build/generated/hebrus_metal_sources.h,
// written by mps_kernels/embed_metal.py) and compiled into its own MetalShaderLibrary at first use;
// the library caches its pipeline states. Kernels are encoded on PyTorch's current MPS stream
// through MetalKernelFunction::runCommandBlock / startEncoding / setArg / setErrorBufferIndex /
// dispatch, exactly as PyTorch's own ops do: we never create a queue, end an encoder, commit or wait.
// Value errors found by a kernel go to the stream's error buffer and are raised by PyTorch at the
// stream's next synchronization (torch.AcceleratorError), as its own index kernels' are.
#include <ATen/core/Tensor.h>
#include <ATen/native/mps/MetalShaderLibrary.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "hebrus_check.h"
#include "hebrus_glue.h"
#include "hebrus_launch.h"
#include "op_checks.h"
#include "hebrus_metal_sources.h"  // generated

namespace hebrus::mps {

using at::Tensor;
using at::native::mps::MetalKernelFunction;
using at::native::mps::MetalShaderLibrary;

inline const char* source_prefix() { return hebrus::glue::kHasBFloat ? "#define HEBRUS_METAL_BFLOAT 1\n" : ""; }

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
  HEBRUS_CHECK(fn->getStaticThreadGroupMemoryLength() <= HEBRUS_MAX_THREADGROUP_MEMORY, HebrusError, "hebrus::", op,
               ": the Metal kernel ", name, " uses ", fn->getStaticThreadGroupMemoryLength(),
               " bytes of threadgroup memory, more than the ", HEBRUS_MAX_THREADGROUP_MEMORY, " every Apple GPU has");
  HEBRUS_CHECK(fn->getMaxThreadsPerThreadgroup() >= group, HebrusError, "hebrus::", op, ": the Metal kernel ", name,
               " runs at most ", fn->getMaxThreadsPerThreadgroup(), " threads per threadgroup on this GPU, the ",
               "launch needs ", group);
  return fn;
}

// Encodes every launch of `call` on the current MPS stream: tensors to buffers 0.., the stream's
// error buffer, the parameter block, dispatchThreads. Nothing is read back.
inline void encode(const char* op, const hebrus::glue::Call& call) {
  for (const auto& l : call.launches) {
    if (l.threads == 0) continue;
    const auto fn = kernel(op, l.stem.c_str(), l.kernel, l.group);
    fn->runCommandBlock([&] {
      fn->startEncoding();
      for (unsigned i = 0; i < l.tensors.size(); ++i) fn->setArg(i, l.tensors[i]);
      fn->setErrorBufferIndex(l.error_index);
      fn->setArg(l.params_index, l.params.data(), l.params.size());
      fn->dispatch(l.threads, l.group);
    });
  }
}

}  // namespace hebrus::mps
