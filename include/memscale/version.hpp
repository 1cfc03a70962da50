// memscale — the library version: the one place it is written. CMakeLists.txt
// reads project(VERSION) from these three lines.
#pragma once

#define MEMSCALE_VERSION_MAJOR 0
#define MEMSCALE_VERSION_MINOR 1
#define MEMSCALE_VERSION_PATCH 0

namespace memscale {
inline constexpr int version_major = MEMSCALE_VERSION_MAJOR;
inline constexpr int version_minor = MEMSCALE_VERSION_MINOR;
inline constexpr int version_patch = MEMSCALE_VERSION_PATCH;
}  // namespace memscale
