// memscale::distributed — DataParallel: gradients all-reduced by c10d's Reducer,
// the engine PyTorch's DistributedDataParallel runs on, built and driven the way
// torch/nn/parallel/distributed.py does it: rank 0's parameters and buffers
// broadcast at construction, buckets rebuilt from the first backward's gradient
// order, each bucket's all-reduce started as its last gradient arrives, so
// communication overlaps the rest of backward. memscale's checkpoints and
// offloaded segments pass every gradient through autograd, so the Reducer's
// hooks on each parameter's AccumulateGrad fire once per backward, as without memscale.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/detail/modules.hpp>
#include <memscale/distributed/c10d.hpp>
#include <memscale/distributed/process_group.hpp>
#include <memscale/errors.hpp>

namespace memscale::distributed {

/// DataParallel's knobs, with DistributedDataParallel's defaults but one.
struct data_parallel_options {
  std::int64_t bucket_cap_bytes = 25 * 1024 * 1024;  ///< gradients all-reduced together, at most
  bool broadcast_buffers = true;        ///< rank 0's buffers (BatchNorm statistics) before each forward
  bool find_unused_parameters = false;  ///< parameters a forward may leave out (walks the graph each step)
  bool gradient_as_bucket_view = false; ///< .grad views the communication buffer (saves one copy)
  /// false (the default): gradients are bucketed in reverse parameter order, a
  /// 1 MiB first bucket then bucket_cap_bytes ones, for good. That layout does not
  /// depend on memscale, so with it the all-reduced sums, and the parameters, are
  /// bit-identical with and without memscale for any number of ranks.
  /// true: as DistributedDataParallel, buckets rebuilt in the order gradients
  /// arrived in the first backward. Checkpointing changes that order, and with 3
  /// or more ranks Gloo's ring adds each element in an order set by its place in
  /// its bucket, so sums may then differ from a run without memscale in the last bits.
  bool buckets_in_arrival_order = false;
};

namespace detail {

/// Coalesced broadcasts of this many bytes at most (DDP's broadcast_bucket_size).
inline constexpr std::size_t broadcast_bucket_bytes = 250u * 1024u * 1024u;

/// The tensors of a forward's output (a Tensor, a vector or a tuple of them).
template <class Output>
void tensors_of(const Output& output, std::vector<at::Tensor>& out) {
  if constexpr (std::is_convertible_v<const Output&, const at::Tensor&>) {
    out.push_back(output);
  } else if constexpr (requires { output.begin(); output.end(); }) {
    for (const auto& item : output) tensors_of(item, out);
  } else if constexpr (requires { std::tuple_size<Output>::value; }) {
    std::apply([&](const auto&... items) { (tensors_of(items, out), ...); }, output);
  } else {
    static_assert(sizeof(Output) == 0,
                  "DataParallel with find_unused_parameters: the forward's output must be a Tensor, a range or a "
                  "tuple of them (its tensors are where the graph walk starts); call after_forward with its tensors");
  }
}

/// Sends rank 0's values of `tensors` to every rank, coalesced as DDP's
/// _sync_module_states does. Bool tensors (masks) travel as bytes: Gloo has no
/// bool collectives. `in_place`: the broadcast writes into the tensors; else it
/// writes into copies, and the tensors change only once every broadcast succeeded.
inline void broadcast_from_rank0(const process_group& group, const std::vector<at::Tensor>& tensors,
                                 bool in_place = true) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> wire;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (tensor, what travels for it)
  for (const auto& t : tensors) {
    if (in_place && t.scalar_type() != at::kBool) {
      wire.push_back(t);
      continue;
    }
    copies.emplace_back(t, t.scalar_type() == at::kBool ? t.to(at::kByte) : t.detach().clone());
    wire.push_back(copies.back().second);
  }
  c10d::broadcast_coalesced(group, wire, broadcast_bucket_bytes, 0);
  for (auto& [t, received] : copies) t.copy_(received);
}

}  // namespace detail

#if MEMSCALE_HAS_C10D_REDUCER()

/// Data parallel training of `M` over a process group: construct it on every
/// rank (it broadcasts rank 0's parameters and buffers), then call forward()
/// through it each step and backward() on the loss as usual; gradients arrive
/// averaged over the ranks. Like DistributedDataParallel, every rank must run the
/// same forwards and backwards, and each training forward must be followed by a
/// backward through all its parameters (or set find_unused_parameters).
/// Order with memscale: either first; memscale never changes the parameters.
template <Model M>
class DataParallel {
 public:
  DataParallel(M model, process_group group, data_parallel_options options = {})
      : model_(std::move(model)), group_(std::move(group)), options_(options) {
    auto root = memscale::detail::root_of(model_);
    if (!root) throw Error("memscale::distributed::DataParallel: the model is empty (a null module holder)");
    if (!group_) throw Error("memscale::distributed::DataParallel: no process group");
    std::vector<at::Tensor> trainable;
    std::unordered_map<std::size_t, std::string> names;
    std::unordered_set<const void*> seen;
    for (const auto& item : root->named_parameters()) {
      const auto& p = item.value();
      if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
      names.emplace(trainable.size(), item.key());
      trainable.push_back(p);
    }
    if (trainable.empty())
      throw Error("memscale::distributed::DataParallel: the model has no parameter that requires a gradient");
    buffers_ = memscale::detail::unique_tensors(root->buffers());
    step("comparing parameter shapes across ranks", [&] {
      c10d::verify_params_across_processes(group_, trainable, {});
    });
    detail::reducer_settings settings;
    settings.bucket_cap_bytes = options_.bucket_cap_bytes;
    settings.find_unused_parameters = options_.find_unused_parameters;
    settings.gradient_as_bucket_view = options_.gradient_as_bucket_view;
    settings.fixed_buckets = !options_.buckets_in_arrival_order;
    auto built = detail::make_reducer(group_, std::move(trainable), std::move(names), settings);
    // Every rank starts from rank 0's state (DDP's _sync_module_states), received
    // into copies: a failed broadcast leaves the model as it was (and the Reducer
    // built above removes its hooks as it goes).
    auto states = memscale::detail::unique_tensors(root->parameters());
    states.insert(states.end(), buffers_.begin(), buffers_.end());
    step("broadcasting rank 0's parameters and buffers",
         [&] { detail::broadcast_from_rank0(group_, states, /*in_place=*/false); });
    reducer_ = std::move(built.reducer);
    if (settings.fixed_buckets) fixed_buckets_ = std::move(built.buckets);
  }

  /// The model's forward between before_forward() and after_forward().
  template <class... Args>
  auto forward(Args&&... args) {
    before_forward();
    auto output = model_->forward(std::forward<Args>(args)...);
    after_forward(output);
    return output;
  }
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// For a model called some other way: before its training forward, as
  /// DistributedDataParallel's pre-forward (rebuilds buckets after the first
  /// step, broadcasts rank 0's buffers).
  void before_forward() {
    if (torch::GradMode::is_enabled()) {
      reducer_->prepare_for_forward();
      // The Reducer records the first backward's gradient order until its buckets
      // are rebuilt, so rebuild them in any case; with fixed buckets, the
      // construction's layout goes straight back.
      step("rebuilding gradient buckets", [&] {
        if (reducer_->rebuild_buckets() && !fixed_buckets_.empty()) reducer_->initialize_buckets(fixed_buckets_);
      });
    }
    if (options_.broadcast_buffers && !buffers_.empty())
      step("broadcasting rank 0's buffers", [&] { detail::broadcast_from_rank0(group_, buffers_); });
  }

  /// ... and after it: tells the Reducer a backward follows (the output matters
  /// only with find_unused_parameters, which walks its graph).
  template <class Output>
  void after_forward(const Output& output) {
    if (!torch::GradMode::is_enabled()) return;
    std::vector<at::Tensor> outputs;
    if (options_.find_unused_parameters) detail::tensors_of(output, outputs);
    reducer_->prepare_for_backward(outputs);
  }

  [[nodiscard]] M& module() noexcept { return model_; }
  [[nodiscard]] const process_group& group() const noexcept { return group_; }
  [[nodiscard]] int rank() const { return group_->getRank(); }
  [[nodiscard]] int world_size() const { return group_->getSize(); }
  /// The c10d::Reducer itself (communication hooks, statistics).
  [[nodiscard]] c10d::Reducer& reducer() noexcept { return *reducer_; }

 private:
  template <class Step>
  void step(const std::string& what, Step&& body) {
    detail::collective_step("DataParallel: " + what, group_->getRank(), group_->getSize(), std::forward<Step>(body));
  }

  M model_;
  process_group group_;
  data_parallel_options options_;
  std::vector<at::Tensor> buffers_;
  std::unique_ptr<c10d::Reducer> reducer_;
  std::vector<std::vector<std::size_t>> fixed_buckets_;  ///< the construction's layout, kept; empty: DDP's rebuild
};

#else

template <Model M>
class DataParallel {
  static_assert(sizeof(M) == 0,
                "memscale::distributed::DataParallel needs c10d's reducer.hpp, which includes "
                "torch/csrc/distributed/autograd/context/context.h; Debian's libtorch-dev 1.13 lacks that header. "
                "Link the CMake target memscale::distributed, or add include/memscale/distributed/c10d_shim "
                "to the include path");

 public:
  template <class... Args>
  explicit DataParallel(Args&&...) {}
};

#endif

template <Model M, class... Rest>
DataParallel(M, Rest...) -> DataParallel<M>;

}  // namespace memscale::distributed
