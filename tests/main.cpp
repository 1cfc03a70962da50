// Catch2 v2 main for memscale_tests. With --dp-worker first, the binary is one
// rank of a data parallel job instead (tests/distributed/worker.cpp, compiled
// with the test cases; test_distributed.cpp launches it).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <string_view>

#ifdef MEMSCALE_DP_WORKER
int memscale_dp_worker_main(int argc, char** argv);
#endif

int main(int argc, char** argv) {
#ifdef MEMSCALE_DP_WORKER
  if (argc > 1 && std::string_view(argv[1]) == "--dp-worker") return memscale_dp_worker_main(argc - 1, argv + 1);
#endif
  return Catch::Session().run(argc, argv);
}
