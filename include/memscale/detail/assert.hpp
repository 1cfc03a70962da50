// memscale::detail — internal invariant checks; not part of the public surface.
#pragma once

#include <stdexcept>
#include <string>

namespace memscale::detail {

/// Thrown when an internal invariant breaks: a memscale bug, never a user error.
class invariant_violation : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

[[noreturn]] inline void assertion_failed(const char* expr, const char* file, int line,
                                          const std::string& what) {
  throw invariant_violation(std::string("memscale internal error: ") + expr + " failed at " +
                            file + ":" + std::to_string(line) + (what.empty() ? "" : ": " + what));
}

}  // namespace memscale::detail

/// Internal invariant; active in every build type (the checks are cheap and off hot paths).
#define MEMSCALE_ASSERT(cond, what)                                                  \
  do {                                                                               \
    if (!(cond)) ::memscale::detail::assertion_failed(#cond, __FILE__, __LINE__, what); \
  } while (false)
