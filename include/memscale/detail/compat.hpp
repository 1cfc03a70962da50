// memscale::detail — spellings that differ between LibTorch 1.13 and 2.x.
// Internal; see ../shared/LIBTORCH_NOTES.md for what each line papers over.
#pragma once

#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <variant>
#else
#include <c10/util/variant.h>
#endif

namespace memscale::detail::compat {

// Module options hold c10::variant in 1.13 and std::variant in 2.x.
#if TORCH_VERSION_MAJOR >= 2
using std::get_if;
using std::holds_alternative;
#else
using c10::get_if;
using c10::holds_alternative;
#endif

}  // namespace memscale::detail::compat
