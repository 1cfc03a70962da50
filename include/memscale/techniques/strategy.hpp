// memscale — Strategy<Ts...>: the compile-time set of techniques a guard may use.
// optimize<Strategy<Checkpoint>>(...) plans with checkpointing only. A type that is
// not a Technique, or one named twice, fails to compile with a readable message.
#pragma once

#include <cstdint>
#include <type_traits>

#include <memscale/techniques/checkpoint.hpp>
#include <memscale/techniques/concepts.hpp>
#include <memscale/techniques/offload.hpp>
#include <memscale/techniques/tile.hpp>

namespace memscale {

namespace detail {
template <class T, class... Ts>
constexpr bool appears_in = (std::is_same_v<T, Ts> || ...);

template <class... Ts>
struct all_distinct : std::true_type {};
template <class T, class... Ts>
struct all_distinct<T, Ts...> : std::bool_constant<!appears_in<T, Ts...> && all_distinct<Ts...>::value> {};
}  // namespace detail

template <class... Ts>
struct Strategy {
  static_assert(sizeof...(Ts) > 0, "memscale: a Strategy must name at least one Technique");
  static_assert((check_technique<Ts>() && ...), "memscale: every Strategy argument must be a Technique");
  static_assert(detail::all_distinct<Ts...>::value,
                "memscale: a Strategy names the same Technique twice; list each technique once");

  /// Whether the strategy contains technique `t`.
  [[nodiscard]] static constexpr bool contains(technique_id t) noexcept { return ((Ts::id == t) || ...); }
  /// Whether the strategy contains `t` and this build can apply it.
  [[nodiscard]] static constexpr bool applies(technique_id t) noexcept {
    return ((Ts::id == t && Ts::available) || ...);
  }
};

using DefaultStrategy = Strategy<Checkpoint, Offload, Tile>;

template <class T>
struct is_strategy : std::false_type {};
template <class... Ts>
struct is_strategy<Strategy<Ts...>> : std::true_type {};

/// Satisfied by Strategy<Ts...> specializations.
template <class T>
concept StrategyType = is_strategy<T>::value;

}  // namespace memscale
