// memscale — the checks predict() and autotune() share before they run a
// model: training_inputs (a model memscale does not manage now, an example with
// a batch dimension, a forward of one Tensor to one Tensor) and model_device.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/errors.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/execute/attach.hpp>
#include <memscale/execute/registry.hpp>

namespace memscale::predictor::detail {

/// The model's root and its forward as a function, after the checks predict()
/// and autotune() share: a model memscale does not manage now, an example with
/// a batch dimension, a forward of one Tensor to one Tensor. Throws naming `caller`.
template <Model M>
std::pair<std::shared_ptr<torch::nn::Module>, std::function<torch::Tensor(const torch::Tensor&)>> training_inputs(
    M& model, const torch::Tensor& example_input, const std::string& caller, const std::string& if_optimized) {
  auto root = memscale::detail::root_of(model);
  if (!root) throw UnsupportedModelError(caller + ": the model is empty (a null module holder)");
  if (core::registry::global().find(root.get()))
    throw AlreadyOptimizedError(caller + ": this model is optimized by memscale now; " + if_optimized);
  if (!example_input.defined() || example_input.dim() < 1 || example_input.size(0) < 1)
    throw Error(caller + ": example_input must be a tensor with a batch dimension first (at least one row), got " +
                (example_input.defined() ? "shape " + c10::str(example_input.sizes())
                                         : std::string("an undefined tensor")));
  auto forward = memscale::detail::whole_forward(model);
  if (!forward)
    throw UnsupportedModelError(caller + ": the model's forward must take one Tensor and return one Tensor (" +
                                root->name() + "'s does not)");
  return {std::move(root), std::move(forward)};
}

/// The device the model trains on: its parameters' (all on one), else the example's.
inline c10::Device model_device(const std::vector<torch::Tensor>& parameters, const torch::Tensor& example) {
  std::optional<c10::Device> device;
  for (const auto& p : parameters) {
    if (!device) device = p.device();
    else if (*device != p.device())
      throw Error("memscale::predict(): the model's parameters are on several devices (" + device->str() + " and " +
                  p.device().str() + "); predict() sizes a model on one device");
  }
  return device.value_or(example.device());
}

}  // namespace memscale::predictor::detail
