// The `clmha` program: `clmha devices`, `clmha run`, `clmha sdpa`, `clmha demo`, `clmha bench`,
// `clmha tune`.
// This file picks the command; each command is a file of its own in src/cli/ (see cli.h).
//
// Exit status: 0 success; 1 a refused input (unreadable or malformed file, shape mismatch,
// device or library failure) or stdout that could not be written; 2 a usage error (unknown
// command or option, missing value, missing required option). Every error is one line on stderr that starts with
// "clmha <command>: " and names the file or argument at fault.
#include "cli.h"
#include "outputs.h"

#include <errno.h>
#include <stdio.h>

static const char *usage_main =
    "usage: clmha <command> [options]\n"
    "\n"
    "Computes torch.nn.MultiheadAttention on an OpenCL device: the forward pass, the\n"
    "backward pass (gradients) and decoding through a KV cache; and scaled dot-product\n"
    "attention alone, on already projected heads.\n"
    "\n"
    "commands:\n"
    "  devices   list every OpenCL platform and device with the spec string that selects it\n"
    "  run       run a layer file (.safetensors) on .npy inputs, write .npy outputs\n"
    "            (--grad-output: also the gradients; --decode-chunk: through a KV cache)\n"
    "  sdpa      scaled dot-product attention (PyTorch's F.scaled_dot_product_attention)\n"
    "            on .npy query, key and value heads, write .npy outputs (--lse-output: the\n"
    "            log-sum-exp rows; --grad-output: also the gradients; --kv-cache-prefix:\n"
    "            through a KV cache)\n"
    "  demo      run a random layer, check it against the CPU reference, time it\n"
    "  bench     time the device-buffer forward pass: ms, GFLOP/s, scratch, time per stage\n"
    "            (--backward: the training step; --decode: one step over a KV cache)\n"
    "  tune      tune a device, store the result for later runs: CLBlast's GEMMs where\n"
    "            they run in CLBlast, the fused core's tiles, the decode core's split (on\n"
    "            a host-BLAS device, PoCL or Intel's CPU runtime, only the last two)\n"
    "\n"
    "options:\n"
    "  --help, -h   print this help (clmha <command> --help: help on a command)\n"
    "  --version    print the version\n"
    "\n"
    "exit status: 0 success, 1 refused input (bad file, shape mismatch, device error) or\n"
    "stdout could not be written, 2 usage error\n";

// The subcommands: name and entry point (called with the arguments after the name).
static const struct command {
    const char *name;
    int (*run)(int argc, char **argv);
} commands[] = {
    {"devices", clmha__cli_devices},
    {"run", clmha__cli_run},
    {"sdpa", clmha__cli_sdpa},
    {"demo", clmha__cli_demo},
    {"bench", clmha__cli_bench},
    {"tune", clmha__cli_tune},
};
enum { NUM_COMMANDS = sizeof commands / sizeof commands[0] };

// Flushes and closes stdout: what a command printed there (a summary, a listing, --help) is its
// result, so a write that failed (stdout on a full disk, a closed file) turns a success into
// exit status 1, with a message on stderr (a command that failed has said why already: one
// message). Once a command has committed its output files it has succeeded: it flushed stdout
// just before and printed nothing since, so a failure to close it loses nothing, and the
// status stays 0 (a failed run leaves every file as it was; this one wrote them).
static int finish(int rc) {
    errno = 0;
    bool failed = fflush(stdout) != 0 || ferror(stdout);
    int err = errno;
    if (fclose(stdout) != 0 && !failed) failed = true, err = errno;
    if (!failed || rc != EXIT_OK || clmha__cli_outputs_committed()) return rc;
    clmha__cli_report(NULL, "cannot write to stdout: %s", err ? strerror(err) : "write error");
    return EXIT_REFUSED;
}

static int run_command(int argc, char **argv);

int main(int argc, char **argv) { return finish(run_command(argc, argv)); }

static int run_command(int argc, char **argv) {
    char names[256] = "";  // "devices, run, sdpa, demo, bench, tune"
    for (size_t i = 0; i < NUM_COMMANDS; ++i)
        snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "",
                 commands[i].name);
    if (argc < 2) {
        clmha__cli_report(NULL, "no command given (%s; try 'clmha --help')", names);
        return EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        fputs(usage_main, stdout);
        return EXIT_OK;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("clmha %s\n", clmha_version());
        return EXIT_OK;
    }
    for (size_t i = 0; i < NUM_COMMANDS; ++i)
        if (strcmp(cmd, commands[i].name) == 0) return commands[i].run(argc - 2, argv + 2);
    if (clmha__cli_starts_with(cmd, "-"))
        clmha__cli_report(NULL, "unknown option '%s' (try 'clmha --help')", cmd);
    else
        clmha__cli_report(NULL, "unknown command '%s' (%s; try 'clmha --help')", cmd, names);
    return EXIT_USAGE;
}
