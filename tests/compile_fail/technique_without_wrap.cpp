// expect: is `available` but has no `static torch::nn::AnyModule wrap
#include <memscale/techniques/strategy.hpp>
struct Half {
  static constexpr memscale::technique_id id = memscale::technique_id::tile;
  static constexpr std::string_view name = "half";
  static constexpr bool available = true;  // ... but no wrap()
};
memscale::Strategy<Half> bad;
int main() {}
