// memscale — profiler output: per-slot costs of every chain (a torch::nn::Sequential)
// in the model. slot_cost is plain data so the decision rules can run in constexpr.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace memscale {

/// What one slot of a chain costs in one training step, on the chain's device.
/// The decision engine derives everything else (retained bytes, recompute time)
/// from these fields; see core/memory_model.hpp.
struct slot_cost {
  std::int64_t input_bytes = 0;      ///< bytes of the slot's input tensor
  /// A chain's slot 0 only: by how much the live bytes grew between the end of
  /// the chain run before and this chain's start, in the example forward
  /// (without autograd): the input the model's own code made for it (a
  /// torch::cat's, a pool's) and the temporaries of the expression calling it,
  /// less what that code freed. Counted live from the chain's start to the end
  /// of its backward (temporaries die sooner; what the code saves for backward
  /// is not in it); no plan of the chain frees it.
  std::int64_t made_before_bytes = 0;
  std::int64_t output_bytes = 0;     ///< bytes of the slot's output tensor
  bool output_is_view = false;       ///< output shares the input's storage (no new bytes)
  std::int64_t saved_bytes = 0;      ///< bytes saved for backward beyond its input and output
  bool saves_input = false;          ///< backward keeps the input alive
  bool saves_output = false;         ///< backward keeps the output alive
  bool mutates_input = false;        ///< in place (ReLU(inplace), ...): no checkpoint may start here
  /// Its backward needs only its input and its parameters (a plain
  /// torch::nn::Linear): a checkpointed run ending at it gets its gradients from
  /// its recomputed input and never runs its forward again.
  bool backward_from_input = false;
  std::int64_t workspace_bytes = 0;  ///< transient bytes during forward, freed before it returns
  /// Transient bytes during its backward beyond the gradients it returns (0:
  /// unmeasured, and the forward's workspace stands in); a convolution's on CPU
  /// is several activations.
  std::int64_t backward_workspace_bytes = 0;
  /// A part of that workspace the batch does not change: a convolution's
  /// weight-sized buffer (oneDNN on CPU), beside the rest in its forward, the
  /// floor of its backward's (core/layer_rules.hpp). Where a profile at a
  /// small batch is read at a larger one (scale_profile), it is not scaled.
  std::int64_t fixed_workspace_bytes = 0;
  double forward_seconds = 0.0;      ///< one forward
  double backward_seconds = 0.0;
  /// What a checkpoint's recompute of it saves by writing back the random masks
  /// its forward drew instead of drawing them again (detail/draw_replay.hpp):
  /// the draws' time less packing and writing back their outcomes.
  double replay_saved_seconds = 0.0;
  /// What a checkpoint keeps of its forward's random draws for that replay: a
  /// bit an element of each mask and the generator's state after each draw.
  std::int64_t replay_kept_bytes = 0;
  /// Its matrix products (a Linear's addmm, a plain mm; detail/product_replay.hpp):
  /// their time, which a selective recompute skips, and their outputs' bytes,
  /// which it keeps from forward to backward; of those, the bytes of the one
  /// it returns (a plain Linear's), not kept where it ends a checkpointed run.
  double product_saved_seconds = 0.0;
  std::int64_t product_kept_bytes = 0;
  std::int64_t returned_product_bytes = 0;
  /// A checkpoint holding it keeps its products (the plan chose selective
  /// recompute): recompute_seconds() and run_replay_kept_bytes() count them.
  bool keeps_products = false;
  /// Its saved tensors kept compact where the plan leaves it in place
  /// (techniques/saved_compaction.hpp): the bytes that frees (its masks less
  /// their bits, its outputs computed again from inputs saved anyway), and the
  /// step time it adds (packing and writing back the masks, computing the
  /// outputs again in backward).
  std::int64_t compact_bytes = 0;
  double compact_seconds = 0.0;
  /// The largest of those tensors: compacted, its backward writes it back (or
  /// computes it again) while the op that saved it runs, beside what it holds.
  std::int64_t compact_transient_bytes = 0;
  /// Of saved_bytes, what offloading the slot leaves on the device, measured by
  /// a dry run of the offload scope (techniques/offload.hpp, offload_census):
  /// storages a saved view under the engine's min_bytes keeps (an LSTM step's
  /// gate chunks), or that something besides its saved views holds. 0 where
  /// not measured (a static rule's slot): everything saved leaves.
  std::int64_t offload_kept_bytes = 0;
  /// Left in place, it keeps its saved tensors compact (the plan chose it):
  /// its saved_bytes are then already less its compact_bytes.
  bool compacts_saved = false;
  /// Leading input dimensions along which the slot treats rows independently
  /// (core/tile_rules.hpp): it may run over chunks of any of them. 0: it mixes
  /// rows (attention, BatchNorm in training), so it is never tiled.
  int row_dims = 0;
  std::array<std::int64_t, 4> input_extents{};  ///< the input's first four sizes (0 past its rank)

  /// Transient bytes beside its input and output gradients while its backward runs.
  [[nodiscard]] constexpr std::int64_t backward_extra_bytes() const noexcept {
    return (backward_workspace_bytes > workspace_bytes ? backward_workspace_bytes : workspace_bytes) +
           (compacts_saved ? compact_transient_bytes : 0);
  }

  /// What recomputing it in a checkpoint's backward costs.
  [[nodiscard]] constexpr double recompute_seconds() const noexcept {
    const double skipped = replay_saved_seconds + (keeps_products ? product_saved_seconds : 0.0);
    return forward_seconds > skipped ? forward_seconds - skipped : 0.0;
  }

  /// The same as the last slot of a checkpointed run: the product it returns is
  /// the run's output, not kept, so it is multiplied again (its share of the
  /// products' time, by bytes).
  [[nodiscard]] constexpr double last_recompute_seconds() const noexcept {
    const double seconds = recompute_seconds();
    if (!keeps_products || returned_product_bytes <= 0 || product_kept_bytes <= 0) return seconds;
    const double returned = product_saved_seconds * static_cast<double>(returned_product_bytes) /
                            static_cast<double>(product_kept_bytes);
    return seconds + returned < forward_seconds ? seconds + returned : forward_seconds;
  }

  /// New bytes the forward allocates and keeps (output plus saved extras).
  [[nodiscard]] constexpr std::int64_t kept_bytes() const noexcept {
    return (output_is_view ? 0 : output_bytes) + saved_bytes;
  }
};

/// Scales what running a slot measured beyond its rule's bytes: its times (the
/// forward's and what its recompute skips or its compaction costs by `forward`,
/// the backward's by `backward`) and the bytes of the draws and products a
/// recompute keeps, of compacting its saved tensors and of what offloading
/// leaves, through `bytes`.
template <class Bytes>
void scale_measured(slot_cost& s, double forward, double backward, Bytes&& bytes) {
  s.forward_seconds *= forward;
  s.backward_seconds *= backward;
  s.replay_saved_seconds *= forward;
  s.replay_kept_bytes = bytes(s.replay_kept_bytes);
  s.product_saved_seconds *= forward;
  s.product_kept_bytes = bytes(s.product_kept_bytes);
  s.returned_product_bytes = bytes(s.returned_product_bytes);
  s.compact_bytes = bytes(s.compact_bytes);
  s.compact_seconds *= forward;
  s.compact_transient_bytes = bytes(s.compact_transient_bytes);
  s.offload_kept_bytes = bytes(s.offload_kept_bytes);
}

/// Where a slot's costs came from: a per-type rule, or measurement.
enum class profile_source : std::uint8_t { static_rule, empirical };

[[nodiscard]] constexpr std::string_view to_string(profile_source s) noexcept {
  return s == profile_source::static_rule ? "static" : "empirical";
}

/// One torch::nn::Sequential found in the model tree, profiled.
struct chain_profile {
  std::string path;                     ///< dotted module path ("" for the root)
  std::vector<std::string> slot_names;  ///< "0 (Linear)", ...
  std::vector<slot_cost> slots;
  std::vector<profile_source> sources;  ///< per slot
  std::vector<std::string> notes;       ///< why a slot was profiled as it was
  std::vector<std::int64_t> input_shape;
  bool supported = true;                ///< false: some slot is not Tensor -> Tensor
  std::string unsupported_reason;
  std::vector<std::string> caveats;     ///< what could not be measured as asked, and why (the Report prints them)
};

/// The whole model as the decision engine sees it.
struct ModelGraph {
  std::vector<chain_profile> chains;
  std::int64_t parameter_bytes = 0;            ///< all parameters on the planning device
  std::int64_t trainable_parameter_bytes = 0;  ///< those that require grad (gradients of this size)
  std::int64_t buffer_bytes = 0;
};

}  // namespace memscale
