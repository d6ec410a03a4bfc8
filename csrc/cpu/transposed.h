#pragma once
// The transposed weight of a dense projection (x @ W.T as at::mm(x, transposed(w))), for the CPU kernels.
// w.t() is three dispatched ops (aten::t, aten::transpose, aten::as_strided; ~0.3-0.5 us each), and a 1-request
// decode step runs ~69 projections from C++. transposed(w) builds the same view by hand, as ATen's own transpose
// kernel does below ADInplaceOrView (where our kernels run): a TensorImpl over w's storage with the sizes and
// strides swapped, w's storage offset, dtype and dispatch keys, so at::mm receives what w.t() gives and makes the
// same BLAS call, bit for bit. It shares w's version counter, as a view does. Anything the hand-made view would not
// carry falls back to w.t(): w that is not 2-D or has any dispatch key beyond a plain CPU tensor's (another device
// or layout, conj/neg bits, a subclass, functorch wrappers, a quantized tensor), and w that requires grad where
// autograd could record the product (grad mode on and autograd's keys not excluded: the view has no autograd
// history). A weight that requires grad (an nn.Parameter) takes the view under no_grad / inference_mode and inside
// a hebrus op's kernel, which runs below autograd.
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

inline at::Tensor transposed(const at::Tensor& w) {
  if (!plain_cpu_tensor(w) || w.dim() != 2 || autograd_could_record(w)) return w.t();
  at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(w.storage()),
                                                             w.key_set(), w.dtype());
  c10::TensorImpl* impl = view.unsafeGetTensorImpl();
  const int64_t sizes[2] = {w.size(1), w.size(0)};
  const int64_t strides[2] = {w.stride(1), w.stride(0)};
  impl->set_sizes_and_strides(sizes, strides, w.storage_offset());
  if (!w.is_inference()) impl->set_version_counter(w.unsafeGetTensorImpl()->version_counter());
  return view;
}

}  // namespace hebrus
