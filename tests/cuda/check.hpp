// The checks of the kernel tests in tests/cuda (no test framework: they link
// memscale::cuda and the CUDA runtime only). A failed check prints what failed
// and counts; main returns whether any did.
#pragma once

#include <cstdio>

namespace kernel_test {

inline int failures = 0;

inline void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    ++failures;
  }
}

}  // namespace kernel_test
