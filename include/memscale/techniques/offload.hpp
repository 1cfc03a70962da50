// memscale — the Offload technique tag: saved activations moved to a lower memory
// tier (pinned host, pageable host, disk) and prefetched back for backward. This
// release's executor does not apply it yet (available = false); plans and the
// report say so when a Strategy or Config asks for it.
#pragma once

#include <string_view>

#include <memscale/techniques/concepts.hpp>

namespace memscale {

struct Offload {
  static constexpr technique_id id = technique_id::offload;
  static constexpr std::string_view name = "offload";
  static constexpr bool available = false;
};

}  // namespace memscale
