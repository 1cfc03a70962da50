// memscale — the Technique concept and the technique tag types. A technique is
// a small tag type with static constexpr knobs; the executor applies it by id.
// Strategy<Ts...> (techniques/strategy.hpp) composes techniques at compile time.
#pragma once

#include <concepts>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace memscale {

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
}  // namespace detail

/// Satisfied by a tag type with a static `id` (technique_id), `name` and
/// `available` (whether this build's executor can apply it).
template <class T>
concept Technique = detail::has_technique_id<T> && detail::has_technique_name<T> && detail::has_availability<T>;

/// Activation checkpointing of segments (techniques/checkpoint.hpp).
struct Checkpoint {
  static constexpr technique_id id = technique_id::checkpoint;
  static constexpr std::string_view name = "checkpoint";
  static constexpr bool available = true;
};

/// Offloading saved activations to a lower memory tier. Not applied by this
/// release's executor (the offload engine is tracked separately); plans say so.
struct Offload {
  static constexpr technique_id id = technique_id::offload;
  static constexpr std::string_view name = "offload";
  static constexpr bool available = false;
};

/// Tiling row-independent layers over chunks. Not applied by this release's
/// executor (tracked separately); plans say so.
struct Tile {
  static constexpr technique_id id = technique_id::tile;
  static constexpr std::string_view name = "tile";
  static constexpr bool available = false;
};

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
  return Technique<T>;
}

}  // namespace memscale
