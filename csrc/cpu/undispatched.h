#pragma once
// What the CPU kernels would ask of ATen's dispatcher, made without it: views (what t, reshape / view, narrow / split /
// chunk make below ADInplaceOrView, where our kernels run), dtype conversions that are no-ops, and output
// allocations. A view is a TensorImpl over the same storage with the sizes, strides and offset ATen's op gives (a
// reshape's strides by ATen's own computeStride), the same dtype and dispatch keys, sharing the base's version counter
// as a view does; an allocation is ATen's empty_cpu, what at::empty runs on the CPU. No bit of any result changes.
//
// Why: inside a decode step, after the layers' weights streamed through the caches, each dispatched op costs ~1.3 us
// instead of ~0.4 warm (benchmarks/RESULTS.md, session 31), and a 1-request step made ~130 views, ~30 no-op
// conversions and ~40 allocations from C++. w.t() alone is three dispatched ops (aten::t, aten::transpose,
// aten::as_strided).
//
// Anything a hand-made view would not carry falls back to ATen's op: a tensor with any dispatch key beyond a plain
// CPU tensor's (another device or layout, conj/neg bits, a subclass, functorch wrappers, a quantized tensor), one
// autograd could record the view of (grad mode on and autograd's keys not excluded: the view has no autograd
// history), a reshape that needs a copy. A weight that requires grad (an nn.Parameter) takes the hand-made view under
// no_grad / inference_mode and inside a hebrus op's kernel, which runs below autograd.
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/InferSize.h>
#include <ATen/TensorUtils.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstdint>

namespace hebrus {

// A plain CPU tensor: no dispatch key beyond a plain CPU tensor's.
inline bool plain_cpu_tensor(const at::Tensor& t) {
  static const c10::DispatchKeySet plain_cpu{c10::DispatchKey::CPU, c10::DispatchKey::AutogradCPU,
                                             c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCPU};
  return t.defined() && plain_cpu.isSupersetOf(t.key_set());
}

// Whether autograd could record an op on t here (it requires grad, grad mode is on and autograd's keys are not
// excluded, as they are inside a hebrus op's kernel).
inline bool autograd_could_record(const at::Tensor& t) {
  return t.requires_grad() && c10::GradMode::is_enabled() &&
         !c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::AutogradCPU);
}

inline bool viewable_by_hand(const at::Tensor& t) { return plain_cpu_tensor(t) && !autograd_could_record(t); }

// The view of t's storage with these sizes, strides and storage offset (the caller's: a view ATen's ops would make).
inline at::Tensor view_by_hand(const at::Tensor& t, c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t offset) {
  at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()),
                                                             t.key_set(), t.dtype());
  c10::TensorImpl* impl = view.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(sizes, strides, offset);
  if (!t.is_inference()) impl->set_version_counter(t.unsafeGetTensorImpl()->version_counter());
  return view;
}

// w.t() of a 2-D w.
inline at::Tensor transposed(const at::Tensor& w) {
  if (!viewable_by_hand(w) || w.dim() != 2) return w.t();
  const int64_t sizes[2] = {w.size(1), w.size(0)};
  const int64_t strides[2] = {w.stride(1), w.stride(0)};
  return view_by_hand(w, sizes, strides, w.storage_offset());
}

// t.reshape(shape) where that is a view (one -1 allowed); t.reshape(shape), a copy, where it is not.
inline at::Tensor reshaped(const at::Tensor& t, c10::IntArrayRef shape) {
  if (!viewable_by_hand(t)) return t.reshape(shape);
  const at::DimVector sizes = at::infer_size_dv(shape, t.numel());
  const std::optional<at::DimVector> strides = at::detail::computeStride(t.sizes(), t.strides(), sizes);
  if (!strides.has_value()) return t.reshape(shape);
  return view_by_hand(t, sizes, *strides, t.storage_offset());
}

// t.narrow(-1, start, length): columns [start, start + length) of the last dim.
inline at::Tensor last_dim_columns(const at::Tensor& t, int64_t start, int64_t length) {
  if (!viewable_by_hand(t) || t.dim() == 0 || start < 0 || length < 0 || start + length > t.size(-1))
    return t.narrow(-1, start, length);
  at::DimVector sizes(t.sizes().begin(), t.sizes().end());
  sizes.back() = length;
  return view_by_hand(t, sizes, t.strides(), t.storage_offset() + start * t.stride(-1));
}

// t.to(dtype): t itself where it already has that dtype (what to() returns then), without its dispatch.
inline at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// at::empty(sizes, options) of a CPU tensor: ATen's empty_cpu, what at::empty runs for it, without the dispatcher.
inline at::Tensor empty_on_cpu(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  return options.device().is_cpu() && !options.requires_grad() ? at::detail::empty_cpu(sizes, options)
                                                                : at::empty(sizes, options);
}

}  // namespace hebrus
