// expect: is not a Technique: it has no `static constexpr technique_id id` member
#include <memscale/techniques/strategy.hpp>
struct NotATechnique {};
memscale::Strategy<memscale::Checkpoint, NotATechnique> bad;
int main() {}
