// The `clmha` command-line program: `clmha devices`, `clmha run`, `clmha demo`, `clmha bench`.
//
// Exit status: 0 success; 1 a refused input (unreadable or malformed file, shape mismatch,
// device or library failure); 2 a usage error (unknown command or option, missing value,
// missing required option). Every error is one line on stderr that starts with
// "clmha <command>: " and names the file or argument at fault.
#define _POSIX_C_SOURCE 200809L

#include <clmha.h>

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "heatmap.h"
#include "npy.h"

enum { EXIT_OK = 0, EXIT_REFUSED = 1, EXIT_USAGE = 2 };

// ---- help texts -------------------------------------------------------------------------------

static const char *usage_main =
    "usage: clmha <command> [options]\n"
    "\n"
    "Computes torch.nn.MultiheadAttention's forward pass on an OpenCL device.\n"
    "\n"
    "commands:\n"
    "  devices   list every OpenCL platform and device with the spec string that selects it\n"
    "  run       run a layer file (.safetensors) on .npy inputs, write .npy outputs\n"
    "  demo      run a random layer, check it against the CPU reference, time it\n"
    "  bench     time the device-buffer forward pass: ms, GFLOP/s, scratch, time per stage\n"
    "  tune      tune CLBlast's GEMMs for a device, store the result for later runs\n"
    "\n"
    "options:\n"
    "  --help, -h   print this help (clmha <command> --help: help on a command)\n"
    "  --version    print the version\n"
    "\n"
    "exit status: 0 success, 1 refused input (bad file, shape mismatch, device error),\n"
    "2 usage error\n";

static const char *usage_devices =
    "usage: clmha devices\n"
    "\n"
    "Lists every OpenCL device of every platform: type, compute units, global and local\n"
    "memory, largest allocation, fp16/fp64 support, driver version, and the spec string\n"
    "(\"P:D\", in brackets) that selects it with --device or $CLMHA_DEVICE.\n"
    "\n"
    "options:\n"
    "  --help, -h   print this help\n";

static const char *usage_run =
    "usage: clmha run --layer F.safetensors --query Q.npy [options]\n"
    "\n"
    "Runs torch.nn.MultiheadAttention's forward pass (eval mode: no dropout) with the layer\n"
    "in F.safetensors (state_dict() names; metadata num_heads, batch_first, add_zero_attn)\n"
    "on the arrays of .npy files. Shapes and masks are PyTorch's: query (L, N, E), or\n"
    "(N, L, E) when the layer file says batch_first, or (L, E) unbatched.\n"
    "\n"
    "inputs:\n"
    "  --layer F.safetensors     the layer (required)\n"
    "  --query Q.npy             query, float32 or float64 (required)\n"
    "  --key K.npy               key (S, N, kdim); default: the query (self-attention)\n"
    "  --value V.npy             value (S, N, vdim); default: the key\n"
    "  --key-padding-mask M.npy  (N, S), or (S) unbatched\n"
    "  --attn-mask A.npy         (L, S), or (N*num_heads, L, S); unbatched (num_heads, L, S)\n"
    "                            bool/uint8 masks: true (non-zero) = may NOT attend;\n"
    "                            float masks are added to the scores (-inf forbids)\n"
    "  --is-causal               forbid key j > query i (top-left aligned)\n"
    "\n"
    "outputs:\n"
    "  --need-weights            also compute the attention weights\n"
    "  --per-head-weights        weights per head (N, H, L, S') instead of averaged over\n"
    "                            the heads (N, L, S') (average_attn_weights=False);\n"
    "                            implies --need-weights\n"
    "  --output O.npy            write the attention output, float32, shaped like the query\n"
    "  --weights-output W.npy    write the weights, float32; implies --need-weights\n"
    "                            (unbatched inputs drop N; S' = S + add_bias_kv + add_zero_attn)\n"
    "  Files are written only after the forward pass succeeded, each whole or not at all.\n"
    "  A query row whose every key is masked gets zero weights (PyTorch gives NaN there).\n"
    "  Results not written to a file are summarised on stdout (shape, first values).\n"
    "\n"
    "device:\n"
    "  --device SPEC             \"P:D\", gpu, cpu, accelerator or part of a device name\n"
    "                            (see clmha devices); default: $CLMHA_DEVICE, else the first\n"
    "                            GPU, else the first device\n"
    "  --impl auto|fused|unfused the attention core: fused streams key tiles and never\n"
    "                            stores the scores, but cannot give weights; auto (default)\n"
    "                            is fused without weights, else unfused\n"
    "\n"
    "  --help, -h                print this help\n"
    "\n"
    "exit status: 0 success, 1 refused input (bad file, shape mismatch, device error),\n"
    "2 usage error. Options take their value as --opt VALUE or --opt=VALUE.\n";

static const char *usage_demo =
    "usage: clmha demo [--device SPEC] [--heatmap OUT.png]\n"
    "\n"
    "Runs a random layer (embed_dim 64, 8 heads, L = S = 48, N = 2, padding mask) on a\n"
    "device, checks it against the double-precision CPU reference (tolerance 1e-4) and\n"
    "prints the device, the shapes, the max error and the time per forward.\n"
    "\n"
    "options:\n"
    "  --device SPEC      \"P:D\", gpu, cpu, accelerator or part of a device name (see\n"
    "                     clmha devices); default: $CLMHA_DEVICE, else the first GPU, else\n"
    "                     the first device\n"
    "  --heatmap OUT.png  also write the attention weights of the first batch item as a PNG:\n"
    "                     one tile per head, the mean over the heads and a colour scale\n"
    "  --help, -h         print this help\n"
    "\n"
    "exit status: 0 PASS, 1 FAIL or device error, 2 usage error\n";

static const char *usage_bench =
    "usage: clmha bench [--batch N] [--tgt-len L] [--src-len S] [--embed E] [--heads H]\n"
    "                   [--need-weights] [--batch-first] [--layer F.safetensors]\n"
    "                   [--impl auto|fused|unfused] [--repeat R] [--device SPEC] [--json]\n"
    "\n"
    "Times the forward pass on device buffers (clmha_layer_forward): a warm-up\n"
    "(clmha_layer_bake at the shape: sizes the scratch, compiles the kernels), then R timed\n"
    "runs, each waited for with clFinish. Reports the median time per forward, GFLOP/s, the\n"
    "layer's device scratch in bytes and, from one more run with profiling on, the time of\n"
    "each stage (project, split, scores, softmax, av, fused, merge, out_proj, weights).\n"
    "Self-attention (key = value = query: one packed QKV projection) when L == S and the\n"
    "layer's kdim == vdim == E; else cross-attention with key = value, one (S, N, kdim)\n"
    "tensor (separate key and value tensors when kdim != vdim). Inputs are random.\n"
    "\n"
    "shape (N, L and S take comma-separated lists, e.g. --tgt-len 128,256,512: every\n"
    "combination is timed, one result per shape):\n"
    "  --batch N            batch size (default 8)\n"
    "  --tgt-len L          target (query) length (default 128)\n"
    "  --src-len S          source (key/value) length (default: L, self-attention)\n"
    "  --embed E            embed_dim of the random layer (default 512)\n"
    "  --heads H            num_heads of the random layer (default 8; must divide E)\n"
    "  --need-weights       also compute the attention weights (N, L, S), averaged over heads\n"
    "  --batch-first        inputs (N, L, E) instead of (L, N, E)\n"
    "  --layer F.safetensors  time this layer file (e.g. from tools/export_mha.py) instead\n"
    "                       of a random one (weights uniform in +-1/sqrt(E), bias); its\n"
    "                       embed_dim, num_heads, kdim, vdim and batch_first are used\n"
    "                       (--embed, --heads and --batch-first, when given, must agree)\n"
    "\n"
    "run:\n"
    "  --impl I             attention core: auto (default: fused without --need-weights,\n"
    "                       else unfused), fused or unfused\n"
    "  --repeat R           timed runs per shape (default 10)\n"
    "  --device SPEC        \"P:D\", gpu, cpu, accelerator or part of a device name (see\n"
    "                       clmha devices); default: $CLMHA_DEVICE, else the first GPU, else\n"
    "                       the first device\n"
    "  --json               one JSON object per shape and line: device, layer, batch, tgt_len,\n"
    "                       src_len, embed_dim, num_heads, kdim, vdim, batch_first,\n"
    "                       need_weights, impl (the core used), attention (\"self\"/\"cross\"),\n"
    "                       repeat, ms (median),\n"
    "                       ms_min, ms_max, flops, gflops, scratch_bytes, stages {name: ms}\n"
    "  --help, -h           print this help\n"
    "\n"
    "FLOPs counted (the GEMMs; masks, softmax and head split/merge are not counted):\n"
    "  2*N*E*(L*E + S*kdim + S*vdim + L*E)   Q, K, V and output projections\n"
    "  + 4*N*L*S'*E                          Q*K^T and weights*V (S' = S + add_bias_kv\n"
    "                                        + add_zero_attn)\n"
    "  = 2*N*E^2*(2L + 2S) + 4*N*L*S*E for kdim = vdim = E, and 8*N*L*E^2 + 4*N*L^2*E\n"
    "  for self-attention (L = S). GFLOP/s = FLOPs / median time.\n"
    "\n"
    "exit status: 0 success, 1 refused input (bad layer file, device error, shape too large\n"
    "for the device), 2 usage error\n";

// ---- messages ---------------------------------------------------------------------------------

// Prints "clmha <cmd>: <message>" as one line on stderr: control characters (from file names or
// library messages) become spaces. (Also used by src/cli_tune.c.)
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

static void report(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void report(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    clmha__cli_vreport(cmd, fmt, ap);
    va_end(ap);
}

static bool starts_with(const char *s, const char *prefix) {
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

// @p msg without a leading "<path>: " (the report names the path already).
static const char *without_path(const char *msg, const char *path) {
    size_t n = strlen(path);
    return strncmp(msg, path, n) == 0 && msg[n] == ':' && msg[n + 1] == ' ' ? msg + n + 2 : msg;
}

// "(2, 3, 4)", "(5,)" or "()".
static const char *shape_str(char *buf, size_t size, size_t ndim, const size_t *shape) {
    size_t used = (size_t)snprintf(buf, size, "(");
    for (size_t i = 0; i < ndim && used < size; ++i)
        used += (size_t)snprintf(buf + used, size - used, i ? ", %zu" : "%zu", shape[i]);
    if (used < size) snprintf(buf + used, size - used, ndim == 1 ? ",)" : ")");
    return buf;
}

// ---- option parsing ---------------------------------------------------------------------------

typedef struct option_spec {
    const char *name;    // "--layer"
    const char **value;  // options with a value: where it goes
    bool *flag;          // flags: where true goes
    bool allow_empty;    // the value may be ""
} option_spec;

// Parses argv against @p opts. Returns EXIT_OK when parsed (*help set when --help or -h came),
// or EXIT_USAGE after reporting a usage error.
static int parse_options(const char *cmd, int argc, char **argv, const option_spec *opts,
                         size_t num_opts, bool *help) {
    *help = false;
    for (int i = 0; i < argc; ++i) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            *help = true;
            return EXIT_OK;
        }
        if (!starts_with(arg, "--") || arg[2] == '\0') {
            report(cmd, "unexpected argument '%s' (try 'clmha %s --help')", arg, cmd);
            return EXIT_USAGE;
        }
        const char *eq = strchr(arg, '=');
        size_t name_len = eq ? (size_t)(eq - arg) : strlen(arg);
        const option_spec *o = NULL;
        for (size_t k = 0; k < num_opts && !o; ++k)
            if (strlen(opts[k].name) == name_len && strncmp(opts[k].name, arg, name_len) == 0)
                o = &opts[k];
        if (!o) {
            report(cmd, "unknown option '%.*s' (try 'clmha %s --help')", (int)name_len, arg,
                   cmd);
            return EXIT_USAGE;
        }
        if (o->flag) {
            if (eq) {
                report(cmd, "%s takes no value (got '%s')", o->name, arg);
                return EXIT_USAGE;
            }
            *o->flag = true;
            continue;
        }
        const char *value = NULL;
        if (eq) {
            value = eq + 1;
        } else if (i + 1 < argc && !starts_with(argv[i + 1], "--")) {
            value = argv[++i];
        } else {
            if (i + 1 < argc)
                report(cmd, "%s needs a value, got option '%s' (write %s=VALUE for a value that "
                       "starts with --)", o->name, argv[i + 1], o->name);
            else
                report(cmd, "%s needs a value", o->name);
            return EXIT_USAGE;
        }
        if (!value[0] && !o->allow_empty) {
            report(cmd, "%s needs a non-empty value", o->name);
            return EXIT_USAGE;
        }
        if (*o->value) {
            report(cmd, "%s given twice ('%s' and '%s')", o->name, *o->value, value);
            return EXIT_USAGE;
        }
        *o->value = value;
    }
    return EXIT_OK;
}

// Device spec: --device, else $CLMHA_DEVICE, else the default. Reports a failure.
static clmha_context *open_context(const char *cmd, const char *device_opt) {
    const char *env = getenv("CLMHA_DEVICE");
    const char *spec = device_opt ? device_opt : env;
    clmha_context *ctx = NULL;
    if (clmha_context_create(&ctx, spec) != CLMHA_SUCCESS) {
        if (device_opt)
            report(cmd, "--device %s: %s", device_opt, clmha_last_create_error());
        else if (env && env[0])
            report(cmd, "$CLMHA_DEVICE=%s: %s", env, clmha_last_create_error());
        else
            report(cmd, "default device: %s", clmha_last_create_error());
        return NULL;
    }
    return ctx;
}

// Parses --impl (auto, fused or unfused; NULL: auto) for a call that wants weights or not;
// @p weight_flags names the options that ask for weights. Reports a bad value, and fused with
// weights.
static bool parse_impl(const char *cmd, const char *text, bool need_weights,
                       const char *weight_flags, clmha_impl *impl) {
    static const clmha_impl all[] = {CLMHA_IMPL_AUTO, CLMHA_IMPL_FUSED, CLMHA_IMPL_UNFUSED};
    *impl = CLMHA_IMPL_AUTO;
    if (!text) return true;
    size_t i = 0;
    while (i < sizeof all / sizeof all[0] && strcmp(text, clmha_impl_name(all[i])) != 0) ++i;
    if (i == sizeof all / sizeof all[0]) {
        report(cmd, "--impl '%s': expected auto, fused or unfused", text);
        return false;
    }
    *impl = all[i];
    if (*impl == CLMHA_IMPL_FUSED && need_weights) {
        report(cmd, "--impl fused cannot give weights: drop %s, or use --impl unfused",
               weight_flags);
        return false;
    }
    return true;
}

// Refuses an output path early (before any work) when its folder does not exist or cannot be
// written, or when the path names a folder. Reports and returns false.
static bool output_path_ok(const char *cmd, const char *flag, const char *path) {
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        report(cmd, "%s %s: is a folder, not a file name", flag, path);
        return false;
    }
    const char *slash = strrchr(path, '/');
    size_t len = slash ? (size_t)(slash - path) : 1;
    if (slash && len == 0) len = 1;  // "/name": the root folder
    char *dir = malloc(len + 1);
    if (!dir) {
        report(cmd, "out of memory");
        return false;
    }
    memcpy(dir, slash ? path : ".", len);
    dir[len] = '\0';
    bool ok = false;
    if (stat(dir, &st) != 0)
        report(cmd, "%s %s: the folder '%s' does not exist", flag, path, dir);
    else if (!S_ISDIR(st.st_mode))
        report(cmd, "%s %s: '%s' is not a folder", flag, path, dir);
    else if (access(dir, W_OK | X_OK) != 0)
        report(cmd, "%s %s: the folder '%s' is not writable", flag, path, dir);
    else
        ok = true;
    free(dir);
    return ok;
}

// ---- clmha devices ------------------------------------------------------------------------------

static const char *type_name(cl_device_type t) {
    if (t & CL_DEVICE_TYPE_GPU) return "GPU";
    if (t & CL_DEVICE_TYPE_CPU) return "CPU";
    if (t & CL_DEVICE_TYPE_ACCELERATOR) return "accelerator";
    return "other";
}

static int cmd_devices(int argc, char **argv) {
    bool help;
    int rc = parse_options("devices", argc, argv, NULL, 0, &help);
    if (rc != EXIT_OK) return rc;
    if (help) {
        fputs(usage_devices, stdout);
        return EXIT_OK;
    }
    size_t count = 0;
    if (clmha_device_count(&count) != CLMHA_SUCCESS) {
        report("devices", "could not list the OpenCL platforms: %s", clmha_last_create_error());
        return EXIT_REFUSED;
    }
    if (count == 0) {
        printf("no OpenCL device found (install a driver, e.g. pocl-opencl-icd)\n");
        return EXIT_OK;
    }
    printf("%zu OpenCL device%s; select one with --device SPEC or $CLMHA_DEVICE=SPEC:\n", count,
           count == 1 ? "" : "s");
    for (size_t i = 0; i < count; ++i) {
        clmha_device_info info = {.struct_size = sizeof info};
        if (clmha_device_describe(i, &info) != CLMHA_SUCCESS) {
            report("devices", "could not describe device %zu: %s", i, clmha_last_create_error());
            return EXIT_REFUSED;
        }
        const clmha_device_info *d = &info;
        printf("[%s] %s / %s\n", d->spec, d->platform_name, d->device_name);
        printf("      type %s, %u compute units, global %llu MiB, local %llu KiB, max alloc %llu "
               "MiB, fp16 %s, fp64 %s, driver %s\n",
               type_name(d->type), d->compute_units,
               (unsigned long long)(d->global_mem_bytes >> 20),
               (unsigned long long)(d->local_mem_bytes >> 10),
               (unsigned long long)(d->max_alloc_bytes >> 20), d->fp16 ? "yes" : "no",
               d->fp64 ? "yes" : "no", d->driver_version);
        const char *note = clmha_device_note(d);
        if (*note) printf("      note: %s\n", note);
    }
    return EXIT_OK;
}

// ---- clmha run --------------------------------------------------------------------------------

// One .npy input.
typedef struct input_file {
    const char *flag;  // "--query"
    const char *path;  // NULL when not given
    bool is_mask;      // bool/uint8 allowed
    clmha__npy a;
} input_file;

enum { IN_QUERY, IN_KEY, IN_VALUE, IN_KPM, IN_ATTN, IN_COUNT };

// Reads one input; reports and returns false when it is refused.
static bool read_input(input_file *in) {
    char msg[1024] = "";
    char s[160];
    if (clmha__npy_read(in->path, &in->a, msg, sizeof msg) != CLMHA_SUCCESS) {
        report("run", "%s %s: %s", in->flag, in->path,
               msg[0] ? without_path(msg, in->path) : "cannot read the file");
        return false;
    }
    if (in->a.ndim == 0 || in->a.ndim > 4) {
        report("run", "%s %s: a %zu-D array %s; %s takes 1 to 4 dimensions", in->flag, in->path,
               in->a.ndim, shape_str(s, sizeof s, in->a.ndim, in->a.shape), in->flag);
        return false;
    }
    if (!in->is_mask && in->a.kind != CLMHA__NPY_FLOAT) {
        report("run", "%s %s: dtype '%s' is boolean; %s must be float32 or float64", in->flag,
               in->path, in->a.dtype, in->flag);
        return false;
    }
    return true;
}

static clmha_tensor tensor_of(const clmha__npy *a) {
    clmha_tensor t = {.ndim = a->ndim};
    for (size_t i = 0; i < a->ndim && i < 4; ++i) t.shape[i] = a->shape[i];
    t.data = a->kind == CLMHA__NPY_FLOAT ? (const void *)a->f32 : (const void *)a->u8;
    return t;
}

static clmha_mask mask_of(const input_file *in) {
    clmha_mask m = {.kind = CLMHA_MASK_NONE};
    if (!in->path) return m;
    m.kind = in->a.kind == CLMHA__NPY_BOOL ? CLMHA_MASK_BOOL_IGNORE : CLMHA_MASK_FLOAT;
    m.tensor = tensor_of(&in->a);
    return m;
}

// The input a library message about query/key/value refers to (NULL: the layer as a whole).
// Key defaults to the query and value to the key, so a message about an input that was not
// given names the input it defaulted to.
static const input_file *input_culprit(const char *msg, const input_file *in, bool batch_first) {
    const input_file *q = &in[IN_QUERY];
    const input_file *k = in[IN_KEY].path ? &in[IN_KEY] : q;
    const input_file *v = in[IN_VALUE].path ? &in[IN_VALUE] : k;
    if (starts_with(msg, "query")) return q;
    if (starts_with(msg, "key ") && strstr(msg, " and value ")) return v;
    if (starts_with(msg, "key ")) return k;
    if (starts_with(msg, "value ")) return v;
    if (starts_with(msg, "batch sizes differ")) {
        size_t b = batch_first ? 0 : 1;
        if (q->a.ndim == 3 && k->a.ndim == 3 && k->a.shape[b] != q->a.shape[b]) return k;
        return v;
    }
    return NULL;
}

// "0.123457 -1.5 ... (48 values)".
static void print_values(const char *label, const float *x, size_t count, size_t ndim,
                         const size_t *shape, const char *note) {
    char s[160];
    printf("%-8s %s%s:", label, shape_str(s, sizeof s, ndim, shape), note);
    size_t shown = count < 6 ? count : 6;
    for (size_t i = 0; i < shown; ++i) printf(" %.6g", (double)x[i]);
    if (shown < count) printf(" ...");
    printf(" (%zu value%s)\n", count, count == 1 ? "" : "s");
}

// Writes the requested outputs: each file whole or not at all, and when two are requested both
// or (as far as the file system allows) neither: both are written to temporary names next to
// their targets first, then renamed.
static bool write_outputs(const char *out_path, const float *y, size_t y_ndim,
                          const size_t *y_shape, const char *w_path, const float *w,
                          size_t w_ndim, const size_t *w_shape) {
    char msg[1024] = "";
    char *tmp_y = NULL, *tmp_w = NULL;
    bool ok = false, y_written = false, w_written = false, y_renamed = false;
    if (!out_path || !w_path) {  // one file (or none): written whole or not at all by itself
        const char *path = out_path ? out_path : w_path;
        if (path && clmha__npy_write_f32(path, out_path ? y : w, out_path ? y_ndim : w_ndim,
                                         out_path ? y_shape : w_shape, msg, sizeof msg)) {
            report("run", "%s %s: %s", out_path ? "--output" : "--weights-output", path, msg);
            return false;
        }
        return true;
    }
    size_t ny = strlen(out_path) + 64, nw = strlen(w_path) + 64;
    if (!(tmp_y = malloc(ny)) || !(tmp_w = malloc(nw))) {
        report("run", "out of memory");
        goto fail;
    }
    snprintf(tmp_y, ny, "%s.clmha-%ld.tmp", out_path, (long)getpid());
    snprintf(tmp_w, nw, "%s.clmha-%ld.tmp", w_path, (long)getpid());
    if (clmha__npy_write_f32(tmp_y, y, y_ndim, y_shape, msg, sizeof msg)) {
        report("run", "--output %s: %s", out_path, msg);
        goto fail;
    }
    y_written = true;
    if (clmha__npy_write_f32(tmp_w, w, w_ndim, w_shape, msg, sizeof msg)) {
        report("run", "--weights-output %s: %s (no output written)", w_path, msg);
        goto fail;
    }
    w_written = true;
    if (rename(tmp_y, out_path) != 0) {
        report("run", "--output %s: cannot rename %s to it: %s (no output written)", out_path,
               tmp_y, strerror(errno));
        goto fail;
    }
    y_renamed = true;
    if (rename(tmp_w, w_path) != 0) {
        report("run", "--weights-output %s: cannot rename %s to it: %s (no output written)",
               w_path, tmp_w, strerror(errno));
        goto fail;
    }
    ok = true;
fail:
    if (!ok) {
        if (y_renamed) remove(out_path);
        else if (y_written) remove(tmp_y);
        if (w_written) remove(tmp_w);
    }
    free(tmp_y);
    free(tmp_w);
    return ok;
}

static int cmd_run(int argc, char **argv) {
    const char *layer_path = NULL, *output_path = NULL, *weights_path = NULL, *device = NULL;
    input_file in[IN_COUNT] = {
        [IN_QUERY] = {.flag = "--query"},
        [IN_KEY] = {.flag = "--key"},
        [IN_VALUE] = {.flag = "--value"},
        [IN_KPM] = {.flag = "--key-padding-mask", .is_mask = true},
        [IN_ATTN] = {.flag = "--attn-mask", .is_mask = true},
    };
    bool is_causal = false, need_weights = false, per_head = false, help = false;
    const char *impl_opt = NULL;
    const option_spec opts[] = {
        {.name = "--layer", .value = &layer_path},
        {.name = "--query", .value = &in[IN_QUERY].path},
        {.name = "--key", .value = &in[IN_KEY].path},
        {.name = "--value", .value = &in[IN_VALUE].path},
        {.name = "--key-padding-mask", .value = &in[IN_KPM].path},
        {.name = "--attn-mask", .value = &in[IN_ATTN].path},
        {.name = "--is-causal", .flag = &is_causal},
        {.name = "--impl", .value = &impl_opt},
        {.name = "--need-weights", .flag = &need_weights},
        {.name = "--per-head-weights", .flag = &per_head},
        {.name = "--output", .value = &output_path},
        {.name = "--weights-output", .value = &weights_path},
        {.name = "--device", .value = &device, .allow_empty = true},
    };
    int rc = parse_options("run", argc, argv, opts, sizeof opts / sizeof opts[0], &help);
    if (rc != EXIT_OK) return rc;
    if (help) {
        fputs(usage_run, stdout);
        return EXIT_OK;
    }
    if (!layer_path || !in[IN_QUERY].path) {
        report("run", "%s required (try 'clmha run --help')",
               !layer_path && !in[IN_QUERY].path ? "--layer and --query are"
               : !layer_path                     ? "--layer is"
                                                 : "--query is");
        return EXIT_USAGE;
    }
    if (output_path && weights_path && strcmp(output_path, weights_path) == 0) {
        report("run", "--output and --weights-output name the same file '%s'", output_path);
        return EXIT_USAGE;
    }
    if (weights_path || per_head) need_weights = true;
    clmha_impl impl;
    if (!parse_impl("run", impl_opt, need_weights,
                    "--need-weights, --per-head-weights and --weights-output", &impl))
        return EXIT_USAGE;

    clmha_context *ctx = NULL;
    clmha_layer *layer = NULL;
    float *y = NULL, *w = NULL;
    rc = EXIT_REFUSED;

    // Files first: they are refused without touching a device.
    if ((output_path && !output_path_ok("run", "--output", output_path)) ||
        (weights_path && !output_path_ok("run", "--weights-output", weights_path)))
        goto fail;
    FILE *f = fopen(layer_path, "rb");
    if (!f) {
        report("run", "--layer %s: cannot open: %s", layer_path, strerror(errno));
        goto fail;
    }
    fclose(f);
    for (int i = 0; i < IN_COUNT; ++i)
        if (in[i].path && !read_input(&in[i])) goto fail;

    if (!(ctx = open_context("run", device))) goto fail;
    if (clmha_layer_load(&layer, ctx, layer_path) != CLMHA_SUCCESS) {
        report("run", "--layer %s: %s", layer_path,
               without_path(clmha_context_last_error(ctx), layer_path));
        goto fail;
    }
    clmha_layer_desc desc = {.struct_size = sizeof desc};
    if (clmha_layer_get_desc(layer, &desc) != CLMHA_SUCCESS) {
        report("run", "--layer %s: %s", layer_path, clmha_context_last_error(ctx));
        goto fail;
    }

    // The arguments, checked one input at a time so that a refusal names its file.
    clmha_forward_args args = {.struct_size = sizeof args, .query = tensor_of(&in[IN_QUERY].a)};
    if (in[IN_KEY].path) args.key = tensor_of(&in[IN_KEY].a);
    if (in[IN_VALUE].path) {
        args.value = tensor_of(&in[IN_VALUE].a);
        if (!in[IN_KEY].path) args.key = args.query;  // key defaults to the query
    }
    size_t y_count = 0, w_count = 0;
    if (clmha_layer_output_counts(layer, &args, NULL, NULL) != CLMHA_SUCCESS) {
        const char *msg = clmha_context_last_error(ctx);
        const input_file *culprit = input_culprit(msg, in, desc.batch_first);
        if (culprit)
            report("run", "%s %s: %s", culprit->flag, culprit->path, msg);
        else
            report("run", "--layer %s: %s", layer_path, msg);
        goto fail;
    }
    args.key_padding_mask = mask_of(&in[IN_KPM]);
    if (clmha_layer_output_counts(layer, &args, NULL, NULL) != CLMHA_SUCCESS) {
        report("run", "--key-padding-mask %s: %s", in[IN_KPM].path,
               clmha_context_last_error(ctx));
        goto fail;
    }
    args.attn_mask = mask_of(&in[IN_ATTN]);
    args.is_causal = is_causal;
    if (clmha_layer_output_counts(layer, &args, NULL, NULL) != CLMHA_SUCCESS) {
        report("run", "%s%s: %s", in[IN_ATTN].path ? "--attn-mask " : "--is-causal",
               in[IN_ATTN].path ? in[IN_ATTN].path : "", clmha_context_last_error(ctx));
        goto fail;
    }
    args.need_weights = need_weights;
    args.per_head_weights = per_head;
    args.impl = impl;
    if (clmha_layer_output_counts(layer, &args, &y_count, &w_count) != CLMHA_SUCCESS) {
        report("run", "%s", clmha_context_last_error(ctx));
        goto fail;
    }

    // Output shapes: the output is shaped like the query (whose last size is E); the weights
    // (N, [H,] L, S'), unbatched without N.
    const clmha__npy *q = &in[IN_QUERY].a;
    bool batched = q->ndim == 3;
    size_t n = batched ? q->shape[desc.batch_first ? 0 : 1] : 1;
    size_t l = batched ? q->shape[desc.batch_first ? 1 : 0] : q->shape[0];
    size_t w_shape[4], w_ndim = 0;
    if (need_weights) {
        size_t rows = n * l * (per_head ? desc.num_heads : 1);
        size_t s_padded = rows ? w_count / rows : 0;
        if (batched) w_shape[w_ndim++] = n;
        if (per_head) w_shape[w_ndim++] = desc.num_heads;
        w_shape[w_ndim++] = l;
        w_shape[w_ndim++] = s_padded;
    }

    if (!(y = malloc((y_count ? y_count : 1) * sizeof *y)) ||
        (need_weights && !(w = malloc((w_count ? w_count : 1) * sizeof *w)))) {
        report("run", "out of host memory for the outputs (%zu + %zu floats)", y_count, w_count);
        goto fail;
    }
    clmha_status st = clmha_layer_forward_host(layer, &args, y, y_count, w, w_count);
    if (st != CLMHA_SUCCESS) {
        report("run", "forward pass failed on %s: %s: %s", clmha_context_device_name(ctx),
               clmha_status_string(st), clmha_context_last_error(ctx));
        goto fail;
    }
    if (!write_outputs(output_path, y, q->ndim, q->shape, weights_path, w, w_ndim, w_shape))
        goto fail;

    // A summary of what was not written to a file.
    bool show_y = !output_path, show_w = need_weights && !weights_path;
    if (show_y || show_w) {
        char s[160];
        printf("device:  %s\n", clmha_context_device_name(ctx));
        printf("layer:   embed_dim %zu, num_heads %zu, kdim %zu, vdim %zu%s%s%s%s\n",
               desc.embed_dim, desc.num_heads, desc.kdim, desc.vdim, desc.bias ? ", bias" : "",
               desc.add_bias_kv ? ", add_bias_kv" : "",
               desc.add_zero_attn ? ", add_zero_attn" : "",
               desc.batch_first ? ", batch_first" : "");
        printf("query:   %s%s\n", shape_str(s, sizeof s, q->ndim, q->shape),
               batched ? (desc.batch_first ? " (N, L, E)" : " (L, N, E)") : " (L, E) unbatched");
        if (show_y) print_values("output:", y, y_count, q->ndim, q->shape, "");
        if (show_w)
            print_values("weights:", w, w_count, w_ndim, w_shape,
                         per_head ? " per head" : " averaged over the heads");
    }
    rc = EXIT_OK;
fail:
    free(y);
    free(w);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    for (int i = 0; i < IN_COUNT; ++i) clmha__npy_free(&in[i].a);
    return rc;
}

// ---- clmha demo -------------------------------------------------------------------------------

// splitmix64-based uniform numbers in [-1, 1).
static float uniform(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static double now_ms(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int cmd_demo(int argc, char **argv) {
    const char *device = NULL, *heatmap = NULL;
    bool help = false;
    const option_spec opts[] = {
        {.name = "--device", .value = &device, .allow_empty = true},
        {.name = "--heatmap", .value = &heatmap},
    };
    int rc = parse_options("demo", argc, argv, opts, sizeof opts / sizeof opts[0], &help);
    if (rc != EXIT_OK) return rc;
    if (help) {
        fputs(usage_demo, stdout);
        return EXIT_OK;
    }
    enum { E = 64, H = 8, N = 2, L = 48, S = 48, RUNS = 10 };
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = H,
                             .bias = true};
    static float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E], x[L * N * E], y[L * N * E];
    static float w[N * L * S], w_heads[N * H * L * S];
    static double y_ref[L * N * E], w_ref[N * L * S];
    static unsigned char kpm[N * S];
    uint64_t rng = 42;
    float a = 1.0f / sqrtf((float)E);
    for (size_t i = 0; i < 3 * E * E; ++i) w_in[i] = a * uniform(&rng);
    for (size_t i = 0; i < E * E; ++i) w_out[i] = a * uniform(&rng);
    for (size_t i = 0; i < 3 * E; ++i) b_in[i] = 0.1f * uniform(&rng);
    for (size_t i = 0; i < E; ++i) b_out[i] = 0.1f * uniform(&rng);
    for (size_t i = 0; i < L * N * E; ++i) x[i] = uniform(&rng);
    for (size_t n = 0; n < N; ++n)  // the second sequence is padded after 40 tokens
        for (size_t j = 0; j < S; ++j) kpm[n * S + j] = n == 1 && j >= 40;

    clmha_forward_args args = {
        .struct_size = sizeof args,
        .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
        .key_padding_mask = {.kind = CLMHA_MASK_BOOL_IGNORE,
                             .tensor = {.ndim = 2, .shape = {N, S}, .data = kpm}},
        .need_weights = true};
    clmha_reference_params params = {.struct_size = sizeof params,
                                     .in_proj_weight = w_in, .in_proj_bias = b_in,
                                     .out_proj_weight = w_out, .out_proj_bias = b_out};

    if (heatmap && !output_path_ok("demo", "--heatmap", heatmap)) return EXIT_REFUSED;
    clmha_layer *layer = NULL;
    rc = EXIT_REFUSED;
    clmha_status st = CLMHA_SUCCESS;
    clmha_context *ctx = open_context("demo", device);
    if (!ctx) goto done;
    printf("device:  %s\n", clmha_context_device_name(ctx));
    printf("layer:   embed_dim %d, num_heads %d, bias, self-attention\n", E, H);
    printf("input:   query (L, N, E) = (%d, %d, %d), key_padding_mask (N, S) = (%d, %d)\n", L, N,
           E, N, S);
    if ((st = clmha_layer_create(&layer, ctx, &desc)) ||
        (st = clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E)) ||
        (st = clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * E)) ||
        (st = clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E)) ||
        (st = clmha_layer_set_parameter(layer, "out_proj.bias", b_out, E)))
        goto fail;
    double times[RUNS];
    for (int r = 0; r < RUNS + 1; ++r) {  // the first run compiles CLBlast's kernels
        double t0 = now_ms();
        if ((st = clmha_layer_forward_host(layer, &args, y, L * N * E, w, N * L * S))) goto fail;
        if (r > 0) times[r - 1] = now_ms() - t0;
    }
    qsort(times, RUNS, sizeof times[0], cmp_double);
    char msg[1024];
    st = clmha_reference_forward(&desc, &params, &args, y_ref, L * N * E, w_ref, N * L * S, msg,
                                 sizeof msg);
    if (st) {
        report("demo", "reference failed: %s", msg);
        goto done;
    }
    double err_y = 0, err_w = 0;
    for (size_t i = 0; i < L * N * E; ++i) err_y = fmax(err_y, fabs(y[i] - y_ref[i]));
    for (size_t i = 0; i < N * L * S; ++i) err_w = fmax(err_w, fabs(w[i] - w_ref[i]));
    printf("output:  (L, N, E) = (%d, %d, %d), weights (N, L, S) = (%d, %d, %d)\n", L, N, E, N, L,
           S);
    printf("error:   max |output - reference| = %.3e, max |weights - reference| = %.3e "
           "(tolerance 1e-4)\n",
           err_y, err_w);
    printf("time:    %.3f ms per forward (median of %d, host arrays in and out)\n",
           times[RUNS / 2], RUNS);
    bool pass = err_y <= 1e-4 && err_w <= 1e-4;
    if (heatmap) {
        // One more forward for the per-head weights (N, H, L, S); the first batch item is the
        // first H * L * S of them.
        args.per_head_weights = true;
        if ((st = clmha_layer_forward_host(layer, &args, y, L * N * E, w_heads, N * H * L * S)))
            goto fail;
        if (clmha__heatmap_write(heatmap, w_heads, H, L, S, msg, sizeof msg) != CLMHA_SUCCESS) {
            report("demo", "--heatmap %s: %s", heatmap, msg);
            goto done;
        }
        printf("heatmap: %s (attention weights of batch item 0, %d heads and their mean)\n",
               heatmap, H);
    }
    printf("result:  %s\n", pass ? "PASS" : "FAIL");
    rc = pass ? EXIT_OK : EXIT_REFUSED;
    goto done;
fail:
    report("demo", "%s: %s", clmha_status_string(st), clmha_context_last_error(ctx));
done:
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    return rc;
}

// ---- clmha bench ------------------------------------------------------------------------------

enum { BENCH_MAX_LIST = 64 };
#define BENCH_MAX_SIZE ((size_t)1 << 24)  // largest N, L, S, E or H accepted
#define BENCH_MAX_REPEAT ((size_t)100000)

static double monotonic_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

// Parses @p text, a comma-separated list of at most @p max_count positive integers no larger
// than @p max_value, into @p out. Reports and returns EXIT_USAGE when it is not one.
static int parse_sizes(const char *flag, const char *text, size_t max_count, size_t max_value,
                       size_t *out, size_t *count) {
    *count = 0;
    const char *p = text;
    for (;;) {
        char *end = NULL;
        errno = 0;
        unsigned long long v = isdigit((unsigned char)*p) ? strtoull(p, &end, 10) : 0;
        if (!end || errno || v == 0 || v > max_value || (*end != '\0' && *end != ',')) {
            report("bench", "%s '%s': expected %s from 1 to %zu", flag, text,
                   max_count > 1 ? "comma-separated whole numbers" : "a whole number",
                   max_value);
            return EXIT_USAGE;
        }
        if (*count == max_count) {
            report("bench", "%s '%s': more than %zu value%s", flag, text, max_count,
                   max_count == 1 ? "" : "s");
            return EXIT_USAGE;
        }
        out[(*count)++] = (size_t)v;
        if (*end == '\0') return EXIT_OK;
        p = end + 1;
    }
}

// *out = a * b * c, false on overflow.
static bool mul3(size_t a, size_t b, size_t c, size_t *out) {
    if (a && b > SIZE_MAX / a) return false;
    size_t ab = a * b;
    if (ab && c > SIZE_MAX / ab) return false;
    *out = ab * c;
    return true;
}

// Writes @p count random floats in [-1, 1) to @p buf, a chunk at a time.
static cl_int fill_random(cl_command_queue queue, cl_mem buf, size_t count, uint64_t *rng) {
    enum { CHUNK = 1 << 20 };
    float *host = malloc((count < CHUNK ? count : CHUNK) * sizeof *host);
    if (!host) return CL_OUT_OF_HOST_MEMORY;
    cl_int err = CL_SUCCESS;
    for (size_t done = 0; done < count && err == CL_SUCCESS;) {
        size_t n = count - done < CHUNK ? count - done : CHUNK;
        for (size_t i = 0; i < n; ++i) host[i] = uniform(rng);
        err = clEnqueueWriteBuffer(queue, buf, CL_TRUE, done * sizeof *host, n * sizeof *host,
                                   host, 0, NULL, NULL);
        done += n;
    }
    free(host);
    return err;
}

// Prints @p s as a JSON string.
static void json_string(const char *s) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; ++p) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p < 0x20)
            printf("\\u%04x", *p);
        else
            putchar(*p);
    }
    putchar('"');
}

// What every shape of one `clmha bench` call shares.
typedef struct bench_config {
    const char *layer_path;   // NULL: a random layer of desc
    clmha_layer_desc desc;    // random layer, or the file's (kdim/vdim filled in)
    const float *w_in, *b_in, *w_out, *b_out;  // random parameters
    bool need_weights, json;
    clmha_impl impl;          // as given; the core used is in bench_result
    size_t repeat;
} bench_config;

// The result of one shape.
typedef struct bench_result {
    size_t n, l, s, s_padded;
    bool self;
    clmha_impl impl;  // the core that ran: fused or unfused
    double ms, ms_min, ms_max, flops;
    size_t scratch_bytes;
    double stage_ms[CLMHA_STAGE_COUNT];
} bench_result;

// A fresh layer for one shape (so that its scratch is that shape's own). Reports a failure.
static clmha_layer *bench_layer(clmha_context *ctx, const bench_config *cfg) {
    clmha_layer *layer = NULL;
    if (cfg->layer_path) {
        if (clmha_layer_load(&layer, ctx, cfg->layer_path) != CLMHA_SUCCESS) {
            report("bench", "--layer %s: %s", cfg->layer_path,
                   without_path(clmha_context_last_error(ctx), cfg->layer_path));
            return NULL;
        }
        return layer;
    }
    size_t e = cfg->desc.embed_dim;
    clmha_status st;
    if ((st = clmha_layer_create(&layer, ctx, &cfg->desc)) ||
        (st = clmha_layer_set_parameter(layer, "in_proj_weight", cfg->w_in, 3 * e * e)) ||
        (st = clmha_layer_set_parameter(layer, "in_proj_bias", cfg->b_in, 3 * e)) ||
        (st = clmha_layer_set_parameter(layer, "out_proj.weight", cfg->w_out, e * e)) ||
        (st = clmha_layer_set_parameter(layer, "out_proj.bias", cfg->b_out, e))) {
        report("bench", "random layer (embed_dim %zu, num_heads %zu): %s: %s", e,
               cfg->desc.num_heads, clmha_status_string(st), clmha_context_last_error(ctx));
        clmha_layer_release(layer);
        return NULL;
    }
    return layer;
}

// Times one shape: warm-up, cfg->repeat timed runs, one profiled run. Returns EXIT_OK or
// EXIT_REFUSED after reporting.
static int bench_shape(clmha_context *ctx, const bench_config *cfg, size_t n, size_t l, size_t s,
                       double *times, bench_result *res) {
    const clmha_layer_desc *d = &cfg->desc;
    size_t e = d->embed_dim, kd = d->kdim, vd = d->vdim;
    bool self = l == s && kd == e && vd == e;
    bool kv_same = kd == vd;  // cross-attention: key = value, one tensor
    *res = (bench_result){.n = n, .l = l, .s = s, .self = self};
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    cl_mem bufs[5] = {NULL};  // query, key, value, output, weights
    clmha_layer *layer = NULL;
    int rc = EXIT_REFUSED;
    cl_int err = CL_SUCCESS;
    const char *what = NULL;
    char where[160];
    snprintf(where, sizeof where, "N %zu, L %zu, S %zu", n, l, s);

    size_t counts[5] = {0};
    if (!mul3(n, l, e, &counts[0]) || !mul3(n, s, kd, &counts[1]) ||
        !mul3(n, s, vd, &counts[2]) || !mul3(n, l, s, &counts[4]) ||
        counts[0] > SIZE_MAX / 4 || counts[1] > SIZE_MAX / 4 || counts[2] > SIZE_MAX / 4) {
        report("bench", "%s, E %zu: the tensor sizes overflow", where, e);
        return EXIT_REFUSED;
    }
    clmha_forward_args args = {.struct_size = sizeof args, .need_weights = cfg->need_weights};
    args.query = (clmha_tensor){.ndim = 3, .shape = {l, n, e}};
    if (!self) {
        args.key = (clmha_tensor){.ndim = 3, .shape = {s, n, kd}};
        if (!kv_same) args.value = (clmha_tensor){.ndim = 3, .shape = {s, n, vd}};
    }
    if (d->batch_first) {
        clmha_tensor *t[3] = {&args.query, &args.key, &args.value};
        for (int i = 0; i < 3; ++i) {
            size_t seq = t[i]->shape[0];
            t[i]->shape[0] = t[i]->shape[1];
            t[i]->shape[1] = seq;
        }
    }
    if (!(layer = bench_layer(ctx, cfg))) goto done;
    clmha_layer_set_impl(layer, cfg->impl);
    res->impl = cfg->impl != CLMHA_IMPL_AUTO ? cfg->impl
                : cfg->need_weights         ? CLMHA_IMPL_UNFUSED
                                            : CLMHA_IMPL_FUSED;
    size_t out_count = 0, w_count = 0;
    if (clmha_layer_output_counts(layer, &args, &out_count, &w_count) != CLMHA_SUCCESS) {
        report("bench", "%s: %s", where, clmha_context_last_error(ctx));
        goto done;
    }
    res->s_padded = s + d->add_bias_kv + d->add_zero_attn;
    counts[3] = out_count;
    counts[4] = w_count;
    if (self) counts[1] = 0;
    if (self || kv_same) counts[2] = 0;

    // The buffers, with random inputs and a zeroed output.
    cl_context cl = clmha_context_cl_context(ctx);
    cl_ulong max_alloc = 0;
    clGetDeviceInfo(clmha_context_cl_device(ctx), CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof max_alloc,
                    &max_alloc, NULL);
    static const char *names[5] = {"query", "key", "value", "output", "weights"};
    uint64_t rng = 7;
    for (int i = 0; i < 5; ++i) {
        if (!counts[i]) continue;
        what = names[i];
        if (max_alloc && (cl_ulong)counts[i] * sizeof(float) > max_alloc) {
            report("bench", "%s: the %s buffer needs %zu bytes, more than the largest allocation "
                   "of %s (%llu bytes)", where, names[i], counts[i] * sizeof(float),
                   clmha_context_device_name(ctx), (unsigned long long)max_alloc);
            goto done;
        }
        bufs[i] = clCreateBuffer(cl, CL_MEM_READ_WRITE, counts[i] * sizeof(float), NULL, &err);
        if (err != CL_SUCCESS) goto cl_fail;
        if (i < 3) {
            err = fill_random(queue, bufs[i], counts[i], &rng);
        } else {
            float zero = 0.0f;
            err = clEnqueueFillBuffer(queue, bufs[i], &zero, sizeof zero, 0,
                                      counts[i] * sizeof(float), 0, NULL, NULL);
        }
        if (err != CL_SUCCESS) goto cl_fail;
    }
    what = "clFinish";
    if ((err = clFinish(queue)) != CL_SUCCESS) goto cl_fail;
    args.query.buffer = bufs[0];
    if (!self) args.key.buffer = bufs[1];
    if (!self && !kv_same) args.value.buffer = bufs[2];

    // Warm-up: bake sizes the scratch and runs the forward once at this shape, which compiles
    // the kernels. Bake runs cross-attention with separate key and value tensors, so the
    // cross-attention path with key = value runs once more here.
    clmha_status st = clmha_layer_bake(layer, n, l, s, cfg->need_weights);
    if (!st && !self)
        st = clmha_layer_forward(layer, &args, bufs[3], 0, bufs[4], 0, 0, NULL, NULL);
    if (!st && clFinish(queue) != CL_SUCCESS) st = CLMHA_OPENCL_ERROR;
    if (st) goto forward_fail;

    for (size_t r = 0; r < cfg->repeat; ++r) {
        double t0 = monotonic_ms();
        if ((st = clmha_layer_forward(layer, &args, bufs[3], 0, bufs[4], 0, 0, NULL, NULL)))
            goto forward_fail;
        what = "clFinish";
        if ((err = clFinish(queue)) != CL_SUCCESS) goto cl_fail;
        times[r] = monotonic_ms() - t0;
    }
    qsort(times, cfg->repeat, sizeof *times, cmp_double);
    size_t r = cfg->repeat;
    res->ms = r % 2 ? times[r / 2] : 0.5 * (times[r / 2 - 1] + times[r / 2]);
    res->ms_min = times[0];
    res->ms_max = times[r - 1];

    // One more run with a marker after every stage.
    if ((st = clmha_layer_set_profiling(layer, true)) ||
        (st = clmha_layer_forward(layer, &args, bufs[3], 0, bufs[4], 0, 0, NULL, NULL)) ||
        (st = clmha_layer_stage_times(layer, res->stage_ms)) ||
        (st = clmha_layer_set_profiling(layer, false)))
        goto forward_fail;
    what = "clFinish";
    if ((err = clFinish(queue)) != CL_SUCCESS) goto cl_fail;

    res->scratch_bytes = clmha_layer_scratch_bytes(layer);
    double dn = (double)n, dl = (double)l, ds = (double)s, de = (double)e;
    res->flops = 2.0 * dn * de * (dl * de + ds * (double)kd + ds * (double)vd + dl * de) +
                 4.0 * dn * dl * (double)res->s_padded * de;
    rc = EXIT_OK;
    goto done;
forward_fail:
    report("bench", "forward pass failed on %s at %s: %s: %s", clmha_context_device_name(ctx),
           where, clmha_status_string(st), clmha_context_last_error(ctx));
    goto done;
cl_fail:
    report("bench", "%s: %s%s failed on %s: OpenCL error %d", where, what,
           strcmp(what, "clFinish") ? " buffer" : "", clmha_context_device_name(ctx), (int)err);
done:
    for (int i = 0; i < 5; ++i)
        if (bufs[i]) clReleaseMemObject(bufs[i]);
    clmha_layer_release(layer);
    return rc;
}

static void bench_print(const clmha_context *ctx, const bench_config *cfg,
                        const bench_result *res) {
    const clmha_layer_desc *d = &cfg->desc;
    if (cfg->json) {
        printf("{\"device\": ");
        json_string(clmha_context_device_name(ctx));
        printf(", \"layer\": ");
        if (cfg->layer_path)
            json_string(cfg->layer_path);
        else
            printf("null");
        printf(", \"batch\": %zu, \"tgt_len\": %zu, \"src_len\": %zu, \"embed_dim\": %zu, "
               "\"num_heads\": %zu, \"kdim\": %zu, \"vdim\": %zu, \"batch_first\": %s, "
               "\"need_weights\": %s, \"impl\": \"%s\", \"attention\": \"%s\", "
               "\"repeat\": %zu, \"ms\": %.6g, "
               "\"ms_min\": %.6g, \"ms_max\": %.6g, \"flops\": %.0f, \"gflops\": %.6g, "
               "\"scratch_bytes\": %zu, \"stages\": {",
               res->n, res->l, res->s, d->embed_dim, d->num_heads, d->kdim, d->vdim,
               d->batch_first ? "true" : "false", cfg->need_weights ? "true" : "false",
               clmha_impl_name(res->impl), res->self ? "self" : "cross", cfg->repeat, res->ms, res->ms_min, res->ms_max,
               res->flops, res->flops / res->ms / 1e6, res->scratch_bytes);
        for (int i = 0; i < CLMHA_STAGE_COUNT; ++i)
            printf("%s\"%s\": %.6g", i ? ", " : "", clmha_stage_name((clmha_stage)i),
                   res->stage_ms[i]);
        printf("}}\n");
        fflush(stdout);
        return;
    }
    double total = 0;
    for (int i = 0; i < CLMHA_STAGE_COUNT; ++i) total += res->stage_ms[i];
    printf("shape:   N %zu, L %zu, S %zu (%s-attention%s), need_weights %s, %s core\n",
           res->n, res->l, res->s, res->self ? "self" : "cross",
           res->self ? ", packed QKV projection"
           : d->kdim == d->vdim ? ", key = value" : ", separate key and value",
           cfg->need_weights ? "on" : "off", clmha_impl_name(res->impl));
    printf("time:    %.3f ms per forward (median of %zu; min %.3f, max %.3f)\n", res->ms,
           cfg->repeat, res->ms_min, res->ms_max);
    printf("speed:   %.2f GFLOP/s (%.4g GFLOP per forward)\n", res->flops / res->ms / 1e6,
           res->flops / 1e9);
    printf("scratch: %zu bytes (%.1f MiB)\n", res->scratch_bytes,
           (double)res->scratch_bytes / (1024.0 * 1024.0));
    printf("stages:  (one profiled run, %.3f ms)\n", total);
    for (int i = 0; i < CLMHA_STAGE_COUNT; ++i)
        printf("  %-9s %10.3f ms %5.1f%%\n", clmha_stage_name((clmha_stage)i), res->stage_ms[i],
               total > 0 ? 100.0 * res->stage_ms[i] / total : 0.0);
    fflush(stdout);
}

static int cmd_bench(int argc, char **argv) {
    const char *batch_opt = NULL, *tgt_opt = NULL, *src_opt = NULL, *embed_opt = NULL,
               *heads_opt = NULL, *repeat_opt = NULL, *layer_path = NULL, *device = NULL,
               *impl_opt = NULL;
    bool need_weights = false, batch_first = false, json = false, help = false;
    const option_spec opts[] = {
        {.name = "--impl", .value = &impl_opt},
        {.name = "--batch", .value = &batch_opt},
        {.name = "--tgt-len", .value = &tgt_opt},
        {.name = "--src-len", .value = &src_opt},
        {.name = "--embed", .value = &embed_opt},
        {.name = "--heads", .value = &heads_opt},
        {.name = "--need-weights", .flag = &need_weights},
        {.name = "--batch-first", .flag = &batch_first},
        {.name = "--layer", .value = &layer_path},
        {.name = "--repeat", .value = &repeat_opt},
        {.name = "--device", .value = &device, .allow_empty = true},
        {.name = "--json", .flag = &json},
    };
    int rc = parse_options("bench", argc, argv, opts, sizeof opts / sizeof opts[0], &help);
    if (rc != EXIT_OK) return rc;
    if (help) {
        fputs(usage_bench, stdout);
        return EXIT_OK;
    }
    size_t batches[BENCH_MAX_LIST] = {8}, tgts[BENCH_MAX_LIST] = {128}, srcs[BENCH_MAX_LIST];
    size_t nb = 1, nt = 1, ns = 0, e = 512, h = 8, repeat = 10, one = 0;
    if ((batch_opt && (rc = parse_sizes("--batch", batch_opt, BENCH_MAX_LIST, BENCH_MAX_SIZE,
                                        batches, &nb))) ||
        (tgt_opt && (rc = parse_sizes("--tgt-len", tgt_opt, BENCH_MAX_LIST, BENCH_MAX_SIZE,
                                      tgts, &nt))) ||
        (src_opt && (rc = parse_sizes("--src-len", src_opt, BENCH_MAX_LIST, BENCH_MAX_SIZE,
                                      srcs, &ns))) ||
        (embed_opt && (rc = parse_sizes("--embed", embed_opt, 1, BENCH_MAX_SIZE, &e, &one))) ||
        (heads_opt && (rc = parse_sizes("--heads", heads_opt, 1, BENCH_MAX_SIZE, &h, &one))) ||
        (repeat_opt &&
         (rc = parse_sizes("--repeat", repeat_opt, 1, BENCH_MAX_REPEAT, &repeat, &one))))
        return rc;
    if (!layer_path && e % h != 0) {
        report("bench", "--embed %zu is not a multiple of --heads %zu", e, h);
        return EXIT_USAGE;
    }
    clmha_impl impl;
    if (!parse_impl("bench", impl_opt, need_weights, "--need-weights", &impl))
        return EXIT_USAGE;

    bench_config cfg = {.layer_path = layer_path, .need_weights = need_weights, .json = json,
                        .impl = impl, .repeat = repeat};
    cfg.desc = (clmha_layer_desc){.struct_size = sizeof cfg.desc,
                                  .embed_dim = e, .num_heads = h, .kdim = e, .vdim = e,
                                  .bias = true, .batch_first = batch_first};
    float *params = NULL;
    double *times = NULL;
    clmha_context *ctx = NULL;
    clmha_layer *layer = NULL;
    rc = EXIT_REFUSED;
    if (layer_path) {
        FILE *f = fopen(layer_path, "rb");
        if (!f) {
            report("bench", "--layer %s: cannot open: %s", layer_path, strerror(errno));
            goto done;
        }
        fclose(f);
    }
    if (!(times = malloc(repeat * sizeof *times))) {
        report("bench", "out of host memory");
        goto done;
    }
    if (!(ctx = open_context("bench", device))) goto done;
    if (layer_path) {  // the file's configuration
        if (!(layer = bench_layer(ctx, &cfg))) goto done;
        clmha_layer_get_desc(layer, &cfg.desc);
        clmha_layer_release(layer);
        layer = NULL;
        const clmha_layer_desc *d = &cfg.desc;
        if ((embed_opt && d->embed_dim != e) || (heads_opt && d->num_heads != h) ||
            (batch_first && !d->batch_first)) {
            report("bench", "--layer %s has embed_dim %zu, num_heads %zu, batch_first %s: "
                   "it disagrees with %s", layer_path, d->embed_dim, d->num_heads,
                   d->batch_first ? "true" : "false",
                   embed_opt && d->embed_dim != e ? "--embed"
                   : heads_opt && d->num_heads != h ? "--heads" : "--batch-first");
            goto done;
        }
    } else {  // random parameters, PyTorch-like scale
        if (e > BENCH_MAX_SIZE / 4 / e ||
            !(params = malloc((4 * e * e + 4 * e) * sizeof *params))) {
            report("bench", "--embed %zu: out of host memory for the parameters", e);
            goto done;
        }
        cfg.w_in = params;
        cfg.w_out = params + 3 * e * e;
        cfg.b_in = params + 4 * e * e;
        cfg.b_out = params + 4 * e * e + 3 * e;
        uint64_t rng = 42;
        float a = 1.0f / sqrtf((float)e);
        for (size_t i = 0; i < 4 * e * e; ++i) params[i] = a * uniform(&rng);
        for (size_t i = 4 * e * e; i < 4 * e * e + 4 * e; ++i) params[i] = 0.1f * uniform(&rng);
    }
    if (!json) {
        const clmha_layer_desc *d = &cfg.desc;
        printf("device:  %s\n", clmha_context_device_name(ctx));
        printf("layer:   embed_dim %zu, num_heads %zu, kdim %zu, vdim %zu%s%s%s%s (%s)\n",
               d->embed_dim, d->num_heads, d->kdim, d->vdim, d->bias ? ", bias" : "",
               d->add_bias_kv ? ", add_bias_kv" : "", d->add_zero_attn ? ", add_zero_attn" : "",
               d->batch_first ? ", batch_first" : "", layer_path ? layer_path : "random");
        fflush(stdout);
    }
    for (size_t ib = 0; ib < nb; ++ib)
        for (size_t it = 0; it < nt; ++it)
            for (size_t is = 0; is < (ns ? ns : 1); ++is) {
                bench_result res;
                size_t s = ns ? srcs[is] : tgts[it];
                if (bench_shape(ctx, &cfg, batches[ib], tgts[it], s, times, &res) != EXIT_OK)
                    goto done;
                bench_print(ctx, &cfg, &res);
            }
    rc = EXIT_OK;
done:
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    free(params);
    free(times);
    return rc;
}

// ---- main -------------------------------------------------------------------------------------

// `clmha tune` lives in src/cli_tune.c.

// The subcommands: name and entry point (called with the arguments after the name).
static const struct command {
    const char *name;
    int (*run)(int argc, char **argv);
} commands[] = {
    {"devices", cmd_devices},
    {"run", cmd_run},
    {"demo", cmd_demo},
    {"bench", cmd_bench},
    {"tune", clmha__cli_tune},
};
enum { NUM_COMMANDS = sizeof commands / sizeof commands[0] };

int main(int argc, char **argv) {
    char names[256] = "";  // "devices, run, demo, bench"
    for (size_t i = 0; i < NUM_COMMANDS; ++i)
        snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "",
                 commands[i].name);
    if (argc < 2) {
        report(NULL, "no command given (%s; try 'clmha --help')", names);
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
    if (starts_with(cmd, "-"))
        report(NULL, "unknown option '%s' (try 'clmha --help')", cmd);
    else
        report(NULL, "unknown command '%s' (%s; try 'clmha --help')", cmd, names);
    return EXIT_USAGE;
}
