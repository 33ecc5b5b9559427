// strata: train models larger than GPU memory. A thin dispatcher over the subcommands.
#include <cstdio>
#include <cstring>
#include <string_view>

#include "tools/commands.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int, char**);
  const char* help;
};

constexpr Command kCommands[] = {
    {"train", strata::tools::cmd_train,
     "train a model from a config (DeepSpeed ds_config.json works)"},
    {"probe", strata::tools::cmd_probe,
     "measure this machine (memory, CPU optimizer, GEMM, link, NVMe, collectives): a profile"},
    {"plan", strata::tools::cmd_plan,
     "per-tier bytes, fit, step time and bottleneck per placement; writes the best config"},
    {"eval", strata::tools::cmd_eval,
     "mean next-token loss and perplexity of a model or checkpoint over a token file"},
    {"export", strata::tools::cmd_export,
     "write a checkpoint's model as a Hugging Face model directory (weights, tokenizer)"},
    {"generate", strata::tools::cmd_generate,
     "a quick look at what a model says: greedy or sampled text from a prompt"},
    {"trace", strata::tools::cmd_trace,
     "replay a recorded access trace against cache policies (trace replay)"},
};

void usage(FILE* out) {
  std::fprintf(out,
               "strata: train models far larger than GPU memory.\n\n"
               "usage: strata <command> [options]   (strata <command> --help for its options)\n\n"
               "commands:\n");
  for (const auto& c : kCommands) std::fprintf(out, "  %-8s %s\n", c.name, c.help);
  std::fprintf(out,
               "\nenvironment:\n"
               "  STRATA_CPU_ISA  force the CPU code path (optimizer and GEMM): "
               "scalar|avx2|avx512|avx512bf16|onednn\n"
               "                  (default: chosen by CPUID and logged; docs/ARCHITECTURE.md)\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : kCommands) {
    if (std::string_view(argv[1]) == c.name) return c.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "strata: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}
