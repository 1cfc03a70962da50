// memscale::detail — removing a directory tree without std::filesystem::remove_all.
// Internal.
#pragma once

#include <filesystem>
#include <system_error>

#if defined(__unix__) || defined(__APPLE__)
#include <ftw.h>
#include <sys/stat.h>

#include <cstdio>
#endif

namespace memscale::detail {

/// Removes `path` and everything under it (symbolic links themselves, never
/// what they point to), as std::filesystem::remove_all(path, ec) does, but
/// without calling it. PyTorch's Linux wheels export the std::filesystem of
/// the libstdc++ they link statically (pytorch/pytorch#133437). A program
/// linked against such a libtorch binds its own remove_all calls to that
/// copy, and with LibTorch 2.11.0+cu130 that call crashed: a jump through a
/// null pointer. On POSIX this walks the tree with nftw and removes each entry
/// with remove(3). Errors are ignored. Returns whether `path` is gone.
inline bool remove_tree(const std::filesystem::path& path) noexcept {
#if defined(__unix__) || defined(__APPLE__)
  constexpr auto remove_one = [](const char* entry, const struct stat*, int, struct FTW*) -> int {
    (void)std::remove(entry);
    return 0;  // go on past an entry that stays
  };
  (void)::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
  struct stat left {};
  return ::lstat(path.c_str(), &left) != 0;
#else
  std::error_code ignored;
  std::filesystem::remove_all(path, ignored);
  return !std::filesystem::exists(path, ignored);
#endif
}

}  // namespace memscale::detail
