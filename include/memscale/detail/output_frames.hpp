// memscale::detail — the frames detail/output_recipes.hpp's kernels report to:
// what an op computed and from what, and when an alias with a version counter
// of its own was made of a tensor (detail/product_replay.hpp's _unsafe_view
// kernel reports that, so that no output written through such an alias is
// computed again). Its own header so that both kernels' headers include it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace memscale::detail {

enum class output_op : std::uint8_t { gelu, silu, layer_norm, mul };

/// How one output was computed: the op and its non-tensor arguments; its
/// tensor inputs are the frame's to keep (in schema order).
struct output_recipe {
  output_op op = output_op::mul;
  std::string approximate;                     ///< gelu's
  std::vector<std::int64_t> normalized_shape;  ///< native_layer_norm's
  double eps = 0.0;                            ///< native_layer_norm's
  std::vector<std::int64_t> sizes, strides;    ///< the output's layout as computed
  double seconds = 0.0;                        ///< what computing it took, where the frame times ops
};

/// Hears, on its thread, every output the kernels see computed while it is the
/// innermost frame (output_frame_scope opens one).
class output_frame {
 public:
  virtual ~output_frame() = default;
  /// `inputs` in schema order (gelu, silu: self; native_layer_norm: input,
  /// weight, bias, an absent one undefined; mul: self, other).
  virtual void computed(output_recipe recipe, const at::Tensor& output, const std::vector<at::Tensor>& inputs) = 0;
  /// Whether recipes carry the time the op took (a profiler's census).
  [[nodiscard]] virtual bool timed() const { return false; }
  /// An alias of `base` was made with a version counter of its own
  /// (_unsafe_view): a write through it would not show in `base`'s version.
  virtual void aliased(const at::Tensor& base) { (void)base; }
};

inline std::vector<output_frame*>& output_frames() {
  thread_local std::vector<output_frame*> frames;
  return frames;
}

}  // namespace memscale::detail
