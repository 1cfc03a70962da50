// memscale::distributed — the process group data parallel training runs on: a
// store every rank reaches (a file, or a TCP server on rank 0) and Gloo (CPU) or
// NCCL (CUDA) over it, with one timeout for the store and for every collective,
// so that a rank that dies or never comes ends the others with an error, not a hang.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

#include <torch/torch.h>

#include <memscale/distributed/c10d.hpp>
#include <memscale/errors.hpp>

namespace memscale::distributed {

/// How long a rank waits for the others, in the store and in each collective,
/// before it fails. Generous for a first rendezvous; tests use seconds.
inline constexpr std::chrono::milliseconds default_timeout = std::chrono::minutes(5);

/// A collective or the store failed: a peer exited, never started, or did not
/// answer within the timeout. The message names this rank and what it was doing.
class DistributedError : public Error {
 public:
  using Error::Error;
};

namespace detail {

/// Whether c10d's or Gloo's message says the other side went away or never
/// answered (rather than, say, that the ranks' models differ).
inline bool lost_contact(std::string_view message) {
  for (std::string_view sign : {"imeout", "imed out", "closed", "reset", "onnection", "peer", "Broken pipe", "refused"})
    if (message.find(sign) != std::string_view::npos) return true;
  return false;
}

/// Runs `step` (a collective or a store operation) and turns a c10d failure into
/// a DistributedError that says which rank was doing what.
template <class Step>
decltype(auto) collective_step(const std::string& what, int rank, int world_size, Step&& step) {
  try {
    return std::forward<Step>(step)();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string message = e.what();
    if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) message = c10->what_without_backtrace();
    const char* hint = lost_contact(message) ? " (another rank exited, never started or stopped answering: the "
                                               "ranks end here at once, or when the time allowed runs out)"
                                             : "";
    throw DistributedError("memscale: rank " + std::to_string(rank) + " of " + std::to_string(world_size) + ": " +
                           what + " failed: " + message + hint);
  }
}

inline std::string within(std::chrono::milliseconds timeout) {
  std::ostringstream os;
  os << " (timeout " << std::chrono::duration<double>(timeout).count() << " s)";
  return os.str();
}

/// 2.x serves a TCPStore with libuv by default, which Debian's LibTorch is
/// built without; the classic server exists in every version.
template <class Options>
void classic_tcp_server(Options& options) {
  if constexpr (requires { options.useLibUV; }) options.useLibUV = false;
}

}  // namespace detail

/// A store in a file every rank can open (the same path on every rank; a fresh
/// file per job: a file left by an earlier job confuses the rendezvous).
inline c10::intrusive_ptr<c10d::Store> file_store(const std::string& path, int world_size,
                                                  std::chrono::milliseconds timeout = default_timeout) {
  auto store = c10::make_intrusive<c10d::FileStore>(path, world_size);
  store->setTimeout(timeout);
  return store;
}

/// A store served by rank 0 on host:port; the other ranks connect to it.
inline c10::intrusive_ptr<c10d::Store> tcp_store(const std::string& host, std::uint16_t port, int rank,
                                                 int world_size, std::chrono::milliseconds timeout = default_timeout) {
  c10d::TCPStoreOptions options;
  options.port = port;
  options.isServer = rank == 0;
  options.numWorkers = static_cast<std::size_t>(world_size);
  options.waitWorkers = false;  // the process group's own rendezvous waits for the others
  options.timeout = timeout;
  detail::classic_tcp_server(options);
  return detail::collective_step("connecting to the TCP store at " + host + ":" + std::to_string(port) +
                                     detail::within(timeout),
                                 rank, world_size, [&] {
                                   return c10::intrusive_ptr<c10d::Store>(
                                       c10::make_intrusive<c10d::TCPStore>(host, options));
                                 });
}

#if MEMSCALE_HAS_GLOO()
/// Gloo over `store`, bound to `host` (an address of this machine the other ranks
/// reach: "127.0.0.1" when every rank runs here; "" for Gloo's default, the
/// address of this machine's host name). Gloo writes to its peers with
/// writev(2), which raises SIGPIPE where a peer is gone, and that ends the
/// process: ignore SIGPIPE in a rank's program (`signal(SIGPIPE, SIG_IGN)`, as
/// Python does) for the collective to fail with an error instead.
inline process_group gloo_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                                std::chrono::milliseconds timeout = default_timeout,
                                const std::string& host = "127.0.0.1") {
  return detail::collective_step("the Gloo rendezvous" + detail::within(timeout), rank, world_size, [&]() -> process_group {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(host.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                            : c10d::ProcessGroupGloo::createDeviceForHostname(host));
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
#if TORCH_VERSION_MAJOR >= 2
    // As torch.distributed registers "gloo": for CPU and CUDA tensors.
    return detail::front_end(store, rank, world_size, gloo, c10d::ProcessGroup::BackendType::GLOO,
                             {c10::DeviceType::CPU, c10::DeviceType::CUDA});
#else
    return gloo;
#endif
  });
}

/// The whole set-up for one machine in one call: Gloo over a FileStore at
/// `store_path` (the same fresh path on every rank), bound to `host`.
inline process_group process_group_from(int rank, int world_size, const std::string& store_path,
                                        std::chrono::milliseconds timeout = default_timeout,
                                        const std::string& host = "127.0.0.1") {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw Error("memscale: rank " + std::to_string(rank) + " of world size " + std::to_string(world_size) +
                ": the rank must be in [0, world size)");
  return gloo_group(file_store(store_path, world_size, timeout), rank, world_size, timeout, host);
}
#endif

#if MEMSCALE_HAS_NCCL()
/// NCCL over `store`, for CUDA tensors: one GPU per rank (select it with
/// c10::cuda::set_device before the first collective).
inline process_group nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                                std::chrono::milliseconds timeout = default_timeout) {
  return detail::collective_step("setting up NCCL" + detail::within(timeout), rank, world_size, [&]() -> process_group {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, options);
#if TORCH_VERSION_MAJOR >= 2
    return detail::front_end(store, rank, world_size, nccl, c10d::ProcessGroup::BackendType::NCCL,
                             {c10::DeviceType::CUDA});
#else
    return nccl;
#endif
  });
}
#endif

}  // namespace memscale::distributed
