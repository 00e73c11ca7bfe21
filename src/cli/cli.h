// What the files of the `clmha` program share: the commands (one file each: devices.c, run.c,
// sdpa.c, demo.c, bench.c (with bench_backward.c), tune.c; main.c picks one) and their common code in
// common.c (messages, option parsing, opening the device, output paths, random numbers and
// time).
#ifndef CLMHA_CLI_H
#define CLMHA_CLI_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include <clmha.h>

#include "base/defs.h"

// Exit status of every command.
enum { EXIT_OK = 0, EXIT_REFUSED = 1, EXIT_USAGE = 2 };

// ---- the commands: called with the arguments after the command's name; return the exit status

int clmha__cli_devices(int argc, char **argv);
int clmha__cli_run(int argc, char **argv);
int clmha__cli_demo(int argc, char **argv);
int clmha__cli_bench(int argc, char **argv);
int clmha__cli_tune(int argc, char **argv);
int clmha__cli_sdpa(int argc, char **argv);

// ---- messages

// Prints "clmha <cmd>: <message>" (or "clmha: <message>" for a NULL @p cmd) as one line on
// stderr; control characters in the message (from file names or library messages) become
// spaces.
void clmha__cli_vreport(const char *cmd, const char *fmt, va_list ap);
void clmha__cli_report(const char *cmd, const char *fmt, ...) CLMHA__PRINTF(2, 3);

// @p msg without a leading "<path>: " (the report names the path already).
const char *clmha__cli_without_path(const char *msg, const char *path);

static inline bool clmha__cli_starts_with(const char *s, const char *prefix) {
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

// ---- options

typedef struct clmha__cli_option {
    const char *name;    // "--layer"
    const char **value;  // options with a value: where it goes
    bool *flag;          // flags: where true goes
    bool allow_empty;    // the value may be ""
} clmha__cli_option;

// Parses argv against @p opts. Returns true when the command goes on. Returns false when it
// stops here, with *exit_status EXIT_OK after printing @p usage for --help or -h, or EXIT_USAGE
// after reporting a usage error.
bool clmha__cli_parse_options(const char *cmd, int argc, char **argv,
                              const clmha__cli_option *opts, size_t num_opts, const char *usage,
                              int *exit_status);

// Parses the value @p text of option @p flag (NULL: not given, *v = 0) as a decimal integer in
// [0, 2^64). Reports "clmha <cmd>: <flag> '<text>': ..." and returns false for anything else.
bool clmha__cli_parse_u64(const char *cmd, const char *flag, const char *text, uint64_t *v);

// Sequence lengths of a packed batch (--seq-lens 5,3,7): *lens (malloc'd; the caller frees it)
// and their number, at most CLMHA__CLI_MAX_SEQS.
enum { CLMHA__CLI_MAX_SEQS = 1 << 20 };
typedef struct clmha__cli_lens {
    size_t *lens;  // NULL: not given
    size_t count;
} clmha__cli_lens;

// Parses @p text of option @p flag of command @p cmd (NULL: not given, l->lens NULL): a
// comma-separated list of decimal integers, each in [0, 2^63). Reports "clmha <cmd>: <flag>
// '<text>': ..." and returns false for anything else (or out of host memory).
bool clmha__cli_parse_lens(const char *cmd, const char *flag, const char *text,
                           clmha__cli_lens *l);

// Parses a KV cache's element type (--kv-dtype): f32 (or float32; NULL too), f16, bf16, int8
// or int4. Reports "clmha <cmd>: --kv-dtype '<text>': ..." and returns false for anything else.
bool clmha__cli_parse_kv_dtype(const char *cmd, const char *text, clmha_kv_dtype *dt);

// The --kv-dtype name of @p dt ("?" for none).
const char *clmha__cli_kv_dtype_name(clmha_kv_dtype dt);

// A sliding window (--window LEFT,RIGHT): query i attends key j only when
// i - left <= j <= i + right (-1: that side unbounded).
typedef struct clmha__cli_window {
    bool on;  // --window given
    int64_t left, right;
} clmha__cli_window;

// Parses --window @p text of command @p cmd (NULL: not given, w->on false): "LEFT,RIGHT", each
// -1 or an integer in [0, 2^63). Reports "clmha <cmd>: --window '<text>': ..." and returns
// false for anything else.
bool clmha__cli_parse_window(const char *cmd, const char *text, clmha__cli_window *w);

// Parses --softcap @p text of command @p cmd (NULL: not given, *c = 0): 0 (off) or a positive
// finite decimal number. Reports "clmha <cmd>: --softcap '<text>': ..." and returns false for
// anything else (a sign, NaN, inf, a value past the double range, garbage).
bool clmha__cli_parse_softcap(const char *cmd, const char *text, double *c);

// Parses --dtype @p opt of command @p cmd: f32 (also when @p opt is NULL), f64, f16 or bf16
// (PyTorch's float32, float64, float16 and bfloat16 are taken too). Reports and returns false
// for anything else.
bool clmha__cli_parse_dtype(const char *cmd, const char *opt, clmha_dtype *out);

// Parses --impl (auto, fused or unfused; NULL: auto) for a call that wants weights or not;
// @p weight_flags names the options that ask for weights. Reports a bad value, and fused with
// weights.
bool clmha__cli_parse_impl(const char *cmd, const char *text, bool need_weights,
                           const char *weight_flags, clmha_impl *impl);

// ---- device and files

// Device spec: @p device_opt (--device), else $CLMHA_DEVICE, else the default. Reports a
// failure and returns NULL.
clmha_context *clmha__cli_open_context(const char *cmd, const char *device_opt);

// Refuses an output path early (before any work) when its folder does not exist or cannot be
// written, when the path is too long, or when something other than a regular file is there
// (a folder, a FIFO, a device, a symbolic link: see base/file_write.h). Reports and returns
// false.
bool clmha__cli_output_path_ok(const char *cmd, const char *flag, const char *path);

// --grads-dir @p dir must be an existing, writable folder (it is not created). Reports and
// returns false.
bool clmha__cli_grads_dir_ok(const char *cmd, const char *dir);

// ---- user score and mask functions (--score-mod FILE.cl, --mod-params P.npy)

// The longest --score-mod file read (an OpenCL C source; a bigger one is refused).
#define CLMHA__CLI_MOD_MAX_BYTES (1u << 20)

// User score and mask functions (clmha_layer_desc::mod_source, clmha_attention_args::
// mod_source) from the command line: the OpenCL C file and the parameters p.
typedef struct clmha__cli_mod {
    const char *source_path;  // --score-mod (NULL: not given)
    const char *params_path;  // --mod-params (NULL: not given, p empty)
    char *source;             // the file's text, NUL-terminated (malloc'd); NULL without it
    float *params;            // p (malloc'd); NULL without --mod-params or for 0 values
    size_t count;             // floats in p
} clmha__cli_mod;

// --mod-params needs --score-mod. Reports a usage error and returns false.
bool clmha__cli_mod_options_ok(const char *cmd, const clmha__cli_mod *m);

// Reads m->source_path (a regular, non-empty text file of at most CLMHA__CLI_MOD_MAX_BYTES,
// without NUL bytes) and m->params_path (a 1-D float .npy: float32, float16 or float64 values
// rounded to float32), when given. Reports "clmha <cmd>: --score-mod <path>: ..." (or
// --mod-params) and returns false when one is refused.
bool clmha__cli_mod_read(const char *cmd, clmha__cli_mod *m);

// Frees what clmha__cli_mod_read() read (the paths stay).
void clmha__cli_mod_free(clmha__cli_mod *m);

// ---- random numbers and time

// splitmix64-based uniform numbers in [-1, 1).
float clmha__cli_uniform(uint64_t *state);

// A monotonic clock in milliseconds.
double clmha__cli_now_ms(void);

// qsort comparison of doubles, ascending.
int clmha__cli_cmp_double(const void *a, const void *b);

#endif
