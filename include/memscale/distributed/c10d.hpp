// memscale::distributed — internal: the c10d headers data parallel training uses,
// and the spellings that differ between LibTorch 1.13 and 2.x (process groups
// became front ends of per-device Backends in 2.0; the Reducer's constructor
// changed several times). See ../shared/LIBTORCH_NOTES.md.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/torch.h>

// ProcessGroupGloo.hpp is wrapped in USE_C10D_GLOO, which PyTorch's own build
// defines and Torch's CMake config does not; its <gloo/...> headers come from
// libgloo-dev. Define MEMSCALE_NO_GLOO to leave Gloo out.
#if !defined(USE_C10D_GLOO) && !defined(MEMSCALE_NO_GLOO) && __has_include(<gloo/config.h>)
#define USE_C10D_GLOO 1
#endif
#if defined(USE_C10D_GLOO)
#define MEMSCALE_HAS_GLOO() 1
#else
#define MEMSCALE_HAS_GLOO() 0
#endif

// reducer.hpp includes dist-autograd's context.h, which Debian's libtorch-dev
// 1.13 does not ship: the memscale::distributed CMake target then puts
// include/memscale/distributed/c10d_shim on the include path (see the note there).
#if __has_include(<torch/csrc/distributed/autograd/context/context.h>)
#define MEMSCALE_HAS_C10D_REDUCER() 1
#else
#define MEMSCALE_HAS_C10D_REDUCER() 0
#endif

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#if MEMSCALE_HAS_GLOO()
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if MEMSCALE_HAS_C10D_REDUCER()
#include <torch/csrc/distributed/c10d/reducer.hpp>
#endif
// NCCL: a CUDA LibTorch, nccl.h, and USE_C10D_NCCL defined by the build.
#if defined(USE_C10D_NCCL)
#define MEMSCALE_HAS_NCCL() 1
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#else
#define MEMSCALE_HAS_NCCL() 0
#endif

namespace memscale::distributed {

/// A c10d process group: Gloo (CPU), NCCL (CUDA), or any other c10d backend.
using process_group = c10::intrusive_ptr<c10d::ProcessGroup>;

namespace detail {

#if TORCH_VERSION_MAJOR >= 2
/// 2.x: a process group is a front end that dispatches to one Backend per
/// device type (1.13: the backend is the process group). Its constructor took
/// ProcessGroup::Options (the backend's name, the timeout) until the front end
/// learned its default backend from setDefaultBackend; either spelling compiles.
template <class Group = c10d::ProcessGroup>
process_group front_end(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                        const c10::intrusive_ptr<c10d::Backend>& backend, typename Group::BackendType type,
                        const std::vector<c10::DeviceType>& devices) {
  c10::intrusive_ptr<Group> group;
  if constexpr (std::is_constructible_v<Group, const c10::intrusive_ptr<c10d::Store>&, int, int>) {
    group = c10::make_intrusive<Group>(store, rank, world_size);
  } else {
    group = c10::make_intrusive<Group>(
        store, rank, world_size, c10::make_intrusive<typename Group::Options>(backend->getBackendName()));
  }
  for (auto device : devices) group->setBackend(device, type, backend);
  if constexpr (requires { group->setDefaultBackend(type); }) group->setDefaultBackend(type);
  return group;
}
#endif

#if MEMSCALE_HAS_C10D_REDUCER()
/// Bucket caps as PyTorch's DistributedDataParallel sets them.
struct reducer_settings {
  std::int64_t bucket_cap_bytes = c10d::kDefaultBucketBytesCap;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool fixed_buckets = false;  ///< sized buckets from the start, kept (not rebuilt in arrival order)
};

/// c10d::Reducer's constructor: its arguments differ by version, and the first
/// list this LibTorch's constructor takes wins.
template <class Reducer>
std::unique_ptr<Reducer> construct_reducer(const process_group& group, std::vector<at::Tensor> params,
                                           std::vector<std::vector<std::size_t>> buckets,
                                           std::vector<std::size_t> per_bucket_limits, const std::vector<bool>& dense,
                                           std::unordered_map<std::size_t, std::string> names,
                                           const reducer_settings& settings) {
  const std::int64_t cap = settings.bucket_cap_bytes;
  const std::int64_t first_cap = c10d::kDefaultFirstBucketBytes;
  const bool unused = settings.find_unused_parameters;
  const bool as_view = settings.gradient_as_bucket_view;
  using names_t = std::unordered_map<std::size_t, std::string>;
  using buckets_t = std::vector<std::vector<std::size_t>>;
  using tensors_t = std::vector<at::Tensor>;
  if constexpr (std::is_constructible_v<Reducer, tensors_t, buckets_t, process_group, std::vector<bool>, std::int64_t,
                                        bool, bool, names_t, std::int64_t, bool, bool, std::vector<std::int64_t>>) {
    // 2.10+: skip_all_reduce_unused_params, use_python_reducer, bucket_bytes_cap_list (empty: the two caps)
    return std::make_unique<Reducer>(std::move(params), std::move(buckets), group, dense, cap, unused, as_view,
                                     std::move(names), first_cap, false, false, std::vector<std::int64_t>{});
  } else if constexpr (std::is_constructible_v<Reducer, tensors_t, buckets_t, process_group, std::vector<bool>,
                                               std::int64_t, bool, bool, names_t, std::int64_t, bool, bool>) {
    return std::make_unique<Reducer>(std::move(params), std::move(buckets), group, dense, cap, unused, as_view,
                                     std::move(names), first_cap, false, false);
  } else if constexpr (std::is_constructible_v<Reducer, tensors_t, buckets_t, process_group, std::vector<bool>,
                                               std::int64_t, bool, bool, names_t, std::int64_t, bool>) {
    return std::make_unique<Reducer>(std::move(params), std::move(buckets), group, dense, cap, unused, as_view,
                                     std::move(names), first_cap, false);
  } else if constexpr (std::is_constructible_v<Reducer, tensors_t, buckets_t, process_group, std::vector<bool>,
                                               std::int64_t, bool, bool, names_t, std::int64_t>) {
    return std::make_unique<Reducer>(std::move(params), std::move(buckets), group, dense, cap, unused, as_view,
                                     std::move(names), first_cap);
  } else if constexpr (std::is_constructible_v<Reducer, tensors_t, buckets_t, std::vector<std::size_t>, process_group,
                                               std::vector<bool>, std::int64_t, bool, bool, names_t, std::int64_t>) {
    // 1.13 to 2.0: the per-bucket size limits come third.
    return std::make_unique<Reducer>(std::move(params), std::move(buckets), std::move(per_bucket_limits), group,
                                     dense, cap, unused, as_view, std::move(names), first_cap);
  } else {
    static_assert(sizeof(Reducer) == 0,
                  "memscale::distributed: this LibTorch's c10d::Reducer constructor is none of those memscale "
                  "knows (1.13 to 2.14): add its argument list to construct_reducer in memscale/distributed/c10d.hpp");
  }
}

/// The Reducer and its buckets at construction (indices into the parameters).
template <class Reducer>
struct built_reducer {
  std::unique_ptr<Reducer> reducer;
  std::vector<std::vector<std::size_t>> buckets;
};

/// c10d::Reducer as DistributedDataParallel builds it (torch/nn/parallel/distributed.py,
/// _ddp_init_helper): one bucket to start with (the real ones are built from the
/// order gradients arrive in the first backward; with find_unused_parameters, or
/// fixed_buckets, a small first bucket and `bucket_cap_bytes` ones), in reverse
/// parameter order.
template <class Reducer = c10d::Reducer>
built_reducer<Reducer> make_reducer(const process_group& group, std::vector<at::Tensor> params,
                                    std::unordered_map<std::size_t, std::string> names,
                                    const reducer_settings& settings) {
  const std::vector<bool> dense(params.size(), false);
  std::vector<std::size_t> limits{static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max())};
  if (settings.find_unused_parameters || settings.fixed_buckets)
    limits = {static_cast<std::size_t>(c10d::kDefaultFirstBucketBytes),
              static_cast<std::size_t>(settings.bucket_cap_bytes)};
  auto [buckets, per_bucket_limits] = c10d::compute_bucket_assignment_by_size(params, limits, dense);
  std::reverse(buckets.begin(), buckets.end());
  std::reverse(per_bucket_limits.begin(), per_bucket_limits.end());
  auto layout = buckets;
  return {construct_reducer<Reducer>(group, std::move(params), std::move(buckets), std::move(per_bucket_limits),
                                     dense, std::move(names), settings),
          std::move(layout)};
}
#endif

}  // namespace detail
}  // namespace memscale::distributed
