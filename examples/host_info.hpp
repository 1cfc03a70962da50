// Host facts the example and the benchmark print beside their figures: the CPU,
// the BLAS library actually in use (a step is over ten times slower on Debian's
// reference BLAS than on OpenBLAS) and its thread count.
#pragma once

#include <dlfcn.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include <memscale/device/hardware.hpp>

namespace host_info {

inline std::string cpu_model() { return memscale::detail::cpu_model(); }

/// The BLAS library this process uses: a libblas/libopenblas/libmkl mapped into
/// it, else what the system's libblas.so.3 alternative resolves to.
inline std::string blas_in_use() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string file = std::filesystem::path(path).filename().string();
    if (file.rfind("libopenblas", 0) == 0 || file.rfind("libblas", 0) == 0 || file.rfind("libmkl_rt", 0) == 0 ||
        file.rfind("libblis", 0) == 0) {
      std::error_code ec;
      const auto real = std::filesystem::canonical(path, ec);
      return ec ? path : real.string();
    }
  }
  std::error_code ec;
  const auto real = std::filesystem::canonical("/usr/lib/x86_64-linux-gnu/libblas.so.3", ec);
  return ec ? "unknown (no BLAS mapped, /usr/lib/x86_64-linux-gnu/libblas.so.3 not found)"
            : real.string() + " (libblas.so.3 alternative; not mapped yet)";
}

/// OpenBLAS's own thread count (its pool is separate from LibTorch's intra-op
/// threads), looked up at run time so that any BLAS links; -1 when not OpenBLAS.
inline int openblas_threads() {
  using get_fn = int (*)();
  auto* fn = reinterpret_cast<get_fn>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return fn != nullptr ? fn() : -1;
}

}  // namespace host_info
