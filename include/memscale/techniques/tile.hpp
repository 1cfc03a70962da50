// memscale — the Tile technique tag: row-independent layers run over chunks of
// the batch or sequence, each chunk checkpointed. This release's executor does not
// apply it yet (available = false); plans and the report say so when asked for it.
#pragma once

#include <string_view>

#include <memscale/techniques/concepts.hpp>

namespace memscale {

struct Tile {
  static constexpr technique_id id = technique_id::tile;
  static constexpr std::string_view name = "tile";
  static constexpr bool available = false;
};

}  // namespace memscale
