// expect: (constraints not satisfied|StrategyType)
#include <memscale/memscale.hpp>
int main() {
  torch::nn::Sequential seq(torch::nn::Linear(2, 2));
  auto guard = memscale::optimize<memscale::Checkpoint>(seq);
}
