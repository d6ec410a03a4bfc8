#pragma once
// Error checks for hebrus kernels. The bracketed tag names the hebrus_torch.errors class that the
// Python side re-raises (errors.translate); the message starts with "hebrus::<op>:".
#include <c10/util/Exception.h>

#define HEBRUS_CHECK(cond, error_class, ...) \
  TORCH_CHECK_VALUE((cond), "[" #error_class "] ", __VA_ARGS__)
