// expect: names the same Technique twice
#include <memscale/techniques/strategy.hpp>
memscale::Strategy<memscale::Checkpoint, memscale::Tile, memscale::Checkpoint> duplicate;
int main() {}
