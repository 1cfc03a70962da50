// Uses memscale as a downstream project would: one include, one call.
#include <memscale/memscale.hpp>

int main() {
  const memscale::Config config{};
  config.validate();
  return 0;
}
