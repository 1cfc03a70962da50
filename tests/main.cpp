// Catch2 v2 main for memscale_tests.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
