// memscale — the Technique concept. A technique is a small tag type with static
// constexpr knobs and a static wrap() for a run of chain slots; each lives beside
// its implementation (techniques/checkpoint.hpp, offload.hpp, tile.hpp).
// Strategy<Ts...> (techniques/strategy.hpp) composes techniques at compile time.
#pragma once

#include <concepts>
#include <cstdint>
#include <memory>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace memscale {

namespace offload {
class engine;
}

/// What the executor hands a technique's wrap(): the attachment's offload
/// engine (null unless the plan offloads something), and for Tile the chunk
/// count and the input dimension it chunks.
struct wrap_context {
  std::shared_ptr<offload::engine> offload_engine;
  int tiles = 1;
  int tile_dim = 0;
  bool replay_random_draws = true;  ///< Config::replay_random_draws
  bool keep_products = false;       ///< a checkpoint keeps its matrix products (the plan chose selective recompute)
};

enum class technique_id : std::uint8_t { checkpoint, offload, tile };

[[nodiscard]] constexpr std::string_view to_string(technique_id t) noexcept {
  switch (t) {
    case technique_id::checkpoint: return "checkpoint";
    case technique_id::offload: return "offload";
    case technique_id::tile: return "tile";
  }
  return "?";
}

namespace detail {
template <class T>
concept has_technique_id = requires {
  { T::id } -> std::convertible_to<technique_id>;
};
template <class T>
concept has_technique_name = requires {
  { T::name } -> std::convertible_to<std::string_view>;
};
template <class T>
concept has_availability = requires {
  { T::available } -> std::convertible_to<bool>;
};
/// How a technique takes over a run of chain slots: one module for the first slot
/// (the executor fills the others with pass-throughs).
template <class T>
concept wraps_slots = requires(std::vector<torch::nn::AnyModule> slots, const wrap_context& context) {
  { T::wrap(std::move(slots), context) } -> std::same_as<torch::nn::AnyModule>;
};
template <class T>
concept applicable = has_availability<T> && (!T::available || wraps_slots<T>);
}  // namespace detail

/// Satisfied by a tag type with a static `id` (technique_id), `name`, `available`
/// (whether this release's executor applies it) and, when available, a static
/// `wrap(std::vector<torch::nn::AnyModule>, const wrap_context&)` that turns a
/// run of slots into one.
/// The tags: Checkpoint, Offload, Tile (techniques/checkpoint.hpp, offload.hpp, tile.hpp).
template <class T>
concept Technique = detail::has_technique_id<T> && detail::has_technique_name<T> && detail::applicable<T>;

/// Reads as a sentence when a type is not a Technique.
template <class T>
constexpr bool check_technique() {
  static_assert(detail::has_technique_id<T>,
                "memscale: this type is not a Technique: it has no `static constexpr technique_id id` member");
  static_assert(detail::has_technique_name<T>,
                "memscale: this type is not a Technique: it has no `static constexpr std::string_view name` "
                "member");
  static_assert(detail::has_availability<T>,
                "memscale: this type is not a Technique: it has no `static constexpr bool available` member");
  if constexpr (detail::has_availability<T>)
    static_assert(detail::applicable<T>,
                  "memscale: this type is not a Technique: it is `available` but has no "
                  "`static torch::nn::AnyModule wrap(std::vector<torch::nn::AnyModule>, const wrap_context&)` "
                  "member");
  return Technique<T>;
}

}  // namespace memscale
