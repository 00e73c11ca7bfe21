// What the commands of the `clmha` program share: messages on stderr, option parsing, opening
// the device, output paths, the user score and mask functions' files, random numbers and time
// (see cli.h).
#define _POSIX_C_SOURCE 200809L

#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/file_read.h"
#include "base/file_write.h"
#include "base/message.h"
#include "npy.h"

// ---- messages ---------------------------------------------------------------------------------

// Prints "clmha <cmd>: <message>" as one line on stderr: control characters (from file names or
// library messages) become spaces. 
void clmha__cli_vreport(const char *cmd, const char *fmt, va_list ap) {
    char line[3072];
    vsnprintf(line, sizeof line, fmt, ap);
    for (char *p = line; *p; ++p)
        if (iscntrl((unsigned char)*p)) *p = ' ';
    if (cmd)
        fprintf(stderr, "clmha %s: %s\n", cmd, line);
    else
        fprintf(stderr, "clmha: %s\n", line);
}

void clmha__cli_report(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    clmha__cli_vreport(cmd, fmt, ap);
    va_end(ap);
}

// @p msg without a leading "<path>: " (the report names the path already).
const char *clmha__cli_without_path(const char *msg, const char *path) {
    size_t n = strlen(path);
    return strncmp(msg, path, n) == 0 && msg[n] == ':' && msg[n + 1] == ' ' ? msg + n + 2 : msg;
}

// ---- option parsing ---------------------------------------------------------------------------

bool clmha__cli_parse_options(const char *cmd, int argc, char **argv,
                              const clmha__cli_option *opts, size_t num_opts, const char *usage,
                              int *exit_status) {
    *exit_status = EXIT_USAGE;
    for (int i = 0; i < argc; ++i) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            fputs(usage, stdout);
            *exit_status = EXIT_OK;
            return false;
        }
        if (!clmha__cli_starts_with(arg, "--") || arg[2] == '\0') {
            clmha__cli_report(cmd, "unexpected argument '%s' (try 'clmha %s --help')", arg, cmd);
            return false;
        }
        const char *eq = strchr(arg, '=');
        size_t name_len = eq ? (size_t)(eq - arg) : strlen(arg);
        const clmha__cli_option *o = NULL;
        for (size_t k = 0; k < num_opts && !o; ++k)
            if (strlen(opts[k].name) == name_len && strncmp(opts[k].name, arg, name_len) == 0)
                o = &opts[k];
        if (!o) {
            clmha__cli_report(cmd, "unknown option '%.*s' (try 'clmha %s --help')", (int)name_len,
                              arg, cmd);
            return false;
        }
        if (o->flag) {
            if (eq) {
                clmha__cli_report(cmd, "%s takes no value (got '%s')", o->name, arg);
                return false;
            }
            *o->flag = true;
            continue;
        }
        const char *value = NULL;
        if (eq) {
            value = eq + 1;
        } else if (i + 1 < argc && !clmha__cli_starts_with(argv[i + 1], "--")) {
            value = argv[++i];
        } else {
            if (i + 1 < argc)
                clmha__cli_report(
                    cmd,
                    "%s needs a value, got option '%s' (write %s=VALUE for a value that "
                    "starts with --)",
                    o->name, argv[i + 1], o->name);
            else
                clmha__cli_report(cmd, "%s needs a value", o->name);
            return false;
        }
        if (!value[0] && !o->allow_empty) {
            clmha__cli_report(cmd, "%s needs a non-empty value", o->name);
            return false;
        }
        if (*o->value) {
            clmha__cli_report(cmd, "%s given twice ('%s' and '%s')", o->name, *o->value, value);
            return false;
        }
        *o->value = value;
    }
    return true;
}

bool clmha__cli_parse_u64(const char *cmd, const char *flag, const char *text, uint64_t *v) {
    *v = 0;
    if (!text) return true;
    char *end = NULL;
    errno = 0;
    unsigned long long x = isdigit((unsigned char)text[0]) ? strtoull(text, &end, 10) : 0;
    if (!end || *end || errno) {
        clmha__cli_report(cmd, "%s '%s': expected an integer in [0, 2^64)", flag, text);
        return false;
    }
    *v = (uint64_t)x;
    return true;
}

// One bound of --window: "-1" or digits of a number below 2^63, up to @p end.
static bool window_bound(const char *s, const char *end, int64_t *out) {
    if (end - s == 2 && s[0] == '-' && s[1] == '1') {
        *out = -1;
        return true;
    }
    if (s == end) return false;
    uint64_t v = 0;
    for (const char *p = s; p < end; ++p) {
        if (*p < '0' || *p > '9') return false;
        unsigned d = (unsigned)(*p - '0');
        if (v > ((uint64_t)INT64_MAX - d) / 10) return false;
        v = v * 10 + d;
    }
    *out = (int64_t)v;
    return true;
}

bool clmha__cli_parse_window(const char *cmd, const char *text, clmha__cli_window *w) {
    *w = (clmha__cli_window){0};
    if (!text) return true;
    const char *comma = strchr(text, ',');
    if (!comma || !window_bound(text, comma, &w->left) ||
        !window_bound(comma + 1, comma + 1 + strlen(comma + 1), &w->right)) {
        clmha__cli_report(cmd, "--window '%s': expected LEFT,RIGHT, two integers, each -1 "
                          "(unbounded) or from 0 to 2^63-1, such as 1023,0", text);
        return false;
    }
    w->on = true;
    return true;
}

bool clmha__cli_parse_lens(const char *cmd, const char *flag, const char *text,
                           clmha__cli_lens *l) {
    *l = (clmha__cli_lens){0};
    if (!text) return true;
    size_t count = 1;
    for (const char *c = text; *c; ++c) count += *c == ',';
    if (count > CLMHA__CLI_MAX_SEQS) {
        clmha__cli_report(cmd, "%s: %zu lengths, more than the %d sequences a call takes here",
                          flag, count, CLMHA__CLI_MAX_SEQS);
        return false;
    }
    if (!(l->lens = malloc(count * sizeof *l->lens))) {
        clmha__cli_report(cmd, "%s: out of host memory", flag);
        return false;
    }
    const char *c = text;
    for (size_t i = 0; i < count; ++i) {
        char *end = NULL;
        errno = 0;
        unsigned long long v = isdigit((unsigned char)*c) ? strtoull(c, &end, 10) : 0;
        if (!end || errno || v >= (1ull << 63) || (*end != ',' && *end != '\0') ||
            (i + 1 < count) != (*end == ',')) {
            clmha__cli_report(cmd, "%s '%s': expected lengths separated by commas, each an "
                              "integer from 0, such as 5,3,7", flag, text);
            free(l->lens);
            l->lens = NULL;
            return false;
        }
        l->lens[i] = (size_t)v;
        c = end + 1;
    }
    l->count = count;
    return true;
}

// The names of the kinds of KV cache, by clmha_kv_dtype.
static const char *const kv_dtype_names[] = {"f32", "int8", "f16", "bf16", "int4"};

const char *clmha__cli_kv_dtype_name(clmha_kv_dtype dt) {
    return (unsigned)dt < sizeof kv_dtype_names / sizeof *kv_dtype_names ? kv_dtype_names[dt]
                                                                         : "?";
}

bool clmha__cli_parse_kv_dtype(const char *cmd, const char *text, clmha_kv_dtype *dt) {
    *dt = CLMHA_KV_FLOAT32;
    if (!text || strcmp(text, "float32") == 0) return true;
    for (size_t i = 0; i < sizeof kv_dtype_names / sizeof *kv_dtype_names; ++i)
        if (strcmp(text, kv_dtype_names[i]) == 0) {
            *dt = (clmha_kv_dtype)i;
            return true;
        }
    clmha__cli_report(cmd, "--kv-dtype '%s': expected f32, f16, bf16, int8 or int4", text);
    return false;
}

bool clmha__cli_parse_softcap(const char *cmd, const char *text, double *c) {
    *c = 0.0;
    if (!text) return true;
    char *end = NULL;
    errno = 0;
    // Digits or a point first: no sign, space, "nan" or "inf" (which strtod takes).
    double v = isdigit((unsigned char)text[0]) || text[0] == '.' ? strtod(text, &end) : -1.0;
    if (!end || *end || errno || !isfinite(v) || v < 0.0) {
        clmha__cli_report(cmd, "--softcap '%s': expected 0 (off) or a positive finite number, "
                          "such as 50", text);
        return false;
    }
    *c = v;
    return true;
}

// Device spec: --device, else $CLMHA_DEVICE, else the default. Reports a failure.
clmha_context *clmha__cli_open_context(const char *cmd, const char *device_opt) {
    const char *env = getenv("CLMHA_DEVICE");
    const char *spec = device_opt ? device_opt : env;
    clmha_context *ctx = NULL;
    if (clmha_context_create(&ctx, spec) != CLMHA_SUCCESS) {
        if (device_opt)
            clmha__cli_report(cmd, "--device %s: %s", device_opt, clmha_last_create_error());
        else if (env && env[0])
            clmha__cli_report(cmd, "$CLMHA_DEVICE=%s: %s", env, clmha_last_create_error());
        else
            clmha__cli_report(cmd, "default device: %s", clmha_last_create_error());
        return NULL;
    }
    return ctx;
}

// Parses --impl (auto, fused or unfused; NULL: auto) for a call that wants weights or not;
// @p weight_flags names the options that ask for weights. Reports a bad value, and fused with
// weights.
bool clmha__cli_parse_dtype(const char *cmd, const char *opt, clmha_dtype *out) {
    static const struct {
        const char *name, *torch;
        clmha_dtype dtype;
    } names[] = {{"f32", "float32", CLMHA_DTYPE_F32},
                 {"f64", "float64", CLMHA_DTYPE_F64},
                 {"f16", "float16", CLMHA_DTYPE_F16},
                 {"bf16", "bfloat16", CLMHA_DTYPE_BF16}};
    *out = CLMHA_DTYPE_F32;
    if (!opt) return true;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i)
        if (strcmp(opt, names[i].name) == 0 || strcmp(opt, names[i].torch) == 0) {
            *out = names[i].dtype;
            return true;
        }
    clmha__cli_report(cmd, "--dtype %s: expected f32, f64, f16 or bf16", opt);
    return false;
}

bool clmha__cli_parse_impl(const char *cmd, const char *text, bool need_weights,
                           const char *weight_flags, clmha_impl *impl) {
    static const clmha_impl all[] = {CLMHA_IMPL_AUTO, CLMHA_IMPL_FUSED, CLMHA_IMPL_UNFUSED};
    *impl = CLMHA_IMPL_AUTO;
    if (!text) return true;
    size_t i = 0;
    while (i < sizeof all / sizeof all[0] && strcmp(text, clmha_impl_name(all[i])) != 0) ++i;
    if (i == sizeof all / sizeof all[0]) {
        clmha__cli_report(cmd, "--impl '%s': expected auto, fused or unfused", text);
        return false;
    }
    *impl = all[i];
    if (*impl == CLMHA_IMPL_FUSED && need_weights) {
        clmha__cli_report(cmd, "--impl fused cannot give weights: drop %s, or use --impl unfused",
                          weight_flags);
        return false;
    }
    return true;
}

// Refuses an output path early (before any work): see cli.h.
bool clmha__cli_output_path_ok(const char *cmd, const char *flag, const char *path) {
    struct stat st;
    char msg[1024];
    // (Also refuses a name too long for the file system, before any work.)
    if (clmha__file_check_target(path, msg, sizeof msg) != CLMHA_SUCCESS) {
        clmha__cli_report(cmd, "%s %s: %s", flag, path, clmha__cli_without_path(msg, path));
        return false;
    }
    const char *slash = strrchr(path, '/');
    size_t len = slash ? (size_t)(slash - path) : 1;
    if (slash && len == 0) len = 1;  // "/name": the root folder
    char *dir = malloc(len + 1);
    if (!dir) {
        clmha__cli_report(cmd, "out of memory");
        return false;
    }
    memcpy(dir, slash ? path : ".", len);
    dir[len] = '\0';
    bool ok = false;
    if (stat(dir, &st) != 0)
        clmha__cli_report(cmd, "%s %s: the folder '%s' does not exist", flag, path, dir);
    else if (!S_ISDIR(st.st_mode))
        clmha__cli_report(cmd, "%s %s: '%s' is not a folder", flag, path, dir);
    else if (access(dir, W_OK | X_OK) != 0)
        clmha__cli_report(cmd, "%s %s: the folder '%s' is not writable", flag, path, dir);
    else
        ok = true;
    free(dir);
    return ok;
}

bool clmha__cli_grads_dir_ok(const char *cmd, const char *dir) {
    struct stat st;
    if (stat(dir, &st) != 0)
        clmha__cli_report(cmd, "--grads-dir %s: %s (the folder is not created: make it first)",
                          dir, strerror(errno));
    else if (!S_ISDIR(st.st_mode))
        clmha__cli_report(cmd, "--grads-dir %s: not a folder", dir);
    else if (access(dir, W_OK | X_OK) != 0)
        clmha__cli_report(cmd, "--grads-dir %s: the folder is not writable", dir);
    else
        return true;
    return false;
}

// ---- user score and mask functions -----------------------------------------------------------

bool clmha__cli_mod_options_ok(const char *cmd, const clmha__cli_mod *m) {
    if (m->params_path && !m->source_path) {
        clmha__cli_report(cmd, "--mod-params needs --score-mod (the functions that read p)");
        return false;
    }
    return true;
}

// --score-mod: the whole file as text. Reports and returns false.
static bool mod_source_read(const char *cmd, clmha__cli_mod *m) {
    const char *path = m->source_path;
    unsigned char *bytes = NULL;
    size_t size = 0;
    char msg[1024] = "";
    if (clmha__file_read_whole(path, CLMHA__CLI_MOD_MAX_BYTES, &bytes, &size, NULL, msg,
                               sizeof msg) != CLMHA_SUCCESS) {
        clmha__cli_report(cmd, "--score-mod %s: %s", path,
                          msg[0] ? clmha__cli_without_path(msg, path) : "cannot read the file");
        return false;
    }
    const unsigned char *nul = memchr(bytes, 0, size);
    const char *why = size == 0 ? "the file is empty; it must define clmha_score_mod, "
                                  "clmha_score_mod_grad or clmha_mask_mod in OpenCL C"
                      : nul     ? "the file holds a NUL byte: an OpenCL C source is text"
                                : NULL;
    if (why) {
        clmha__cli_report(cmd, "--score-mod %s: %s", path, why);
        free(bytes);
        return false;
    }
    m->source = (char *)bytes;  // (NUL-terminated by clmha__file_read_whole)
    return true;
}

// --mod-params: a 1-D float array, as floats. Reports and returns false.
static bool mod_params_read(const char *cmd, clmha__cli_mod *m) {
    const char *path = m->params_path;
    clmha__npy a = {0};
    char msg[1024] = "", shape[160];
    if (clmha__npy_read(path, &a, msg, sizeof msg) != CLMHA_SUCCESS) {
        clmha__cli_report(cmd, "--mod-params %s: %s", path,
                          msg[0] ? clmha__cli_without_path(msg, path) : "cannot read the file");
        return false;
    }
    bool ok = false;
    if (a.kind != CLMHA__NPY_FLOAT)
        clmha__cli_report(cmd, "--mod-params %s: dtype '%s' is not a float type; p must be "
                          "float32 (or float64, float16)", path, a.dtype);
    else if (a.ndim != 1)
        clmha__cli_report(cmd, "--mod-params %s: a %zu-D array %s; p takes 1 dimension (count)",
                          path, a.ndim,
                          clmha__shape_str_most(shape, sizeof shape, a.ndim, a.shape,
                                                CLMHA__NPY_MAX_DIMS));
    else if (a.overflowed)
        clmha__cli_report(cmd, "--mod-params %s: %zu float64 value%s beyond float32's range "
                          "(p is float32)", path, a.overflowed, a.overflowed == 1 ? "" : "s");
    else
        ok = true;
    if (ok && a.count) {
        m->params = a.f32;  // (taken over: not freed below)
        a.f32 = NULL;
    }
    m->count = ok ? a.count : 0;
    clmha__npy_free(&a);
    return ok;
}

bool clmha__cli_mod_read(const char *cmd, clmha__cli_mod *m) {
    return (!m->source_path || mod_source_read(cmd, m)) &&
           (!m->params_path || mod_params_read(cmd, m));
}

void clmha__cli_mod_free(clmha__cli_mod *m) {
    free(m->source);
    free(m->params);
    m->source = NULL;
    m->params = NULL;
    m->count = 0;
}

// ---- random numbers and time ------------------------------------------------------------------

float clmha__cli_uniform(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

double clmha__cli_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int clmha__cli_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
