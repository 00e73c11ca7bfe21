// The `clmha` program (CLMHA_CLI_PATH), run as a separate process:
//   - every case of tests/cli/cases.inc through `clmha run`, compared with PyTorch's results
//     (max abs error <= 1e-4); one line per case goes to stderr:
//       cli <case> out_maxabs=... w_maxabs=...
//     the gradient cases (grad_output.npy) also through --grad-output/--grads-dir, every
//     gradient file against PyTorch's float64 autograd (max abs error <= 1e-4 * (1 + max|torch|)),
//     through both attention cores:
//       cli <case> grads=<files> grad_maxnorm=...
//   - every case of tests/cli/sdpa_cases.inc through `clmha sdpa` (scaled dot-product attention
//     on .npy heads), the output, log-sum-exp, weights and gradients against PyTorch's float64
//     formula (max abs error <= 1e-5; gradients as above), through both forward cores:
//       cli_sdpa <case> out_maxabs=... lse_maxabs=... w_maxabs=... grads=N grad_maxnorm=...
//     and its usage errors, refused files and shapes, float64 inputs, dropout replay, files all
//     or none;
//   - sliding windows (a layer file's metadata window, --window): the window cases of both lists,
//     through every core (fused, unfused, decode); bad --window values are usage errors;
//   - soft-capping and ALiBi (a layer file's softcap, alibi and alibi_slopes; --softcap, --alibi,
//     --alibi-slopes) likewise: their cases of both lists through every core; bad values are
//     usage errors; bench's JSON line names them;
//   - attention sinks (a layer file's tensor sinks, sdpa's --sinks, bench's --sinks) likewise,
//     their gradient (sinks.npy) with the others; a wrongly shaped sinks file is refused;
//   - user score and mask functions (--score-mod FILE.cl, --mod-params P.npy): ALiBi and
//     is_causal written as functions give the PyTorch results of the ALiBi and causal cases (run:
//     both cores, gradients, --decode-chunk; sdpa: gradients, sinks, a KV cache); unreadable
//     files, sources that do not compile (the build log in the message) and a backward pass
//     without clmha_score_mod_grad are refused; bench's JSON line names the file;
//   - --dtype f64: '<f8' files in and out, against the float64 reference and every PyTorch case
//     (max abs error <= 1e-12), doubles no float holds kept bit for bit; what float64 layers
//     lack yet (KV cache, backward) refused as usage errors; `clmha bench --dtype f64`;
//   - refused inputs exit 1 with one stderr line naming the file or argument and create no file;
//   - usage errors exit 2; --help and --version exit 0;
//   - `clmha devices` lists the spec strings; `clmha demo --heatmap` and `clmha run --heatmap`
//     write a PNG;
//   - files: special files are neither read (no hang) nor replaced, a failed run (a rename made
//     to fail by tests/cli/cli_fail_rename.c) leaves every file as it was, outputs that are the same
//     file or an input are refused, 255-byte names are written;
//   - a stdout that cannot be written (/dev/full) fails the command; honest bench limits; a
//     warning for NaN/Inf results.
// Tests that need an OpenCL device skip when `clmha devices` finds none.
#define _POSIX_C_SOURCE 200809L

#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clmha.h"
#include "base/half.h"
#include "cli/npy.h"
#include "support.h"

#ifndef CLMHA_CLI_PATH
#error "CLMHA_CLI_PATH (the path of the built clmha program, a string) must be defined"
#endif
#ifndef CLMHA_FAIL_RENAME_LIB
#error "CLMHA_FAIL_RENAME_LIB (the path of the built tests/cli/cli_fail_rename.c, a string) must be defined"
#endif
#ifndef CLMHA_TEST_DATA_DIR
#error "CLMHA_TEST_DATA_DIR (the path of tests/, a string) must be defined"
#endif

#define CLI_TOL 1e-4
// Gradients: max |clmha - torch| <= CLI_GRAD_TOL * (1 + max |torch|), per file.
#define CLI_GRAD_TOL 1e-4
#define CLI_MAX_ARGS 64
#define CLI_MAX_NAME 128
#define CLI_PATH_SIZE 1024

// The case names, written by tools/make_cli_cases.py next to the case folders.
static const char *const cli_case_names[] = {
#include "cli/cases.inc"
    NULL};
#define CLI_NUM_CASES (sizeof cli_case_names / sizeof *cli_case_names - 1)

// ---- running the program --------------------------------------------------------------------

typedef struct cli_result {
    int status;  // exit status; -1 when the program did not exit normally
    int signal;  // the signal that ended it, or 0
    char *out;   // stdout, NUL-terminated
    char *err;   // stderr, NUL-terminated
} cli_result;

// How the next runs start (tests that change them put them back): a hung program is ended by
// SIGALRM after cli_alarm_s seconds; stdout goes to cli_stdout_to (e.g. "/dev/full") instead of
// being captured when set; cli_fail_rename (when set) is preloaded with tests/cli/cli_fail_rename.c
// so that a rename onto a path ending so fails.
static unsigned cli_alarm_s = 600;
static const char *cli_stdout_to;
static const char *cli_fail_rename;

// Runs the program with @p args (NULL-terminated, without argv[0]); stdout and stderr are
// captured in temporary files outside every test folder.
static cli_result cli_run_argv(const char *const *args) {
    cli_result r = {.status = -1};
    char out_path[] = "/tmp/clmha-cli-stdout-XXXXXX", err_path[] = "/tmp/clmha-cli-stderr-XXXXXX";
    int out_fd = mkstemp(out_path);
    int err_fd = mkstemp(err_path);
    cr_assert(out_fd >= 0 && err_fd >= 0, "mkstemp failed");
    const char *argv[CLI_MAX_ARGS + 2] = {CLMHA_CLI_PATH};
    size_t argc = 1;
    for (; args[argc - 1]; ++argc) {
        cr_assert(argc <= CLI_MAX_ARGS, "too many arguments");
        argv[argc] = args[argc - 1];
    }
    argv[argc] = NULL;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    cr_assert(pid >= 0, "fork failed");
    if (pid == 0) {
        int null_fd = open("/dev/null", O_RDONLY);
        if (null_fd >= 0) dup2(null_fd, 0);
        int to_fd = cli_stdout_to ? open(cli_stdout_to, O_WRONLY) : -1;
        dup2(to_fd >= 0 ? to_fd : out_fd, 1);
        dup2(err_fd, 2);
        if (cli_fail_rename) {
            setenv("LD_PRELOAD", CLMHA_FAIL_RENAME_LIB, 1);
            setenv("CLMHA_TEST_FAIL_RENAME", cli_fail_rename, 1);
            char asan[1024];  // ASan wants to come first; the preloaded library comes first
            const char *old = getenv("ASAN_OPTIONS");
            snprintf(asan, sizeof asan, "%s%sverify_asan_link_order=0", old ? old : "",
                     old && old[0] ? ":" : "");
            setenv("ASAN_OPTIONS", asan, 1);
        }
        alarm(cli_alarm_s);  // a hung program ends with SIGALRM instead of hanging the suite
        execv(CLMHA_CLI_PATH, (char *const *)argv);
        _exit(127);
    }
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0) {
    }
    close(out_fd);
    close(err_fd);
    if (WIFEXITED(ws)) r.status = WEXITSTATUS(ws);
    if (WIFSIGNALED(ws)) r.signal = WTERMSIG(ws);
    r.out = read_file(out_path, NULL);
    r.err = read_file(err_path, NULL);
    unlink(out_path);
    unlink(err_path);
    cr_assert(r.out && r.err, "could not read the captured output");
    cr_assert_eq(r.signal, 0, "clmha crashed with signal %d; stderr: %s", r.signal, r.err);
    return r;
}

#define cli_run(...) cli_run_argv((const char *const[]){__VA_ARGS__, NULL})

static void cli_free(cli_result *r) {
    free(r->out);
    free(r->err);
    r->out = r->err = NULL;
}

// The whole stderr is one line that starts with @p prefix and contains each of the NULL-ended
// strings that follow.
static void assert_one_line(const cli_result *r, const char *prefix, ...) {
    const char *e = r->err;
    size_t len = strlen(e);
    cr_assert(len > 1 && e[len - 1] == '\n' && strchr(e, '\n') == e + len - 1,
              "stderr is not exactly one line: [%s]", e);
    cr_assert(strncmp(e, prefix, strlen(prefix)) == 0, "stderr does not start with '%s': %s",
              prefix, e);
    va_list ap;
    va_start(ap, prefix);
    for (const char *want; (want = va_arg(ap, const char *)) != NULL;)
        cr_assert(strstr(e, want) != NULL, "stderr does not name '%s': %s", want, e);
    va_end(ap);
}

static bool have_device(void) {
    cli_result r = cli_run("devices");
    bool yes = r.status == 0 && strstr(r.out, "no OpenCL device") == NULL;
    cli_free(&r);
    return yes;
}

#define SKIP_WITHOUT_DEVICE()                                                                  \
    do {                                                                                       \
        if (!have_device()) cr_skip_test("no OpenCL device");                                  \
    } while (0)

// ---- temporary folders and files ---------------------------------------------------------------

typedef struct tmp_dir {
    char path[64];
} tmp_dir;

static tmp_dir tmp_make(void) {
    tmp_dir d;
    tmpdir_make(d.path, sizeof d.path, "clmha-cli");
    return d;
}

// "<dir>/<name>" in a rotating set of buffers (enough for one call's arguments).
static const char *tmp_file(const tmp_dir *d, const char *name) {
    static char bufs[16][CLI_PATH_SIZE];
    static unsigned next;
    char *b = bufs[next++ % 16];
    snprintf(b, CLI_PATH_SIZE, "%s/%s", d->path, name);
    return b;
}

// Number of entries of the folder (without . and ..); the names go to @p names.
static size_t tmp_list(const tmp_dir *d, char *names, size_t names_size) {
    return tmpdir_list(d->path, names, names_size);
}

static bool file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

// Removes the folder with its files (and the empty subfolder "sub" some tests make).
static void tmp_remove(const tmp_dir *d) { tmpdir_remove(d->path); }

// A .npy file of any dtype, version 1.0, C order.
static void write_npy_raw(const char *path, const char *descr, size_t ndim, const size_t *shape,
                          const void *data, size_t data_size) {
    char header[256], dims[128] = "";
    size_t used = 0;
    for (size_t i = 0; i < ndim; ++i)
        used += (size_t)snprintf(dims + used, sizeof dims - used, "%zu,%s", shape[i],
                                 i + 1 < ndim ? " " : "");
    if (ndim > 1) dims[used - 1] = '\0';  // (2, 3) but (5,)
    int len = snprintf(header, sizeof header,
                       "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", descr, dims);
    size_t total = 10 + (size_t)len + 1;
    size_t padded = (total + 63) / 64 * 64;
    size_t header_len = padded - 10;
    unsigned char *buf = calloc(1, padded + data_size);
    cr_assert(buf != NULL);
    memcpy(buf, "\x93NUMPY\x01\x00", 8);
    buf[8] = (unsigned char)(header_len & 0xff);
    buf[9] = (unsigned char)(header_len >> 8);
    memset(buf + 10, ' ', header_len);
    memcpy(buf + 10, header, (size_t)len);
    buf[padded - 1] = '\n';
    if (data_size) memcpy(buf + padded, data, data_size);
    write_bytes(path, buf, padded + data_size);
    free(buf);
}

// Deterministic values in [-1, 1).
static float pseudo(uint32_t *state) {
    *state = *state * 1664525u + 1013904223u;
    return (float)((double)(*state >> 8) / 8388608.0 - 1.0);
}

static void write_f32(const char *path, size_t ndim, const size_t *shape) {
    size_t count = 1;
    for (size_t i = 0; i < ndim; ++i) count *= shape[i];
    float *x = malloc((count ? count : 1) * sizeof *x);
    cr_assert(x != NULL);
    uint32_t state = (uint32_t)count * 7919u + 1u;
    for (size_t i = 0; i < count; ++i) x[i] = pseudo(&state);
    write_npy_raw(path, "<f4", ndim, shape, x, count * sizeof *x);
    free(x);
}

#define write_f32_shape(path, ...)                                                             \
    write_f32(path, sizeof((size_t[]){__VA_ARGS__}) / sizeof(size_t), (size_t[]){__VA_ARGS__})

// A layer file written by hand: embed_dim 8, 2 heads, bias, sequence-first.
static void write_layer(const char *path) {
    enum { E = 8 };
    const char *names[] = {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"};
    const char *shapes[] = {"[24,8]", "[24]", "[8,8]", "[8]"};
    size_t counts[] = {3 * E * E, 3 * E, E * E, E};
    char header[1024];
    size_t used = (size_t)snprintf(header, sizeof header,
                                   "{\"__metadata__\":{\"num_heads\":\"2\"}");
    size_t offset = 0, total = 0;
    for (int i = 0; i < 4; ++i) total += counts[i];
    for (int i = 0; i < 4; ++i) {
        used += (size_t)snprintf(header + used, sizeof header - used,
                                 ",\"%s\":{\"dtype\":\"F32\",\"shape\":%s,\"data_offsets\":[%zu,%zu]}",
                                 names[i], shapes[i], offset, offset + counts[i] * 4);
        offset += counts[i] * 4;
    }
    used += (size_t)snprintf(header + used, sizeof header - used, "}");
    while (used % 8) header[used++] = ' ';
    size_t size = 8 + used + total * 4;
    unsigned char *buf = calloc(1, size);
    cr_assert(buf != NULL);
    for (int i = 0; i < 8; ++i) buf[i] = (unsigned char)((uint64_t)used >> (8 * i));
    memcpy(buf + 8, header, used);
    uint32_t state = 12345u;
    for (size_t i = 0; i < total; ++i) {
        float v = 0.35f * pseudo(&state);
        memcpy(buf + 8 + used + 4 * i, &v, 4);
    }
    write_bytes(path, buf, size);
    free(buf);
}

// A folder with layer.safetensors (E = 8, H = 2) and q.npy (L, N, E) = (3, 2, 8).
static tmp_dir make_inputs(void) {
    tmp_dir d = tmp_make();
    write_layer(tmp_file(&d, "layer.safetensors"));
    write_f32_shape(tmp_file(&d, "q.npy"), 3, 2, 8);
    return d;
}

// Runs a refused command: exit 1, one line on stderr naming the option @p flag and the file
// @p file, and no file besides the @p inputs ones in the folder.
static void expect_refused(const tmp_dir *d, size_t inputs, const char *flag, const char *file,
                           const char *const *args) {
    cli_result r = cli_run_argv(args);
    cr_assert_eq(r.status, 1, "exit status %d (want 1); stderr: %s", r.status, r.err);
    assert_one_line(&r, "clmha run: ", flag, file, NULL);
    char names[1024];
    size_t count = tmp_list(d, names, sizeof names);
    cr_assert_eq(count, inputs, "files left in %s: %s", d->path, names);
    cr_log_info("refused as expected: %s", r.err);
    cli_free(&r);
}

#define EXPECT_REFUSED(d, inputs, flag, file, ...)                                              \
    expect_refused(d, inputs, flag, file, (const char *const[]){__VA_ARGS__, NULL})

static void expect_usage(const char *prefix, const char *const *args) {
    cli_result r = cli_run_argv(args);
    cr_assert_eq(r.status, 2, "exit status %d (want 2); stderr: %s", r.status, r.err);
    assert_one_line(&r, prefix, NULL);
    cli_free(&r);
}

#define EXPECT_USAGE(prefix, ...) expect_usage(prefix, (const char *const[]){__VA_ARGS__, NULL})

// ---- PyTorch cases ------------------------------------------------------------------------------

struct cli_param {
    char name[CLI_MAX_NAME];
};

// The parameters of suite @p suite: the @p count case names of @p names that its stride keeps
// (CLMHA_TEST_CASE_STRIDE).
static struct criterion_test_params case_params(const char *suite, const char *const *names,
                                                size_t count) {
    case_stride stride = case_stride_get(suite, count);
    struct cli_param *params = count ? cr_malloc(count * sizeof *params) : NULL;
    if (!params) return cr_make_param_array(struct cli_param, NULL, 0);
    size_t n = 0;
    for (size_t i = 0; i < count; i++) {
        if (!case_stride_keeps(stride, i)) continue;
        memset(&params[n], 0, sizeof params[n]);
        snprintf(params[n].name, sizeof params[n].name, "%s", names[i]);
        ++n;
    }
    return cr_make_param_array(struct cli_param, params, n, case_params_free);
}

ParameterizedTestParameters(cli, cases) {
    return case_params("cli", cli_case_names, CLI_NUM_CASES);
}

Test(cli, cases_listed) {
    cr_assert_gt(CLI_NUM_CASES, 0, "tests/cli/cases.inc lists no case");
}

// Max abs difference; a NaN or infinity on one side only counts as infinite.
static double npy_max_abs_diff(const clmha__npy *got, const clmha__npy *want, const char *what,
                               const char *name) {
    cr_assert_eq(got->ndim, want->ndim, "%s %s: got %zu-D, want %zu-D", name, what, got->ndim,
                 want->ndim);
    for (size_t i = 0; i < got->ndim; ++i)
        cr_assert_eq(got->shape[i], want->shape[i], "%s %s: dimension %zu is %zu, want %zu",
                     name, what, i, got->shape[i], want->shape[i]);
    cr_assert_eq(got->kind, CLMHA__NPY_FLOAT);
    cr_assert_str_eq(got->dtype, "<f4", "%s %s: dtype %s, want <f4", name, what, got->dtype);
    double err = 0;
    for (size_t i = 0; i < got->count; ++i) {
        double g = got->f32[i], w = want->f32[i];
        double e = isfinite(g) && isfinite(w) ? fabs(g - w) : (g == w ? 0.0 : INFINITY);
        if (!(e <= err)) err = e;
    }
    return err;
}

static void read_npy(const char *path, clmha__npy *a) {
    char msg[512];
    cr_assert_eq(clmha__npy_read(path, a, msg, sizeof msg), CLMHA_SUCCESS, "%s: %s", path, msg);
}

// An output file against the expected one (npy_max_abs_diff()), and the expected file's largest
// magnitude in *scale (the unit of the narrower KV caches' contracts).
static double npy_file_err(const char *out, const char *want_path, const char *name,
                           double *scale) {
    clmha__npy got, want;
    read_npy(out, &got);
    read_npy(want_path, &want);
    double err = npy_max_abs_diff(&got, &want, "output", name);
    *scale = 0;
    for (size_t i = 0; i < want.count; ++i)
        *scale = fmax(*scale, fabs(want.f64 ? want.f64[i] : want.f32[i]));
    clmha__npy_free(&got);
    clmha__npy_free(&want);
    return err;
}

// The gradient files of a case (expected_grads/*.npy) against those `clmha run --grads-dir`
// wrote to @p grads_dir: the same names, and max |clmha - torch| <= CLI_GRAD_TOL * (1 +
// max|torch|) for each. Returns the worst normalised error; *count gets the number of files.
static double compare_grads(const char *case_dir, const char *grads_dir, const char *what,
                            size_t *count) {
    char want_dir[CLI_PATH_SIZE], names[2048];
    snprintf(want_dir, sizeof want_dir, "%s/expected_grads", case_dir);
    DIR *d = opendir(want_dir);
    cr_assert_not_null(d, "%s: cannot open %s", what, want_dir);
    double worst = 0;
    *count = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.') continue;
        char want_path[CLI_PATH_SIZE + 256], got_path[CLI_PATH_SIZE + 256];
        snprintf(want_path, sizeof want_path, "%s/%s", want_dir, e->d_name);
        snprintf(got_path, sizeof got_path, "%s/%s", grads_dir, e->d_name);
        cr_assert(file_exists(got_path), "%s: %s was not written", what, e->d_name);
        clmha__npy got = {0}, want = {0};
        read_npy(got_path, &got);
        read_npy(want_path, &want);
        double err = npy_max_abs_diff(&got, &want, e->d_name, what), scale = 0;
        for (size_t i = 0; i < want.count; ++i)
            if (fabs(want.f32[i]) > scale) scale = fabs(want.f32[i]);
        double norm = err / (1 + scale);
        cr_expect_leq(norm, CLI_GRAD_TOL, "%s: %s: max abs error %.3e, max|torch| %.3g", what,
                      e->d_name, err, scale);
        if (!(norm <= worst)) worst = norm;
        clmha__npy_free(&got);
        clmha__npy_free(&want);
        ++*count;
    }
    closedir(d);
    size_t written = tmpdir_list(grads_dir, names, sizeof names);
    cr_assert_eq(written, *count, "%s: %zu gradient files written, want %zu: %s", what, written,
                 *count, names);
    return worst;
}

// Whether a case's layer file's header holds @p key (such as "\"window\":\"") or its args the
// option @p flag.
static bool case_has(const char *layer_path, const char *flags, const char *key,
                     const char *flag) {
    if (flags && strstr(flags, flag)) return true;
    size_t size = 0, len = strlen(key);
    char *bytes = read_file(layer_path, &size);
    bool yes = false;
    if (bytes && size > 8) {
        size_t n = 0;
        for (int i = 7; i >= 0; --i) n = n << 8 | (unsigned char)bytes[i];
        for (size_t i = 8; !yes && n <= size - 8 && i + len <= 8 + n; ++i)
            yes = memcmp(bytes + i, key, len) == 0;
    }
    free(bytes);
    return yes;
}

// Whether a case's layer file has a sliding window (__metadata__ window) or its args give one.
static bool case_has_window(const char *layer_path, const char *flags) {
    return case_has(layer_path, flags, "\"window\":\"", "--window");
}

// Whether a case's layer file has ALiBi (__metadata__ alibi "true") or its args add it.
static bool case_has_alibi(const char *layer_path, const char *flags) {
    return case_has(layer_path, flags, "\"alibi\":\"true\"", "--alibi");
}

ParameterizedTest(struct cli_param *param, cli, cases) {
    const char *name = param->name;
    SKIP_WITHOUT_DEVICE();
    char dir[CLI_PATH_SIZE / 2];
    snprintf(dir, sizeof dir, "%s/cli/%s", CLMHA_TEST_DATA_DIR, name);
    tmp_dir out = tmp_make();

    // The command line: the input files present, the extra flags of `args`, the outputs.
    static char paths[8][CLI_PATH_SIZE];
    const char *argv[CLI_MAX_ARGS + 1] = {"run"};
    size_t argc = 1;
    static const char *const inputs[][2] = {
        {"--layer", "layer.safetensors"},
        {"--query", "query.npy"},
        {"--key", "key.npy"},
        {"--value", "value.npy"},
        {"--key-padding-mask", "key_padding_mask.npy"},
        {"--attn-mask", "attn_mask.npy"},
        {"--grad-output", "grad_output.npy"},
        {"--grad-weights", "grad_weights.npy"},
    };
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; ++i) {
        snprintf(paths[i], CLI_PATH_SIZE, "%s/%s", dir, inputs[i][1]);
        if (i < 2) cr_assert(file_exists(paths[i]), "%s: %s is missing", name, paths[i]);
        if (!file_exists(paths[i])) continue;
        argv[argc++] = inputs[i][0];
        argv[argc++] = paths[i];
    }
    char args_path[CLI_PATH_SIZE];
    snprintf(args_path, sizeof args_path, "%s/args", dir);
    char *extra = read_file(args_path, NULL);
    if (extra)
        for (char *tok = strtok(extra, " \t\r\n"); tok; tok = strtok(NULL, " \t\r\n")) {
            cr_assert_lt(argc, CLI_MAX_ARGS - 4, "%s: too many arguments", name);
            argv[argc++] = tok;
        }
    char want_w_path[CLI_PATH_SIZE];
    snprintf(want_w_path, sizeof want_w_path, "%s/expected_weights.npy", dir);
    bool weights = file_exists(want_w_path);
    const char *out_path = tmp_file(&out, "out.npy"), *w_path = tmp_file(&out, "w.npy");
    char grads_dir[CLI_PATH_SIZE];
    snprintf(grads_dir, sizeof grads_dir, "%s/grads", out.path);
    bool grads = file_exists(paths[6]), grad_weights = file_exists(paths[7]);
    if (grads) {
        cr_assert_eq(mkdir(grads_dir, 0700), 0);
        argv[argc++] = "--grads-dir";
        argv[argc++] = grads_dir;
    }
    argv[argc++] = "--output";
    argv[argc++] = out_path;
    if (weights) {
        argv[argc++] = "--weights-output";
        argv[argc++] = w_path;
    }
    argv[argc] = NULL;

    cli_result r = cli_run_argv(argv);
    cr_assert_eq(r.status, 0, "%s: exit status %d; stderr: %s", name, r.status, r.err);

    clmha__npy got = {0}, want = {0};
    char want_path[CLI_PATH_SIZE];
    snprintf(want_path, sizeof want_path, "%s/expected_output.npy", dir);
    read_npy(out_path, &got);
    read_npy(want_path, &want);
    double out_err = npy_max_abs_diff(&got, &want, "output", name);
    clmha__npy_free(&got);
    clmha__npy_free(&want);
    double w_err = -1;
    if (weights) {
        read_npy(w_path, &got);
        read_npy(want_w_path, &want);
        w_err = npy_max_abs_diff(&got, &want, "weights", name);
        clmha__npy_free(&got);
        clmha__npy_free(&want);
    } else {
        cr_assert(!file_exists(w_path));
    }
    if (weights)
        fprintf(stderr, "cli %s out_maxabs=%.3e w_maxabs=%.3e\n", name, out_err, w_err);
    else
        fprintf(stderr, "cli %s out_maxabs=%.3e w_maxabs=-\n", name, out_err);
    cr_expect_leq(out_err, CLI_TOL, "%s: output max abs error %.3e", name, out_err);
    cr_expect_leq(w_err, CLI_TOL, "%s: weights max abs error %.3e", name, w_err);
    cli_free(&r);
    if (grads) {
        size_t files = 0;
        double g_err = compare_grads(dir, grads_dir, name, &files);
        fprintf(stderr, "cli %s grads=%zu grad_maxnorm=%.3e\n", name, files, g_err);
        tmpdir_remove(grads_dir);
        cr_assert_eq(mkdir(grads_dir, 0700), 0);
    }

    // The other attention core, without weights: --impl unfused where the run above took the
    // fused core (no weights), --impl fused where it took the unfused one. The gradients too,
    // unless the case gives the weights a gradient (which needs them).
    size_t at = 0;
    for (size_t i = 0; i < argc - (weights ? 4 : 2); ++i) {
        bool grad_opt = strcmp(argv[i], "--grad-weights") == 0 ||
                        (grad_weights && (strcmp(argv[i], "--grad-output") == 0 ||
                                          strcmp(argv[i], "--grads-dir") == 0));
        if (grad_opt) ++i;  // and its value
        else if (strcmp(argv[i], "--need-weights") != 0 &&
                 strcmp(argv[i], "--per-head-weights") != 0)
            argv[at++] = argv[i];
    }
    const char *other = weights ? "fused" : "unfused";
    argv[at++] = "--impl";
    argv[at++] = other;
    argv[at++] = "--output";
    argv[at++] = out_path;
    argv[at] = NULL;
    r = cli_run_argv(argv);
    char *flags = read_file(args_path, NULL);
    bool window = case_has_window(paths[0], flags), alibi = case_has_alibi(paths[0], flags);
    char other_what[CLI_MAX_NAME + 32];
    snprintf(other_what, sizeof other_what, "%s --impl %s", name, other);
    cr_assert_eq(r.status, 0, "%s --impl %s: exit status %d; stderr: %s", name, other, r.status,
                 r.err);
    read_npy(out_path, &got);
    read_npy(want_path, &want);
    double other_err = npy_max_abs_diff(&got, &want, "output", name);
    clmha__npy_free(&got);
    clmha__npy_free(&want);
    fprintf(stderr, "cli %s --impl %s out_maxabs=%.3e\n", name, other, other_err);
    cr_expect_leq(other_err, CLI_TOL, "%s --impl %s: output max abs error %.3e", name, other,
                  other_err);
    cli_free(&r);
    if (grads && !grad_weights) {
        size_t files = 0;
        double g_err = compare_grads(dir, grads_dir, other_what, &files);
        fprintf(stderr, "cli %s grads=%zu grad_maxnorm=%.3e\n", other_what, files, g_err);
    }
    // Through a KV cache, two query rows a call (--decode-chunk 2): the one-shot output again,
    // for every case without masks, dropout, packed batches, or is_causal with a key of its
    // own. With a window or ALiBi, causal self-attention only (the CLI refuses the rest: there the later calls'
    // queries would sit at the end of the cache).
    bool causal = flags && strstr(flags, "--is-causal");
    bool packed = flags && strstr(flags, "--seq-lens");  // (the CLI refuses it with a cache)
    bool chunks = !(flags && strstr(flags, "--training")) && !packed && !file_exists(paths[4]) &&
                  !file_exists(paths[5]) && !(causal && file_exists(paths[2])) &&
                  !((window || alibi) && !causal);
    free(flags);
    if (chunks) {
        const char *cv[24];
        size_t cn = 0;
        cv[cn++] = "run";
        for (size_t i = 0; i < 4; ++i)
            if (file_exists(paths[i])) {
                cv[cn++] = inputs[i][0];
                cv[cn++] = paths[i];
            }
        if (causal) cv[cn++] = "--is-causal";
        // The layer file's load options (a seed module's or a model's state_dict), --window,
        // --softcap, --alibi.
        char *opts = read_file(args_path, NULL);
        for (char *tok = opts ? strtok(opts, " \t\r\n") : NULL; tok;
             tok = strtok(NULL, " \t\r\n")) {
            if (strcmp(tok, "--alibi") == 0) {
                cv[cn++] = tok;
                continue;
            }
            bool load_opt = strcmp(tok, "--prefix") == 0 || strcmp(tok, "--num-heads") == 0 ||
                            strcmp(tok, "--batch-first") == 0 || strcmp(tok, "--window") == 0 ||
                            strcmp(tok, "--softcap") == 0;
            char *value = load_opt ? strtok(NULL, " \t\r\n") : NULL;
            if (!load_opt || !value) continue;
            cr_assert_lt(cn, sizeof cv / sizeof cv[0] - 8, "%s: too many arguments", name);
            cv[cn++] = tok;
            cv[cn++] = value;
        }
        cv[cn++] = "--decode-chunk";
        cv[cn++] = "2";
        cv[cn++] = "--output";
        cv[cn++] = out_path;
        cv[cn] = NULL;
        r = cli_run_argv(cv);
        char chunk_what[CLI_MAX_NAME + 32];
        snprintf(chunk_what, sizeof chunk_what, "%s --decode-chunk 2", name);
        cr_assert_eq(r.status, 0, "%s: exit status %d; stderr: %s", chunk_what, r.status,
                     r.err);
        read_npy(out_path, &got);
        read_npy(want_path, &want);
        double chunk_err = npy_max_abs_diff(&got, &want, "output", name);
        clmha__npy_free(&got);
        clmha__npy_free(&want);
        fprintf(stderr, "cli %s out_maxabs=%.3e\n", chunk_what, chunk_err);
        cr_expect_leq(chunk_err, CLI_TOL, "%s: output max abs error %.3e", chunk_what, chunk_err);
        cli_free(&r);
        free(opts);
    }
    if (grads) tmpdir_remove(grads_dir);
    free(extra);
    tmp_remove(&out);
}

// ---- refused inputs: exit 1, one line naming the culprit, no file ----------------------------

// Layer files that need load options, and torch.save files: exit 1, one line that says what
// to do (--num-heads, the prefixes the file has, how to convert a .pt file).
Test(cli_refused, layer_load_options) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = tmp_make();
    const char *q = tmp_file(&d, "q.npy"), *o = tmp_file(&d, "o.npy");
    write_f32_shape(q, 2, 3, 8);
    char seed[CLI_PATH_SIZE], model[CLI_PATH_SIZE], pt[CLI_PATH_SIZE], legacy[CLI_PATH_SIZE];
    snprintf(seed, sizeof seed, "%s/cli/seed_continuiti/layer.safetensors", CLMHA_TEST_DATA_DIR);
    snprintf(model, sizeof model, "%s/cli/model_prefix/layer.safetensors", CLMHA_TEST_DATA_DIR);
    snprintf(pt, sizeof pt, "%s/cli/torch_save/module.pt", CLMHA_TEST_DATA_DIR);
    snprintf(legacy, sizeof legacy, "%s/cli/torch_save/legacy.pt", CLMHA_TEST_DATA_DIR);
    struct {
        const char *const *args;
        const char *want[3];
    } rows[] = {
        {(const char *const[]){"run", "--layer", seed, "--query", q, "--output", o, NULL},
         {"has no num_heads", "--num-heads", NULL}},
        {(const char *const[]){"run", "--layer", model, "--prefix", "decoder", "--num-heads", "2",
                               "--query", q, "--output", o, NULL},
         {"no tensor's name starts with the prefix \"decoder.\"", "\"encoder.layers.1.self_attn.\"",
          NULL}},
        {(const char *const[]){"run", "--layer", pt, "--query", q, "--output", o, NULL},
         {"torch.save (a zip archive", "clmha.torch.export(torch.load(", NULL}},
        {(const char *const[]){"run", "--layer", legacy, "--num-heads", "2", "--query", q,
                               "--output", o, NULL},
         {"torch.save (a pickle", "--prefix and --num-heads", NULL}},
    };
    for (size_t i = 0; i < sizeof rows / sizeof *rows; ++i) {
        cli_result r = cli_run_argv(rows[i].args);
        cr_assert_eq(r.status, 1, "row %zu: exit status %d (want 1); stderr: %s", i, r.status,
                     r.err);
        assert_one_line(&r, "clmha run: --layer ", rows[i].want[0], rows[i].want[1], NULL);
        cr_assert(!file_exists(o), "row %zu: %s written", i, o);
        cli_free(&r);
    }
    tmp_remove(&d);
}

Test(cli_usage, layer_load_options) {
    EXPECT_USAGE("clmha run: --num-heads '0'", "run", "--layer", "l", "--query", "q",
                 "--num-heads", "0");
    EXPECT_USAGE("clmha run: --num-heads 'x'", "run", "--layer", "l", "--query", "q",
                 "--num-heads", "x");
    EXPECT_USAGE("clmha run: --batch-first 'maybe'", "run", "--layer", "l", "--query", "q",
                 "--batch-first", "maybe");
}

Test(cli_refused, missing_layer_file) {
    tmp_dir d = make_inputs();
    const char *missing = tmp_file(&d, "absent.safetensors");
    EXPECT_REFUSED(&d, 2, "--layer", "absent.safetensors", "run", "--layer", missing, "--query",
                   tmp_file(&d, "q.npy"), "--output", tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

Test(cli_refused, missing_query_file) {
    tmp_dir d = make_inputs();
    EXPECT_REFUSED(&d, 2, "--query", "nothere.npy", "run", "--layer", tmp_file(&d, "layer.safetensors"),
                   "--query", tmp_file(&d, "nothere.npy"), "--output", tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

Test(cli_refused, truncated_npy) {
    tmp_dir d = make_inputs();
    size_t size = 0;
    char *bytes = read_file(tmp_file(&d, "q.npy"), &size);
    cr_assert(bytes && size > 100);
    write_bytes(tmp_file(&d, "short.npy"), bytes, size - 10);  // data cut short
    write_bytes(tmp_file(&d, "header.npy"), bytes, 20);        // header cut short
    free(bytes);
    EXPECT_REFUSED(&d, 4, "--query", "short.npy", "run", "--layer", tmp_file(&d, "layer.safetensors"),
                   "--query", tmp_file(&d, "short.npy"), "--output", tmp_file(&d, "o.npy"));
    EXPECT_REFUSED(&d, 4, "--key", "header.npy", "run", "--layer",
                   tmp_file(&d, "layer.safetensors"), "--query", tmp_file(&d, "q.npy"), "--key",
                   tmp_file(&d, "header.npy"), "--output", tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

Test(cli_refused, int64_npy) {
    tmp_dir d = make_inputs();
    int64_t x[3 * 2 * 8] = {0};
    write_npy_raw(tmp_file(&d, "i64.npy"), "<i8", 3, (size_t[]){3, 2, 8}, x, sizeof x);
    EXPECT_REFUSED(&d, 3, "--query", "i64.npy", "run", "--layer",
                   tmp_file(&d, "layer.safetensors"), "--query", tmp_file(&d, "i64.npy"), "--output", tmp_file(&d, "o.npy"));
    EXPECT_REFUSED(&d, 3, "--attn-mask", "i64.npy", "run", "--layer", tmp_file(&d, "layer.safetensors"),
                   "--query", tmp_file(&d, "q.npy"), "--attn-mask", tmp_file(&d, "i64.npy"),
                   "--output", tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

Test(cli_refused, boolean_query_and_scalar) {
    tmp_dir d = make_inputs();
    unsigned char b[3 * 2 * 8] = {0};
    float one = 1.0f;
    write_npy_raw(tmp_file(&d, "b.npy"), "|b1", 3, (size_t[]){3, 2, 8}, b, sizeof b);
    write_npy_raw(tmp_file(&d, "scalar.npy"), "<f4", 0, NULL, &one, sizeof one);
    EXPECT_REFUSED(&d, 4, "--query", "b.npy", "run", "--layer", tmp_file(&d, "layer.safetensors"),
                   "--query", tmp_file(&d, "b.npy"), "--output", tmp_file(&d, "o.npy"));
    EXPECT_REFUSED(&d, 4, "--key", "scalar.npy", "run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                   tmp_file(&d, "q.npy"), "--key", tmp_file(&d, "scalar.npy"), "--output",
                   tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

Test(cli_refused, corrupt_layer_file) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    write_bytes(tmp_file(&d, "bad.safetensors"), "\x07\xfe\x31", 3);
    EXPECT_REFUSED(&d, 3, "--layer", "bad.safetensors", "run", "--layer", tmp_file(&d, "bad.safetensors"),
                   "--query", tmp_file(&d, "q.npy"), "--output", tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

Test(cli_refused, query_wrong_features) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    write_f32_shape(tmp_file(&d, "q7.npy"), 3, 2, 7);
    EXPECT_REFUSED(&d, 3, "--query", "q7.npy", "run", "--layer", tmp_file(&d, "layer.safetensors"),
                   "--query", tmp_file(&d, "q7.npy"), "--output", tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

Test(cli_refused, mask_wrong_shape) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    unsigned char m[4 * 5] = {0};
    write_npy_raw(tmp_file(&d, "am.npy"), "|b1", 2, (size_t[]){4, 5}, m, sizeof m);
    write_npy_raw(tmp_file(&d, "kpm.npy"), "|b1", 2, (size_t[]){2, 4}, m, 8);
    EXPECT_REFUSED(&d, 4, "--attn-mask", "am.npy", "run", "--layer", tmp_file(&d, "layer.safetensors"),
                   "--query", tmp_file(&d, "q.npy"), "--attn-mask", tmp_file(&d, "am.npy"),
                   "--output", tmp_file(&d, "o.npy"));
    EXPECT_REFUSED(&d, 4, "--key-padding-mask", "kpm.npy", "run", "--layer",
                   tmp_file(&d, "layer.safetensors"), "--query", tmp_file(&d, "q.npy"),
                   "--key-padding-mask", tmp_file(&d, "kpm.npy"), "--output",
                   tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

Test(cli_refused, key_value_batch_mismatch) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    write_f32_shape(tmp_file(&d, "k2.npy"), 5, 2, 8);
    write_f32_shape(tmp_file(&d, "v3.npy"), 5, 3, 8);
    write_f32_shape(tmp_file(&d, "k3.npy"), 5, 3, 8);
    EXPECT_REFUSED(&d, 5, "--value", "v3.npy", "run", "--layer", tmp_file(&d, "layer.safetensors"),
                   "--query", tmp_file(&d, "q.npy"), "--key", tmp_file(&d, "k2.npy"), "--value",
                   tmp_file(&d, "v3.npy"), "--output", tmp_file(&d, "o.npy"));
    EXPECT_REFUSED(&d, 5, "--key", "k3.npy", "run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                   tmp_file(&d, "q.npy"), "--key", tmp_file(&d, "k3.npy"), "--value",
                   tmp_file(&d, "v3.npy"), "--output", tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

Test(cli_refused, weights_output_into_missing_folder) {
    tmp_dir d = make_inputs();
    const char *w = tmp_file(&d, "nofolder/w.npy");
    EXPECT_REFUSED(&d, 2, "--weights-output", "nofolder/w.npy", "run", "--layer", tmp_file(&d, "layer.safetensors"),
                   "--query", tmp_file(&d, "q.npy"), "--need-weights", "--output",
                   tmp_file(&d, "o.npy"), "--weights-output", w);
    cr_assert(!file_exists(tmp_file(&d, "o.npy")));
    tmp_remove(&d);
}

Test(cli_refused, weights_output_is_a_folder) {
    tmp_dir d = make_inputs();
    cr_assert_eq(mkdir(tmp_file(&d, "sub"), 0700), 0);
    EXPECT_REFUSED(&d, 3, "--weights-output", "sub", "run", "--layer",
                   tmp_file(&d, "layer.safetensors"), "--query", tmp_file(&d, "q.npy"),
                   "--output", tmp_file(&d, "o.npy"), "--weights-output", tmp_file(&d, "sub"));
    tmp_remove(&d);
}

Test(cli_refused, output_into_missing_folder) {
    tmp_dir d = make_inputs();
    EXPECT_REFUSED(&d, 2, "--output", "nofolder/o.npy", "run", "--layer", tmp_file(&d, "layer.safetensors"),
                   "--query", tmp_file(&d, "q.npy"), "--output", tmp_file(&d, "nofolder/o.npy"),
                   "--weights-output", tmp_file(&d, "w.npy"));
    tmp_remove(&d);
}

// ---- successful runs on hand-made inputs ----------------------------------------------------------

Test(cli_run, writes_both_outputs_with_pytorch_shapes) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    unsigned char kpm[2 * 3] = {0, 0, 1, 0, 0, 0};
    write_npy_raw(tmp_file(&d, "kpm.npy"), "|b1", 2, (size_t[]){2, 3}, kpm, sizeof kpm);
    cli_result r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                           tmp_file(&d, "q.npy"), "--key-padding-mask", tmp_file(&d, "kpm.npy"),
                           "--per-head-weights", "--output", tmp_file(&d, "o.npy"),
                           "--weights-output", tmp_file(&d, "w.npy"));
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_assert_str_empty(r.err);
    char names[512];
    cr_assert_eq(tmp_list(&d, names, sizeof names), 5, "files: %s", names);
    clmha__npy o = {0}, w = {0};
    read_npy(tmp_file(&d, "o.npy"), &o);
    read_npy(tmp_file(&d, "w.npy"), &w);
    cr_assert_eq(o.ndim, 3);
    cr_assert(o.shape[0] == 3 && o.shape[1] == 2 && o.shape[2] == 8);
    cr_assert_eq(w.ndim, 4);  // (N, H, L, S)
    cr_assert(w.shape[0] == 2 && w.shape[1] == 2 && w.shape[2] == 3 && w.shape[3] == 3);
    for (size_t row = 0; row < 2 * 2 * 3; ++row) {
        double sum = 0;
        for (size_t j = 0; j < 3; ++j) sum += w.f32[row * 3 + j];
        cr_assert_float_eq(sum, 1.0, 1e-5);
        if (row < 2 * 3) cr_assert_eq(w.f32[row * 3 + 2], 0.0f);  // batch 0, key 2 padded
    }
    clmha__npy_free(&o);
    clmha__npy_free(&w);
    cli_free(&r);
    tmp_remove(&d);
}

// --heatmap: the attention maps of one batch item as a PNG, written with the other outputs;
// --heatmap-batch must name an item of the query (exit 1 otherwise, nothing written) and needs
// --heatmap (exit 2).
Test(cli_run, heatmap_of_a_batch_item) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    cli_result r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                           tmp_file(&d, "q.npy"), "--output", tmp_file(&d, "o.npy"), "--heatmap",
                           tmp_file(&d, "h.png"), "--heatmap-batch", "1");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_assert_str_empty(r.err);
    char names[512];
    cr_assert_eq(tmp_list(&d, names, sizeof names), 4, "files: %s", names);  // + o.npy, h.png
    size_t size = 0;
    char *bytes = read_file(tmp_file(&d, "h.png"), &size);
    cr_assert(bytes != NULL && size > 8 && memcmp(bytes, "\x89PNG\r\n\x1a\n", 8) == 0);
    free(bytes);
    cli_free(&r);
    r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                tmp_file(&d, "q.npy"), "--output", tmp_file(&d, "o2.npy"), "--heatmap",
                tmp_file(&d, "h2.png"), "--heatmap-batch", "2");
    cr_assert_eq(r.status, 1, "stderr: %s", r.err);
    assert_one_line(&r, "clmha run: ", "--heatmap-batch 2", "2 batch items", NULL);
    cr_assert_eq(tmp_list(&d, names, sizeof names), 4, "files: %s", names);
    cli_free(&r);
    r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                tmp_file(&d, "q.npy"), "--heatmap-batch", "0");
    cr_assert_eq(r.status, 2, "stderr: %s", r.err);
    assert_one_line(&r, "clmha run: ", "--heatmap-batch needs --heatmap", NULL);
    cli_free(&r);
    tmp_remove(&d);
}

// --dtype f16 / bf16: a float16 query file ('<f2') is read exactly; the layer file's values and
// the query are rounded to the dtype; the output and weights are float16 files ('<f2') for f16 and float32
// files of bfloat16 values for bf16, within the accuracy contract (include/clmha.h,
// clmha_dtype) of the float64 reference on the rounded parameters and query.
Test(cli_run, dtype_f16_and_bf16) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    enum { L = 3, N = 2, E = 8, Q = L * N * E };
    float q[Q];
    uint16_t q16[Q];
    uint32_t state = 99u;
    for (size_t i = 0; i < Q; ++i) {
        q16[i] = clmha__f32_to_f16(pseudo(&state));
        q[i] = clmha__f16_to_f32(q16[i]);
    }
    write_npy_raw(tmp_file(&d, "q16.npy"), "<f2", 3, (size_t[]){L, N, E}, q16, sizeof q16);
    const char *names[] = {"f16", "bf16"};
    const clmha_dtype dtypes[] = {CLMHA_DTYPE_F16, CLMHA_DTYPE_BF16};
    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_env(&ctx), CLMHA_SUCCESS);
    for (int k = 0; k < 2; ++k) {
        clmha_dtype t = dtypes[k];
        cli_result r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                               tmp_file(&d, "q16.npy"), "--dtype", names[k], "--output",
                               tmp_file(&d, "o.npy"), "--weights-output", tmp_file(&d, "w.npy"));
        cr_assert_eq(r.status, 0, "--dtype %s: stderr: %s", names[k], r.err);
        clmha__npy o = {0}, w = {0};
        read_npy(tmp_file(&d, "o.npy"), &o);
        read_npy(tmp_file(&d, "w.npy"), &w);
        const char *want_descr = t == CLMHA_DTYPE_F16 ? "<f2" : "<f4";
        cr_expect_str_eq(o.dtype, want_descr, "--dtype %s: output dtype %s", names[k], o.dtype);
        cr_expect_str_eq(w.dtype, want_descr, "--dtype %s: weights dtype %s", names[k], w.dtype);
        // The reference on the layer's rounded parameters and the (exact) query.
        clmha_layer *layer = NULL;
        cr_assert_eq(clmha_layer_load_as(&layer, ctx, tmp_file(&d, "layer.safetensors"), t),
                     CLMHA_SUCCESS);
        float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E];
        cr_assert_eq(clmha_layer_get_parameter(layer, "in_proj_weight", w_in, 3 * E * E), 0);
        cr_assert_eq(clmha_layer_get_parameter(layer, "in_proj_bias", b_in, 3 * E), 0);
        cr_assert_eq(clmha_layer_get_parameter(layer, "out_proj.weight", w_out, E * E), 0);
        cr_assert_eq(clmha_layer_get_parameter(layer, "out_proj.bias", b_out, E), 0);
        clmha_layer_release(layer);
        clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = 2,
                                 .bias = true};
        clmha_reference_params p = {.struct_size = sizeof p, .in_proj_weight = w_in,
                                    .in_proj_bias = b_in, .out_proj_weight = w_out,
                                    .out_proj_bias = b_out};
        float qt[Q];  // the query as the layer reads it: rounded to its dtype
        for (size_t i = 0; i < Q; ++i) qt[i] = clmha__dtype_round(t, q[i]);
        clmha_forward_args a = {.struct_size = sizeof a,
                                .query = {.ndim = 3, .shape = {L, N, E}, .data = qt},
                                .need_weights = true};
        double ref[Q], ref_w[N * L * L];
        char msg[256];
        cr_assert_eq(clmha_reference_forward(&desc, &p, &a, ref, Q, ref_w, N * L * L, msg,
                                             sizeof msg),
                     CLMHA_SUCCESS, "%s", msg);
        double rel = t == CLMHA_DTYPE_F16 ? 0x1p-11 : 0x1p-8, worst = 0.0;
        const double *want[] = {ref, ref_w};
        const clmha__npy *got[] = {&o, &w};
        for (int m = 0; m < 2; ++m) {
            cr_assert_eq(got[m]->count, m ? (size_t)N * L * L : (size_t)Q);
            for (size_t i = 0; i < got[m]->count; ++i) {
                double g = got[m]->f32[i], x = want[m][i];
                cr_expect_eq(clmha__dtype_round(t, (float)g), (float)g,
                             "--dtype %s: value %zu (%a) is not one of the dtype", names[k], i, g);
                double bound = rel * (fabs(x) + 2e-5) + 2e-5, e = fabs(g - x);
                if (e / bound > worst) worst = e / bound;
            }
        }
        cr_expect(worst <= 1.0, "--dtype %s: error %.2f times the contract", names[k], worst);
        clmha__npy_free(&o);
        clmha__npy_free(&w);
        cli_free(&r);
    }
    clmha_context_release(ctx);
    tmp_remove(&d);
}

// --dtype f16 / bf16 with --grad-output and --grads-dir: the gradient files are float16
// ('<f2') for f16 and float32 files of bfloat16 values for bf16, within the gradient contract
// (include/clmha.h, clmha_dtype) of the float64 reference backward on the rounded parameters,
// query and output gradient; with --grad-dtype f32 float32 files whose values round to them.
Test(cli_run, dtype_16_bit_gradients) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    enum { L = 3, N = 2, E = 8, Q = L * N * E };
    float q[Q], gy[Q];
    uint32_t state = 7u;
    for (size_t i = 0; i < Q; ++i) q[i] = pseudo(&state), gy[i] = pseudo(&state);
    write_npy_raw(tmp_file(&d, "q32.npy"), "<f4", 3, (size_t[]){L, N, E}, q, sizeof q);
    write_npy_raw(tmp_file(&d, "g32.npy"), "<f4", 3, (size_t[]){L, N, E}, gy, sizeof gy);
    const char *names[] = {"f16", "bf16"};
    const clmha_dtype dtypes[] = {CLMHA_DTYPE_F16, CLMHA_DTYPE_BF16};
    const char *files[] = {"query", "in_proj_weight", "in_proj_bias", "out_proj.weight",
                           "out_proj.bias"};
    const size_t counts[] = {Q, 3 * E * E, 3 * E, E * E, E};
    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_env(&ctx), CLMHA_SUCCESS);
    for (int k = 0; k < 2; ++k) {
        clmha_dtype t = dtypes[k];
        for (int wide = 1; wide >= 0; --wide) {  // the default run last: its files stay
            cli_result r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"),
                                   "--query", tmp_file(&d, "q32.npy"), "--dtype", names[k],
                                   "--grad-output", tmp_file(&d, "g32.npy"), "--grads-dir",
                                   d.path, wide ? "--grad-dtype" : NULL, "f32", NULL);
            cr_assert_eq(r.status, 0, "--dtype %s: stderr: %s", names[k], r.err);
            cli_free(&r);
            char keep[64];
            snprintf(keep, sizeof keep, "query.%s.npy", wide ? "f32" : "dtype");
            cr_assert_eq(rename(tmp_file(&d, "query.npy"), tmp_file(&d, keep)), 0);
        }
        // The reference on the layer's rounded parameters, query and output gradient.
        clmha_layer *layer = NULL;
        cr_assert_eq(clmha_layer_load_as(&layer, ctx, tmp_file(&d, "layer.safetensors"), t),
                     CLMHA_SUCCESS);
        float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E], qt[Q], gt[Q];
        cr_assert_eq(clmha_layer_get_parameter(layer, "in_proj_weight", w_in, 3 * E * E), 0);
        cr_assert_eq(clmha_layer_get_parameter(layer, "in_proj_bias", b_in, 3 * E), 0);
        cr_assert_eq(clmha_layer_get_parameter(layer, "out_proj.weight", w_out, E * E), 0);
        cr_assert_eq(clmha_layer_get_parameter(layer, "out_proj.bias", b_out, E), 0);
        clmha_layer_release(layer);
        for (size_t i = 0; i < Q; ++i)
            qt[i] = clmha__dtype_round(t, q[i]), gt[i] = clmha__dtype_round(t, gy[i]);
        clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = 2,
                                 .bias = true};
        clmha_reference_params p = {.struct_size = sizeof p, .in_proj_weight = w_in,
                                    .in_proj_bias = b_in, .out_proj_weight = w_out,
                                    .out_proj_bias = b_out};
        clmha_forward_args a = {.struct_size = sizeof a,
                                .query = {.ndim = 3, .shape = {L, N, E}, .data = qt}};
        static double want[5][3 * E * E];
        clmha_reference_grads rg = {.struct_size = sizeof rg, .query = want[0],
                                    .in_proj_weight = want[1], .in_proj_bias = want[2],
                                    .out_proj_weight = want[3], .out_proj_bias = want[4]};
        char msg[256];
        cr_assert_eq(clmha_reference_backward(&desc, &p, &a, gt, NULL, &rg, msg, sizeof msg),
                     CLMHA_SUCCESS, "%s", msg);
        double rel = t == CLMHA_DTYPE_F16 ? 0x1p-11 : 0x1p-8, worst = 0.0;
        for (int f = 0; f < 5; ++f) {
            clmha__npy got = {0}, g32 = {0};
            char name[64];
            snprintf(name, sizeof name, "%s.npy", files[f]);
            read_npy(tmp_file(&d, f ? name : "query.dtype.npy"), &got);
            if (!f) read_npy(tmp_file(&d, "query.f32.npy"), &g32);
            cr_expect_str_eq(got.dtype, t == CLMHA_DTYPE_F16 ? "<f2" : "<f4", "--dtype %s: %s",
                             names[k], name);
            cr_assert_eq(got.count, counts[f]);
            double scale = 0.0;
            for (size_t i = 0; i < got.count; ++i) scale = fmax(scale, fabs(want[f][i]));
            double tol = 1e-4 * (1 + scale);
            for (size_t i = 0; i < got.count; ++i) {
                double g = got.f32[i], x = want[f][i], e = fabs(g - x);
                cr_expect_eq(clmha__dtype_round(t, (float)g), (float)g,
                             "--dtype %s: %s value %zu (%a) is not one of the dtype", names[k],
                             name, i, g);
                worst = fmax(worst, e / (rel * (fabs(x) + tol) + tol));
                if (!f)  // --grad-dtype f32: float32 values that round to the dtype's ones
                    cr_expect_eq(clmha__dtype_round(t, g32.f32[i]), (float)g,
                                 "--dtype %s --grad-dtype f32: query value %zu", names[k], i);
            }
            if (!f) cr_expect_str_eq(g32.dtype, "<f4");
            clmha__npy_free(&got);
            clmha__npy_free(&g32);
        }
        fprintf(stderr, "cli --dtype %s gradients: %.2f of the contract\n", names[k], worst);
        cr_expect(worst <= 1.0, "--dtype %s: gradient error %.2f times the contract", names[k],
                  worst);
    }
    clmha_context_release(ctx);
    tmp_remove(&d);
}

// --dtype f16 with --decode-chunk: the 16-bit layer decodes through its KV cache; the rows
// equal the one-shot causal run's within one float16 rounding each way.
Test(cli_run, dtype_f16_decode_chunk) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    const char *o[2] = {tmp_file(&d, "once.npy"), tmp_file(&d, "chunked.npy")};
    for (int k = 0; k < 2; ++k) {
        cli_result r = k ? cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                                   tmp_file(&d, "q.npy"), "--dtype", "f16", "--is-causal",
                                   "--decode-chunk", "2", "--output", o[k])
                         : cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                                   tmp_file(&d, "q.npy"), "--dtype", "f16", "--is-causal",
                                   "--output", o[k]);
        cr_assert_eq(r.status, 0, "run %d: stderr: %s", k, r.err);
        cli_free(&r);
    }
    clmha__npy a = {0}, b = {0};
    read_npy(o[0], &a);
    read_npy(o[1], &b);
    cr_assert_str_eq(b.dtype, "<f2");
    cr_assert_eq(a.count, b.count);
    for (size_t i = 0; i < a.count; ++i)
        cr_expect(fabs((double)a.f32[i] - b.f32[i]) <= 0x1p-10 * fabs((double)a.f32[i]) + 1e-5,
                  "row value %zu: one-shot %a, decoded %a", i, (double)a.f32[i],
                  (double)b.f32[i]);
    clmha__npy_free(&a);
    clmha__npy_free(&b);
    tmp_remove(&d);
}

// ---- float64 layers (--dtype f64) --------------------------------------------------------------

// Whether the device the program picks ($CLMHA_DEVICE, else the default: as
// clmha_context_create_from_env() picks) has double precision, which float64 layers need.
static bool device_has_fp64(void) {
    clmha_context *ctx = NULL;
    if (clmha_context_create_from_env(&ctx) != CLMHA_SUCCESS) return false;
    cl_device_fp_config config = 0;
    cl_int err = clGetDeviceInfo(clmha_context_cl_device(ctx), CL_DEVICE_DOUBLE_FP_CONFIG,
                                 sizeof config, &config, NULL);
    clmha_context_release(ctx);
    return err == CL_SUCCESS && config != 0;
}

#define SKIP_WITHOUT_FP64()                                                                    \
    do {                                                                                       \
        SKIP_WITHOUT_DEVICE();                                                                 \
        if (!device_has_fp64()) cr_skip_test("the device has no double precision");           \
    } while (0)

// The parameters of write_layer_values()'s layers (E 8, 2 heads, bias), one after the other:
// in_proj_weight (24, 8), in_proj_bias (24), out_proj.weight (8, 8), out_proj.bias (8).
enum { LF_E = 8, LF_W_IN = 0, LF_B_IN = 3 * LF_E * LF_E, LF_W_OUT = LF_B_IN + 3 * LF_E,
       LF_B_OUT = LF_W_OUT + LF_E * LF_E, LF_COUNT = LF_B_OUT + LF_E };

// A layer file holding @p p (see LF_COUNT) as F64 tensors, or as F32 ones with @p f32 (the
// values must then be floats), with @p meta (NULL: nothing) after num_heads in its metadata
// (",\"window\":\"2,0\""), and with @p slopes the tensor alibi_slopes (2), those two values.
static void write_layer_meta(const char *path, const double *p, bool f32, const char *meta,
                             const double *slopes) {
    const char *names[] = {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias",
                           "alibi_slopes"};
    const char *shapes[] = {"[24,8]", "[24]", "[8,8]", "[8]", "[2]"};
    const size_t first[] = {LF_W_IN, LF_B_IN, LF_W_OUT, LF_B_OUT, LF_COUNT, LF_COUNT + 2};
    size_t item = f32 ? 4 : 8, tensors = slopes ? 5 : 4, count = first[tensors];
    char header[1024];
    size_t used = (size_t)snprintf(header, sizeof header,
                                   "{\"__metadata__\":{\"num_heads\":\"2\"%s}", meta ? meta : "");
    for (size_t i = 0; i < tensors; ++i)
        used += (size_t)snprintf(header + used, sizeof header - used,
                                 ",\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[%zu,"
                                 "%zu]}",
                                 names[i], f32 ? "F32" : "F64", shapes[i], first[i] * item,
                                 first[i + 1] * item);
    used += (size_t)snprintf(header + used, sizeof header - used, "}");
    while (used % 8) header[used++] = ' ';
    size_t size = 8 + used + count * item;
    unsigned char *buf = calloc(1, size);
    cr_assert(buf != NULL);
    for (int i = 0; i < 8; ++i) buf[i] = (unsigned char)((uint64_t)used >> (8 * i));
    memcpy(buf + 8, header, used);
    for (size_t i = 0; i < count; ++i) {  // (the test host is little-endian)
        double x = i < LF_COUNT ? p[i] : slopes[i - LF_COUNT];
        float v = (float)x;
        cr_assert(!f32 || (double)v == x, "parameter %zu is no float", i);
        if (f32) memcpy(buf + 8 + used + 4 * i, &v, 4);
        else memcpy(buf + 8 + used + 8 * i, &x, 8);
    }
    write_bytes(path, buf, size);
    free(buf);
}

// write_layer_meta() with the sliding window @p window ("LEFT,RIGHT") in the metadata (NULL:
// none).
static void write_layer_window(const char *path, const double *p, bool f32, const char *window) {
    char meta[96] = "";
    if (window) snprintf(meta, sizeof meta, ",\"window\":\"%s\"", window);
    write_layer_meta(path, p, f32, meta, NULL);
}

static void write_layer_values(const char *path, const double *p, bool f32) {
    write_layer_window(path, p, f32, NULL);
}

// --window replaces the layer file's window: the same layer with the window from its file, or
// from --window over a file without one or with another, gives the same bytes, for every dtype
// (the layer is made again with the window and the parameters copied: doubles of a float64
// layer kept, 16-bit values kept); without the window the output differs.
Test(cli_run, window_option_replaces_the_files) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = tmp_make();
    enum { L = 6, N = 2, E = LF_E, Q = L * N * E };
    double pd[LF_COUNT], qd[Q];
    uint32_t state = 777u;
    for (size_t i = 0; i < LF_COUNT; ++i) pd[i] = 0.35 * pseudo(&state) + 1e-12 * pseudo(&state);
    for (size_t i = 0; i < Q; ++i) qd[i] = pseudo(&state);
    const size_t q_shape[] = {L, N, E};
    write_npy_raw(tmp_file(&d, "q.npy"), "<f8", 3, q_shape, qd, sizeof qd);
    write_layer_window(tmp_file(&d, "w20.safetensors"), pd, false, "2,0");
    write_layer_window(tmp_file(&d, "w00.safetensors"), pd, false, "0,0");
    write_layer_window(tmp_file(&d, "none.safetensors"), pd, false, NULL);
    const char *dtypes[] = {"f32", "f16", "bf16", "f64"};
    for (size_t t = 0; t < sizeof dtypes / sizeof *dtypes; ++t) {
        if (strcmp(dtypes[t], "f64") == 0 && !device_has_fp64()) continue;
        const char *runs[][3] = {{"w20.safetensors", NULL, "a.npy"},
                                 {"none.safetensors", "2,0", "b.npy"},
                                 {"w00.safetensors", "2,0", "c.npy"},
                                 {"w20.safetensors", "-1,-1", "none.npy"}};
        char *bytes[4] = {NULL};
        size_t sizes[4] = {0};
        for (int r = 0; r < 4; ++r) {
            char layer[CLI_PATH_SIZE], out[CLI_PATH_SIZE];
            snprintf(layer, sizeof layer, "%s", tmp_file(&d, runs[r][0]));
            snprintf(out, sizeof out, "%s", tmp_file(&d, runs[r][2]));
            const char *argv[16] = {"run", "--layer", layer, "--query", tmp_file(&d, "q.npy"),
                                    "--is-causal", "--dtype", dtypes[t], "--output", out};
            size_t argc = 10;
            if (runs[r][1]) argv[argc++] = "--window", argv[argc++] = runs[r][1];
            argv[argc] = NULL;
            cli_result res = cli_run_argv(argv);
            cr_assert_eq(res.status, 0, "%s, %s: exit status %d; stderr: %s", dtypes[t],
                         runs[r][2], res.status, res.err);
            cli_free(&res);
            bytes[r] = read_file(out, &sizes[r]);
            cr_assert(bytes[r] != NULL);
        }
        for (int r = 1; r < 3; ++r)
            cr_expect(sizes[r] == sizes[0] && memcmp(bytes[r], bytes[0], sizes[0]) == 0,
                      "%s: %s differs from the file's window's output", dtypes[t], runs[r][2]);
        cr_expect(sizes[3] == sizes[0] && memcmp(bytes[3], bytes[0], sizes[0]) != 0,
                  "%s: the window changes nothing", dtypes[t]);
        for (int r = 0; r < 4; ++r) free(bytes[r]);
    }
    tmp_remove(&d);
}

// --softcap and --alibi replace and add to the layer file's: the same layer with softcap and
// ALiBi from its file, or from the options over a file without them or with another softcap,
// gives the same bytes, for every dtype (the parameters copied, the file's alibi_slopes too);
// --softcap 0 turns the file's off, which changes the output.
Test(cli_run, score_variant_options_replace_the_files) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = tmp_make();
    enum { L = 6, N = 2, E = LF_E, Q = L * N * E };
    double pd[LF_COUNT], qd[Q];
    const double slopes[2] = {0.75, -0.125};
    uint32_t state = 4242u;
    for (size_t i = 0; i < LF_COUNT; ++i) pd[i] = 0.35 * pseudo(&state) + 1e-12 * pseudo(&state);
    for (size_t i = 0; i < Q; ++i) qd[i] = 4.0 * pseudo(&state);
    const size_t q_shape[] = {L, N, E};
    write_npy_raw(tmp_file(&d, "q.npy"), "<f8", 3, q_shape, qd, sizeof qd);
    write_layer_meta(tmp_file(&d, "sa.safetensors"), pd, false,
                     ",\"softcap\":\"1.5\",\"alibi\":\"true\"", NULL);
    write_layer_meta(tmp_file(&d, "s5.safetensors"), pd, false, ",\"softcap\":\"5\"", NULL);
    write_layer_meta(tmp_file(&d, "none.safetensors"), pd, false, NULL, NULL);
    write_layer_meta(tmp_file(&d, "sa_slopes.safetensors"), pd, false,
                     ",\"softcap\":\"1.5\",\"alibi\":\"true\"", slopes);
    write_layer_meta(tmp_file(&d, "a_slopes.safetensors"), pd, false, ",\"alibi\":\"true\"",
                     slopes);
    const char *dtypes[] = {"f32", "f16", "bf16", "f64"};
    for (size_t t = 0; t < sizeof dtypes / sizeof *dtypes; ++t) {
        if (strcmp(dtypes[t], "f64") == 0 && !device_has_fp64()) continue;
        enum { RUNS = 7 };
        const char *runs[RUNS][4] = {{"sa.safetensors", NULL, NULL, "a.npy"},
                                     {"none.safetensors", "1.5", "--alibi", "b.npy"},
                                     {"s5.safetensors", "1.5", "--alibi", "c.npy"},
                                     {"sa.safetensors", "1.5", "--alibi", "d.npy"},
                                     {"sa_slopes.safetensors", NULL, NULL, "e.npy"},
                                     {"a_slopes.safetensors", "1.5", "--alibi", "f.npy"},
                                     {"sa.safetensors", "0", NULL, "off.npy"}};
        char *bytes[RUNS] = {NULL};
        size_t sizes[RUNS] = {0};
        for (int r = 0; r < RUNS; ++r) {
            char layer[CLI_PATH_SIZE], out[CLI_PATH_SIZE];
            snprintf(layer, sizeof layer, "%s", tmp_file(&d, runs[r][0]));
            snprintf(out, sizeof out, "%s", tmp_file(&d, runs[r][3]));
            const char *argv[16] = {"run", "--layer", layer, "--query", tmp_file(&d, "q.npy"),
                                    "--is-causal", "--dtype", dtypes[t], "--output", out};
            size_t argc = 10;
            if (runs[r][1]) argv[argc++] = "--softcap", argv[argc++] = runs[r][1];
            if (runs[r][2]) argv[argc++] = runs[r][2];
            argv[argc] = NULL;
            cli_result res = cli_run_argv(argv);
            cr_assert_eq(res.status, 0, "%s, %s: exit status %d; stderr: %s", dtypes[t],
                         runs[r][3], res.status, res.err);
            cli_free(&res);
            bytes[r] = read_file(out, &sizes[r]);
            cr_assert(bytes[r] != NULL);
        }
        for (int r = 1; r < 4; ++r)
            cr_expect(sizes[r] == sizes[0] && memcmp(bytes[r], bytes[0], sizes[0]) == 0,
                      "%s: %s differs from the file's softcap and alibi's output", dtypes[t],
                      runs[r][3]);
        cr_expect(sizes[5] == sizes[4] && memcmp(bytes[5], bytes[4], sizes[4]) == 0,
                  "%s: --softcap over a file's alibi_slopes differs", dtypes[t]);
        cr_expect(sizes[4] == sizes[0] && memcmp(bytes[4], bytes[0], sizes[0]) != 0,
                  "%s: the file's alibi_slopes change nothing", dtypes[t]);
        cr_expect(sizes[6] == sizes[0] && memcmp(bytes[6], bytes[0], sizes[0]) != 0,
                  "%s: --softcap 0 changes nothing", dtypes[t]);
        for (int r = 0; r < RUNS; ++r) free(bytes[r]);
    }
    tmp_remove(&d);
}

// A layer file's sinks go along when --window, --softcap or --alibi make the layer again (its
// parameters copied): --softcap 0 and --window -1,-1 over the file change no byte of the
// output, for every dtype; the same file without its sinks gives another output. And its
// gradients include sinks.npy.
Test(cli_run, sinks_kept_through_options) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = tmp_make();
    char layer[CLI_PATH_SIZE], query[CLI_PATH_SIZE];
    snprintf(layer, sizeof layer, "%s/cli/sinks_file_causal_weights/layer.safetensors",
             CLMHA_TEST_DATA_DIR);
    snprintf(query, sizeof query, "%s/cli/sinks_file_causal_weights/query.npy",
             CLMHA_TEST_DATA_DIR);
    // The same file without the tensor sinks: its header's last entry, and its last 16 bytes.
    size_t size = 0;
    char *bytes = read_file(layer, &size);
    cr_assert(bytes && size > 8);
    size_t n = 0;
    for (int i = 7; i >= 0; --i) n = n << 8 | (unsigned char)bytes[i];
    char *entry = strstr(bytes + 8, ",\"sinks\":{");
    cr_assert(entry && entry < bytes + 8 + n, "no sinks entry");
    char *end = strchr(entry, '}');
    cr_assert(end != NULL);
    memmove(entry, end + 1, (size_t)(bytes + size - (end + 1)));  // the entry out
    size_t header = n - (size_t)(end + 1 - entry);
    while (header % 8) {  // padded with spaces again, before the data
        memmove(bytes + 8 + header + 1, bytes + 8 + header, size - 8 - n);
        bytes[8 + header++] = ' ';
    }
    for (int i = 0; i < 8; ++i) bytes[i] = (char)(unsigned char)((uint64_t)header >> (8 * i));
    write_bytes(tmp_file(&d, "plain.safetensors"), bytes, 8 + header + (size - 8 - n) - 16);
    free(bytes);
    const char *dtypes[] = {"f32", "f16", "f64"};
    for (size_t t = 0; t < sizeof dtypes / sizeof *dtypes; ++t) {
        if (strcmp(dtypes[t], "f64") == 0 && !device_has_fp64()) continue;
        enum { RUNS = 4 };
        const char *runs[RUNS][4] = {{layer, NULL, NULL, "a.npy"},
                                     {layer, "--softcap", "0", "b.npy"},
                                     {layer, "--window", "-1,-1", "c.npy"},
                                     {tmp_file(&d, "plain.safetensors"), NULL, NULL, "p.npy"}};
        char *out[RUNS] = {NULL};
        size_t sizes[RUNS] = {0};
        for (int r = 0; r < RUNS; ++r) {
            char path[CLI_PATH_SIZE], lpath[CLI_PATH_SIZE];
            snprintf(path, sizeof path, "%s", tmp_file(&d, runs[r][3]));
            snprintf(lpath, sizeof lpath, "%s", runs[r][0]);
            const char *argv[16] = {"run", "--layer", lpath, "--query", query, "--is-causal",
                                    "--dtype", dtypes[t], "--output", path};
            size_t argc = 10;
            if (runs[r][1]) argv[argc++] = runs[r][1], argv[argc++] = runs[r][2];
            argv[argc] = NULL;
            cli_result res = cli_run_argv(argv);
            cr_assert_eq(res.status, 0, "%s, %s: exit status %d; stderr: %s", dtypes[t],
                         runs[r][3], res.status, res.err);
            cli_free(&res);
            out[r] = read_file(path, &sizes[r]);
            cr_assert(out[r] != NULL);
        }
        for (int r = 1; r < 3; ++r)
            cr_expect(sizes[r] == sizes[0] && memcmp(out[r], out[0], sizes[0]) == 0,
                      "%s: %s differs from the file's sinks' output", dtypes[t], runs[r][3]);
        cr_expect(sizes[3] == sizes[0] && memcmp(out[3], out[0], sizes[0]) != 0,
                  "%s: the file's sinks change nothing", dtypes[t]);
        for (int r = 0; r < RUNS; ++r) free(out[r]);
    }
    tmp_remove(&d);
}

static void read_npy_f64(const char *path, clmha__npy *a) {
    char msg[512];
    cr_assert_eq(clmha__npy_read_f64(path, a, msg, sizeof msg), CLMHA_SUCCESS, "%s: %s", path,
                 msg);
}

static double max_abs_diff_d(const double *a, const double *b, size_t count) {
    double err = 0;
    for (size_t i = 0; i < count; ++i) {
        double e = fabs(a[i] - b[i]);
        if (!(e <= err)) err = e;  // NaN counts
    }
    return err;
}

// --dtype f64 with --grad-output and --grads-dir on PyTorch's gradient cases: '<f8' gradient
// files, each value within float32's rounding of the case's expected gradient (PyTorch's
// float64 autograd stored as float32: 2^-24 relative) plus 1e-12 (1 + max |g|), which a float32
// computation (errors near 1e-7) does not meet.
Test(cli_run, dtype_f64_gradients) {
    SKIP_WITHOUT_DEVICE();
    if (!device_has_fp64()) cr_skip_test("the device has no double precision");
    const char *const cases[] = {"grad_float_masks_bias_kv", "grad_self", "grad_kdim_vdim"};
    static const char *const inputs[][2] = {
        {"--layer", "layer.safetensors"}, {"--query", "query.npy"}, {"--key", "key.npy"},
        {"--value", "value.npy"}, {"--key-padding-mask", "key_padding_mask.npy"},
        {"--attn-mask", "attn_mask.npy"}, {"--grad-output", "grad_output.npy"}};
    double worst = 0.0;
    size_t files = 0;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; ++c) {
        char dir[CLI_PATH_SIZE / 2], grads_dir[CLI_PATH_SIZE];
        static char paths[7][CLI_PATH_SIZE];
        snprintf(dir, sizeof dir, "%s/cli/%s", CLMHA_TEST_DATA_DIR, cases[c]);
        tmp_dir out = tmp_make();
        snprintf(grads_dir, sizeof grads_dir, "%s/grads", out.path);
        cr_assert_eq(mkdir(grads_dir, 0700), 0);
        const char *argv[CLI_MAX_ARGS + 1] = {"run", "--dtype", "f64", "--grads-dir", grads_dir};
        size_t argc = 5;
        for (size_t i = 0; i < sizeof inputs / sizeof *inputs; ++i) {
            snprintf(paths[i], CLI_PATH_SIZE, "%s/%s", dir, inputs[i][1]);
            if (!file_exists(paths[i])) continue;
            argv[argc++] = inputs[i][0];
            argv[argc++] = paths[i];
        }
        argv[argc] = NULL;
        cli_result r = cli_run_argv(argv);
        cr_assert_eq(r.status, 0, "%s: stderr: %s", cases[c], r.err);
        cli_free(&r);
        char want_dir[CLI_PATH_SIZE];
        snprintf(want_dir, sizeof want_dir, "%s/expected_grads", dir);
        DIR *d = opendir(want_dir);
        cr_assert_not_null(d);
        for (struct dirent *e; (e = readdir(d)) != NULL;) {
            if (e->d_name[0] == '.') continue;
            char want_path[CLI_PATH_SIZE + 256], got_path[CLI_PATH_SIZE + 256];
            snprintf(want_path, sizeof want_path, "%s/%s", want_dir, e->d_name);
            snprintf(got_path, sizeof got_path, "%s/%s", grads_dir, e->d_name);
            clmha__npy got = {0}, want = {0};
            read_npy_f64(got_path, &got);
            read_npy(want_path, &want);
            cr_expect_str_eq(got.dtype, "<f8", "%s: %s", cases[c], e->d_name);
            cr_assert_eq(got.count, want.count);
            double scale = 0.0;
            for (size_t i = 0; i < want.count; ++i) scale = fmax(scale, fabs(want.f32[i]));
            for (size_t i = 0; i < want.count; ++i) {
                double w = want.f32[i], err = fabs(got.f64[i] - w);
                double ratio = err / (0x1p-24 * fabs(w) + 1e-12 * (1 + scale));
                worst = fmax(worst, ratio);
                cr_expect(ratio <= 1.0, "%s: %s[%zu]: %.17g, PyTorch %.9g", cases[c],
                          e->d_name, i, got.f64[i], w);
            }
            clmha__npy_free(&got);
            clmha__npy_free(&want);
            ++files;
        }
        closedir(d);
        tmp_remove(&out);
    }
    fprintf(stderr, "cli --dtype f64 gradients: %zu files, %.2f of float32's rounding\n", files,
            worst);
}

// --dtype f64: the layer is float64, '<f8' inputs (query, float key_padding_mask) are read as
// doubles, the output and weights are written as '<f8' files.
//   1. Float values (so that the float64 reference, which takes floats, sees the same ones):
//      an F64 layer file with an '<f8' query, a float64 key padding mask and the weights, and
//      an F32 layer file with an '<f4' query (both widened), causal: max |error| <= 1e-12
//      against clmha_reference_forward() (the float64 contract, include/clmha.h).
//   2. Values no float holds (the layer's and the query's values plus 1e-9): the files equal
//      bit for bit what clmha_layer_forward_host_f64() gives in-process on a layer loaded with
//      clmha_layer_load_as(F64) and the same doubles (test_f64 holds that path to PyTorch's
//      float64 within 1e-12), so the CLI reads and writes the doubles exactly (a query read
//      through float32 moved the output by 4.0e-10 and the weights by 3.6e-11, as PyTorch's
//      float64 module predicts); and the output moved from case 1's reference by more than
//      1e-12 and less than 1e-7 (PyTorch: 2.2e-9).
Test(cli_run, dtype_f64) {
    SKIP_WITHOUT_FP64();
    tmp_dir d = tmp_make();
    enum { L = 3, N = 2, E = LF_E, Q = L * N * E, WC = N * L * L };
    float pf[LF_COUNT], qf[Q], kpm_f[N * L] = {0.0f, -0.75f, 0.0f, 0.0f, 0.0f, -1.5f};
    double pd[LF_COUNT], qd[Q], kpm_d[N * L];
    uint32_t state = 4242u;
    for (size_t i = 0; i < LF_COUNT; ++i) pd[i] = pf[i] = 0.35f * pseudo(&state);
    for (size_t i = 0; i < Q; ++i) qd[i] = qf[i] = pseudo(&state);
    for (size_t i = 0; i < N * L; ++i) kpm_d[i] = kpm_f[i];
    const size_t q_shape[] = {L, N, E}, kpm_shape[] = {N, L};
    const char *layer64 = tmp_file(&d, "layer64.safetensors");
    const char *layer32 = tmp_file(&d, "layer32.safetensors");
    write_layer_values(layer64, pd, false);
    write_layer_values(layer32, pd, true);
    write_npy_raw(tmp_file(&d, "q8.npy"), "<f8", 3, q_shape, qd, sizeof qd);
    write_npy_raw(tmp_file(&d, "q4.npy"), "<f4", 3, q_shape, qf, sizeof qf);
    write_npy_raw(tmp_file(&d, "kpm.npy"), "<f8", 2, kpm_shape, kpm_d, sizeof kpm_d);

    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = 2,
                             .bias = true, .dtype = CLMHA_DTYPE_F64};
    clmha_reference_params p = {.struct_size = sizeof p, .in_proj_weight = pf + LF_W_IN,
                                .in_proj_bias = pf + LF_B_IN, .out_proj_weight = pf + LF_W_OUT,
                                .out_proj_bias = pf + LF_B_OUT};
    double ref_kpm[Q], ref_kpm_w[WC], ref_causal[Q];
    char msg[256];
    clmha_forward_args a = {.struct_size = sizeof a,
                            .query = {.ndim = 3, .shape = {L, N, E}, .data = qf},
                            .key_padding_mask = {.kind = CLMHA_MASK_FLOAT,
                                                 .tensor = {.ndim = 2, .shape = {N, L},
                                                            .data = kpm_f}},
                            .need_weights = true};
    cr_assert_eq(clmha_reference_forward(&desc, &p, &a, ref_kpm, Q, ref_kpm_w, WC, msg,
                                         sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    clmha_forward_args c = {.struct_size = sizeof c,
                            .query = {.ndim = 3, .shape = {L, N, E}, .data = qf},
                            .is_causal = true};
    cr_assert_eq(clmha_reference_forward(&desc, &p, &c, ref_causal, Q, NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);

    // 1. Float values, against the reference.
    const char *o = tmp_file(&d, "o.npy"), *w = tmp_file(&d, "w.npy");
    cli_result r = cli_run("run", "--layer", layer64, "--query", tmp_file(&d, "q8.npy"),
                           "--key-padding-mask", tmp_file(&d, "kpm.npy"), "--dtype", "f64",
                           "--output", o, "--weights-output", w);
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_assert_str_empty(r.err);
    cli_free(&r);
    clmha__npy go = {0}, gw = {0};
    read_npy_f64(o, &go);
    read_npy_f64(w, &gw);
    cr_assert_str_eq(go.dtype, "<f8");
    cr_assert_str_eq(gw.dtype, "<f8");
    cr_assert(go.ndim == 3 && go.shape[0] == L && go.shape[1] == N && go.shape[2] == E);
    cr_assert(gw.ndim == 3 && gw.shape[0] == N && gw.shape[1] == L && gw.shape[2] == L);
    double err_o = max_abs_diff_d(go.f64, ref_kpm, Q);
    double err_w = max_abs_diff_d(gw.f64, ref_kpm_w, WC);
    fprintf(stderr, "cli dtype_f64 out_maxabs=%.3g w_maxabs=%.3g\n", err_o, err_w);
    cr_expect(err_o <= 1e-12, "output: max error %.3g", err_o);
    cr_expect(err_w <= 1e-12, "weights: max error %.3g", err_w);
    clmha__npy_free(&go);
    clmha__npy_free(&gw);

    r = cli_run("run", "--layer", layer32, "--query", tmp_file(&d, "q4.npy"), "--is-causal",
                "--dtype", "f64", "--output", o);
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cli_free(&r);
    read_npy_f64(o, &go);
    cr_assert_str_eq(go.dtype, "<f8");
    cr_assert_eq(go.count, (size_t)Q);
    double err_c = max_abs_diff_d(go.f64, ref_causal, Q);
    fprintf(stderr, "cli dtype_f64 (F32 file, causal) out_maxabs=%.3g\n", err_c);
    cr_expect(err_c <= 1e-12, "F32 layer file, causal: max error %.3g", err_c);
    clmha__npy_free(&go);

    // 2. Values no float holds: the CLI's files equal the in-process float64 call's.
    double pd2[LF_COUNT], qd2[Q];
    for (size_t i = 0; i < LF_COUNT; ++i) pd2[i] = pd[i] + 1e-9;
    for (size_t i = 0; i < Q; ++i) {
        qd2[i] = qd[i] + 1e-9;
        cr_assert_neq((double)(float)qd2[i], qd2[i], "query value %zu is a float", i);
    }
    const char *layer_d = tmp_file(&d, "layer_d.safetensors");
    write_layer_values(layer_d, pd2, false);
    write_npy_raw(tmp_file(&d, "qd.npy"), "<f8", 3, q_shape, qd2, sizeof qd2);
    r = cli_run("run", "--layer", layer_d, "--query", tmp_file(&d, "qd.npy"),
                "--key-padding-mask", tmp_file(&d, "kpm.npy"), "--dtype", "f64", "--output", o,
                "--weights-output", w);
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cli_free(&r);
    read_npy_f64(o, &go);
    read_npy_f64(w, &gw);
    cr_assert_eq(go.count, (size_t)Q);
    cr_assert_eq(gw.count, (size_t)WC);

    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_env(&ctx), CLMHA_SUCCESS);
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_load_as(&layer, ctx, layer_d, CLMHA_DTYPE_F64), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    double got_p[LF_COUNT];
    cr_assert_eq(clmha_layer_get_parameter_f64(layer, "in_proj_weight", got_p, 3 * E * E), 0);
    cr_assert(memcmp(got_p, pd2, 3 * E * E * sizeof *got_p) == 0,
              "the F64 file's in_proj_weight was not kept exactly");
    clmha_forward_args a2 = a;
    a2.query.data = qd2;
    a2.key_padding_mask.tensor.data = kpm_d;
    double y2[Q], w2[WC];
    cr_assert_eq(clmha_layer_forward_host_f64(layer, &a2, y2, Q, w2, WC), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    cr_expect(memcmp(go.f64, y2, sizeof y2) == 0,
              "the output differs from clmha_layer_forward_host_f64's by up to %.3g",
              max_abs_diff_d(go.f64, y2, Q));
    cr_expect(memcmp(gw.f64, w2, sizeof w2) == 0,
              "the weights differ from clmha_layer_forward_host_f64's by up to %.3g",
              max_abs_diff_d(gw.f64, w2, WC));
    double moved = max_abs_diff_d(go.f64, ref_kpm, Q);
    fprintf(stderr, "cli dtype_f64 (values plus 1e-9) moved the output by %.3g\n", moved);
    cr_expect(moved > 1e-12 && moved < 1e-7,
              "values plus 1e-9 moved the output by %.3g (want more than 1e-12: not rounded "
              "to float; less than 1e-7: a small change)",
              moved);
    clmha__npy_free(&go);
    clmha__npy_free(&gw);
    tmp_remove(&d);
}

// Every PyTorch case of tests/cli through --dtype f64 (without the gradient options): the
// expected files are PyTorch's float64 module on the values the case's files hold, so the
// float64 layer meets them within the float64 contract, max |error| <= 1e-12, output and
// weights ('<f8' files). Except layer_f64, whose expectation is that of the float32 layer its
// F64 file rounds to: there the float64 layer keeps the file's doubles and must be more than
// 1e-12 away from it.
Test(cli_run, dtype_f64_pytorch_cases) {
    SKIP_WITHOUT_FP64();
    tmp_dir out = tmp_make();
    const char *out_path = tmp_file(&out, "out.npy"), *w_path = tmp_file(&out, "w.npy");
    static const char *const inputs[][2] = {
        {"--layer", "layer.safetensors"},
        {"--query", "query.npy"},
        {"--key", "key.npy"},
        {"--value", "value.npy"},
        {"--key-padding-mask", "key_padding_mask.npy"},
        {"--attn-mask", "attn_mask.npy"},
    };
    enum { NUM_INPUTS = sizeof inputs / sizeof inputs[0] };
    double worst = 0, worst_chunked = 0;
    size_t chunked_cases = 0;
    for (size_t c = 0; c < CLI_NUM_CASES; ++c) {
        const char *name = cli_case_names[c];
        char dir[CLI_PATH_SIZE / 2], paths[NUM_INPUTS][CLI_PATH_SIZE], want_o[CLI_PATH_SIZE],
            want_w[CLI_PATH_SIZE], args_path[CLI_PATH_SIZE];
        snprintf(dir, sizeof dir, "%s/cli/%s", CLMHA_TEST_DATA_DIR, name);
        const char *argv[CLI_MAX_ARGS + 1] = {"run", "--dtype", "f64", "--output", out_path};
        size_t argc = 5;
        for (size_t i = 0; i < NUM_INPUTS; ++i) {
            snprintf(paths[i], CLI_PATH_SIZE, "%s/%s", dir, inputs[i][1]);
            if (!file_exists(paths[i])) continue;
            argv[argc++] = inputs[i][0];
            argv[argc++] = paths[i];
        }
        snprintf(args_path, sizeof args_path, "%s/args", dir);
        char *extra = read_file(args_path, NULL);
        if (extra)
            for (char *tok = strtok(extra, " \t\r\n"); tok; tok = strtok(NULL, " \t\r\n")) {
                cr_assert_lt(argc, CLI_MAX_ARGS - 2, "%s: too many arguments", name);
                argv[argc++] = tok;
            }
        snprintf(want_o, sizeof want_o, "%s/expected_output.npy", dir);
        snprintf(want_w, sizeof want_w, "%s/expected_weights.npy", dir);
        // The same call through a float64 KV cache, two query rows a call (pages of 8): for
        // the cases --decode-chunk takes (no masks, weights, training or packed batch; is_causal
        // self-attention only where a key is given or a window, ALiBi or user functions are).
        bool causal = false, positional = false, refused = file_exists(paths[4]) ||
                                                            file_exists(paths[5]);
        for (size_t i = 5; i < argc; ++i) {
            causal |= strcmp(argv[i], "--is-causal") == 0;
            positional |= strcmp(argv[i], "--window") == 0 || strcmp(argv[i], "--alibi") == 0 ||
                          strcmp(argv[i], "--score-mod") == 0;
            refused |= strcmp(argv[i], "--training") == 0 || strcmp(argv[i], "--seq-lens") == 0 ||
                       strstr(argv[i], "-weights") != NULL;
        }
        refused |= (causal && file_exists(paths[2])) || (positional && !causal);
        const char *chunked[CLI_MAX_ARGS + 1];
        memcpy(chunked, argv, argc * sizeof *argv);
        size_t chunked_argc = argc;
        chunked[chunked_argc++] = "--decode-chunk";
        chunked[chunked_argc++] = "2";
        chunked[chunked_argc++] = "--page-size";
        chunked[chunked_argc++] = "8";
        chunked[chunked_argc] = NULL;
        bool weights = file_exists(want_w);
        if (weights) {
            argv[argc++] = "--weights-output";
            argv[argc++] = w_path;
        }
        argv[argc] = NULL;
        cli_result r = cli_run_argv(argv);
        cr_assert_eq(r.status, 0, "%s: exit status %d; stderr: %s", name, r.status, r.err);
        cli_free(&r);
        if (!refused && strcmp(name, "layer_f64") != 0) {
            char chunk_out[CLI_PATH_SIZE];
            snprintf(chunk_out, sizeof chunk_out, "%s", tmp_file(&out, "chunked.npy"));
            chunked[4] = chunk_out;  // --output
            r = cli_run_argv(chunked);
            cr_assert_eq(r.status, 0, "%s --decode-chunk 2: exit status %d; stderr: %s", name,
                         r.status, r.err);
            cli_free(&r);
            clmha__npy got = {0}, want = {0};
            read_npy_f64(chunk_out, &got);
            read_npy_f64(want_o, &want);
            cr_assert_str_eq(got.dtype, "<f8", "%s: dtype %s", name, got.dtype);
            cr_assert_eq(got.count, want.count, "%s", name);
            double e = max_abs_diff_d(got.f64, want.f64, got.count);
            fprintf(stderr, "cli f64 %s --decode-chunk 2 --page-size 8 out_maxabs=%.3e\n", name,
                    e);
            cr_expect_leq(e, 1e-12, "%s --decode-chunk 2: output max abs error %.3e", name, e);
            clmha__npy_free(&got);
            clmha__npy_free(&want);
            worst_chunked = fmax(worst_chunked, e);
            ++chunked_cases;
        }
        free(extra);
        double err[2] = {0, 0};
        for (int k = 0; k < 1 + weights; ++k) {
            clmha__npy got = {0}, want = {0};
            read_npy_f64(k ? w_path : out_path, &got);
            read_npy_f64(k ? want_w : want_o, &want);
            cr_assert_str_eq(got.dtype, "<f8", "%s: dtype %s", name, got.dtype);
            cr_assert_eq(got.ndim, want.ndim, "%s", name);
            cr_assert(memcmp(got.shape, want.shape, sizeof got.shape) == 0, "%s: shape", name);
            err[k] = max_abs_diff_d(got.f64, want.f64, got.count);
            clmha__npy_free(&got);
            clmha__npy_free(&want);
        }
        if (weights)
            fprintf(stderr, "cli f64 %s out_maxabs=%.3e w_maxabs=%.3e\n", name, err[0], err[1]);
        else
            fprintf(stderr, "cli f64 %s out_maxabs=%.3e w_maxabs=-\n", name, err[0]);
        if (strcmp(name, "layer_f64") == 0) {
            cr_expect_gt(err[0], 1e-12, "%s: the F64 file's doubles were rounded (%.3e)", name,
                         err[0]);
            continue;
        }
        cr_expect_leq(err[0], 1e-12, "%s: output max abs error %.3e", name, err[0]);
        cr_expect_leq(err[1], 1e-12, "%s: weights max abs error %.3e", name, err[1]);
        worst = fmax(worst, fmax(err[0], err[1]));
    }
    fprintf(stderr, "cli f64 %zu PyTorch cases: max abs error %.3e; %zu through a KV cache: %.3e\n",
            CLI_NUM_CASES - 1, worst, chunked_cases, worst_chunked);
    cr_expect_gt(chunked_cases, 3, "cases through a KV cache: %zu", chunked_cases);
    tmp_remove(&out);
}

// --grad-dtype other than f32, or without a 16-bit layer's gradients: usage errors (exit 2)
// before any file is read, one line; a float64 training step and decode step in `clmha bench`.
Test(cli_usage, dtype_f64_refusals) {
    const char *const run[] = {"run", "--layer", "l.safetensors", "--query", "q.npy"};
    struct {
        const char *prefix, *names;
        const char *const extra[6];
    } cases[] = {
        {"clmha run: --grad-dtype takes f32", "the layer's dtype",
         {"--dtype", "bf16", "--grad-dtype", "f64"}},
        {"clmha run: --grad-dtype f32 needs --grads-dir", "f16 or bf16",
         {"--grad-dtype", "f32"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        const char *args[CLI_MAX_ARGS + 1];
        size_t n = 0;
        for (size_t k = 0; k < sizeof run / sizeof run[0]; ++k) args[n++] = run[k];
        for (size_t k = 0; k < 6 && cases[i].extra[k]; ++k) args[n++] = cases[i].extra[k];
        args[n] = NULL;
        cli_result r = cli_run_argv(args);
        cr_assert_eq(r.status, 2, "case %zu: exit status %d (want 2); stderr: %s", i, r.status,
                     r.err);
        assert_one_line(&r, cases[i].prefix, cases[i].names, NULL);
        cli_free(&r);
    }
    cli_result r;
    if (device_has_fp64()) {  // a float64 training step
        r = cli_run("bench", "--json", "--backward", "--dtype", "f64", "--embed", "16",
                    "--heads", "2", "--batch", "2", "--tgt-len", "5", "--repeat", "2");
        cr_assert_eq(r.status, 0, "stderr: %s", r.err);
        cr_expect(strstr(r.out, "\"dtype\": \"float64\"") != NULL, "%s", r.out);
        cli_free(&r);
    }
    if (device_has_fp64()) {  // a float64 decode step: its cache holds doubles, 8 bytes a value
        r = cli_run("bench", "--json", "--decode", "--dtype", "f64", "--cache-len", "20",
                    "--embed", "16", "--heads", "2", "--batch", "2", "--repeat", "2");
        cr_assert_eq(r.status, 0, "stderr: %s", r.err);
        cr_expect(strstr(r.out, "\"dtype\": \"float64\"") != NULL, "%s", r.out);
        // K and V of 2 sequences, 2 heads of 8, 21 tokens, 8 bytes: 10752.
        cr_expect(strstr(r.out, "\"kv_bytes\": 10752,") != NULL, "%s", r.out);
        cli_free(&r);
    }
}

// --seq-lens / --kv-seq-lens (a packed batch): malformed lists and what they do not go with
// are usage errors; lengths that do not fit the files are refused naming the file or the list.
Test(cli_usage, seq_lens) {
    EXPECT_USAGE("clmha run: --seq-lens '5,,3': expected lengths", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--seq-lens", "5,,3");
    EXPECT_USAGE("clmha run: --seq-lens '-1': expected lengths", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--seq-lens", "-1");
    EXPECT_USAGE("clmha run: --kv-seq-lens '3,x': expected lengths", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--seq-lens", "1,2", "--kv-seq-lens",
                 "3,x");
    EXPECT_USAGE("clmha run: --kv-seq-lens needs --seq-lens", "run", "--layer", "l.safetensors",
                 "--query", "q.npy", "--kv-seq-lens", "3");
    EXPECT_USAGE("clmha run: --seq-lens and --kv-seq-lens must give as many", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--seq-lens", "1,2", "--kv-seq-lens", "3");
    EXPECT_USAGE("clmha run: --seq-lens does not go with --decode-chunk", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--seq-lens", "6", "--decode-chunk", "2");
    EXPECT_USAGE("clmha sdpa: --seq-lens does not go with --weights-output", "sdpa", "--query",
                 "q.npy", "--key", "k.npy", "--value", "v.npy", "--seq-lens", "2,3",
                 "--weights-output", "w.npy");
    EXPECT_USAGE("clmha sdpa: --seq-lens does not go with --kv-cache-prefix", "sdpa", "--query",
                 "q.npy", "--key", "k.npy", "--value", "v.npy", "--seq-lens", "2,3",
                 "--kv-cache-prefix", "2");
    EXPECT_USAGE("clmha sdpa: --kv-seq-lens needs --seq-lens", "sdpa", "--query", "q.npy",
                 "--key", "k.npy", "--value", "v.npy", "--kv-seq-lens", "2,3");
    EXPECT_USAGE("clmha sdpa: --seq-lens '2;3': expected lengths", "sdpa", "--query", "q.npy",
                 "--key", "k.npy", "--value", "v.npy", "--seq-lens", "2;3");
}

Test(cli_refused, seq_lens) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    write_f32_shape(tmp_file(&d, "t.npy"), 6, 8);  // (T, E) = (6, 8)
    const char *layer = tmp_file(&d, "layer.safetensors");
    char q[4096], o[4096];
    snprintf(q, sizeof q, "%s", tmp_file(&d, "t.npy"));
    snprintf(o, sizeof o, "%s", tmp_file(&d, "o.npy"));
    // The lengths sum to 5, the query holds 6 tokens; a 3-D query; queries without keys.
    EXPECT_REFUSED(&d, 3, "--query", "t.npy", "run", "--layer", layer, "--query", q,
                   "--seq-lens", "2,3", "--output", o);
    EXPECT_REFUSED(&d, 3, "--query", "q.npy", "run", "--layer", layer, "--query",
                   tmp_file(&d, "q.npy"), "--seq-lens", "3,3", "--output", o);
    EXPECT_REFUSED(&d, 3, "--key", "t.npy", "run", "--layer", layer, "--query", q, "--key", q,
                   "--value", q, "--seq-lens", "3,3", "--kv-seq-lens", "2,2", "--output", o);
    EXPECT_REFUSED(&d, 3, "--seq-lens", "3,3", "run", "--layer", layer, "--query", q, "--key",
                   q, "--value", q, "--seq-lens", "3,3", "--kv-seq-lens", "6,0", "--output", o);
    // Masks and weights have no per-sequence shape.
    EXPECT_REFUSED(&d, 3, "--seq-lens", "packed", "run", "--layer", layer, "--query", q,
                   "--seq-lens", "3,3", "--need-weights", "--output", o);
    tmp_remove(&d);
}

// --decode-chunk through a paged KV cache (--page-size): PyTorch's causal and sliding-window
// outputs again, as the contiguous cache gives them; a bad page size is a usage error.
Test(cli_run, decode_chunk_paged) {
    SKIP_WITHOUT_DEVICE();
    static const char *const cases[] = {"causal", "window_file_causal_bias_kv"};
    tmp_dir d = tmp_make();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        char dir[4096], layer[4200], query[4200], want_path[4200];
        snprintf(dir, sizeof dir, "%s/cli/%s", CLMHA_TEST_DATA_DIR, cases[i]);
        snprintf(layer, sizeof layer, "%s/layer.safetensors", dir);
        snprintf(query, sizeof query, "%s/query.npy", dir);
        snprintf(want_path, sizeof want_path, "%s/expected_output.npy", dir);
        const char *out = tmp_file(&d, "o.npy");
        cli_result r = cli_run("run", "--layer", layer, "--query", query, "--is-causal",
                               "--decode-chunk", "3", "--page-size", "16", "--output", out);
        cr_assert_eq(r.status, 0, "%s: exit %d: %s", cases[i], r.status, r.err);
        cli_free(&r);
        clmha__npy got, want;
        read_npy(out, &got);
        read_npy(want_path, &want);
        double err = npy_max_abs_diff(&got, &want, "output", cases[i]);
        cr_expect_leq(err, CLI_TOL, "%s --decode-chunk 3 --page-size 16: %.3e", cases[i], err);
        fprintf(stderr, "cli %s --decode-chunk 3 --page-size 16 out_maxabs=%.3e\n", cases[i],
                err);
        clmha__npy_free(&got);
        clmha__npy_free(&want);
    }
    tmp_remove(&d);
    EXPECT_USAGE("clmha run: --page-size 24: expected a power of two", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--decode-chunk", "2", "--page-size",
                 "24");
    EXPECT_USAGE("clmha run: --page-size needs --decode-chunk", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--page-size", "16");
    EXPECT_USAGE("clmha run: --kv-dtype 'int2': expected f32, f16, bf16, int8 or int4", "run",
                 "--layer", "l.safetensors", "--query", "q.npy", "--decode-chunk", "2",
                 "--kv-dtype", "int2");
}

// clmha sdpa --kv-cache-prefix through a paged cache (the same output as PyTorch's), an int8
// one (within 1e-2 of the largest output) and an int4 one (within 2e-1: docs/accuracy.md).
Test(cli_sdpa, kv_cache_paged_and_quantised) {
    SKIP_WITHOUT_DEVICE();
    char dir[4096], in[3][4200], want_path[4200];
    snprintf(dir, sizeof dir, "%s/cli/sdpa_kv_cache_decode", CLMHA_TEST_DATA_DIR);
    static const char *const names[3] = {"query", "key", "value"};
    for (int i = 0; i < 3; ++i) snprintf(in[i], sizeof in[i], "%s/%s.npy", dir, names[i]);
    snprintf(want_path, sizeof want_path, "%s/expected_output.npy", dir);
    tmp_dir d = tmp_make();
    const char *out = tmp_file(&d, "o.npy");
    static const char *const kinds[3][4] = {{"--page-size", "16", "--kv-dtype", "f32"},
                                            {"--page-size", "16", "--kv-dtype", "int8"},
                                            {"--page-size", "32", "--kv-dtype", "int4"}};
    static const double bound[3] = {0, 1e-2, 2e-1};  // of the largest output (f32: CLI_TOL)
    for (int k = 0; k < 3; ++k) {
        cli_result r = cli_run("sdpa", "--query", in[0], "--key", in[1], "--value", in[2],
                               "--layout", "nlhd", "--is-causal", "--enable-gqa",
                               "--kv-cache-prefix", "4", kinds[k][0], kinds[k][1], kinds[k][2],
                               kinds[k][3], "--output", out);
        cr_assert_eq(r.status, 0, "%s: exit %d: %s", kinds[k][3], r.status, r.err);
        cli_free(&r);
        double scale, err = npy_file_err(out, want_path, "sdpa_kv_cache_decode", &scale);
        cr_expect_leq(k ? err / scale : err, k ? bound[k] : CLI_TOL, "%s: %.3e", kinds[k][3],
                      err);
        fprintf(stderr, "cli sdpa kv cache paged %s: max |err| %.3e\n", kinds[k][3], err);
    }
    tmp_remove(&d);
    EXPECT_USAGE("clmha sdpa: --page-size needs --kv-cache-prefix", "sdpa", "--query", "q.npy",
                 "--key", "k.npy", "--value", "v.npy", "--page-size", "16");
}

// --decode-chunk through each narrower KV cache: PyTorch's output within the kind's contract
// (of the output's largest value; these cases are unit-scale: docs/accuracy.md).
Test(cli_run, decode_chunk_kv_dtypes) {
    SKIP_WITHOUT_DEVICE();
    char dir[4096], layer[4200], query[4200], want_path[4200];
    snprintf(dir, sizeof dir, "%s/cli/causal", CLMHA_TEST_DATA_DIR);
    snprintf(layer, sizeof layer, "%s/layer.safetensors", dir);
    snprintf(query, sizeof query, "%s/query.npy", dir);
    snprintf(want_path, sizeof want_path, "%s/expected_output.npy", dir);
    tmp_dir d = tmp_make();
    const char *out = tmp_file(&d, "o.npy");
    static const struct {
        const char *name, *page;
        double bound;
    } kinds[] = {{"f16", "16", 1e-3}, {"bf16", "8", 5e-3}, {"int8", "16", 1e-2},
                 {"int4", "8", 2e-1}};
    size_t count = sizeof kinds / sizeof kinds[0];
    case_stride stride = case_stride_get("cli kv dtypes", count);  // a driver lane's share
    for (size_t k = 0; k < count; ++k) {
        if (!case_stride_keeps(stride, k)) continue;
        cli_result r = cli_run("run", "--layer", layer, "--query", query, "--is-causal",
                               "--decode-chunk", "2", "--kv-dtype", kinds[k].name,
                               "--page-size", kinds[k].page, "--output", out);
        cr_assert_eq(r.status, 0, "%s: exit %d: %s", kinds[k].name, r.status, r.err);
        cli_free(&r);
        double scale, err = npy_file_err(out, want_path, "causal", &scale);
        cr_expect_leq(err / scale, kinds[k].bound, "%s: %.3e of %.3e", kinds[k].name, err,
                      scale);
        fprintf(stderr, "cli causal --decode-chunk 2 --kv-dtype %s --page-size %s: max |err| "
                "%.3e (%.2e of the largest output)\n", kinds[k].name, kinds[k].page, err,
                err / scale);
    }
    tmp_remove(&d);
}

Test(cli_usage, dtype) {
    EXPECT_USAGE("clmha run: ", "run", "--layer", "l.safetensors", "--query", "q.npy", "--dtype",
                 "f8");
    EXPECT_USAGE("clmha run: ", "run", "--layer", "l.safetensors", "--query", "q.npy", "--dtype",
                 "");
}

Test(cli_run, summary_without_output) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    write_f32_shape(tmp_file(&d, "q2.npy"), 4, 8);  // unbatched
    cli_result r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                           tmp_file(&d, "q2.npy"), "--is-causal", "--need-weights");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_assert(strstr(r.out, "(4, 8)") != NULL, "stdout: %s", r.out);  // output
    cr_assert(strstr(r.out, "(4, 4)") != NULL, "stdout: %s", r.out);  // averaged weights
    cr_assert_eq(tmp_list(&d, NULL, 0), 3);
    cli_free(&r);
    tmp_remove(&d);
}

// ---- usage errors: exit 2 ---------------------------------------------------------------------

Test(cli_usage, no_command) {
    EXPECT_USAGE("clmha: ", NULL);
}

Test(cli_usage, unknown_command) {
    EXPECT_USAGE("clmha: ", "frobnicate");
    EXPECT_USAGE("clmha: ", "--frobnicate");
}

Test(cli_usage, unknown_option) {
    EXPECT_USAGE("clmha run: ", "run", "--layer", "l.safetensors", "--query", "q.npy", "--bogus");
    EXPECT_USAGE("clmha run: ", "run", "positional.npy");
    EXPECT_USAGE("clmha demo: ", "demo", "--bogus");
    EXPECT_USAGE("clmha devices: ", "devices", "--bogus");
    EXPECT_USAGE("clmha run: ", "run", "--layer", "l.safetensors", "--query", "q.npy",
                 "--need-weights=yes");
}

Test(cli_usage, run_without_layer_or_query) {
    EXPECT_USAGE("clmha run: ", "run", "--query", "q.npy");
    EXPECT_USAGE("clmha run: ", "run", "--layer", "l.safetensors");
    EXPECT_USAGE("clmha run: ", "run");
}

Test(cli_usage, option_missing_value) {
    EXPECT_USAGE("clmha run: ", "run", "--query", "q.npy", "--layer");
    EXPECT_USAGE("clmha run: ", "run", "--layer", "--query", "q.npy");
    EXPECT_USAGE("clmha run: ", "run", "--layer=", "--query", "q.npy");
    EXPECT_USAGE("clmha demo: ", "demo", "--heatmap");
    EXPECT_USAGE("clmha demo: ", "demo", "--device");
}

Test(cli_usage, impl) {
    EXPECT_USAGE("clmha run: --impl 'flash'", "run", "--layer", "l.safetensors", "--query",
                 "q.npy", "--impl", "flash");
    EXPECT_USAGE("clmha run: --impl fused cannot give weights", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--impl", "fused", "--need-weights");
    EXPECT_USAGE("clmha run: --impl fused cannot give weights", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--impl=fused", "--weights-output",
                 "w.npy");
    EXPECT_USAGE("clmha bench: --impl 'Fused'", "bench", "--impl", "Fused");
    EXPECT_USAGE("clmha bench: --impl fused cannot give weights", "bench", "--impl", "fused",
                 "--need-weights");
}

Test(cli_usage, option_given_twice) {
    EXPECT_USAGE("clmha run: ", "run", "--layer", "a", "--layer", "b", "--query", "q.npy");
}

// ---- help, version, devices, demo ---------------------------------------------------------------

static void expect_help(const char *const *args, const char *want) {
    cli_result r = cli_run_argv(args);
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_assert_str_empty(r.err);
    cr_assert(strstr(r.out, want) != NULL, "stdout lacks '%s': %s", want, r.out);
    cli_free(&r);
}

#define EXPECT_HELP(want, ...) expect_help((const char *const[]){__VA_ARGS__, NULL}, want)

Test(cli_help, every_command) {
    EXPECT_HELP("usage: clmha <command>", "--help");
    EXPECT_HELP("usage: clmha <command>", "-h");
    EXPECT_HELP("usage: clmha run", "run", "--help");
    EXPECT_HELP("--weights-output", "run", "--layer", "x", "--help");
    EXPECT_HELP("usage: clmha demo", "demo", "--help");
    EXPECT_HELP("usage: clmha devices", "devices", "--help");
    EXPECT_HELP("usage: clmha sdpa", "sdpa", "--help");
    EXPECT_HELP("--lse-output LSE.npy", "sdpa", "--query", "x", "--help");
    EXPECT_HELP("  sdpa      scaled dot-product attention", "--help");
    // The help texts in full (their parts put together; the last line ends them).
    EXPECT_HELP("--window LEFT,RIGHT", "run", "--help");
    EXPECT_HELP("--window LEFT,RIGHT", "sdpa", "--help");
    EXPECT_HELP("--softcap C", "run", "--help");
    EXPECT_HELP("--alibi-slopes A.npy", "sdpa", "--help");
    EXPECT_HELP("[--softcap C] [--alibi] [--sinks]", "bench", "--help");
    EXPECT_HELP("--sinks S.npy", "sdpa", "--help");
    EXPECT_HELP("bias_k, bias_v (1, 1, E), sinks (H)", "run", "--help");
    EXPECT_HELP("--score-mod FILE.cl", "run", "--help");
    EXPECT_HELP("--mod-params P.npy", "sdpa", "--help");
    EXPECT_HELP("[--score-mod FILE.cl [--mod-params P.npy]]", "bench", "--help");
    EXPECT_HELP("--opt VALUE or --opt=VALUE.\n", "run", "--help");
    EXPECT_HELP("--opt VALUE or --opt=VALUE.\n", "sdpa", "--help");
    EXPECT_HELP("--candidates N", "tune", "--help");
}

Test(cli_help, version) {
    char want[64];
    snprintf(want, sizeof want, "clmha %s\n", clmha_version());
    cli_result r = cli_run("--version");
    cr_assert_eq(r.status, 0);
    cr_assert_str_eq(r.out, want);
    cli_free(&r);
}

// `clmha tune` bounded by --candidates (a budget it does not reach): a short run that applies,
// reports and stores nothing with --no-store; and its usage errors.
Test(cli_tune, candidates_bound_the_search) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = tmp_make();
    setenv("CLMHA_TUNING_DIR", d.path, 1);  // (the child inherits it)
    cli_result r = cli_run("tune", "--candidates", "1", "--budget", "3600", "--shape", "1,8,16,2",
                           "--no-store");
    unsetenv("CLMHA_TUNING_DIR");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    size_t n = 99;
    const char *res = strstr(r.out, "result:");
    cr_assert(res && (sscanf(strstr(res, " after ") ? strstr(res, " after ") : "", " after %zu", &n)
                      == 1), "stdout: %s", r.out);
    cr_expect(n >= 1 && n <= 4, "%zu candidates (one per search): %s", n, r.out);
    cr_expect_eq(tmp_list(&d, NULL, 0), 0, "--no-store wrote a file");
    cli_free(&r);
    static const char *const bad[] = {"0", "-1", "x", "1e3", "1000001"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
        r = cli_run("tune", "--candidates", bad[i]);
        cr_expect_eq(r.status, 2, "--candidates %s", bad[i]);
        assert_one_line(&r, "clmha tune: --candidates", bad[i], "1 to 1000000", NULL);
        cli_free(&r);
    }
    r = cli_run("tune", "--candidates", "1", "--candidates", "2");
    cr_expect_eq(r.status, 2);
    assert_one_line(&r, "clmha tune: --candidates given twice", NULL);
    cli_free(&r);
    tmp_remove(&d);
}

Test(cli_devices, lists_every_spec) {
    cli_result r = cli_run("devices");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    size_t count = 0;
    cr_assert_eq(clmha_device_count(&count), CLMHA_SUCCESS);
    if (count == 0) {
        cr_assert(strstr(r.out, "no OpenCL device") != NULL, "stdout: %s", r.out);
        cli_free(&r);
        cr_skip_test("no OpenCL device");
    }
    clmha_device_info *all = calloc(count, sizeof *all);
    cr_assert(all != NULL);
    for (size_t i = 0; i < count; ++i) {
        all[i].struct_size = sizeof all[i];
        cr_assert_eq(clmha_device_describe(i, &all[i]), CLMHA_SUCCESS);
    }
    for (size_t i = 0; i < count; ++i) {
        char spec[48];
        snprintf(spec, sizeof spec, "[%s]", all[i].spec);
        cr_assert(strchr(all[i].spec, ':') != NULL, "spec %s", all[i].spec);
        cr_assert(strstr(r.out, spec) != NULL, "stdout lacks %s: %s", spec, r.out);
        cr_assert(strstr(r.out, all[i].device_name) != NULL);
    }
    cr_assert(strstr(r.out, "compute units") && strstr(r.out, "fp64") &&
              strstr(r.out, "driver"));
    free(all);
    cli_free(&r);
}

Test(cli_demo, writes_heatmap_png) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = tmp_make();
    const char *png = tmp_file(&d, "h.png");
    cli_result r = cli_run("demo", "--heatmap", png);
    cr_assert_eq(r.status, 0, "stdout: %s\nstderr: %s", r.out, r.err);
    cr_assert(strstr(r.out, "PASS") != NULL, "stdout: %s", r.out);
    cr_assert(strstr(r.out, "batch item 1, keys 40 to 47 padding") != NULL, "stdout: %s", r.out);
    size_t size = 0;
    char *bytes = read_file(png, &size);
    cr_assert(bytes != NULL, "%s was not written", png);
    cr_assert_gt(size, 8);
    cr_assert(memcmp(bytes, "\x89PNG\r\n\x1a\n", 8) == 0, "no PNG signature");
    free(bytes);
    cli_free(&r);
    tmp_remove(&d);
}

Test(cli_demo, heatmap_into_missing_folder) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = tmp_make();
    cli_result r = cli_run("demo", "--heatmap", tmp_file(&d, "nofolder/h.png"));
    cr_assert_eq(r.status, 1, "stderr: %s", r.err);
    assert_one_line(&r, "clmha demo: ", "--heatmap", NULL);
    cr_assert_eq(tmp_list(&d, NULL, 0), 0);
    cli_free(&r);
    tmp_remove(&d);
}

// Writes a .safetensors file with header @p json (padded to 8 bytes) followed by @p data_size
// bytes of data, or with the header length field set to @p claimed_len when non-zero.
static void write_st(const char *path, const char *json, size_t data_size, uint64_t claimed_len) {
    size_t len = strlen(json), padded = (len + 7) / 8 * 8;
    size_t size = 8 + padded + data_size;
    unsigned char *buf = calloc(1, size);
    cr_assert(buf != NULL);
    uint64_t field = claimed_len ? claimed_len : padded;
    for (int i = 0; i < 8; ++i) buf[i] = (unsigned char)(field >> (8 * i));
    memcpy(buf + 8, json, len);
    memset(buf + 8 + len, ' ', padded - len);
    write_bytes(path, buf, size);
    free(buf);
}

// Malformed layer files are refused by `clmha run` with exit 1, one line naming --layer and the
// file, and no output file.
Test(cli_refused, malformed_layer_files) {
    SKIP_WITHOUT_DEVICE();
    // A valid layer E = 4, H = 2 needs in_proj_weight (12, 4) and out_proj.weight (4, 4): 64
    // floats = 256 bytes. Each row breaks one thing.
#define W "\"in_proj_weight\":{\"dtype\":\"F32\",\"shape\":[12,4],\"data_offsets\":[0,192]}"
#define O "\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[192,256]}"
    static const struct {
        const char *what, *json;
        size_t data;
        uint64_t claimed_len;
    } rows[] = {
        {"truncated data", "{\"__metadata__\":{\"num_heads\":\"2\"}," W "," O "}", 100, 0},
        {"header length past the end", "{\"__metadata__\":{\"num_heads\":\"2\"}," W "," O "}",
         256, 1u << 20},
        {"header not JSON", "{\"__metadata__\":{\"num_heads\":\"2\"}," W "," O, 256, 0},
        {"data offsets past the end",
         "{\"__metadata__\":{\"num_heads\":\"2\"}," W ",\"out_proj.weight\":{\"dtype\":\"F32\","
         "\"shape\":[4,4],\"data_offsets\":[192,9999]}}",
         256, 0},
        {"shape disagrees with bytes",
         "{\"__metadata__\":{\"num_heads\":\"2\"}," W ",\"out_proj.weight\":{\"dtype\":\"F32\","
         "\"shape\":[4,5],\"data_offsets\":[192,256]}}",
         256, 0},
        {"unsupported dtype",
         "{\"__metadata__\":{\"num_heads\":\"2\"}," W ",\"out_proj.weight\":{\"dtype\":\"I32\","
         "\"shape\":[4,4],\"data_offsets\":[192,256]}}",
         256, 0},
        {"missing num_heads", "{" W "," O "}", 256, 0},
        {"non-numeric num_heads", "{\"__metadata__\":{\"num_heads\":\"two\"}," W "," O "}", 256, 0},
        {"num_heads not dividing E", "{\"__metadata__\":{\"num_heads\":\"3\"}," W "," O "}", 256,
         0},
        {"window not LEFT,RIGHT",
         "{\"__metadata__\":{\"num_heads\":\"2\",\"window\":\"-2,0\"}," W "," O "}", 256, 0},
        {"negative softcap",
         "{\"__metadata__\":{\"num_heads\":\"2\",\"softcap\":\"-1\"}," W "," O "}", 256, 0},
        {"alibi not a boolean",
         "{\"__metadata__\":{\"num_heads\":\"2\",\"alibi\":\"yes\"}," W "," O "}", 256, 0},
        {"sinks not (num_heads)",
         "{\"__metadata__\":{\"num_heads\":\"2\"}," W "," O ",\"sinks\":{\"dtype\":\"F32\","
         "\"shape\":[3],\"data_offsets\":[256,268]}}",
         268, 0},
        {"dimensions overflow",
         "{\"__metadata__\":{\"num_heads\":\"2\"}," W ",\"out_proj.weight\":{\"dtype\":\"F32\","
         "\"shape\":[4294967296,4294967296],\"data_offsets\":[192,256]}}",
         256, 0},
    };
#undef W
#undef O
    tmp_dir d = make_inputs();
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; ++i) {
        cr_log_info("malformed layer file: %s", rows[i].what);
        write_st(tmp_file(&d, "bad.safetensors"), rows[i].json, rows[i].data,
                 rows[i].claimed_len);
        EXPECT_REFUSED(&d, 3, "--layer", "bad.safetensors", "run", "--layer",
                       tmp_file(&d, "bad.safetensors"), "--query", tmp_file(&d, "q.npy"),
                       "--output", tmp_file(&d, "o.npy"));
    }
    tmp_remove(&d);
}

// ---- files: what is read, what is replaced, what a failure leaves ------------------------------

// The bytes of @p path (NULL when it cannot be read), with its size in *size.
static char *slurp(const char *path, size_t *size) { return read_file(path, size); }

// @p path holds exactly @p want (@p want_size bytes).
static void assert_same_bytes(const char *path, const char *want, size_t want_size) {
    size_t size = 0;
    char *got = slurp(path, &size);
    cr_assert(got != NULL, "%s is gone", path);
    cr_assert(size == want_size && memcmp(got, want, size) == 0, "%s was changed", path);
    free(got);
}

// `clmha run` with a preloaded rename() that fails onto w.npy: the first output (o.npy, which
// existed) was renamed already when the second rename fails; the failed run must put o.npy back
// as it was and leave no new file.
Test(cli_files, failed_second_rename_keeps_the_old_output) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    const char *o = tmp_file(&d, "o.npy");
    write_bytes(o, "old output", 10);
    cli_fail_rename = "/w.npy";
    cli_result r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                           tmp_file(&d, "q.npy"), "--output", o, "--weights-output",
                           tmp_file(&d, "w.npy"));
    cli_fail_rename = NULL;
    cr_assert_eq(r.status, 1, "exit status %d; stderr: %s", r.status, r.err);
    assert_one_line(&r, "clmha run: ", "--weights-output", "w.npy", NULL);
    assert_same_bytes(o, "old output", 10);
    char names[1024];
    cr_assert_eq(tmp_list(&d, names, sizeof names), 3, "files: %s", names);
    cli_free(&r);
    tmp_remove(&d);
}

// The same, with --output naming a new file: it must not be left behind.
Test(cli_files, failed_second_rename_leaves_no_new_file) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    const char *w = tmp_file(&d, "w.npy");
    write_bytes(w, "old weights", 11);
    cli_fail_rename = "/w.npy";
    cli_result r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                           tmp_file(&d, "q.npy"), "--output", tmp_file(&d, "o.npy"),
                           "--weights-output", w);
    cli_fail_rename = NULL;
    cr_assert_eq(r.status, 1, "exit status %d; stderr: %s", r.status, r.err);
    assert_same_bytes(w, "old weights", 11);
    cr_assert(!file_exists(tmp_file(&d, "o.npy")), "o.npy was left behind");
    char names[1024];
    cr_assert_eq(tmp_list(&d, names, sizeof names), 3, "files: %s", names);
    cli_free(&r);
    tmp_remove(&d);
}

// One file spelled twice ("o.npy" and "./o.npy"), an output that names an input, an output
// hard-linked to an input: refused before any work (exit 2), every file as it was.
Test(cli_files, outputs_that_are_the_same_file_or_an_input) {
    tmp_dir d = make_inputs();
    const char *o = tmp_file(&d, "o.npy"), *q = tmp_file(&d, "q.npy");
    write_bytes(o, "old output", 10);
    size_t q_size = 0;
    char *q_bytes = slurp(q, &q_size);
    cr_assert(q_bytes != NULL);
    char o2[CLI_PATH_SIZE], q2[CLI_PATH_SIZE];
    snprintf(o2, sizeof o2, "%s/./o.npy", d.path);
    snprintf(q2, sizeof q2, "%s/../%s/q.npy", d.path, strrchr(d.path, '/') + 1);
    cr_assert_eq(link(q, tmp_file(&d, "q-link.npy")), 0);
    const char *layer = tmp_file(&d, "layer.safetensors");
    const char *const cases[][8] = {
        {"--output", o, "--weights-output", o2},
        {"--output", q2},
        {"--output", o, "--weights-output", q},
        {"--output", tmp_file(&d, "q-link.npy")},
        {"--weights-output", layer},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        const char *args[16] = {"run", "--layer", layer, "--query", q};
        size_t n = 5;
        for (size_t k = 0; k < 8 && cases[i][k]; ++k) args[n++] = cases[i][k];
        cli_result r = cli_run_argv(args);
        cr_expect_eq(r.status, 2, "case %zu: exit status %d; stderr: %s", i, r.status, r.err);
        assert_one_line(&r, "clmha run: ", "--", NULL);
        cli_free(&r);
        assert_same_bytes(o, "old output", 10);
        assert_same_bytes(q, q_bytes, q_size);
        cr_assert_eq(tmp_list(&d, NULL, 0), 4, "case %zu left a file", i);
    }
    free(q_bytes);
    tmp_remove(&d);
}

// A FIFO without a writer, /dev/zero and /dev/null as inputs: refused at once (exit 1, a line
// naming the option and what the file is), instead of hanging or reading without end.
Test(cli_files, special_files_as_inputs_are_refused_at_once) {
    tmp_dir d = make_inputs();
    const char *fifo = tmp_file(&d, "fifo");
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    const char *layer = tmp_file(&d, "layer.safetensors"), *q = tmp_file(&d, "q.npy");
    const char *const cases[][8] = {
        {"run", "--layer", fifo, "--query", q},
        {"run", "--layer", layer, "--query", fifo},
        {"run", "--layer", layer, "--query", q, "--key", fifo},
        {"run", "--layer", layer, "--query", q, "--attn-mask", fifo},
        {"run", "--layer", layer, "--query", "/dev/zero"},
        {"run", "--layer", layer, "--query", "/dev/null"},
        {"bench", "--layer", fifo},
    };
    const char *const want[] = {"FIFO", "FIFO", "FIFO", "FIFO", "character device",
                                "character device", "FIFO"};
    unsigned saved = cli_alarm_s;
    cli_alarm_s = 20;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        cli_result r = cli_run_argv(cases[i]);
        cr_expect_eq(r.status, 1, "case %zu: exit status %d; stderr: %s", i, r.status, r.err);
        cr_expect(strstr(r.err, want[i]) != NULL, "case %zu: stderr: %s", i, r.err);
        cli_free(&r);
    }
    cli_alarm_s = saved;
    cr_assert_eq(tmp_list(&d, NULL, 0), 3);
    tmp_remove(&d);
}

// Outputs that exist but are no regular file (a FIFO, a symbolic link to /dev/null, to the
// program's stdout, to a regular file) are refused before any work and left as they are.
Test(cli_files, special_files_as_outputs_are_left_alone) {
    tmp_dir d = make_inputs();
    const char *fifo = tmp_file(&d, "fifo");
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    cr_assert_eq(symlink("/dev/null", tmp_file(&d, "to-null")), 0);
    cr_assert_eq(symlink("/proc/self/fd/1", tmp_file(&d, "to-stdout")), 0);
    write_bytes(tmp_file(&d, "file"), "x", 1);
    cr_assert_eq(symlink("file", tmp_file(&d, "to-file")), 0);
    const char *names[] = {"fifo", "to-null", "to-stdout", "to-file"};
    const char *layer = tmp_file(&d, "layer.safetensors"), *q = tmp_file(&d, "q.npy");
    unsigned saved = cli_alarm_s;
    cli_alarm_s = 60;
    for (size_t i = 0; i < 4; ++i)
        for (int weights = 0; weights < 2; ++weights) {
            const char *out = tmp_file(&d, names[i]);
            cli_result r = weights ? cli_run("run", "--layer", layer, "--query", q,
                                             "--weights-output", out)
                                   : cli_run("run", "--layer", layer, "--query", q, "--output",
                                             out);
            cr_expect_eq(r.status, 1, "%s: exit status %d; stderr: %s", names[i], r.status,
                         r.err);
            cr_expect(strstr(r.err, i == 0 ? "FIFO" : "symbolic link") != NULL, "stderr: %s",
                      r.err);
            cr_expect(strstr(r.out, "output:") == NULL, "the forward pass ran: %s", r.out);
            struct stat st;
            cr_assert_eq(lstat(out, &st), 0, "%s is gone", names[i]);
            cr_expect(i == 0 ? S_ISFIFO(st.st_mode) : S_ISLNK(st.st_mode), "%s was replaced",
                      names[i]);
            cli_free(&r);
        }
    cli_alarm_s = saved;
    assert_same_bytes(tmp_file(&d, "file"), "x", 1);
    cr_assert_eq(tmp_list(&d, NULL, 0), 7);
    tmp_remove(&d);
}

// `demo --heatmap` onto a FIFO: refused before any work, the FIFO left as it is.
Test(cli_files, heatmap_onto_a_fifo_is_refused) {
    tmp_dir d = tmp_make();
    const char *fifo = tmp_file(&d, "h.png");
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    cli_result r = cli_run("demo", "--heatmap", fifo);
    cr_assert_eq(r.status, 1, "stderr: %s", r.err);
    assert_one_line(&r, "clmha demo: ", "--heatmap", "FIFO", NULL);
    struct stat st;
    cr_assert(lstat(fifo, &st) == 0 && S_ISFIFO(st.st_mode));
    cli_free(&r);
    tmp_remove(&d);
}

// A legal 255-byte file name is written (the temporary file has a short name of its own); a
// 256-byte one is refused before the forward pass.
Test(cli_files, longest_file_name) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    char name[258];
    memset(name, 'a', 255);
    memcpy(name + 251, ".npy", 5);
    cli_result r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                           tmp_file(&d, "q.npy"), "--output", tmp_file(&d, name));
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_assert(file_exists(tmp_file(&d, name)));
    cli_free(&r);
    memset(name, 'b', 256);
    memcpy(name + 252, ".npy", 5);
    r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                tmp_file(&d, "q.npy"), "--output", tmp_file(&d, name), "--device", "no-such-device");
    cr_assert_eq(r.status, 1, "stderr: %s", r.err);
    assert_one_line(&r, "clmha run: ", "--output", "File name too long", NULL);
    cli_free(&r);
    cr_assert_eq(tmp_list(&d, NULL, 0), 3);
    tmp_remove(&d);
}

// ---- stdout that cannot be written ---------------------------------------------------------------

// With stdout on a full disk (/dev/full), a command whose result goes to stdout fails (exit 1)
// with a message on stderr instead of exiting 0.
static void expect_stdout_failure(const char *const *args) {
    cli_stdout_to = "/dev/full";
    cli_result r = cli_run_argv(args);
    cli_stdout_to = NULL;
    cr_expect_eq(r.status, 1, "clmha %s %s: exit status %d; stderr: %s", args[0],
                 args[1] ? args[1] : "", r.status, r.err);
    cr_expect(strstr(r.err, "stdout") != NULL, "clmha %s: stderr: %s", args[0], r.err);
    cli_free(&r);
}

#define EXPECT_STDOUT_FAILURE(...) expect_stdout_failure((const char *const[]){__VA_ARGS__, NULL})

Test(cli_stdout, full_disk_without_device) {
    EXPECT_STDOUT_FAILURE("--help");
    EXPECT_STDOUT_FAILURE("--version");
    EXPECT_STDOUT_FAILURE("run", "--help");
    EXPECT_STDOUT_FAILURE("bench", "--help");
    EXPECT_STDOUT_FAILURE("devices");
}

Test(cli_stdout, full_disk_with_device) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    EXPECT_STDOUT_FAILURE("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                          tmp_file(&d, "q.npy"));
    EXPECT_STDOUT_FAILURE("bench", "--json", "--embed", "8", "--heads", "2", "--batch", "1",
                          "--tgt-len", "2", "--repeat", "1");
    EXPECT_STDOUT_FAILURE("demo");
    cr_assert_eq(tmp_list(&d, NULL, 0), 2);
    tmp_remove(&d);
}

// ---- honest limits -------------------------------------------------------------------------------

// bench --embed 4096 needs 256 MiB of parameters: not "out of host memory". Its parameters are
// made before the device opens, so a missing device is what is reported; a size that cannot be
// allocated is reported with its size.
Test(cli_bench, embed_limit_is_honest) {
    cli_result r = cli_run("bench", "--embed", "4096", "--device", "no-such-device");
    cr_assert_eq(r.status, 1, "stderr: %s", r.err);
    assert_one_line(&r, "clmha bench: ", "--device", NULL);
    cr_assert(strstr(r.err, "memory") == NULL, "stderr: %s", r.err);
    cli_free(&r);
    r = cli_run("bench", "--embed", "16777216", "--device", "no-such-device");
    cr_assert_eq(r.status, 1, "stderr: %s", r.err);
    assert_one_line(&r, "clmha bench: ", "--embed 16777216", "cannot allocate",
                    "1125899973951488 floats", NULL);
    cli_free(&r);
}

// --embed 2056 (above the old false limit of 4*E^2 <= 2^24 floats, E <= 2048) runs.
Test(cli_bench, embed_above_2048_runs) {
    SKIP_WITHOUT_DEVICE();
    cli_result r = cli_run("bench", "--embed", "2056", "--heads", "8", "--batch", "1",
                           "--tgt-len", "1", "--repeat", "1", "--json");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_assert(strstr(r.out, "\"embed_dim\": 2056") != NULL, "stdout: %s", r.out);
    cli_free(&r);
}

// bench --layer F --prefix P --heads H: one attention module of a model's checkpoint (no
// num_heads metadata), as `clmha run --prefix` loads it; without the prefix the whole model's
// file is refused as run refuses it; --prefix alone is a usage error.
Test(cli_bench, layer_prefix) {
    SKIP_WITHOUT_DEVICE();
    char model[1024];
    snprintf(model, sizeof model, "%s/cli/model_prefix/layer.safetensors", CLMHA_TEST_DATA_DIR);
    cli_result r = cli_run("bench", "--layer", model, "--prefix", "encoder.layers.1.self_attn",
                           "--heads", "4", "--batch", "1", "--tgt-len", "3", "--repeat", "1",
                           "--json");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_assert(strstr(r.out, "\"num_heads\": 4") != NULL, "stdout: %s", r.out);
    cli_free(&r);
    r = cli_run("bench", "--layer", model, "--batch", "1", "--tgt-len", "3", "--repeat", "1");
    cr_assert_eq(r.status, 1, "stderr: %s", r.err);
    assert_one_line(&r, "clmha bench: --layer ", "needs a prefix", NULL);
    cli_free(&r);
    r = cli_run("bench", "--prefix", "encoder.", "--repeat", "1");
    cr_assert_eq(r.status, 2, "stderr: %s", r.err);
    assert_one_line(&r, "clmha bench: --prefix goes with --layer", NULL);
    cli_free(&r);
}

// The number after "key": in one JSON line (NAN when the key is not there).
static double json_number(const char *line, const char *key) {
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\": ", key);
    const char *p = strstr(line, pattern);
    if (!p) return NAN;
    char *end;
    double v = strtod(p + strlen(pattern), &end);
    return end == p + strlen(pattern) ? NAN : v;  // null
}

// bench --backward: one JSON line per shape (self- and cross-attention) with the step's, the
// forward's and the backward's times; the FLOPs follow the convention of the help (forward
// P + A, backward 2 P + 2.5 A) and the memory fields add up.
Test(cli_bench, backward_json) {
    SKIP_WITHOUT_DEVICE();
    cli_result r = cli_run("bench", "--backward", "--json", "--embed", "16", "--heads", "2",
                           "--batch", "2", "--tgt-len", "5", "--src-len", "5,7", "--repeat", "2");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    const char *line = r.out;
    for (int i = 0; i < 2; ++i) {
        const char *end = strchr(line, '\n');
        cr_assert(end != NULL, "stdout: %s", r.out);
        char one[4096];
        size_t len = (size_t)(end - line);
        if (len > sizeof one - 1) len = sizeof one - 1;
        memcpy(one, line, len);
        one[len] = '\0';
        cr_expect(strstr(one, "\"backward\": true") != NULL, "%s", one);
        const char *kind = i ? "\"attention\": \"cross\"" : "\"attention\": \"self\"";
        cr_expect(strstr(one, kind) != NULL, "%s", one);
        double p = json_number(one, "projection_flops"), a = json_number(one, "attention_flops");
        double s = i ? 7 : 5;
        cr_expect_eq(p, 2.0 * 2 * 16 * (5 * 16 + s * 16 + s * 16 + 5 * 16), "%s", one);
        cr_expect_eq(a, 4.0 * 2 * 5 * s * 16, "%s", one);
        cr_expect_eq(json_number(one, "forward_flops"), p + a, "%s", one);
        cr_expect_eq(json_number(one, "backward_flops"), 2 * p + 2.5 * a, "%s", one);
        cr_expect_eq(json_number(one, "flops"), 3 * p + 3.5 * a, "%s", one);
        const char *positive[] = {"ms", "forward_ms", "backward_ms", "gflops", "scratch_bytes",
                                  "saved_bytes"};
        for (size_t k = 0; k < sizeof positive / sizeof positive[0]; ++k)
            cr_expect_gt(json_number(one, positive[k]), 0.0, "%s: %s", positive[k], one);
        cr_expect_eq(json_number(one, "training_scratch_bytes"),
                     json_number(one, "scratch_bytes") + json_number(one, "saved_bytes"), "%s",
                     one);
        line = end + 1;
    }
    cr_expect_eq(*line, '\0', "stdout: %s", r.out);
    cli_free(&r);
}

// ---- NaN and Inf ---------------------------------------------------------------------------------

// NaN in the query, float64 values beyond float32's range: exit 0 (as PyTorch) with one warning
// line naming the input; finite inputs give no warning.
Test(cli_nonfinite, warning_names_the_input) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    float x[3 * 2 * 8];
    uint32_t state = 5;
    for (size_t i = 0; i < 48; ++i) x[i] = pseudo(&state);
    x[5] = NAN;
    write_npy_raw(tmp_file(&d, "qnan.npy"), "<f4", 3, (size_t[]){3, 2, 8}, x, sizeof x);
    double big[3 * 2 * 8];
    for (size_t i = 0; i < 48; ++i) big[i] = 0.5;
    big[7] = 1e300;
    write_npy_raw(tmp_file(&d, "qbig.npy"), "<f8", 3, (size_t[]){3, 2, 8}, big, sizeof big);
    const char *layer = tmp_file(&d, "layer.safetensors");
    cli_result r = cli_run("run", "--layer", layer, "--query", tmp_file(&d, "qnan.npy"),
                           "--output", tmp_file(&d, "o.npy"));
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    assert_one_line(&r, "clmha run: warning: ", "NaN", "--query", "qnan.npy", NULL);
    cli_free(&r);
    r = cli_run("run", "--layer", layer, "--query", tmp_file(&d, "qbig.npy"));
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    assert_one_line(&r, "clmha run: warning: ", "--query", "qbig.npy", "float64",
                    "beyond float32", NULL);
    cli_free(&r);
    r = cli_run("run", "--layer", layer, "--query", tmp_file(&d, "q.npy"));
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_assert_str_empty(r.err);
    cli_free(&r);
    tmp_remove(&d);
}


// ---- gradients: refusals, all-or-none files, dropout replay ------------------------------------

// --grads-dir that is a regular file or does not exist: exit 1 before any work, one line naming
// --grads-dir, nothing written (not even --output).
Test(cli_grads, grads_dir_not_a_folder) {
    tmp_dir d = make_inputs();
    write_f32_shape(tmp_file(&d, "g.npy"), 3, 2, 8);
    write_bytes(tmp_file(&d, "file"), "x", 1);
    const char *layer = tmp_file(&d, "layer.safetensors"), *q = tmp_file(&d, "q.npy");
    EXPECT_REFUSED(&d, 4, "--grads-dir", "file", "run", "--layer", layer, "--query", q,
                   "--grad-output", tmp_file(&d, "g.npy"), "--grads-dir", tmp_file(&d, "file"),
                   "--output", tmp_file(&d, "o.npy"));
    EXPECT_REFUSED(&d, 4, "--grads-dir", "absent", "run", "--layer", layer, "--query", q,
                   "--grad-output", tmp_file(&d, "g.npy"), "--grads-dir",
                   tmp_file(&d, "absent"), "--output", tmp_file(&d, "o.npy"));
    assert_same_bytes(tmp_file(&d, "file"), "x", 1);
    tmp_remove(&d);
}

// Options that do not go together: usage errors (exit 2), one line naming them.
Test(cli_grads, option_combinations_are_usage_errors) {
    tmp_dir d = make_inputs();
    write_f32_shape(tmp_file(&d, "g.npy"), 3, 2, 8);
    write_f32_shape(tmp_file(&d, "gw.npy"), 2, 3, 3);
    const char *layer = tmp_file(&d, "layer.safetensors"), *q = tmp_file(&d, "q.npy");
    const char *g = tmp_file(&d, "g.npy"), *gw = tmp_file(&d, "gw.npy");
    EXPECT_USAGE("clmha run: --grad-weights needs --need-weights", "run", "--layer", layer,
                 "--query", q, "--grad-output", g, "--grad-weights", gw, "--grads-dir", d.path);
    EXPECT_USAGE("clmha run: --grad-output needs --grads-dir", "run", "--layer", layer,
                 "--query", q, "--grad-output", g);
    EXPECT_USAGE("clmha run: --grads-dir needs --grad-output", "run", "--layer", layer,
                 "--query", q, "--grads-dir", d.path);
    EXPECT_USAGE("clmha run: --grad-weights needs --grad-output", "run", "--layer", layer,
                 "--query", q, "--need-weights", "--grad-weights", gw);
    EXPECT_USAGE("clmha run: --seed and --offset need --training", "run", "--layer", layer,
                 "--query", q, "--seed", "3");
    EXPECT_USAGE("clmha run: --offset '-1'", "run", "--layer", layer, "--query", q,
                 "--training", "--offset=-1");
    cr_assert_eq(tmp_list(&d, NULL, 0), 4);
    tmp_remove(&d);
}

// A gradient of the wrong shape: exit 1 naming the file and both shapes, nothing written.
Test(cli_grads, gradient_of_the_wrong_shape) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    write_f32_shape(tmp_file(&d, "g.npy"), 3, 2, 8);
    write_f32_shape(tmp_file(&d, "g_bad.npy"), 3, 8, 2);
    write_f32_shape(tmp_file(&d, "gw_bad.npy"), 2, 3, 4);
    const char *layer = tmp_file(&d, "layer.safetensors"), *q = tmp_file(&d, "q.npy");
    EXPECT_REFUSED(&d, 5, "--grad-output", "(3, 8, 2)", "run", "--layer", layer, "--query", q,
                   "--grad-output", tmp_file(&d, "g_bad.npy"), "--grads-dir", d.path,
                   "--output", tmp_file(&d, "o.npy"));
    EXPECT_REFUSED(&d, 5, "--grad-weights", "(2, 3, 3)", "run", "--layer", layer, "--query", q,
                   "--need-weights", "--grad-output", tmp_file(&d, "g.npy"), "--grad-weights",
                   tmp_file(&d, "gw_bad.npy"), "--grads-dir", d.path);
    tmp_remove(&d);
}

// A gradient file that would overwrite an input (the query read from DIR/query.npy): refused
// before the forward pass (exit 2), every file as it was.
Test(cli_grads, gradient_file_naming_an_input) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    write_f32_shape(tmp_file(&d, "query.npy"), 3, 2, 8);
    write_f32_shape(tmp_file(&d, "g.npy"), 3, 2, 8);
    size_t size = 0;
    char *before = slurp(tmp_file(&d, "query.npy"), &size);
    cli_result r = cli_run("run", "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                           tmp_file(&d, "query.npy"), "--grad-output", tmp_file(&d, "g.npy"),
                           "--grads-dir", d.path);
    cr_assert_eq(r.status, 2, "exit status %d; stderr: %s", r.status, r.err);
    assert_one_line(&r, "clmha run: ", "--grads-dir", "query.npy", "names the input --query",
                    NULL);
    assert_same_bytes(tmp_file(&d, "query.npy"), before, size);
    cr_assert_eq(tmp_list(&d, NULL, 0), 4);
    free(before);
    cli_free(&r);
    tmp_remove(&d);
}

// The files a self-attention layer with bias gets, in PyTorch's shapes; a rename that fails on
// the last gradient file leaves the old --output as it was and no gradient file behind.
Test(cli_grads, files_all_or_none) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    const char *g = tmp_file(&d, "g.npy"), *o = tmp_file(&d, "o.npy");
    write_f32_shape(g, 3, 2, 8);
    cr_assert_eq(mkdir(tmp_file(&d, "sub"), 0700), 0);
    char grads_dir[CLI_PATH_SIZE];
    snprintf(grads_dir, sizeof grads_dir, "%s/sub", d.path);
    const char *layer = tmp_file(&d, "layer.safetensors"), *q = tmp_file(&d, "q.npy");
    write_bytes(o, "old output", 10);
    cli_fail_rename = "/out_proj.bias.npy";
    cli_result r = cli_run("run", "--layer", layer, "--query", q, "--grad-output", g,
                           "--grads-dir", grads_dir, "--output", o);
    cli_fail_rename = NULL;
    cr_assert_eq(r.status, 1, "exit status %d; stderr: %s", r.status, r.err);
    assert_one_line(&r, "clmha run: ", "--grads-dir", "out_proj.bias.npy", "as it was", NULL);
    cli_free(&r);
    assert_same_bytes(o, "old output", 10);
    char names[1024];
    cr_assert_eq(tmpdir_list(grads_dir, names, sizeof names), 0, "left behind: %s", names);

    r = cli_run("run", "--layer", layer, "--query", q, "--grad-output", g, "--grads-dir",
                grads_dir, "--output", o);
    cr_assert_eq(r.status, 0, "exit status %d; stderr: %s", r.status, r.err);
    cli_free(&r);
    static const struct {
        const char *name;
        size_t ndim, shape[3];
    } want[] = {{"query.npy", 3, {3, 2, 8}},    {"in_proj_weight.npy", 2, {24, 8}},
                {"in_proj_bias.npy", 1, {24}},  {"out_proj.weight.npy", 2, {8, 8}},
                {"out_proj.bias.npy", 1, {8}}};
    cr_assert_eq(tmpdir_list(grads_dir, names, sizeof names), 5, "files: %s", names);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; ++i) {
        char path[CLI_PATH_SIZE + 64];
        snprintf(path, sizeof path, "%s/%s", grads_dir, want[i].name);
        clmha__npy a = {0};
        read_npy(path, &a);
        cr_expect_eq(a.ndim, want[i].ndim, "%s", want[i].name);
        for (size_t k = 0; k < a.ndim && k < 3; ++k)
            cr_expect_eq(a.shape[k], want[i].shape[k], "%s", want[i].name);
        clmha__npy_free(&a);
    }
    tmpdir_remove(grads_dir);
    tmp_remove(&d);
}

// --training with the layer's dropout (tests/cli/dropout_eval: p = 0.5): the same seed gives the
// same output and gradients, byte for byte; another seed another output.
Test(cli_grads, training_dropout_is_replayed) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = tmp_make();
    char layer[CLI_PATH_SIZE], q[CLI_PATH_SIZE];
    snprintf(layer, sizeof layer, "%s/cli/dropout_eval/layer.safetensors", CLMHA_TEST_DATA_DIR);
    snprintf(q, sizeof q, "%s/cli/dropout_eval/query.npy", CLMHA_TEST_DATA_DIR);
    clmha__npy qa = {0};
    read_npy(q, &qa);
    write_f32(tmp_file(&d, "g.npy"), qa.ndim, qa.shape);
    clmha__npy_free(&qa);
    const char *seeds[] = {"7", "7", "8"};
    char *out[3], *grad[3];
    size_t out_size[3], grad_size[3];
    for (int i = 0; i < 3; ++i) {
        cli_result r = cli_run("run", "--layer", layer, "--query", q, "--training", "--seed",
                               seeds[i], "--offset", "2", "--grad-output", tmp_file(&d, "g.npy"),
                               "--grads-dir", d.path, "--output", tmp_file(&d, "o.npy"));
        cr_assert_eq(r.status, 0, "exit status %d; stderr: %s", r.status, r.err);
        cli_free(&r);
        out[i] = slurp(tmp_file(&d, "o.npy"), &out_size[i]);
        grad[i] = slurp(tmp_file(&d, "in_proj_weight.npy"), &grad_size[i]);
        cr_assert(out[i] && grad[i]);
    }
    cr_expect(out_size[0] == out_size[1] && memcmp(out[0], out[1], out_size[0]) == 0);
    cr_expect(grad_size[0] == grad_size[1] && memcmp(grad[0], grad[1], grad_size[0]) == 0);
    cr_expect(out_size[0] == out_size[2] && memcmp(out[0], out[2], out_size[0]) != 0,
              "another seed gave the same output");
    for (int i = 0; i < 3; ++i) free(out[i]), free(grad[i]);
    tmp_remove(&d);
}

// bench --causal --window LEFT,RIGHT: the call's is_causal and the layer's window in the JSON
// line (null without a window), the attention FLOPs over the (query, key) pairs they allow
// (L = S = 9, window (2, 0) and is_causal: 1 + 2 + 7 * 3 = 24 pairs), forward and training
// step; a window goes with a random layer, LEFT,RIGHT each -1 or at least 0, not with --decode.
Test(cli_bench, window_json) {
    SKIP_WITHOUT_DEVICE();
    double p = 2.0 * 16 * (4 * 9 * 16), a = 4.0 * 24 * 16;
    cli_result r = cli_run("bench", "--json", "--embed", "16", "--heads", "2", "--batch", "1",
                           "--tgt-len", "9", "--causal", "--window", "2,0", "--repeat", "1");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_expect(strstr(r.out, "\"is_causal\": true, \"window_left\": 2, \"window_right\": 0"),
              "%s", r.out);
    cr_expect(strstr(r.out, "\"impl\": \"fused\""), "%s", r.out);
    cr_expect_eq(json_number(r.out, "flops"), p + a, "%s", r.out);
    cli_free(&r);
    r = cli_run("bench", "--json", "--backward", "--embed", "16", "--heads", "2", "--batch", "1",
                "--tgt-len", "9", "--causal", "--window", "2,0", "--repeat", "1");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_expect_eq(json_number(r.out, "attention_flops"), a, "%s", r.out);
    cr_expect_eq(json_number(r.out, "projection_flops"), p, "%s", r.out);
    cli_free(&r);
    r = cli_run("bench", "--json", "--embed", "16", "--heads", "2", "--batch", "1",
                "--tgt-len", "9", "--repeat", "1");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_expect(strstr(r.out, "\"is_causal\": false, \"window_left\": null, "
                            "\"window_right\": null"),
              "%s", r.out);
    cr_expect_eq(json_number(r.out, "flops"), p + 4.0 * 81 * 16, "%s", r.out);
    cli_free(&r);
    EXPECT_USAGE("clmha bench: --window '3'", "bench", "--window", "3");
    EXPECT_USAGE("clmha bench: --window '-2,0'", "bench", "--window", "-2,0");
    EXPECT_USAGE("clmha bench: --window goes with a random layer", "bench", "--window", "1,1",
                 "--layer", "x.safetensors");
    EXPECT_USAGE("clmha bench: --decode takes", "bench", "--decode", "--cache-len", "8",
                 "--causal");
}

// bench --decode: one JSON line per cache length with the step's time, the bytes of cached keys
// and values it reads (2 N H (S + 1) D 4) and their rate, the copy bandwidth and the ratio.
// --dtype: the call's tensors counted in the dtype's bytes (query, output: N L E each; the
// weights off); a 16-bit decode step (--decode) and training step (--backward).
Test(cli_bench, dtype_json) {
    SKIP_WITHOUT_DEVICE();
    const char *dtypes[] = {"f32", "f16", "bf16"};
    const char *names[] = {"\"dtype\": \"float32\"", "\"dtype\": \"float16\"",
                           "\"dtype\": \"bfloat16\""};
    for (int i = 0; i < 3; ++i) {
        cli_result r = cli_run("bench", "--json", "--dtype", dtypes[i], "--embed", "16",
                               "--heads", "2", "--batch", "2", "--tgt-len", "5", "--repeat", "2");
        cr_assert_eq(r.status, 0, "--dtype %s: stderr: %s", dtypes[i], r.err);
        cr_expect(strstr(r.out, names[i]) != NULL, "%s", r.out);
        double bytes = 2.0 * 2 * 5 * 16 * (i ? 2 : 4);
        cr_expect_eq(json_number(r.out, "io_bytes"), bytes, "--dtype %s: %s", dtypes[i], r.out);
        double ms = json_number(r.out, "ms"), gbps = json_number(r.out, "io_gbps");
        cr_expect(fabs(gbps - bytes / ms / 1e6) <= 1e-3 * gbps, "%s", r.out);
        cli_free(&r);
    }
    // A 16-bit layer's decode step: its cache of the default kind holds floats (4 bytes a
    // value: K and V of 2 sequences, 2 heads of 8, 21 tokens).
    cli_result d = cli_run("bench", "--json", "--decode", "--dtype", "f16", "--cache-len", "20",
                           "--embed", "16", "--heads", "2", "--batch", "2", "--repeat", "2");
    cr_assert_eq(d.status, 0, "stderr: %s", d.err);
    cr_expect(strstr(d.out, "\"dtype\": \"float16\"") != NULL, "%s", d.out);
    cr_expect_eq(json_number(d.out, "kv_bytes"), 5376.0, "%s", d.out);
    cli_free(&d);
    EXPECT_USAGE("clmha bench: ", "bench", "--dtype", "half");
    // A 16-bit training step: its JSON names the dtype.
    cli_result r = cli_run("bench", "--json", "--backward", "--dtype", "bf16", "--embed", "16",
                           "--heads", "2", "--batch", "2", "--tgt-len", "5", "--repeat", "2");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_expect(strstr(r.out, "\"dtype\": \"bfloat16\"") != NULL, "%s", r.out);
    cr_expect(json_number(r.out, "backward_ms") > 0.0, "%s", r.out);
    cli_free(&r);
}

// bench --host: the host-array calls timed ("host": true; without it false): the forward with
// and without weights and in a 16-bit dtype, and the training step; refused with --decode.
Test(cli_bench, host_json) {
    SKIP_WITHOUT_DEVICE();
    const char *const extra[][3] = {{"--dtype", "f32", NULL},
                                    {"--need-weights", "--src-len", "7"},
                                    {"--dtype", "bf16", NULL}};
    for (int i = 0; i < 3; ++i) {
        cli_result r = cli_run("bench", "--json", "--host", "--embed", "16", "--heads", "2",
                               "--batch", "2", "--tgt-len", "5", "--repeat", "2", extra[i][0],
                               extra[i][1], extra[i][2]);
        cr_assert_eq(r.status, 0, "case %d: stderr: %s", i, r.err);
        cr_expect(strstr(r.out, "\"host\": true") != NULL, "case %d: %s", i, r.out);
        cr_expect_gt(json_number(r.out, "ms"), 0.0, "case %d: %s", i, r.out);
        cli_free(&r);
    }
    cli_result r = cli_run("bench", "--json", "--embed", "16", "--heads", "2", "--batch", "1",
                           "--tgt-len", "3", "--repeat", "1");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_expect(strstr(r.out, "\"host\": false") != NULL, "%s", r.out);
    cli_free(&r);
    // The training step on host arrays: cross-attention (S != L) with every gradient read back.
    r = cli_run("bench", "--json", "--host", "--backward", "--embed", "16", "--heads", "2",
                "--batch", "2", "--tgt-len", "5", "--src-len", "3", "--repeat", "2");
    cr_assert_eq(r.status, 0, "--backward: stderr: %s", r.err);
    cr_expect(strstr(r.out, "\"host\": true") != NULL, "%s", r.out);
    cr_expect(strstr(r.out, "\"backward\": true") != NULL, "%s", r.out);
    cr_expect_gt(json_number(r.out, "backward_ms"), 0.0, "%s", r.out);
    cli_free(&r);
    EXPECT_USAGE("clmha bench: --host times the forward pass or the training step", "bench",
                 "--host", "--decode", "--cache-len", "8");
}

// bench --dtype f64 (the default layer, E 512, 8 heads): a float64 random layer on float64
// buffers; its tensors (query and output, N L E each, self-attention without weights) are
// counted in 8-byte elements, and the FLOPs are the help's 8 N L E^2 + 4 N L^2 E.
Test(cli_bench, dtype_f64_json) {
    SKIP_WITHOUT_FP64();
    cli_result r = cli_run("bench", "--dtype", "f64", "--batch", "1", "--tgt-len", "8",
                           "--repeat", "1", "--json");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_expect(strstr(r.out, "\"dtype\": \"float64\"") != NULL, "%s", r.out);
    cr_expect(strstr(r.out, "\"attention\": \"self\"") != NULL, "%s", r.out);
    double n = 1, l = 8, e = 512, bytes = 2 * n * l * e * 8;
    double flops = 8 * n * l * e * e + 4 * n * l * l * e;
    cr_expect_eq(json_number(r.out, "io_bytes"), bytes, "%s", r.out);
    cr_expect_eq(json_number(r.out, "flops"), flops, "%s", r.out);
    double ms = json_number(r.out, "ms"), gflops = json_number(r.out, "gflops");
    double gbps = json_number(r.out, "io_gbps");
    cr_expect_gt(ms, 0.0, "%s", r.out);
    cr_expect(fabs(gflops - flops / ms / 1e6) <= 1e-3 * gflops, "%s", r.out);
    cr_expect(fabs(gbps - bytes / ms / 1e6) <= 1e-3 * gbps, "%s", r.out);
    cr_expect_gt(json_number(r.out, "scratch_bytes"), 0.0, "%s", r.out);
    cli_free(&r);
}

Test(cli_bench, decode_json) {
    SKIP_WITHOUT_DEVICE();
    cli_result r = cli_run("bench", "--decode", "--json", "--embed", "16", "--heads", "2",
                           "--batch", "2", "--cache-len", "5,40", "--repeat", "2");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    const char *line = r.out;
    size_t lens[2] = {5, 40};
    for (int i = 0; i < 2; ++i) {
        const char *end = strchr(line, '\n');
        cr_assert(end != NULL, "stdout: %s", r.out);
        char one[4096];
        size_t len = (size_t)(end - line);
        if (len > sizeof one - 1) len = sizeof one - 1;
        memcpy(one, line, len);
        one[len] = '\0';
        cr_expect(strstr(one, "\"decode\": true") != NULL, "%s", one);
        cr_expect_eq(json_number(one, "cache_len"), (double)lens[i], "%s", one);
        cr_expect_eq(json_number(one, "kv_bytes"), 2.0 * 2 * 2 * (lens[i] + 1) * 8 * 4, "%s",
                     one);
        double ms = json_number(one, "ms"), gbps = json_number(one, "kv_gbps");
        cr_expect_gt(ms, 0.0, "%s", one);
        cr_expect(fabs(gbps - json_number(one, "kv_bytes") / ms / 1e6) <= 1e-3 * gbps, "%s", one);
        cr_expect_gt(json_number(one, "copy_gbps"), 0.0, "%s", one);
        cr_expect(fabs(json_number(one, "fraction_of_copy") -
                       gbps / json_number(one, "copy_gbps")) <= 1e-3,
                  "%s", one);
        line = end + 1;
    }
    cr_expect_eq(*line, '\0', "stdout: %s", r.out);
    cli_free(&r);
}

Test(cli_usage, decode_chunk) {
    EXPECT_USAGE("clmha run: --decode-chunk 0: expected a positive", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--decode-chunk", "0");
    EXPECT_USAGE("clmha run: --decode-chunk does not go with weights", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--decode-chunk", "2", "--need-weights");
    EXPECT_USAGE("clmha run: --decode-chunk does not go with masks", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--decode-chunk", "2", "--attn-mask",
                 "a.npy");
    EXPECT_USAGE("clmha run: --decode-chunk does not go with --is-causal with --key", "run",
                 "--layer", "l.safetensors", "--query", "q.npy", "--key", "k.npy",
                 "--is-causal", "--decode-chunk", "2");
    EXPECT_USAGE("clmha run: --decode-chunk does not go with --impl", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--decode-chunk", "2", "--impl", "fused");
}

// --window LEFT,RIGHT: a value that is not two bounds (each -1 or 0..2^63-1) is a usage error of
// `run` and `sdpa` alike, naming the option and the value, before any file is read.
Test(cli_usage, window) {
    static const char *const bad[] = {"abc", "-2,0", "0,-2", "5",    "1,2,3", ",1",
                                      "1,",  "1, 0", "+1,0", "-0,0", "1.5,0",
                                      "9223372036854775808,0", "0,18446744073709551616"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; ++i) {
        char want[128];
        snprintf(want, sizeof want, "clmha run: --window '%s': expected LEFT,RIGHT", bad[i]);
        EXPECT_USAGE(want, "run", "--layer", "l.safetensors", "--query", "q.npy", "--window",
                     bad[i]);
        snprintf(want, sizeof want, "clmha sdpa: --window '%s': expected LEFT,RIGHT", bad[i]);
        EXPECT_USAGE(want, "sdpa", "--query", "q.npy", "--key", "k.npy", "--value", "v.npy",
                     "--window", bad[i]);
    }
    EXPECT_USAGE("clmha run: --window needs a non-empty value", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--window=");
    EXPECT_USAGE("clmha sdpa: --window given twice", "sdpa", "--query", "q.npy", "--key",
                 "k.npy", "--value", "v.npy", "--window", "1,0", "--window", "2,0");
}

// --decode-chunk without --is-causal puts the later calls' queries at the end of the cache: a
// window (--window or the layer file's) would not be the one-shot call's, so it is refused.
Test(cli_refused, window_decode_chunk_not_causal) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    EXPECT_REFUSED(&d, 2, "--decode-chunk without --is-causal", "--window", "run", "--layer",
                   tmp_file(&d, "layer.safetensors"), "--query", tmp_file(&d, "q.npy"),
                   "--window", "1,0", "--decode-chunk", "2", "--output", tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

// ALiBi sees the queries' positions, which the later calls of --decode-chunk without
// --is-causal put at the end of the cache: refused, from --alibi and from the layer file.
Test(cli_refused, alibi_decode_chunk_not_causal) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    EXPECT_REFUSED(&d, 2, "--decode-chunk without --is-causal", "--alibi", "run", "--layer",
                   tmp_file(&d, "layer.safetensors"), "--query", tmp_file(&d, "q.npy"),
                   "--alibi", "--decode-chunk", "2", "--output", tmp_file(&d, "o.npy"));
    double p[LF_COUNT] = {0};
    write_layer_meta(tmp_file(&d, "layer.safetensors"), p, true, ",\"alibi\":\"true\"", NULL);
    EXPECT_REFUSED(&d, 2, "--decode-chunk without --is-causal", "the layer file's alibi", "run",
                   "--layer", tmp_file(&d, "layer.safetensors"), "--query",
                   tmp_file(&d, "q.npy"), "--softcap", "2", "--decode-chunk", "2", "--output",
                   tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

// --softcap C: 0 or a positive finite number, else a usage error of `run`, `sdpa` and `bench`
// alike, naming the option and the value, before any file is read; --alibi-slopes needs
// --alibi; bench's go with a random layer.
Test(cli_usage, softcap_alibi) {
    static const char *const bad[] = {"-1",    "-0.5", "nan",    "NaN", "inf", "-inf",
                                      "abc",   " 2",   "+2",     "2x",  "1,5", "1e999",
                                      "1e-400", "0x",  "infinity"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; ++i) {
        char want[128];
        snprintf(want, sizeof want, "clmha run: --softcap '%s': expected 0 (off) or a positive "
                 "finite number", bad[i]);
        EXPECT_USAGE(want, "run", "--layer", "l.safetensors", "--query", "q.npy", "--softcap",
                     bad[i]);
        snprintf(want, sizeof want, "clmha sdpa: --softcap '%s': expected 0", bad[i]);
        EXPECT_USAGE(want, "sdpa", "--query", "q.npy", "--key", "k.npy", "--value", "v.npy",
                     "--softcap", bad[i]);
        snprintf(want, sizeof want, "clmha bench: --softcap '%s': expected 0", bad[i]);
        EXPECT_USAGE(want, "bench", "--softcap", bad[i]);
    }
    EXPECT_USAGE("clmha run: --softcap needs a non-empty value", "run", "--layer",
                 "l.safetensors", "--query", "q.npy", "--softcap=");
    EXPECT_USAGE("clmha sdpa: --softcap given twice", "sdpa", "--query", "q.npy", "--key",
                 "k.npy", "--value", "v.npy", "--softcap", "1", "--softcap", "2");
    EXPECT_USAGE("clmha sdpa: --alibi-slopes needs --alibi", "sdpa", "--query", "q.npy",
                 "--key", "k.npy", "--value", "v.npy", "--alibi-slopes", "s.npy");
    EXPECT_USAGE("clmha bench: --softcap goes with a random layer", "bench", "--softcap", "2",
                 "--layer", "x.safetensors");
    EXPECT_USAGE("clmha bench: --alibi goes with a random layer", "bench", "--alibi", "--layer",
                 "x.safetensors");
    EXPECT_USAGE("clmha bench: --sinks goes with a random layer", "bench", "--sinks", "--layer",
                 "x.safetensors");
    EXPECT_USAGE("clmha bench: --decode takes", "bench", "--decode", "--cache-len", "8",
                 "--alibi", "--causal");
}

// bench --softcap C --alibi --sinks: the random layer's softcap, alibi and sinks in the JSON
// line (softcap 0, alibi and sinks false without them), for the forward pass, the training step
// and the decode step.
Test(cli_bench, score_variants_json) {
    SKIP_WITHOUT_DEVICE();
    const char *const modes[][4] = {{"--tgt-len", "9", NULL, NULL},
                                    {"--tgt-len", "9", "--backward", NULL},
                                    {"--decode", "--cache-len", "8", NULL}};
    for (int m = 0; m < 3; ++m)
        for (int on = 0; on < 2; ++on) {
            const char *argv[24] = {"bench", "--json", "--embed", "16", "--heads", "4",
                                    "--batch", "1", "--repeat", "1"};
            size_t argc = 10;
            for (int k = 0; k < 4 && modes[m][k]; ++k) argv[argc++] = modes[m][k];
            if (on)
                argv[argc++] = "--softcap", argv[argc++] = "2.5", argv[argc++] = "--alibi",
                argv[argc++] = "--sinks";
            argv[argc] = NULL;
            cli_result r = cli_run_argv(argv);
            cr_assert_eq(r.status, 0, "mode %d: stderr: %s", m, r.err);
            cr_expect_eq(json_number(r.out, "softcap"), on ? 2.5 : 0.0, "%s", r.out);
            cr_expect(strstr(r.out, on ? "\"alibi\": true" : "\"alibi\": false") != NULL, "%s",
                      r.out);
            cr_expect(strstr(r.out, on ? "\"sinks\": true" : "\"sinks\": false") != NULL, "%s",
                      r.out);
            cli_free(&r);
        }
    cli_result r = cli_run("bench", "--embed", "16", "--heads", "4", "--batch", "1",
                           "--tgt-len", "5", "--repeat", "1", "--softcap", "30", "--alibi",
                           "--sinks");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_expect(strstr(r.out, ", softcap 30, alibi, sinks (random)") != NULL, "%s", r.out);
    cli_free(&r);
}

// bench --decode --kv-heads: a grouped-query layer; the step reads its key/value heads only.
Test(cli_bench, decode_kv_heads) {
    SKIP_WITHOUT_DEVICE();
    cli_result r = cli_run("bench", "--decode", "--json", "--embed", "16", "--heads", "4",
                           "--kv-heads", "1", "--batch", "2", "--cache-len", "9", "--repeat", "2");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_expect_eq(json_number(r.out, "kv_heads"), 1.0, "%s", r.out);
    cr_expect_eq(json_number(r.out, "kv_bytes"), 2.0 * 2 * 1 * 10 * 4 * 4, "%s", r.out);
    cli_free(&r);
    EXPECT_USAGE("clmha bench: --kv-heads 3 does not divide --heads 4", "bench", "--decode",
                 "--cache-len", "8", "--heads", "4", "--embed", "16", "--kv-heads", "3");
    EXPECT_USAGE("clmha bench: --kv-heads goes with --decode", "bench", "--kv-heads", "2");
}

// --window LEFT,RIGHT: a windowed layer's step reads the LEFT + 1 latest tokens' keys and
// values (kv_bytes), the bounds in the JSON line; malformed bounds are refused.
Test(cli_bench, decode_window) {
    SKIP_WITHOUT_DEVICE();
    cli_result r = cli_run("bench", "--decode", "--json", "--embed", "16", "--heads", "4",
                           "--kv-heads", "2", "--cache-len", "40", "--batch", "1", "--window",
                           "7,0", "--repeat", "2");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_expect_eq(json_number(r.out, "window_left"), 7.0, "%s", r.out);
    cr_expect_eq(json_number(r.out, "window_right"), 0.0, "%s", r.out);
    cr_expect_eq(json_number(r.out, "kv_bytes"), 2.0 * 1 * 2 * 8 * 4 * 4, "%s", r.out);
    cli_free(&r);
    EXPECT_USAGE("clmha bench: --window '3': expected LEFT,RIGHT", "bench", "--decode",
                 "--cache-len", "8", "--window", "3");
    EXPECT_USAGE("clmha bench: --window '-2,0'", "bench", "--decode", "--cache-len", "8",
                 "--window", "-2,0");
    EXPECT_USAGE("clmha bench: --window '1,2,3'", "bench", "--window", "1,2,3");
}

Test(cli_usage, bench_decode) {
    EXPECT_USAGE("clmha bench: --decode needs --cache-len", "bench", "--decode");
    EXPECT_USAGE("clmha bench: --cache-len goes with --decode", "bench", "--cache-len", "8");
    EXPECT_USAGE("clmha bench: --decode takes", "bench", "--decode", "--cache-len", "8",
                 "--backward");
    EXPECT_USAGE("clmha bench: --decode takes", "bench", "--decode", "--cache-len", "8",
                 "--tgt-len", "4");
    EXPECT_USAGE("clmha bench: --cache-len", "bench", "--decode", "--cache-len", "0");
}

// ---- clmha sdpa: the PyTorch cases of tests/cli/sdpa_cases.inc, refusals, options -------------

// The case names, written by tools/make_cli_cases.py next to the case folders.
static const char *const sdpa_case_names[] = {
#include "cli/sdpa_cases.inc"
    NULL};
#define SDPA_NUM_CASES (sizeof sdpa_case_names / sizeof *sdpa_case_names - 1)
// Max abs error of the output, log-sum-exp and weights against PyTorch's float64 values (no
// projections here: float32 rounding of one attention, some 2e-7 on PoCL).
#define SDPA_TOL 1e-5

ParameterizedTestParameters(cli_sdpa, cases) {
    return case_params("cli_sdpa", sdpa_case_names, SDPA_NUM_CASES);
}

Test(cli_sdpa, cases_listed) {
    cr_assert_gt(SDPA_NUM_CASES, 0, "tests/cli/sdpa_cases.inc lists no case");
}

// Max abs difference of the file @p got_path against the case's float64 @p want_file.
static double sdpa_file_error(const char *dir, const char *want_file, const char *got_path,
                              const char *what) {
    char want_path[CLI_PATH_SIZE];
    snprintf(want_path, sizeof want_path, "%s/%s", dir, want_file);
    clmha__npy got = {0}, want = {0};
    read_npy(got_path, &got);
    read_npy(want_path, &want);
    double err = npy_max_abs_diff(&got, &want, want_file, what);
    clmha__npy_free(&got);
    clmha__npy_free(&want);
    return err;
}

// One run of a case: the output (and the log-sum-exp, the weights when @p lse, @p weights) within
// SDPA_TOL of PyTorch's, the gradients (when @p grads_dir) as compare_grads() checks them; one
// line of errors on stderr.
static void sdpa_check_run(const char *dir, const char *what, const char *const *argv,
                           const tmp_dir *out, bool lse, bool weights, const char *grads_dir) {
    cli_result r = cli_run_argv(argv);
    cr_assert_eq(r.status, 0, "%s: exit status %d; stderr: %s", what, r.status, r.err);
    cli_free(&r);
    double y = sdpa_file_error(dir, "expected_output.npy", tmp_file(out, "out.npy"), what);
    double l = lse ? sdpa_file_error(dir, "expected_lse.npy", tmp_file(out, "lse.npy"), what)
                   : -1;
    double w = weights ? sdpa_file_error(dir, "expected_weights.npy", tmp_file(out, "w.npy"), what)
                       : -1;
    double g = -1;
    size_t files = 0;
    if (grads_dir) g = compare_grads(dir, grads_dir, what, &files);
    fprintf(stderr, "cli_sdpa %s out_maxabs=%.3e lse_maxabs=%.3e w_maxabs=%.3e grads=%zu "
            "grad_maxnorm=%.3e\n", what, y, l, w, files, g);
    cr_expect_leq(y, SDPA_TOL, "%s: output max abs error %.3e", what, y);
    cr_expect_leq(l, SDPA_TOL, "%s: log-sum-exp max abs error %.3e", what, l);
    cr_expect_leq(w, SDPA_TOL, "%s: weights max abs error %.3e", what, w);
    if (grads_dir) {  // empty again for the next run
        tmpdir_remove(grads_dir);
        cr_assert_eq(mkdir(grads_dir, 0700), 0);
    }
}

// Every case through `clmha sdpa` (the inputs present, the flags of `args`, --lse-output and
// --weights-output where the case has their expected files, the gradients where it has
// grad_output.npy), then again with the other forward core (--impl unfused, or fused for a
// case with weights; no log-sum-exp, which only the fused core writes). A case decoded through
// a KV cache (--kv-cache-prefix P in `args`, whose expected output is the one-shot call's) runs
// again as one call, without --kv-cache-prefix (the decode core takes no --impl).
ParameterizedTest(struct cli_param *param, cli_sdpa, cases) {
    const char *name = param->name;
    SKIP_WITHOUT_DEVICE();
    char dir[CLI_PATH_SIZE / 2];
    snprintf(dir, sizeof dir, "%s/cli/%s", CLMHA_TEST_DATA_DIR, name);
    tmp_dir out = tmp_make();
    static char paths[7][CLI_PATH_SIZE];
    static const char *const inputs[][2] = {{"--query", "query.npy"},
                                            {"--key", "key.npy"},
                                            {"--value", "value.npy"},
                                            {"--attn-mask", "attn_mask.npy"},
                                            {"--grad-output", "grad_output.npy"},
                                            {"--alibi-slopes", "alibi_slopes.npy"},
                                            {"--sinks", "sinks.npy"}};
    const char *argv[CLI_MAX_ARGS + 1] = {"sdpa"};
    size_t argc = 1;
    for (size_t i = 0; i < 7; ++i) {
        snprintf(paths[i], CLI_PATH_SIZE, "%s/%s", dir, inputs[i][1]);
        if (i < 3) cr_assert(file_exists(paths[i]), "%s: %s is missing", name, paths[i]);
        if (!file_exists(paths[i])) continue;
        argv[argc++] = inputs[i][0];
        argv[argc++] = paths[i];
    }
    char args_path[CLI_PATH_SIZE], lse_path[CLI_PATH_SIZE], w_path[CLI_PATH_SIZE];
    snprintf(args_path, sizeof args_path, "%s/args", dir);
    snprintf(lse_path, sizeof lse_path, "%s/expected_lse.npy", dir);
    snprintf(w_path, sizeof w_path, "%s/expected_weights.npy", dir);
    bool lse = file_exists(lse_path), weights = file_exists(w_path);
    char *extra = read_file(args_path, NULL), *extra_text = read_file(args_path, NULL);
    cr_assert(extra && extra_text, "%s: no args file", name);
    size_t kv_at = 0;  // where --kv-cache-prefix P is in argv, if it is
    for (char *tok = strtok(extra, " \t\r\n"); tok; tok = strtok(NULL, " \t\r\n")) {
        cr_assert_lt(argc, CLI_MAX_ARGS - 12, "%s: too many arguments", name);
        if (strcmp(tok, "--kv-cache-prefix") == 0) kv_at = argc;
        argv[argc++] = tok;
    }
    char grads_dir[CLI_PATH_SIZE];
    snprintf(grads_dir, sizeof grads_dir, "%s/grads", out.path);
    bool grads = file_exists(paths[4]);
    if (grads) {
        cr_assert_eq(mkdir(grads_dir, 0700), 0);
        argv[argc++] = "--grads-dir";
        argv[argc++] = grads_dir;
    }
    argv[argc++] = "--output";
    argv[argc++] = tmp_file(&out, "out.npy");
    size_t common = argc;  // the arguments both runs share
    if (lse) argv[argc++] = "--lse-output", argv[argc++] = tmp_file(&out, "lse.npy");
    if (weights) argv[argc++] = "--weights-output", argv[argc++] = tmp_file(&out, "w.npy");
    argv[argc] = NULL;
    sdpa_check_run(dir, name, argv, &out, lse, weights, grads ? grads_dir : NULL);

    const char *other = weights ? "fused" : "unfused";
    char what[CLI_MAX_NAME + 48];
    snprintf(what, sizeof what, "%s%s --impl %s", name, kv_at ? " in one call" : "", other);
    if (kv_at) {  // without --kv-cache-prefix P
        memmove(&argv[kv_at], &argv[kv_at + 2], (common - kv_at - 2) * sizeof *argv);
        common -= 2;
    }
    argc = common;
    // The unfused core writes the log-sum-exp rows too: its run checks them as well.
    bool lse2 = lse && !weights && !kv_at;
    if (lse2) argv[argc++] = "--lse-output", argv[argc++] = tmp_file(&out, "lse.npy");
    argv[argc++] = "--impl";
    argv[argc++] = other;
    argv[argc] = NULL;
    sdpa_check_run(dir, what, argv, &out, lse2, false, grads ? grads_dir : NULL);
    free(extra);
    free(extra_text);
    tmp_remove(&out);
}

// Runs `clmha sdpa` with @p args: exit @p status, stderr one line "clmha sdpa: ..." naming
// @p want1 and @p want2 (NULL: nothing more), and @p files entries in @p d afterwards (no output
// written).
static void sdpa_expect(int status, const tmp_dir *d, size_t files, const char *want1,
                        const char *want2, const char *const *args) {
    cli_result r = cli_run_argv(args);
    cr_assert_eq(r.status, status, "exit status %d (want %d); stderr: %s", r.status, status,
                 r.err);
    assert_one_line(&r, "clmha sdpa: ", want1, want2, NULL);
    char names[1024];
    size_t count = tmp_list(d, names, sizeof names);
    cr_assert_eq(count, files, "files in %s: %s", d->path, names);
    cr_log_info("refused as expected: %s", r.err);
    cli_free(&r);
}

#define SDPA_EXPECT(status, d, files, want1, want2, ...)                                        \
    sdpa_expect(status, d, files, want1, want2, (const char *const[]){"sdpa", __VA_ARGS__, NULL})

// A folder with q.npy (2, 4, 5, 8), k.npy and v.npy (2, 2, 6, 8), g.npy (2, 4, 5, 8): 4 files.
static tmp_dir make_sdpa_inputs(void) {
    tmp_dir d = tmp_make();
    write_f32_shape(tmp_file(&d, "q.npy"), 2, 4, 5, 8);
    write_f32_shape(tmp_file(&d, "k.npy"), 2, 2, 6, 8);
    write_f32_shape(tmp_file(&d, "v.npy"), 2, 2, 6, 8);
    write_f32_shape(tmp_file(&d, "g.npy"), 2, 4, 5, 8);
    return d;
}

// --alibi-slopes: a file of H float slopes; another shape is refused (exit 1) naming the file.
Test(cli_sdpa, alibi_slopes_refused) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_sdpa_inputs();
    const char *q = tmp_file(&d, "q.npy"), *k = tmp_file(&d, "k.npy"), *v = tmp_file(&d, "v.npy");
    const char *s3 = tmp_file(&d, "s3.npy"), *s2d = tmp_file(&d, "s2d.npy");
    const char *o = tmp_file(&d, "o.npy");
    write_f32_shape(s3, 3);
    write_f32_shape(s2d, 1, 4);
    SDPA_EXPECT(1, &d, 6, "--alibi-slopes", "alibi_slopes must be (H) = (4)", "--query", q,
                "--key", k, "--value", v, "--enable-gqa", "--alibi", "--alibi-slopes", s3,
                "--output", o);
    SDPA_EXPECT(1, &d, 6, "--alibi-slopes", "takes 1 (H) dimensions", "--query", q, "--key", k,
                "--value", v, "--enable-gqa", "--alibi", "--alibi-slopes", s2d, "--output", o);
    tmp_remove(&d);
}

// --sinks: a file of H float logits; another shape or a boolean file is refused (exit 1) naming
// the file.
Test(cli_sdpa, sinks_refused) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_sdpa_inputs();
    const char *q = tmp_file(&d, "q.npy"), *k = tmp_file(&d, "k.npy"), *v = tmp_file(&d, "v.npy");
    const char *s3 = tmp_file(&d, "s3.npy"), *s2d = tmp_file(&d, "s2d.npy");
    const char *sb = tmp_file(&d, "sb.npy"), *o = tmp_file(&d, "o.npy");
    write_f32_shape(s3, 3);
    write_f32_shape(s2d, 1, 4);
    const unsigned char ones[4] = {1, 1, 1, 1};
    write_npy_raw(sb, "|b1", 1, (size_t[]){4}, ones, sizeof ones);
    SDPA_EXPECT(1, &d, 7, "--sinks", "sinks must be (H) = (4)", "--query", q, "--key", k,
                "--value", v, "--enable-gqa", "--sinks", s3, "--output", o);
    SDPA_EXPECT(1, &d, 7, "--sinks", "takes 1 (H) dimensions", "--query", q, "--key", k,
                "--value", v, "--enable-gqa", "--sinks", s2d, "--output", o);
    SDPA_EXPECT(1, &d, 7, "--sinks", "is not a float type", "--query", q, "--key", k, "--value",
                v, "--enable-gqa", "--sinks", sb, "--output", o);
    tmp_remove(&d);
}

// Options missing or that do not go together: exit 2, one line naming them, no file written.
Test(cli_sdpa, usage_errors) {
    tmp_dir d = make_sdpa_inputs();
    const char *q = tmp_file(&d, "q.npy"), *k = tmp_file(&d, "k.npy"), *v = tmp_file(&d, "v.npy");
    const char *g = tmp_file(&d, "g.npy"), *o = tmp_file(&d, "o.npy");
    SDPA_EXPECT(2, &d, 4, "--key is required", NULL, "--query", q, "--value", v, "--output", o);
    SDPA_EXPECT(2, &d, 4, "--query, --key and --value are required", NULL, "--output", o);
    SDPA_EXPECT(2, &d, 4, "--grads-dir needs --grad-output", NULL, "--query", q, "--key", k,
                "--value", v, "--grads-dir", d.path);
    SDPA_EXPECT(2, &d, 4, "--grad-output needs --grads-dir", NULL, "--query", q, "--key", k,
                "--value", v, "--grad-output", g);
    SDPA_EXPECT(2, &d, 4, "--is-causal and --attn-mask do not go together", NULL, "--query", q,
                "--key", k, "--value", v, "--is-causal", "--attn-mask", g, "--output", o);
    SDPA_EXPECT(2, &d, 4, "--impl fused cannot give weights", NULL, "--query", q, "--key", k,
                "--value", v, "--impl", "fused", "--weights-output", o);
    SDPA_EXPECT(2, &d, 4, "--scale '0'", "1/sqrt(D)", "--query", q, "--key", k, "--value", v,
                "--scale", "0");
    SDPA_EXPECT(2, &d, 4, "--scale 'inf'", NULL, "--query", q, "--key", k, "--value", v,
                "--scale", "inf");
    SDPA_EXPECT(2, &d, 4, "--layout 'bhld'", "nhld or nlhd", "--query", q, "--key", k,
                "--value", v, "--layout", "bhld");
    SDPA_EXPECT(2, &d, 4, "--dropout-p '1'", "[0, 1)", "--query", q, "--key", k, "--value", v,
                "--dropout-p", "1");
    SDPA_EXPECT(2, &d, 4, "--seed and --offset need --dropout-p", NULL, "--query", q, "--key", k,
                "--value", v, "--seed", "3");
    SDPA_EXPECT(2, &d, 4, "--output", "names the input --query", "--query", q, "--key", k,
                "--value", v, "--output", q);
    SDPA_EXPECT(2, &d, 4, "unknown option '--need-weights'", NULL, "--query", q, "--key", k,
                "--value", v, "--need-weights");
    tmp_remove(&d);
}

// Refused inputs before the device is asked: exit 1, one line naming the option, the file and
// the problem, no file written.
Test(cli_sdpa, refused_files) {
    tmp_dir d = make_sdpa_inputs();
    const char *q = tmp_file(&d, "q.npy"), *k = tmp_file(&d, "k.npy"), *v = tmp_file(&d, "v.npy");
    const char *o = tmp_file(&d, "o.npy");
    write_f32_shape(tmp_file(&d, "q5.npy"), 1, 2, 4, 5, 8);
    write_f32_shape(tmp_file(&d, "q2.npy"), 5, 8);
    unsigned char bytes[2 * 4 * 5 * 8] = {0};
    write_npy_raw(tmp_file(&d, "qb.npy"), "|b1", 4, (size_t[]){2, 4, 5, 8}, bytes, sizeof bytes);
    SDPA_EXPECT(1, &d, 7, "--query", "q5.npy: a 5-D array (1, 2, 4, 5, 8)", "--query",
                tmp_file(&d, "q5.npy"), "--key", k, "--value", v, "--output", o);
    SDPA_EXPECT(1, &d, 7, "--query", "q2.npy: a 2-D array (5, 8)", "--query",
                tmp_file(&d, "q2.npy"), "--key", k, "--value", v, "--output", o);
    SDPA_EXPECT(1, &d, 7, "--query", "qb.npy: dtype '|b1' is not a float type", "--query",
                tmp_file(&d, "qb.npy"), "--key", k, "--value", v, "--output", o);
    SDPA_EXPECT(1, &d, 7, "--key", "absent.npy", "--query", q, "--key",
                tmp_file(&d, "absent.npy"), "--value", v, "--output", o);
    SDPA_EXPECT(1, &d, 7, "--value /dev/null", "not a regular file", "--query", q, "--key", k,
                "--value", "/dev/null", "--output", o);
    SDPA_EXPECT(1, &d, 7, "--output", "does not exist", "--query", q, "--key", k, "--value", v,
                "--output", tmp_file(&d, "no/o.npy"));
    SDPA_EXPECT(1, &d, 7, "--grads-dir", "not a folder", "--query", q, "--key", k, "--value", v,
                "--grad-output", tmp_file(&d, "g.npy"), "--grads-dir", q);
    tmp_remove(&d);
}

// Shapes the library refuses: exit 1, one line naming the input's option and file and the
// library's reason, no file written.
Test(cli_sdpa, refused_shapes) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_sdpa_inputs();
    const char *q = tmp_file(&d, "q.npy"), *k = tmp_file(&d, "k.npy"), *v = tmp_file(&d, "v.npy");
    const char *o = tmp_file(&d, "o.npy");
    write_f32_shape(tmp_file(&d, "k16.npy"), 2, 2, 6, 16);
    write_f32_shape(tmp_file(&d, "v7.npy"), 2, 2, 7, 8);
    write_f32_shape(tmp_file(&d, "m.npy"), 3, 5, 6);
    write_f32_shape(tmp_file(&d, "g_bad.npy"), 2, 4, 5, 7);
    write_f32_shape(tmp_file(&d, "k3.npy"), 2, 6, 8);
    SDPA_EXPECT(1, &d, 9, "--key", "k16.npy: key is (2, 2, 6, 16)", "--query", q, "--key",
                tmp_file(&d, "k16.npy"), "--value", v, "--enable-gqa", "--output", o);
    SDPA_EXPECT(1, &d, 9, "--value", "v7.npy: value is (2, 2, 7, 8)", "--query", q, "--key", k,
                "--value", tmp_file(&d, "v7.npy"), "--enable-gqa", "--output", o);
    SDPA_EXPECT(1, &d, 9, "k.npy: the key and value have 2 heads, the query 4", "(--enable-gqa)",
                "--query", q, "--key", k, "--value", v, "--output", o);
    SDPA_EXPECT(1, &d, 9, "--key", "k3.npy: key is (2, 6, 8) but the query is 4-D", "--query", q,
                "--key", tmp_file(&d, "k3.npy"), "--value", v, "--enable-gqa", "--output", o);
    SDPA_EXPECT(1, &d, 9, "--attn-mask", "m.npy: attn_mask is (3, 5, 6)", "--query", q, "--key",
                k, "--value", v, "--enable-gqa", "--attn-mask", tmp_file(&d, "m.npy"),
                "--output", o);
    SDPA_EXPECT(1, &d, 9, "--grad-output", "shape (2, 4, 5, 7), but the output is (2, 4, 5, 8)",
                "--query", q, "--key", k, "--value", v, "--enable-gqa", "--grad-output",
                tmp_file(&d, "g_bad.npy"), "--grads-dir", d.path, "--output", o);
    // (2, 4, 5, 8) read as (N, L, H, D): 5 query heads, 6 key heads.
    SDPA_EXPECT(1, &d, 9, "--key", "heads must divide the query's 5", "--query", q, "--key", k,
                "--value", v, "--enable-gqa", "--layout", "nlhd", "--output", o);
    tmp_remove(&d);
}

// A copy of the float32 .npy file @p from as float64 ('<f8') at @p to.
static void write_as_f64(const char *from, const char *to) {
    clmha__npy a = {0};
    read_npy(from, &a);
    double *x = malloc(a.count * sizeof *x);
    cr_assert_not_null(x);
    for (size_t i = 0; i < a.count; ++i) x[i] = a.f32[i];
    write_npy_raw(to, "<f8", a.ndim, a.shape, x, a.count * sizeof *x);
    free(x);
    clmha__npy_free(&a);
}

// float64 inputs are read as float32: the same output, byte for byte, as their float32 files
// (the same core: both runs ask for the weights); unbatched inputs get weights (H, L, S) and a
// log-sum-exp (H, L).
Test(cli_sdpa, float64_inputs_and_unbatched_shapes) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = tmp_make();
    char src[3][CLI_PATH_SIZE];
    const char *names[3] = {"query", "key", "value"};
    for (int i = 0; i < 3; ++i) {
        snprintf(src[i], sizeof src[i], "%s/cli/sdpa_unbatched_float_mask_scale/%s.npy",
                 CLMHA_TEST_DATA_DIR, names[i]);
        char to[32];
        snprintf(to, sizeof to, "%s64.npy", names[i]);
        write_as_f64(src[i], tmp_file(&d, to));
    }
    cli_result r = cli_run("sdpa", "--query", src[0], "--key", src[1], "--value", src[2],
                           "--output", tmp_file(&d, "o32.npy"), "--weights-output",
                           tmp_file(&d, "w.npy"));
    cr_assert_eq(r.status, 0, "exit status %d; stderr: %s", r.status, r.err);
    cli_free(&r);
    r = cli_run("sdpa", "--query", tmp_file(&d, "query64.npy"), "--key",
                tmp_file(&d, "key64.npy"), "--value", tmp_file(&d, "value64.npy"), "--output",
                tmp_file(&d, "o64.npy"), "--weights-output", tmp_file(&d, "w64.npy"));
    cr_assert_eq(r.status, 0, "exit status %d; stderr: %s", r.status, r.err);
    cr_assert_str_empty(r.err, "stderr: %s", r.err);
    cli_free(&r);
    r = cli_run("sdpa", "--query", src[0], "--key", src[1], "--value", src[2], "--lse-output",
                tmp_file(&d, "lse.npy"));
    cr_assert_eq(r.status, 0, "exit status %d; stderr: %s", r.status, r.err);
    cli_free(&r);
    size_t n32 = 0, n64 = 0;
    char *o32 = slurp(tmp_file(&d, "o32.npy"), &n32), *o64 = slurp(tmp_file(&d, "o64.npy"), &n64);
    cr_expect(n32 == n64 && memcmp(o32, o64, n32) == 0, "float64 inputs gave another output");
    free(o32);
    free(o64);
    clmha__npy w = {0}, lse = {0};
    read_npy(tmp_file(&d, "w.npy"), &w);
    read_npy(tmp_file(&d, "lse.npy"), &lse);
    cr_expect(w.ndim == 3 && w.shape[0] == 2 && w.shape[1] == 4 && w.shape[2] == 6,
              "weights are %zu-D (%zu, %zu, %zu), want (2, 4, 6)", w.ndim, w.shape[0],
              w.shape[1], w.shape[2]);
    cr_expect(lse.ndim == 2 && lse.shape[0] == 2 && lse.shape[1] == 4,
              "lse is %zu-D (%zu, %zu), want (2, 4)", lse.ndim, lse.shape[0], lse.shape[1]);
    clmha__npy_free(&w);
    clmha__npy_free(&lse);
    tmp_remove(&d);
}

// Largest |a - b| over the largest |b|: the float64 contract's relative error.
static double rel_diff_d(const double *a, const double *b, size_t count) {
    double scale = 0;
    for (size_t i = 0; i < count; ++i) scale = fmax(scale, fabs(b[i]));
    return max_abs_diff_d(a, b, count) / (scale > 0 ? scale : 1);
}

// --dtype f64: '<f8' query, key, value, float mask and output gradient (GQA) read as doubles,
// the output, log-sum-exp rows and gradients written as '<f8', within 1e-12 (relative) of the
// double-precision reference on the same values (floats written as doubles, which the reference
// reads); then values no float holds: the output equals, bit for bit, what
// clmha_attention_forward_host_f64() gives in-process on the same doubles. Usage errors:
// --dtype f16, --dtype f64 with --kv-cache-prefix.
// The double-precision reference of attention call @p a: its output, log-sum-exp rows and,
// for output gradient @p g, the gradients of query, key, value and (grads[3]) the float mask's
// or, with sinks, the sinks'.
static void reference_results(const clmha_attention_args *a, const float *g, double *out,
                              size_t nout, double *lse, size_t nlse, double *const grads[4]) {
    char msg[512];
    cr_assert_eq(clmha_reference_attention(a, out, nout, lse, nlse, NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    clmha_reference_grads r = {.struct_size = sizeof r, .query = grads[0], .key = grads[1],
                               .value = grads[2]};
    if (a->sinks.ndim) r.sinks = grads[3];
    else if (a->attn_mask.kind == CLMHA_MASK_FLOAT) r.attn_mask = grads[3];
    cr_assert_eq(clmha_reference_attention_backward(a, g, &r, msg, sizeof msg), CLMHA_SUCCESS,
                 "%s", msg);
}

Test(cli_sdpa, dtype_f64) {
    SKIP_WITHOUT_FP64();
    tmp_dir d = tmp_make();
    enum { N = 2, H = 4, HKV = 2, L = 5, S = 7, D = 8, NQ = N * H * L * D, NK = N * HKV * S * D,
           NM = L * S, NLSE = N * H * L };
    static float qf[NQ], kf[NK], vf[NK], mf[NM], gf[NQ];
    static double qd[NQ], kd[NK], vd[NK], md[NM], gd[NQ];
    float *f[5] = {qf, kf, vf, mf, gf};
    double *x[5] = {qd, kd, vd, md, gd};
    size_t count[5] = {NQ, NK, NK, NM, NQ};
    uint32_t state = 777u;
    for (int t = 0; t < 5; ++t)
        for (size_t i = 0; i < count[t]; ++i) x[t][i] = f[t][i] = pseudo(&state);
    const size_t q_shape[] = {N, H, L, D}, k_shape[] = {N, HKV, S, D}, m_shape[] = {L, S};
    const size_t *shape[5] = {q_shape, k_shape, k_shape, m_shape, q_shape};
    const size_t ndim[5] = {4, 4, 4, 2, 4};
    static const char *const names[5] = {"q.npy", "k.npy", "v.npy", "m.npy", "g.npy"};
    for (int t = 0; t < 5; ++t)
        write_npy_raw(tmp_file(&d, names[t]), "<f8", ndim[t], shape[t], x[t],
                      count[t] * sizeof(double));
    cli_result r = cli_run("sdpa", "--query", tmp_file(&d, "q.npy"), "--key",
                           tmp_file(&d, "k.npy"), "--value", tmp_file(&d, "v.npy"),
                           "--attn-mask", tmp_file(&d, "m.npy"), "--enable-gqa", "--dtype",
                           "f64", "--output", tmp_file(&d, "o.npy"), "--lse-output",
                           tmp_file(&d, "lse.npy"), "--grad-output", tmp_file(&d, "g.npy"),
                           "--grads-dir", d.path);
    cr_assert_eq(r.status, 0, "exit status %d; stderr: %s", r.status, r.err);
    cr_assert_str_empty(r.err, "stderr: %s", r.err);
    cli_free(&r);
    // The reference, on the floats.
    clmha_attention_args a = {.struct_size = sizeof a, .enable_gqa = true,
                              .query = {.ndim = 4, .shape = {N, H, L, D}, .data = qf},
                              .key = {.ndim = 4, .shape = {N, HKV, S, D}, .data = kf},
                              .value = {.ndim = 4, .shape = {N, HKV, S, D}, .data = vf},
                              .attn_mask = {.kind = CLMHA_MASK_FLOAT,
                                            .tensor = {.ndim = 2, .shape = {L, S}, .data = mf}}};
    static double want_o[NQ], want_lse[NLSE], want_g[4][NQ];
    double *const wg[4] = {want_g[0], want_g[1], want_g[2], want_g[3]};
    reference_results(&a, gf, want_o, NQ, want_lse, NLSE, wg);
    static const char *const outs[6] = {"o.npy",     "lse.npy",   "query.npy",
                                        "key.npy",   "value.npy", "attn_mask.npy"};
    const double *want[6] = {want_o, want_lse, want_g[0], want_g[1], want_g[2], want_g[3]};
    const size_t want_count[6] = {NQ, NLSE, NQ, NK, NK, NM};
    for (int t = 0; t < 6; ++t) {
        clmha__npy got = {0};
        read_npy_f64(tmp_file(&d, outs[t]), &got);
        cr_assert_str_eq(got.dtype, "<f8", "%s", outs[t]);
        cr_assert_eq(got.count, want_count[t], "%s", outs[t]);
        double e = rel_diff_d(got.f64, want[t], want_count[t]);
        fprintf(stderr, "cli sdpa --dtype f64 %s: relative error %.3g\n", outs[t], e);
        cr_expect(e <= 1e-12, "%s: relative error %.3g", outs[t], e);
        clmha__npy_free(&got);
    }
    // Values no float holds: read exactly, as the in-process call reads them.
    for (size_t i = 0; i < NQ; ++i) qd[i] += 1e-9;
    write_npy_raw(tmp_file(&d, "q.npy"), "<f8", 4, q_shape, qd, sizeof qd);
    r = cli_run("sdpa", "--query", tmp_file(&d, "q.npy"), "--key", tmp_file(&d, "k.npy"),
                "--value", tmp_file(&d, "v.npy"), "--attn-mask", tmp_file(&d, "m.npy"),
                "--enable-gqa", "--dtype", "f64", "--output", tmp_file(&d, "o.npy"));
    cr_assert_eq(r.status, 0, "exit status %d; stderr: %s", r.status, r.err);
    cli_free(&r);
    clmha_attention_args b = a;
    b.dtype = CLMHA_DTYPE_F64;
    b.query.data = qd, b.key.data = kd, b.value.data = vd, b.attn_mask.tensor.data = md;
    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_env(&ctx), CLMHA_SUCCESS);
    static double in_process[NQ];
    cr_assert_eq(clmha_attention_forward_host_f64(ctx, &b, in_process, NQ, NULL, 0, NULL, 0),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    clmha_context_release(ctx);
    clmha__npy got = {0};
    read_npy_f64(tmp_file(&d, "o.npy"), &got);
    cr_expect(memcmp(got.f64, in_process, sizeof in_process) == 0,
              "the program's float64 output differs from the in-process call's");
    clmha__npy_free(&got);
    // A dtype the program does not know: a usage error.
    r = cli_run("sdpa", "--query", tmp_file(&d, "q.npy"), "--key", tmp_file(&d, "k.npy"),
                "--value", tmp_file(&d, "v.npy"), "--dtype", "f8");
    cr_expect_eq(r.status, 2, "--dtype f8: exit status %d", r.status);
    cr_expect(strstr(r.err, "--dtype") != NULL, "stderr: %s", r.err);
    cli_free(&r);
    tmp_remove(&d);
}

// The largest ratio of |got - want| to the 16-bit contract r·(|want| + t) + t (t = @p t_rel ·
// (1 + max |want|); r half an ulp of @p dt).
static double ratio_16(clmha_dtype dt, const float *got, const double *want, size_t count,
                       double t_rel) {
    double big = 0, worst = 0, r = dt == CLMHA_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
    for (size_t i = 0; i < count; ++i) big = fmax(big, fabs(want[i]));
    double t = t_rel * (1 + big);
    for (size_t i = 0; i < count; ++i) {
        double e = fabs(got[i] - want[i]) / (r * (fabs(want[i]) + t) + t);
        if (!(e <= worst)) worst = e;  // NaN wins
    }
    return worst;
}

// --dtype f16 and bf16: float16 files ('<f2', exact) or float32 files of bfloat16 values in,
// the call computed as a 16-bit call (float32 inside, results rounded once), the output,
// log-sum-exp rows and gradients written as '<f2' (float16) or float32 files of bfloat16
// values; with attention sinks (their gradient too) and is_causal, GQA. Within the 16-bit
// contract of the double-precision reference on the same 16-bit values.
Test(cli_sdpa, dtype_16_bit) {
    SKIP_WITHOUT_DEVICE();
    enum { N = 2, H = 4, HKV = 2, L = 6, D = 8, NQ = N * H * L * D, NK = N * HKV * L * D,
           NLSE = N * H * L };
    static const clmha_dtype dts[2] = {CLMHA_DTYPE_F16, CLMHA_DTYPE_BF16};
    for (int k = 0; k < 2; ++k) {
        clmha_dtype dt = dts[k];
        tmp_dir d = tmp_make();
        static float qf[NQ], kf[NK], vf[NK], gf[NQ], sf[H];
        float *f[5] = {qf, kf, vf, gf, sf};
        size_t count[5] = {NQ, NK, NK, NQ, H};
        uint32_t state = 91u + (uint32_t)k;
        const size_t q_shape[] = {N, H, L, D}, k_shape[] = {N, HKV, L, D}, s_shape[] = {H};
        const size_t *shape[5] = {q_shape, k_shape, k_shape, q_shape, s_shape};
        const size_t ndim[5] = {4, 4, 4, 4, 1};
        static const char *const names[5] = {"q.npy", "k.npy", "v.npy", "g.npy", "s.npy"};
        static uint16_t bits[NQ];
        for (int t = 0; t < 5; ++t) {
            for (size_t i = 0; i < count[t]; ++i) {
                f[t][i] = clmha__dtype_round(dt, (float)pseudo(&state));
                bits[i] = clmha__f32_to_f16(f[t][i]);
            }
            if (dt == CLMHA_DTYPE_F16)
                write_npy_raw(tmp_file(&d, names[t]), "<f2", ndim[t], shape[t], bits,
                              count[t] * 2);
            else
                write_npy_raw(tmp_file(&d, names[t]), "<f4", ndim[t], shape[t], f[t],
                              count[t] * 4);
        }
        const char *dtn = dt == CLMHA_DTYPE_F16 ? "f16" : "bf16";
        cli_result r = cli_run("sdpa", "--query", tmp_file(&d, "q.npy"), "--key",
                               tmp_file(&d, "k.npy"), "--value", tmp_file(&d, "v.npy"),
                               "--sinks", tmp_file(&d, "s.npy"), "--is-causal", "--enable-gqa",
                               "--dtype", dtn, "--output", tmp_file(&d, "o.npy"),
                               "--lse-output", tmp_file(&d, "lse.npy"), "--grad-output",
                               tmp_file(&d, "g.npy"), "--grads-dir", d.path);
        cr_assert_eq(r.status, 0, "%s: exit status %d; stderr: %s", dtn, r.status, r.err);
        cli_free(&r);
        clmha_attention_args a = {.struct_size = sizeof a, .enable_gqa = true, .is_causal = true,
                                  .query = {.ndim = 4, .shape = {N, H, L, D}, .data = qf},
                                  .key = {.ndim = 4, .shape = {N, HKV, L, D}, .data = kf},
                                  .value = {.ndim = 4, .shape = {N, HKV, L, D}, .data = vf},
                                  .sinks = {.ndim = 1, .shape = {H}, .data = sf}};
        static double want_o[NQ], want_lse[NLSE], want_g[4][NQ];
        double *const wg[4] = {want_g[0], want_g[1], want_g[2], want_g[3]};
        reference_results(&a, gf, want_o, NQ, want_lse, NLSE, wg);
        static const char *const outs[6] = {"o.npy",   "lse.npy",   "query.npy",
                                            "key.npy", "value.npy", "sinks.npy"};
        const double *want[6] = {want_o, want_lse, want_g[0], want_g[1], want_g[2], want_g[3]};
        const size_t want_count[6] = {NQ, NLSE, NQ, NK, NK, H};
        for (int t = 0; t < 6; ++t) {
            clmha__npy got = {0};
            read_npy(tmp_file(&d, outs[t]), &got);
            cr_assert_str_eq(got.dtype, dt == CLMHA_DTYPE_F16 ? "<f2" : "<f4", "%s %s", dtn,
                             outs[t]);
            cr_assert_eq(got.count, want_count[t], "%s", outs[t]);
            for (size_t i = 0; i < got.count; ++i)
                cr_assert_eq(got.f32[i], clmha__dtype_round(dt, got.f32[i]),
                             "%s %s: value %zu is not the dtype's", dtn, outs[t], i);
            double e = ratio_16(dt, got.f32, want[t], want_count[t], t < 2 ? 1e-5 : 1e-4);
            fprintf(stderr, "cli sdpa --dtype %s %s: %.3g of the contract\n", dtn, outs[t], e);
            cr_expect(e <= 1.0, "%s %s: %.3g of the contract", dtn, outs[t], e);
            clmha__npy_free(&got);
        }
        tmp_remove(&d);
    }
}

// --kv-cache-prefix with --dtype f64 and f16: a float64 cache of doubles, a 16-bit call's cache
// of floats; prefix 3 then one token a call, is_causal: the one-shot reference's output, within
// the dtype's contract ('<f8' files within 1e-12; float16 within the 16-bit contract).
Test(cli_sdpa, dtype_kv_cache) {
    SKIP_WITHOUT_DEVICE();
    enum { N = 1, H = 2, L = 7, D = 8, NQ = N * H * L * D };
    static float x[3][NQ];
    uint32_t state = 5u;
    for (int t = 0; t < 3; ++t)
        for (size_t i = 0; i < NQ; ++i) x[t][i] = clmha__f16_to_f32(clmha__f32_to_f16(
                                             (float)pseudo(&state)));  // float16 values
    clmha_attention_args a = {.struct_size = sizeof a, .is_causal = true,
                              .query = {.ndim = 4, .shape = {N, H, L, D}, .data = x[0]},
                              .key = {.ndim = 4, .shape = {N, H, L, D}, .data = x[1]},
                              .value = {.ndim = 4, .shape = {N, H, L, D}, .data = x[2]}};
    static double want[NQ];
    char msg[512];
    cr_assert_eq(clmha_reference_attention(&a, want, NQ, NULL, 0, NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    static const char *const dts[2] = {"f64", "f16"};
    for (int k = device_has_fp64() ? 0 : 1; k < 2; ++k) {
        tmp_dir d = tmp_make();
        static const char *const names[3] = {"q.npy", "k.npy", "v.npy"};
        const size_t shape[4] = {N, H, L, D};
        static double xd[NQ];
        static uint16_t xb[NQ];
        for (int t = 0; t < 3; ++t) {
            for (size_t i = 0; i < NQ; ++i) xd[i] = x[t][i], xb[i] = clmha__f32_to_f16(x[t][i]);
            if (k == 0) write_npy_raw(tmp_file(&d, names[t]), "<f8", 4, shape, xd, sizeof xd);
            else write_npy_raw(tmp_file(&d, names[t]), "<f2", 4, shape, xb, sizeof xb);
        }
        cli_result r = cli_run("sdpa", "--query", tmp_file(&d, "q.npy"), "--key",
                               tmp_file(&d, "k.npy"), "--value", tmp_file(&d, "v.npy"),
                               "--is-causal", "--kv-cache-prefix", "3", "--dtype", dts[k],
                               "--output", tmp_file(&d, "o.npy"));
        cr_assert_eq(r.status, 0, "%s: exit status %d; stderr: %s", dts[k], r.status, r.err);
        cli_free(&r);
        clmha__npy got = {0};
        if (k == 0) {
            read_npy_f64(tmp_file(&d, "o.npy"), &got);
            cr_assert_str_eq(got.dtype, "<f8");
            double e = 0;
            for (size_t i = 0; i < NQ; ++i) e = fmax(e, fabs(got.f64[i] - want[i]));
            fprintf(stderr, "cli sdpa --dtype f64 --kv-cache-prefix 3: max abs error %.3g\n", e);
            cr_expect(e <= 1e-12, "max abs error %.3g", e);
        } else {
            read_npy(tmp_file(&d, "o.npy"), &got);
            cr_assert_str_eq(got.dtype, "<f2");
            double e = ratio_16(CLMHA_DTYPE_F16, got.f32, want, NQ, 1e-5);
            fprintf(stderr, "cli sdpa --dtype f16 --kv-cache-prefix 3: %.3g of the contract\n",
                    e);
            cr_expect(e <= 1.0, "%.3g of the contract", e);
        }
        clmha__npy_free(&got);
        tmp_remove(&d);
    }
}

// --dropout-p: the same seed gives the same output and gradients, byte for byte, another seed
// another output; --dropout-p 0 is no dropout.
Test(cli_sdpa, dropout_is_replayed) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_sdpa_inputs();
    char q[CLI_PATH_SIZE], k[CLI_PATH_SIZE], v[CLI_PATH_SIZE];  // (tmp_file's buffers rotate)
    snprintf(q, sizeof q, "%s", tmp_file(&d, "q.npy"));
    snprintf(k, sizeof k, "%s", tmp_file(&d, "k.npy"));
    snprintf(v, sizeof v, "%s", tmp_file(&d, "v.npy"));
    cr_assert_eq(mkdir(tmp_file(&d, "sub"), 0700), 0);
    const char *p[4] = {"0.3", "0.3", "0.3", "0"}, *seed[4] = {"7", "7", "8", "7"};
    char *out[5], *grad[4];
    size_t out_size[5], grad_size[4];
    for (int i = 0; i < 4; ++i) {
        cli_result r = cli_run("sdpa", "--query", q, "--key", k, "--value", v, "--enable-gqa",
                               "--dropout-p", p[i], "--seed", seed[i], "--offset", "2",
                               "--grad-output", tmp_file(&d, "g.npy"), "--grads-dir",
                               tmp_file(&d, "sub"), "--output", tmp_file(&d, "o.npy"));
        cr_assert_eq(r.status, 0, "exit status %d; stderr: %s", r.status, r.err);
        cli_free(&r);
        out[i] = slurp(tmp_file(&d, "o.npy"), &out_size[i]);
        grad[i] = slurp(tmp_file(&d, "sub/key.npy"), &grad_size[i]);
        cr_assert(out[i] && grad[i]);
    }
    cli_result r = cli_run("sdpa", "--query", q, "--key", k, "--value", v, "--enable-gqa",
                           "--output", tmp_file(&d, "o.npy"));
    cr_assert_eq(r.status, 0, "exit status %d; stderr: %s", r.status, r.err);
    cli_free(&r);
    out[4] = slurp(tmp_file(&d, "o.npy"), &out_size[4]);
    cr_expect(out_size[0] == out_size[1] && memcmp(out[0], out[1], out_size[0]) == 0);
    cr_expect(grad_size[0] == grad_size[1] && memcmp(grad[0], grad[1], grad_size[0]) == 0);
    cr_expect(memcmp(out[0], out[2], out_size[0]) != 0, "another seed gave the same output");
    cr_expect(memcmp(grad[0], grad[2], grad_size[0]) != 0, "another seed gave the same grads");
    cr_expect(memcmp(out[3], out[4], out_size[3]) == 0, "--dropout-p 0 is not no dropout");
    for (int i = 0; i < 4; ++i) free(out[i]), free(grad[i]);
    free(out[4]);
    tmpdir_remove(tmp_file(&d, "sub"));
    tmp_remove(&d);
}

// A rename that fails on the last gradient file leaves the old --output as it was and no
// gradient file behind; then the files in their inputs' shapes; a summary on stdout without
// --output.
Test(cli_sdpa, files_all_or_none) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_sdpa_inputs();
    const char *q = tmp_file(&d, "q.npy"), *k = tmp_file(&d, "k.npy"), *v = tmp_file(&d, "v.npy");
    const char *g = tmp_file(&d, "g.npy"), *o = tmp_file(&d, "o.npy");
    cr_assert_eq(mkdir(tmp_file(&d, "sub"), 0700), 0);
    char sub[CLI_PATH_SIZE];
    snprintf(sub, sizeof sub, "%s/sub", d.path);
    write_bytes(o, "old output", 10);
    cli_fail_rename = "/value.npy";
    cli_result r = cli_run("sdpa", "--query", q, "--key", k, "--value", v, "--enable-gqa",
                           "--grad-output", g, "--grads-dir", sub, "--output", o);
    cli_fail_rename = NULL;
    cr_assert_eq(r.status, 1, "exit status %d; stderr: %s", r.status, r.err);
    assert_one_line(&r, "clmha sdpa: ", "--grads-dir", "value.npy", "as it was", NULL);
    cli_free(&r);
    assert_same_bytes(o, "old output", 10);
    char names[1024];
    cr_assert_eq(tmpdir_list(sub, names, sizeof names), 0, "left behind: %s", names);

    r = cli_run("sdpa", "--query", q, "--key", k, "--value", v, "--enable-gqa", "--grad-output",
                g, "--grads-dir", sub);
    cr_assert_eq(r.status, 0, "exit status %d; stderr: %s", r.status, r.err);
    cr_expect(strstr(r.out, "output:  (2, 4, 5, 8):") != NULL, "stdout: %s", r.out);
    cli_free(&r);
    cr_assert_eq(tmpdir_list(sub, names, sizeof names), 3, "files: %s", names);
    const char *files[3] = {"query.npy", "key.npy", "value.npy"};
    const size_t heads[3] = {4, 2, 2}, rows[3] = {5, 6, 6};
    for (int i = 0; i < 3; ++i) {
        char path[CLI_PATH_SIZE + 64];
        snprintf(path, sizeof path, "%s/%s", sub, files[i]);
        clmha__npy a = {0};
        read_npy(path, &a);
        cr_expect(a.ndim == 4 && a.shape[0] == 2 && a.shape[1] == heads[i] &&
                      a.shape[2] == rows[i] && a.shape[3] == 8,
                  "%s: %zu-D (%zu, %zu, %zu, %zu)", files[i], a.ndim, a.shape[0], a.shape[1],
                  a.shape[2], a.shape[3]);
        clmha__npy_free(&a);
    }
    tmpdir_remove(sub);
    tmp_remove(&d);
}

// --kv-cache-prefix with what calls through a KV cache do not take, P outside [1, S], L != S:
// exit 2, one line naming them, no file written (before any device is opened).
Test(cli_sdpa, kv_cache_usage_errors) {
    tmp_dir d = make_sdpa_inputs();  // q.npy: L = 5; k.npy, v.npy: S = 6
    char q[CLI_PATH_SIZE], k[CLI_PATH_SIZE], v[CLI_PATH_SIZE], g[CLI_PATH_SIZE],
        o[CLI_PATH_SIZE], q6[CLI_PATH_SIZE];  // (tmp_file's buffers rotate)
    snprintf(q, sizeof q, "%s", tmp_file(&d, "q.npy"));
    snprintf(k, sizeof k, "%s", tmp_file(&d, "k.npy"));
    snprintf(v, sizeof v, "%s", tmp_file(&d, "v.npy"));
    snprintf(g, sizeof g, "%s", tmp_file(&d, "g.npy"));
    snprintf(o, sizeof o, "%s", tmp_file(&d, "o.npy"));
    snprintf(q6, sizeof q6, "%s", tmp_file(&d, "q6.npy"));
    write_f32_shape(q6, 2, 4, 6, 8);
    SDPA_EXPECT(2, &d, 5, "--kv-cache-prefix and --attn-mask do not go together",
                "only --is-causal", "--query", q6, "--key", k, "--value", v, "--enable-gqa",
                "--kv-cache-prefix", "2", "--attn-mask", g, "--output", o);
    SDPA_EXPECT(2, &d, 5, "--kv-cache-prefix and --dropout-p do not go together", "no dropout",
                "--query", q6, "--key", k, "--value", v, "--kv-cache-prefix", "2", "--dropout-p",
                "0.1", "--output", o);
    SDPA_EXPECT(2, &d, 5, "--kv-cache-prefix and --lse-output do not go together",
                "no log-sum-exp", "--query", q6, "--key", k, "--value", v, "--kv-cache-prefix",
                "2", "--lse-output", o);
    SDPA_EXPECT(2, &d, 5, "--kv-cache-prefix and --weights-output do not go together",
                "no weights", "--query", q6, "--key", k, "--value", v, "--kv-cache-prefix", "2",
                "--weights-output", o);
    SDPA_EXPECT(2, &d, 5, "--kv-cache-prefix and --grad-output do not go together",
                "no backward pass", "--query", q6, "--key", k, "--value", v, "--kv-cache-prefix",
                "2", "--grad-output", g, "--grads-dir", d.path, "--output", o);
    SDPA_EXPECT(2, &d, 5, "--kv-cache-prefix and --impl unfused do not go together",
                "leave --impl out", "--query", q6, "--key", k, "--value", v,
                "--kv-cache-prefix", "2", "--impl", "unfused", "--output", o);
    SDPA_EXPECT(2, &d, 5, "--kv-cache-prefix '0'", "at least 1", "--query", q6, "--key", k,
                "--value", v, "--kv-cache-prefix", "0", "--output", o);
    SDPA_EXPECT(2, &d, 5, "--kv-cache-prefix 'two'", NULL, "--query", q6, "--key", k, "--value",
                v, "--kv-cache-prefix", "two", "--output", o);
    SDPA_EXPECT(2, &d, 5, "--kv-cache-prefix decodes one whole sequence per batch item",
                "q.npy holds L = 5 tokens and --key", "--query", q, "--key", k, "--value", v,
                "--enable-gqa", "--kv-cache-prefix", "2", "--output", o);
    SDPA_EXPECT(2, &d, 5, "--kv-cache-prefix 7: more than the S = 6 tokens of --key", "k.npy",
                "--query", q6, "--key", k, "--value", v, "--enable-gqa", "--kv-cache-prefix",
                "7", "--output", o);
    tmp_remove(&d);
}

// A float32 .npy file of @p ndim dimensions @p shape, values drawn from @p seed.
static void write_f32_seeded(const char *path, uint32_t seed, size_t ndim, const size_t *shape) {
    size_t count = 1;
    for (size_t i = 0; i < ndim; ++i) count *= shape[i];
    float *x = malloc(count * sizeof *x);
    cr_assert(x != NULL);
    for (size_t i = 0; i < count; ++i) x[i] = pseudo(&seed);
    write_npy_raw(path, "<f4", ndim, shape, x, count * sizeof *x);
    free(x);
}

// `clmha sdpa` on inputs @p in[0..2] with --enable-gqa, --is-causal when @p causal, and
// --kv-cache-prefix @p prefix (NULL: none), into @p out; exit status 0.
static void sdpa_run_into(char in[][CLI_PATH_SIZE], bool causal, const char *prefix,
                          const char *out) {
    const char *argv[16] = {"sdpa", "--query", in[0], "--key", in[1], "--value", in[2],
                            "--enable-gqa", "--output", out};
    size_t argc = 10;
    if (causal) argv[argc++] = "--is-causal";
    if (prefix) argv[argc++] = "--kv-cache-prefix", argv[argc++] = prefix;
    argv[argc] = NULL;
    cli_result r = cli_run_argv(argv);
    cr_assert_eq(r.status, 0, "--kv-cache-prefix %s: exit status %d; stderr: %s",
                 prefix ? prefix : "(none)", r.status, r.err);
    cli_free(&r);
}

// --kv-cache-prefix P with --is-causal: the output put together from the calls through the
// cache equals the one-shot causal run's within 1e-5 (P 1, 4 and 9 of 9 tokens, nhld, GQA 4/2;
// unbatched, P 3); without --is-causal and P = S (one call, every query sees every token), the
// one-shot run's without it. The summary counts the calls; a value with D_v != D is refused
// (exit 1).
Test(cli_sdpa, kv_cache_decode_equals_one_shot) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = tmp_make();
    char in[6][CLI_PATH_SIZE], one[CLI_PATH_SIZE], dec[CLI_PATH_SIZE];
    const char *names[6] = {"q.npy", "k.npy", "v.npy", "q3.npy", "k3.npy", "v3.npy"};
    const size_t shapes[6][4] = {{2, 4, 9, 8}, {2, 2, 9, 8}, {2, 2, 9, 8},
                                 {4, 9, 8},    {2, 9, 8},    {2, 9, 8}};
    for (int i = 0; i < 6; ++i) {
        snprintf(in[i], sizeof in[i], "%s", tmp_file(&d, names[i]));
        write_f32_seeded(in[i], 17u * (uint32_t)i + 3u, i < 3 ? 4 : 3, shapes[i]);
    }
    snprintf(one, sizeof one, "%s", tmp_file(&d, "one.npy"));
    snprintf(dec, sizeof dec, "%s", tmp_file(&d, "dec.npy"));
    const struct {
        int first;  // in[first..first + 2]
        const char *prefix;
        bool causal;
    } runs[] = {{0, "1", true}, {0, "4", true}, {0, "9", true}, {3, "3", true}, {0, "9", false}};
    double worst = 0;
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; ++i) {
        sdpa_run_into(in + runs[i].first, runs[i].causal, NULL, one);
        sdpa_run_into(in + runs[i].first, runs[i].causal, runs[i].prefix, dec);
        clmha__npy got = {0}, want = {0};
        read_npy(dec, &got);
        read_npy(one, &want);
        double e = npy_max_abs_diff(&got, &want, "decoded output", runs[i].prefix);
        cr_expect_leq(e, SDPA_TOL, "%s --kv-cache-prefix %s%s: max |decoded - one-shot| %.3e",
                      names[runs[i].first], runs[i].prefix,
                      runs[i].causal ? " --is-causal" : "", e);
        if (!(e <= worst)) worst = e;
        clmha__npy_free(&got);
        clmha__npy_free(&want);
    }
    fprintf(stderr, "cli_sdpa kv_cache_decode_equals_one_shot runs=%zu out_maxabs=%.3e\n",
            sizeof runs / sizeof runs[0], worst);
    cli_result r = cli_run("sdpa", "--query", in[0], "--key", in[1], "--value", in[2],
                           "--enable-gqa", "--is-causal", "--kv-cache-prefix", "4");
    cr_assert_eq(r.status, 0, "exit status %d; stderr: %s", r.status, r.err);
    cr_expect(strstr(r.out, "output:  (2, 4, 9, 8):") != NULL, "stdout: %s", r.out);
    cr_expect(strstr(r.out, "calls:   6 through a KV cache (a prefix of 4 tokens, then 5 "
                            "single-token steps)") != NULL, "stdout: %s", r.out);
    cli_free(&r);
    write_f32_shape(tmp_file(&d, "v6.npy"), 2, 2, 9, 6);
    SDPA_EXPECT(1, &d, 9, "--value", "v6.npy: D_v = 6, the key's D = 8", "--query", in[0],
                "--key", in[1], "--value", tmp_file(&d, "v6.npy"), "--enable-gqa",
                "--kv-cache-prefix", "4", "--output", tmp_file(&d, "o.npy"));
    tmp_remove(&d);
}

// ---- user score and mask functions (--score-mod FILE.cl, --mod-params P.npy) -------------------

// ALiBi as a user score function, p the slopes (the terms clmha's built-in ALiBi adds, after
// soft-capping, on the real keys only), with its derivative; and is_causal as a mask function.
static const char mod_alibi[] =
    "clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k,\n"
    "                           __global const float *p) {\n"
    "    return s - p[h] * fabs((float)(q - k));\n"
    "}\n"
    "clmha_real clmha_score_mod_grad(clmha_real s, int b, int h, int q, int k,\n"
    "                                __global const float *p) {\n"
    "    return 1;\n"
    "}\n";
static const char mod_alibi_no_grad[] =
    "clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k,\n"
    "                           __global const float *p) {\n"
    "    return s - p[h] * fabs((float)(q - k));\n"
    "}\n";
// (p[0] = 0 shifts nothing: p read through a device buffer.)
static const char mod_causal[] =
    "int clmha_mask_mod(int b, int h, int q, int k, __global const float *p) {\n"
    "    return k <= q + (int)p[0];\n"
    "}\n";
static const char mod_syntax_error[] =
    "clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k,\n"
    "                           __global const float *p) {\n"
    "    return s\n"
    "}\n";

// The .cl files above and p files in a new folder: alibi.cl, alibi_no_grad.cl, causal.cl,
// bad.cl; slopes2.npy (float64: the geometric slopes of 2 heads, 2^-4 and 2^-8), slopes4.npy
// (float32: those of 4 heads), zero.npy (one 0).
static tmp_dir make_mod_files(void) {
    tmp_dir d = tmp_make();
    write_bytes(tmp_file(&d, "alibi.cl"), mod_alibi, strlen(mod_alibi));
    write_bytes(tmp_file(&d, "alibi_no_grad.cl"), mod_alibi_no_grad, strlen(mod_alibi_no_grad));
    write_bytes(tmp_file(&d, "causal.cl"), mod_causal, strlen(mod_causal));
    write_bytes(tmp_file(&d, "bad.cl"), mod_syntax_error, strlen(mod_syntax_error));
    const double slopes2[2] = {0.0625, 0.00390625};
    const float slopes4[4] = {0.25f, 0.0625f, 0.015625f, 0.00390625f}, zero[1] = {0};
    write_npy_raw(tmp_file(&d, "slopes2.npy"), "<f8", 1, (size_t[]){2}, slopes2, sizeof slopes2);
    write_npy_raw(tmp_file(&d, "slopes4.npy"), "<f4", 1, (size_t[]){4}, slopes4, sizeof slopes4);
    write_npy_raw(tmp_file(&d, "zero.npy"), "<f4", 1, (size_t[]){1}, zero, sizeof zero);
    return d;
}

// Max abs difference between the .npy files @p got_path and the case's @p want_name.
static double case_file_diff(const char *case_dir, const char *want_name, const char *got_path,
                             const char *what) {
    char want_path[CLI_PATH_SIZE];
    snprintf(want_path, sizeof want_path, "%s/%s", case_dir, want_name);
    clmha__npy got = {0}, want = {0};
    read_npy(got_path, &got);
    read_npy(want_path, &want);
    double err = npy_max_abs_diff(&got, &want, want_name, what);
    clmha__npy_free(&got);
    clmha__npy_free(&want);
    return err;
}

#define CASE_PATH(buf, name, file)                                                             \
    snprintf(buf, sizeof buf, "%s/cli/%s/%s", CLMHA_TEST_DATA_DIR, name, file)

// ALiBi written as a score function reproduces PyTorch's results of the case that has the
// built-in ALiBi (--softcap 1.5 --alibi over a file without them; cross-attention with
// add_bias_kv, whose key gets no ALiBi term, and a float mask): the output through both cores
// and every gradient, p from a float64 file.
Test(cli_score_mod, alibi_function_gives_the_alibi_golden) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir m = make_mod_files();
    const char *name = "grad_softcap_override_cross";
    char dir[CLI_PATH_SIZE], f[6][CLI_PATH_SIZE];
    snprintf(dir, sizeof dir, "%s/cli/%s", CLMHA_TEST_DATA_DIR, name);
    const char *files[6] = {"layer.safetensors", "query.npy", "key.npy", "value.npy",
                            "attn_mask.npy", "grad_output.npy"};
    for (int i = 0; i < 6; ++i) CASE_PATH(f[i], name, files[i]);
    char grads[CLI_PATH_SIZE];
    snprintf(grads, sizeof grads, "%s/grads", m.path);
    const char *impls[2] = {"fused", "unfused"};
    for (int i = 0; i < 2; ++i) {
        cr_assert_eq(mkdir(grads, 0700), 0);
        const char *out = tmp_file(&m, "out.npy");
        cli_result r = cli_run("run", "--layer", f[0], "--query", f[1], "--key", f[2], "--value",
                               f[3], "--attn-mask", f[4], "--softcap", "1.5", "--score-mod",
                               tmp_file(&m, "alibi.cl"), "--mod-params",
                               tmp_file(&m, "slopes2.npy"), "--impl", impls[i], "--grad-output",
                               f[5], "--grads-dir", grads, "--output", out);
        cr_assert_eq(r.status, 0, "--impl %s: stderr: %s", impls[i], r.err);
        cli_free(&r);
        double err = case_file_diff(dir, "expected_output.npy", out, impls[i]);
        size_t count = 0;
        double g_err = compare_grads(dir, grads, impls[i], &count);
        fprintf(stderr, "cli_score_mod %s --impl %s out_maxabs=%.3e grads=%zu grad_maxnorm=%.3e\n",
                name, impls[i], err, count, g_err);
        cr_expect_leq(err, CLI_TOL, "--impl %s: output max abs error %.3e", impls[i], err);
        tmpdir_remove(grads);
    }
    tmp_remove(&m);
}

// The same ALiBi function held by the layer file (__metadata__ mod_source, tensor mod_params,
// written by clmha_layer_save()): `clmha run` without --score-mod gives the ALiBi golden, and
// so does --softcap, which makes the layer again (p copied from the file's layer).
Test(cli_score_mod, layer_file_holds_the_functions) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir m = make_mod_files();
    const char *name = "grad_softcap_override_cross";
    char dir[CLI_PATH_SIZE], f[5][CLI_PATH_SIZE];
    snprintf(dir, sizeof dir, "%s/cli/%s", CLMHA_TEST_DATA_DIR, name);
    const char *files[5] = {"layer.safetensors", "query.npy", "key.npy", "value.npy",
                            "attn_mask.npy"};
    for (int i = 0; i < 5; ++i) CASE_PATH(f[i], name, files[i]);
    // The golden layer again with the functions and p = the slopes (and soft-capping 1.5).
    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_env(&ctx), CLMHA_SUCCESS);
    clmha_layer *golden = NULL, *with = NULL;
    cr_assert_eq(clmha_layer_load(&golden, ctx, f[0]), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    clmha_layer_desc d = {.struct_size = sizeof d};
    cr_assert_eq(clmha_layer_get_desc(golden, &d), CLMHA_SUCCESS);
    const float slopes[2] = {0.0625f, 0.00390625f};
    d.softcap = 1.5, d.mod_source = mod_alibi, d.mod_params = slopes, d.mod_params_count = 2;
    cr_assert_eq(clmha_layer_create(&with, ctx, &d), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    static const char *const params[] = {"q_proj_weight", "k_proj_weight", "v_proj_weight",
                                         "in_proj_weight", "in_proj_bias", "out_proj.weight",
                                         "out_proj.bias", "bias_k", "bias_v"};
    for (size_t i = 0; i < sizeof params / sizeof *params; ++i) {
        size_t n = clmha_layer_parameter_count(golden, params[i]);
        if (!n) continue;
        float *x = malloc(n * sizeof *x);
        cr_assert_not_null(x);
        cr_assert_eq(clmha_layer_get_parameter(golden, params[i], x, n), CLMHA_SUCCESS);
        cr_assert_eq(clmha_layer_set_parameter(with, params[i], x, n), CLMHA_SUCCESS);
        free(x);
    }
    const char *file = tmp_file(&m, "alibi_layer.safetensors");
    cr_assert_eq(clmha_layer_save(with, file), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    clmha_layer_release(with);
    clmha_layer_release(golden);
    clmha_context_release(ctx);
    const char *out = tmp_file(&m, "out.npy");
    for (int k = 0; k < 2; ++k) {
        cli_result r = k ? cli_run("run", "--layer", file, "--query", f[1], "--key", f[2],
                                   "--value", f[3], "--attn-mask", f[4], "--softcap", "1.5",
                                   "--output", out)
                         : cli_run("run", "--layer", file, "--query", f[1], "--key", f[2],
                                   "--value", f[3], "--attn-mask", f[4], "--output", out);
        cr_assert_eq(r.status, 0, "stderr: %s", r.err);
        cli_free(&r);
        double err = case_file_diff(dir, "expected_output.npy", out, k ? "--softcap" : "file");
        fprintf(stderr, "cli_score_mod layer file with the functions%s: out_maxabs=%.3e\n",
                k ? ", --softcap 1.5" : "", err);
        cr_expect_leq(err, CLI_TOL, "output max abs error %.3e", err);
    }
    tmp_remove(&m);
}

// is_causal written as a mask function (p[0] = 0 read) gives the causal case's output and
// weights; through a KV cache (--decode-chunk 2 --is-causal) too.
Test(cli_score_mod, mask_function_gives_the_causal_golden) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir m = make_mod_files();
    char dir[CLI_PATH_SIZE], layer[CLI_PATH_SIZE], query[CLI_PATH_SIZE];
    snprintf(dir, sizeof dir, "%s/cli/causal", CLMHA_TEST_DATA_DIR);
    CASE_PATH(layer, "causal", "layer.safetensors");
    CASE_PATH(query, "causal", "query.npy");
    const char *out = tmp_file(&m, "out.npy"), *w = tmp_file(&m, "w.npy");
    cli_result r = cli_run("run", "--layer", layer, "--query", query, "--score-mod",
                           tmp_file(&m, "causal.cl"), "--mod-params", tmp_file(&m, "zero.npy"),
                           "--output", out, "--weights-output", w);
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cli_free(&r);
    double err = case_file_diff(dir, "expected_output.npy", out, "unfused");
    double w_err = case_file_diff(dir, "expected_weights.npy", w, "unfused");
    r = cli_run("run", "--layer", layer, "--query", query, "--score-mod",
                tmp_file(&m, "causal.cl"), "--mod-params", tmp_file(&m, "zero.npy"),
                "--is-causal", "--decode-chunk", "2", "--output", out);
    cr_assert_eq(r.status, 0, "--decode-chunk 2: stderr: %s", r.err);
    cli_free(&r);
    double chunk_err = case_file_diff(dir, "expected_output.npy", out, "--decode-chunk 2");
    fprintf(stderr, "cli_score_mod causal out_maxabs=%.3e w_maxabs=%.3e decode_maxabs=%.3e\n",
            err, w_err, chunk_err);
    cr_expect_leq(err, CLI_TOL, "output max abs error %.3e", err);
    cr_expect_leq(w_err, CLI_TOL, "weights max abs error %.3e", w_err);
    cr_expect_leq(chunk_err, CLI_TOL, "--decode-chunk 2: output max abs error %.3e", chunk_err);
    tmp_remove(&m);
}

// One `clmha sdpa` case with its flags @p extra (NULL-ended) in place of its args file's:
// the output, the log-sum-exp and the gradients (those the case has) against PyTorch's.
static void sdpa_mod_case(const tmp_dir *m, const char *name, const char *const *extra) {
    char dir[CLI_PATH_SIZE], paths[5][CLI_PATH_SIZE], grads[CLI_PATH_SIZE];
    snprintf(dir, sizeof dir, "%s/cli/%s", CLMHA_TEST_DATA_DIR, name);
    snprintf(grads, sizeof grads, "%s/grads", m->path);
    static const char *const inputs[5][2] = {{"--query", "query.npy"},
                                             {"--key", "key.npy"},
                                             {"--value", "value.npy"},
                                             {"--attn-mask", "attn_mask.npy"},
                                             {"--sinks", "sinks.npy"}};
    const char *argv[CLI_MAX_ARGS + 1] = {"sdpa"};
    size_t argc = 1;
    for (int i = 0; i < 5; ++i) {
        CASE_PATH(paths[i], name, inputs[i][1]);
        if (file_exists(paths[i])) argv[argc++] = inputs[i][0], argv[argc++] = paths[i];
    }
    for (size_t i = 0; extra[i]; ++i) argv[argc++] = extra[i];
    char lse_want[CLI_PATH_SIZE], grad_out[CLI_PATH_SIZE];
    CASE_PATH(lse_want, name, "expected_lse.npy");
    CASE_PATH(grad_out, name, "grad_output.npy");
    bool lse = file_exists(lse_want), grad = file_exists(grad_out);
    const char *out = tmp_file(m, "out.npy"), *lse_path = tmp_file(m, "lse.npy");
    argv[argc++] = "--output", argv[argc++] = out;
    if (lse) argv[argc++] = "--lse-output", argv[argc++] = lse_path;
    if (grad) {
        cr_assert_eq(mkdir(grads, 0700), 0);
        argv[argc++] = "--grad-output", argv[argc++] = grad_out;
        argv[argc++] = "--grads-dir", argv[argc++] = grads;
    }
    argv[argc] = NULL;
    cli_result r = cli_run_argv(argv);
    cr_assert_eq(r.status, 0, "%s: stderr: %s", name, r.err);
    cli_free(&r);
    double err = case_file_diff(dir, "expected_output.npy", out, name);
    double lse_err = lse ? case_file_diff(dir, "expected_lse.npy", lse_path, name) : -1;
    size_t count = 0;
    double g_err = grad ? compare_grads(dir, grads, name, &count) : -1;
    if (grad) tmpdir_remove(grads);
    fprintf(stderr, "cli_score_mod %s out_maxabs=%.3e lse_maxabs=%.3e grads=%zu "
            "grad_maxnorm=%.3e\n", name, err, lse_err, count, g_err);
    cr_expect_leq(err, SDPA_TOL, "%s: output max abs error %.3e", name, err);
    cr_expect_leq(lse_err, SDPA_TOL, "%s: log-sum-exp max abs error %.3e", name, lse_err);
}

// `clmha sdpa --score-mod`: ALiBi as a score function with the case's --alibi-slopes file as p
// (grouped-query, a float mask, soft-capping first; the gradients too); is_causal as a mask
// function beside attention sinks (whose gradient takes the backward on device buffers, p one
// of them); ALiBi as a score function through a KV cache (--kv-cache-prefix, the geometric
// slopes of 4 heads).
Test(cli_score_mod, sdpa_functions_give_the_goldens) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir m = make_mod_files();
    char slopes[CLI_PATH_SIZE];
    CASE_PATH(slopes, "sdpa_softcap_alibi_gqa_grads", "alibi_slopes.npy");
    char alibi[CLI_PATH_SIZE], causal[CLI_PATH_SIZE], zero[CLI_PATH_SIZE], slopes4[CLI_PATH_SIZE];
    snprintf(alibi, sizeof alibi, "%s", tmp_file(&m, "alibi.cl"));
    snprintf(causal, sizeof causal, "%s", tmp_file(&m, "causal.cl"));
    snprintf(zero, sizeof zero, "%s", tmp_file(&m, "zero.npy"));
    snprintf(slopes4, sizeof slopes4, "%s", tmp_file(&m, "slopes4.npy"));
    sdpa_mod_case(&m, "sdpa_softcap_alibi_gqa_grads",
                  (const char *const[]){"--enable-gqa", "--softcap", "1.5", "--score-mod", alibi,
                                        "--mod-params", slopes, NULL});
    sdpa_mod_case(&m, "sdpa_sinks_gqa_grads",
                  (const char *const[]){"--enable-gqa", "--score-mod", causal, "--mod-params",
                                        zero, NULL});
    sdpa_mod_case(&m, "sdpa_softcap_alibi_kv_cache_decode",
                  (const char *const[]){"--layout", "nlhd", "--is-causal", "--enable-gqa",
                                        "--softcap", "2.0", "--score-mod", alibi, "--mod-params",
                                        slopes4, "--kv-cache-prefix", "3", NULL});
    tmp_remove(&m);
}

// A refused run: exit @p status, a stderr line starting with @p prefix that holds @p want
// (other lines, such as a driver's own build messages, may come with it), no output written.
static void expect_mod_refused(int status, const char *prefix, const char *want,
                               const char *out, const char *const *args) {
    cli_result r = cli_run_argv(args);
    cr_assert_eq(r.status, status, "exit status %d (want %d); stderr: %s", r.status, status,
                 r.err);
    const char *line = strstr(r.err, prefix);
    cr_assert(line && (line == r.err || line[-1] == '\n'), "no line starts with '%s': %s",
              prefix, r.err);
    const char *end = strchr(line, '\n');
    cr_assert(end && strstr(line, want) && strstr(line, want) < end,
              "the line of '%s' does not say '%s': %s", prefix, want, r.err);
    if (out) cr_assert(!file_exists(out), "%s was written", out);
    cli_free(&r);
}

#define EXPECT_MOD_REFUSED(status, prefix, want, out, ...)                                     \
    expect_mod_refused(status, prefix, want, out, (const char *const[]){__VA_ARGS__, NULL})

// Files and options refused before any device work (exit 2 for usage, 1 for a file): --mod-params
// without --score-mod, a missing, empty, special or NUL-holding source, a p that is not 1-D
// float; and --decode-chunk without --is-causal, which would move the queries' positions.
Test(cli_score_mod, refused_files_and_options) {
    tmp_dir d = make_inputs();
    tmp_dir m = make_mod_files();
    char layer[CLI_PATH_SIZE], q[CLI_PATH_SIZE], alibi[CLI_PATH_SIZE], zero[CLI_PATH_SIZE],
        out[CLI_PATH_SIZE];
    snprintf(layer, sizeof layer, "%s", tmp_file(&d, "layer.safetensors"));
    snprintf(q, sizeof q, "%s", tmp_file(&d, "q.npy"));
    snprintf(alibi, sizeof alibi, "%s", tmp_file(&m, "alibi.cl"));
    snprintf(zero, sizeof zero, "%s", tmp_file(&m, "zero.npy"));
    snprintf(out, sizeof out, "%s", tmp_file(&m, "out.npy"));
    EXPECT_USAGE("clmha run: --mod-params needs --score-mod", "run", "--layer", layer, "--query",
                 q, "--mod-params", zero);
    EXPECT_USAGE("clmha sdpa: --mod-params needs --score-mod", "sdpa", "--query", q, "--key", q,
                 "--value", q, "--mod-params", zero);
    EXPECT_USAGE("clmha bench: --mod-params needs --score-mod", "bench", "--mod-params", zero);
    EXPECT_USAGE("clmha bench: --score-mod goes with a random layer", "bench", "--layer", layer,
                 "--score-mod", alibi);
    write_bytes(tmp_file(&m, "empty.cl"), "", 0);
    write_bytes(tmp_file(&m, "nul.cl"), "int x;\0", 7);
    write_npy_raw(tmp_file(&m, "p2d.npy"), "<f4", 2, (size_t[]){1, 1}, (float[]){0}, 4);
    write_npy_raw(tmp_file(&m, "pbool.npy"), "|b1", 1, (size_t[]){1}, (unsigned char[]){1}, 1);
    const struct {
        const char *source, *params, *want;  // file names in m
    } bad[] = {
        {"missing.cl", NULL, "missing.cl: cannot open"},
        {"empty.cl", NULL, "the file is empty"},
        {"/dev/null", NULL, "not a regular file"},
        {".", NULL, "cannot read"},
        {"nul.cl", NULL, "NUL byte"},
        {"alibi.cl", "p2d.npy", "p takes 1 dimension"},
        {"alibi.cl", "pbool.npy", "not a float type"},
        {"alibi.cl", "missing.npy", "missing.npy: cannot open"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
        char source[CLI_PATH_SIZE], params[CLI_PATH_SIZE];
        snprintf(source, sizeof source, "%s",
                 bad[i].source[0] == '/' ? bad[i].source : tmp_file(&m, bad[i].source));
        if (bad[i].params) snprintf(params, sizeof params, "%s", tmp_file(&m, bad[i].params));
        const char *flag = bad[i].params ? "--mod-params " : "--score-mod ";
        char run_prefix[64], sdpa_prefix[64];
        snprintf(run_prefix, sizeof run_prefix, "clmha run: %s", flag);
        snprintf(sdpa_prefix, sizeof sdpa_prefix, "clmha sdpa: %s", flag);
        const char *run[16] = {"run", "--layer", layer, "--query", q, "--output", out,
                               "--score-mod", source};
        const char *sdpa[16] = {"sdpa", "--query", q, "--key", q, "--value", q, "--output",
                                out, "--score-mod", source};
        size_t rn = 9, sn = 11;
        if (bad[i].params) {
            run[rn++] = sdpa[sn++] = "--mod-params";
            run[rn++] = sdpa[sn++] = params;
        }
        run[rn] = sdpa[sn] = NULL;
        expect_mod_refused(1, run_prefix, bad[i].want, out, run);
        expect_mod_refused(1, sdpa_prefix, bad[i].want, out, sdpa);
    }
    tmp_remove(&m);
    tmp_remove(&d);
}

// Refused on the device: a source that does not compile (the build log in the message, run,
// sdpa and bench alike), a backward pass whose score function has no derivative, and
// --decode-chunk without --is-causal.
Test(cli_score_mod, refused_sources) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir d = make_inputs();
    tmp_dir m = make_mod_files();
    const char *layer = tmp_file(&d, "layer.safetensors"), *q = tmp_file(&d, "q.npy");
    const char *bad = tmp_file(&m, "bad.cl"), *out = tmp_file(&m, "out.npy");
    EXPECT_MOD_REFUSED(1, "clmha run: --score-mod ", "expected ';'", out, "run", "--layer",
                       layer, "--query", q, "--score-mod", bad, "--output", out);
    EXPECT_MOD_REFUSED(1, "clmha sdpa: --score-mod ", "expected ';'", out, "sdpa", "--query", q,
                       "--key", q, "--value", q, "--score-mod", bad, "--output", out);
    EXPECT_MOD_REFUSED(1, "clmha bench: --score-mod ", "expected ';'", NULL, "bench", "--embed",
                       "8", "--heads", "2", "--batch", "1", "--tgt-len", "3", "--repeat", "1",
                       "--score-mod", bad);
    const char *g = tmp_file(&m, "g.npy"), *grads = tmp_file(&m, "grads");
    write_f32_shape(g, 3, 2, 8);
    cr_assert_eq(mkdir(grads, 0700), 0);
    EXPECT_MOD_REFUSED(1, "clmha run: backward pass failed", "clmha_score_mod_grad", out, "run",
                       "--layer", layer, "--query", q, "--score-mod",
                       tmp_file(&m, "alibi_no_grad.cl"), "--mod-params",
                       tmp_file(&m, "slopes2.npy"), "--grad-output", g, "--grads-dir", grads,
                       "--output", out);
    EXPECT_MOD_REFUSED(1, "clmha run: --decode-chunk without --is-causal", "--score-mod", out,
                       "run", "--layer", layer, "--query", q, "--score-mod",
                       tmp_file(&m, "causal.cl"), "--mod-params", tmp_file(&m, "zero.npy"),
                       "--decode-chunk", "2", "--output", out);
    tmp_remove(&m);
    tmp_remove(&d);
}

// bench --score-mod: the JSON line names the file (null without), the text head too.
Test(cli_score_mod, bench_names_the_file) {
    SKIP_WITHOUT_DEVICE();
    tmp_dir m = make_mod_files();
    const char *alibi = tmp_file(&m, "alibi.cl"), *slopes = tmp_file(&m, "slopes4.npy");
    cli_result r = cli_run("bench", "--json", "--embed", "16", "--heads", "4", "--batch", "1",
                           "--tgt-len", "5", "--repeat", "1", "--causal", "--score-mod", alibi,
                           "--mod-params", slopes);
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    char want[CLI_PATH_SIZE + 32];
    snprintf(want, sizeof want, "\"score_mod\": \"%s\"", alibi);
    cr_expect(strstr(r.out, want) != NULL, "%s", r.out);
    cli_free(&r);
    r = cli_run("bench", "--embed", "16", "--heads", "4", "--decode", "--cache-len", "6",
                "--batch", "1", "--repeat", "1", "--score-mod", alibi, "--mod-params", slopes);
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_expect(strstr(r.out, ", score-mod ") != NULL, "%s", r.out);
    cli_free(&r);
    r = cli_run("bench", "--json", "--embed", "16", "--heads", "4", "--batch", "1", "--tgt-len",
                "5", "--repeat", "1");
    cr_assert_eq(r.status, 0, "stderr: %s", r.err);
    cr_expect(strstr(r.out, "\"score_mod\": null") != NULL, "%s", r.out);
    cli_free(&r);
    tmp_remove(&m);
}
