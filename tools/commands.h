// Subcommands of the `strata` tool. Each returns the process exit code: 0 on success, 1 on a
// failing Status (after printing it), 2 on bad usage. argv[0] is the subcommand's name.
#pragma once

namespace strata::tools {

int cmd_train(int argc, char** argv);
int cmd_probe(int argc, char** argv);
int cmd_trace(int argc, char** argv);
int cmd_plan(int argc, char** argv);
int cmd_export(int argc, char** argv);
int cmd_eval(int argc, char** argv);
int cmd_generate(int argc, char** argv);

}  // namespace strata::tools
