// What the two files of the `clmha` program share: src/cli.c (the commands, main) and
// src/cli_tune.c (`clmha tune`).
#ifndef CLMHA_CLI_H
#define CLMHA_CLI_H

#include <stdarg.h>

// Prints "clmha <cmd>: <message>" (or "clmha: <message>" for a NULL @p cmd) as one line on
// stderr; control characters in the message become spaces.
void clmha__cli_vreport(const char *cmd, const char *fmt, va_list ap);

// `clmha tune`: the arguments after "tune"; returns the exit status.
int clmha__cli_tune(int argc, char **argv);

#endif
