// memscale::detail — byte counts as people read them ("5.50 MiB"), for reports,
// notes and logs. Standard library only, so that light headers (predict/timeline.hpp)
// can say sizes without LibTorch's. Internal.
#pragma once

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

namespace memscale::detail {

inline std::string format_bytes(std::int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = std::abs(static_cast<double>(bytes));  // not -bytes: INT64_MIN has no negation
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  std::ostringstream os;
  os.precision(unit == 0 ? 0 : 2);
  os << std::fixed << (bytes < 0 ? "-" : "") << value << ' ' << units[unit];
  return os.str();
}

}  // namespace memscale::detail
