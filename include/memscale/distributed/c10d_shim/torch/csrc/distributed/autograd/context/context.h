// memscale — stand-in for LibTorch's torch/csrc/distributed/autograd/context/context.h,
// which Debian's libtorch-dev 1.13 does not ship although c10d's reducer.hpp
// includes it. reducer.hpp needs two names from it: ContextPtr, a shared_ptr
// whose layout does not depend on its element type (so c10d::Reducer's layout is
// LibTorch's own), and DistAutogradContext::GradCallback, which it checks against
// its own GradCallback. The CMake target memscale::distributed puts this
// directory on the include path only where the real header is missing.
#pragma once

#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

namespace torch::distributed::autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};

using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace torch::distributed::autograd
