// `strata train`: placeholder until the trainer lands in this series of commits.
#include <cstdio>

#include "tools/commands.h"

namespace strata::tools {

int cmd_train(int, char**) {
  std::fprintf(stderr, "strata train: not built yet\n");
  return 2;
}

}  // namespace strata::tools
