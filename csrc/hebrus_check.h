#pragma once
// Error checks for hebrus kernels. The bracketed tag names the hebrus_torch.errors class that the
// Python side re-raises (errors.translate); the message starts with "hebrus::<op>:".
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#define HEBRUS_CHECK(cond, error_class, ...) \
  TORCH_CHECK_VALUE((cond), "[" #error_class "] ", __VA_ARGS__)

namespace hebrus {

// "torch.int64", as Python prints a dtype, so messages read the same from every backend.
inline std::string dtype_name(c10::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}

// "(3, 4)" / "(5,)", as Python prints a shape.
inline std::string shape_str(c10::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + (sizes.size() == 1 ? ",)" : ")");
}

}  // namespace hebrus
