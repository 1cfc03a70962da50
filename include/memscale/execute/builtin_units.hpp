// memscale — LibTorch's own layer stacks, whose forward memscale cannot see into:
// nn::TransformerEncoder, nn::TransformerDecoder and nn::Transformer call their
// layers from LibTorch's compiled code (a ModuleList, no hook), so a model that
// calls them gets no unit there. builtin_stack_hint names each such module in the
// model and the loop that makes its layers units, for the Report's note and the
// error of a model with no unit boundaries.
#pragma once

#include <cstddef>
#include <string>

#include <torch/torch.h>

namespace memscale::detail {

/// A sentence per nn::TransformerEncoder, nn::TransformerDecoder or
/// nn::Transformer `root` holds (itself included; an encoder or decoder inside a
/// Transformer is said with it): what runs its layers and how a forward of the
/// user's calls them as units. Sentences are joined by ". ", with no period after
/// the last; "" where it holds none.
inline std::string builtin_stack_hint(const torch::nn::Module& root) {
  std::string hint;
  std::string inside;  // the path of the last Transformer found, whose encoder and decoder it says
  bool root_is_transformer = false;
  std::size_t found = 0;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    const auto* module = item.value().get();
    const auto& path = item.key();
    if (root_is_transformer || (!inside.empty() && path.rfind(inside + ".", 0) == 0)) continue;
    const bool transformer = dynamic_cast<const torch::nn::TransformerImpl*>(module) != nullptr;
    const bool encoder = dynamic_cast<const torch::nn::TransformerEncoderImpl*>(module) != nullptr;
    if (!transformer && !encoder && dynamic_cast<const torch::nn::TransformerDecoderImpl*>(module) == nullptr)
      continue;
    if (transformer && path.empty()) root_is_transformer = true;
    else if (transformer) inside = path;
    if (++found > 3) continue;  // counted below
    const std::string kind = transformer ? "Transformer" : encoder ? "TransformerEncoder" : "TransformerDecoder";
    std::string s = (path.empty() ? std::string("the model") : "`" + path + "`") + " is LibTorch's torch::nn::" +
                    kind + ", whose forward calls its layers inside LibTorch, where nothing marks them as units";
    const std::string own = path.empty() ? ": wrap it in a module of your own whose forward calls them"
                                         : ": call them from your own forward instead";
    const std::string decoder_call =
        "`x = memscale::forward(*layer, x, memory)` makes it a unit where the memory needs no gradient (a frozen "
        "encoder's); where it needs one, the call runs directly, since a recompute could not pass that gradient "
        "back";
    if (encoder)
      s += own + ", with `enc` that module: `for (std::size_t i = 0; i < enc->layers->size(); ++i) x = "
                 "memscale::forward(*enc->layers->ptr<torch::nn::TransformerEncoderLayerImpl>(i), x); if "
                 "(!enc->norm.is_empty()) x = enc->norm.forward(x);`, and each layer is a unit (with a mask: "
                 "`memscale::forward(*layer, x, mask)`)";
    else if (transformer)
      s += ": a forward of your own that calls its encoder's layers (`t->encoder.ptr<torch::nn::TransformerEncoderImpl>"
           "()->layers`, with `t` that module) through memscale::forward makes each a unit, as for "
           "torch::nn::TransformerEncoder (a decoder layer takes the target and the memory: " + decoder_call + ")";
    else
      s += own + ": a decoder layer takes the target and the memory: " + decoder_call;
    hint += (hint.empty() ? "" : ". ") + s;
  }
  if (found > 3) hint += ". And " + std::to_string(found - 3) + " more such module(s)";
  return hint;
}

/// builtin_stack_hint as the end of a note or message that has no period of its
/// own yet: ". " and the hint, or "" where the model holds no such module.
inline std::string builtin_stack_suffix(const torch::nn::Module& root) {
  const auto hint = builtin_stack_hint(root);
  return hint.empty() ? hint : ". " + hint;
}

}  // namespace memscale::detail
