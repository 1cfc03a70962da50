// Uses memscale as a downstream project would: one include, a guard around a
// training step, and memscale's log routed into the program's own spdlog
// logger (in the add_subdirectory build, a spdlog target of the project's own).
#include <iostream>
#include <memory>
#include <sstream>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <memscale/memscale.hpp>

int main() {
  std::ostringstream log;
  spdlog::register_logger(
      std::make_shared<spdlog::logger>("memscale", std::make_shared<spdlog::sinks::ostream_sink_mt>(log)));
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 8));
  const memscale::Config config{};
  config.validate();
  {
    auto guard = memscale::optimize(model, torch::randn({4, 8}), config);
    model->forward(torch::randn({4, 8})).sum().backward();
  }
  if (memscale::is_optimized(model) || log.str().find("mode Balanced, device cpu") == std::string::npos) {
    std::cerr << "memscale_consumer: the guard did not detach, or memscale's log did not reach the program's "
                 "logger:\n" << log.str();
    return 1;
  }
  return 0;
}
