// `strata probe`: placeholder until the storage engine's `strata probe io` lands (issue #3).
#include <cstdio>

#include "tools/commands.h"

namespace strata::tools {

int cmd_probe(int, char**) {
  std::fprintf(stderr, "strata probe: not built yet (issues #3, #8)\n");
  return 2;
}

}  // namespace strata::tools
