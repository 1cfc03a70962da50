// memscale — LibTorch's own layer stacks, whose forward memscale cannot see into:
// nn::TransformerEncoder and nn::TransformerDecoder call their layers from
// LibTorch's compiled code (a ModuleList, no hook), so a model that calls them
// gets no unit there. builtin_stack_hint names each such module in the model and
// the loop that makes its layers units, for the Report's note and the error of a
// model with no unit boundaries.
#pragma once

#include <cstddef>
#include <string>

#include <torch/torch.h>

namespace memscale::detail {

/// A sentence per nn::TransformerEncoder or nn::TransformerDecoder `root` holds
/// (itself included): what runs its layers and the line that calls them as units.
/// "" where it holds none.
inline std::string builtin_stack_hint(const torch::nn::Module& root) {
  std::string hint;
  std::size_t found = 0;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    const auto* module = item.value().get();
    const bool encoder = dynamic_cast<const torch::nn::TransformerEncoderImpl*>(module) != nullptr;
    if (!encoder && dynamic_cast<const torch::nn::TransformerDecoderImpl*>(module) == nullptr) continue;
    if (++found > 3) continue;  // counted below
    const std::string name = item.key().empty() ? "the model" : "`" + item.key() + "`";
    const std::string var = item.key().empty() ? "stack" : item.key().substr(item.key().rfind('.') + 1);
    const std::string kind = encoder ? "TransformerEncoder" : "TransformerDecoder";
    hint += " " + name + " is LibTorch's torch::nn::" + kind +
            ", whose forward calls its layers inside LibTorch, where nothing marks them as units: call them from "
            "your forward instead";
    if (encoder)
      hint += ", `for (std::size_t i = 0; i < " + var + "->layers->size(); ++i) x = memscale::forward(*" + var +
              "->layers->ptr<torch::nn::TransformerEncoderLayerImpl>(i), x);` (then its `norm`, where it has one), "
              "and each layer is a unit (with a mask: through a module of yours that holds the mask and takes the "
              "Tensor alone).";
    else
      hint += ": a decoder layer takes the target and the memory, so each is a unit called through "
              "memscale::forward as a module of yours that holds the memory and takes the target alone.";
  }
  if (found > 3) hint += " And " + std::to_string(found - 3) + " more such module(s).";
  return hint;
}

}  // namespace memscale::detail
