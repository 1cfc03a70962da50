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
#define MEMSCALE_DETAIL_STR(x) #x
#define MEMSCALE_DETAIL_VERSION(a, b, c) MEMSCALE_DETAIL_STR(a) "." MEMSCALE_DETAIL_STR(b) "." MEMSCALE_DETAIL_STR(c)
/// "major.minor.patch"
inline constexpr const char* version_string =
    MEMSCALE_DETAIL_VERSION(MEMSCALE_VERSION_MAJOR, MEMSCALE_VERSION_MINOR, MEMSCALE_VERSION_PATCH);
#undef MEMSCALE_DETAIL_VERSION
#undef MEMSCALE_DETAIL_STR
}  // namespace memscale
