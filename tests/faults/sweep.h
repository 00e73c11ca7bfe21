// What the fault sweep's files share (tests/faults/fault_sweep.c, sweep_cli.c): the outcomes of
// one injected run, and the scenario of the `clmha run` program.
#ifndef CLMHA_TESTS_FAULTS_SWEEP_H
#define CLMHA_TESTS_FAULTS_SWEEP_H

// The outcome of one run (a child process's exit status).
enum { OUT_REFUSED = 0, OUT_RECOVERED = 1, OUT_WRONG = 2, OUT_RETRY = 3, OUT_MESSAGE = 4,
       OUT_SETUP = 5, OUT_WRITTEN = 6, OUT_LEAK = 7, OUT_CRASHED = 8, OUTCOMES = 9,
       OUT_DONE = 10 };

// What the preloaded library saw in the program's process (written when it exits,
// $CLMHA_FAULT_REPORT): its calls of the kind, the OpenCL objects and allocations libclmha
// still held, and the call it failed ("-": none).
typedef struct cli_report {
    long calls, held, allocations;
    char failed[64];
} cli_report;

// Runs `clmha run` (@p program) on the case folder @p cases (tests/cli/grad_self: the layer,
// query, output gradient and PyTorch's results) with call @p at of $CLMHA_FAULT_KIND failing
// (0: none), then, after a failure, once more without faults. Returns the outcome, with what
// the injected run's process saw in *report.
int cli_sweep_run(const char *program, const char *cases, long at, cli_report *report);

#endif
