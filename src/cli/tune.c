// `clmha tune`: tunes a device and stores the result (clmha_context_tune()): CLBlast's GEMM
// parameters where the device's products run in CLBlast, the fused core's tiles and the decode
// core's split everywhere (on a host-BLAS device, only those two).
//
// Exit status as for the other commands: 0 success (also when nothing faster was found),
// 1 a device or library failure, 2 a usage error.
#define _POSIX_C_SOURCE 200809L

#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

enum { MAX_TUNE_SHAPES = 4 };

static const char *usage_tune =
    "usage: clmha tune [--device SPEC] [--budget SECONDS] [--shape N,L,E[,H]]... [--no-store]\n"
    "                  [--candidates N] [--trace]\n"
    "\n"
    "Tunes a device for clmha and stores the result. What is tuned depends on where the\n"
    "device's matrix products run (the 'gemm:' line; CLMHA_GEMM chooses):\n"
    "  - in CLBlast (GPUs, and CPU drivers without native kernels): CLBlast's GEMM\n"
    "    parameters, then the fused attention kernel's tiles, then the decode core's split;\n"
    "  - in the host BLAS (CPU drivers with native kernels: PoCL, Intel's CPU runtime;\n"
    "    oneDNN or OpenBLAS): only the fused tiles and the decode split, with the whole\n"
    "    budget, as CLBlast's GEMM parameters are never used there.\n"
    "\n"
    "The GEMM search tries the parameters of the indirect (Xgemm) and direct (XgemmDirect)\n"
    "kernels and the size where CLBlast switches between them, timing sgemm 1024^3 and the\n"
    "GEMMs of the layer shapes; every candidate is checked against a CPU GEMM and costs a\n"
    "kernel build (about 6 s on PoCL). 'Default' is CLBlast's own parameters (neither a\n"
    "stored tuning nor the device's built-in set is applied first; the built-in set is among\n"
    "the first candidates). Then the fused attention kernel's tiles are timed and, last, how\n"
    "the decode core splits a KV cache's keys into ranges (one decode step at 512 and 8192\n"
    "cached keys), with the rest of the budget. Prints the gain and writes the device's\n"
    "tuning file, which every later clmha context on the device loads: $CLMHA_TUNING_DIR,\n"
    "else $XDG_CACHE_HOME/clmha, else ~/.cache/clmha.\n"
    "\n"
    "options:\n"
    "  --device SPEC      \"P:D\", gpu, cpu, accelerator or part of a device name (see\n"
    "                     clmha devices); default: $CLMHA_DEVICE, else the first GPU, else\n"
    "                     the first device\n"
    "  --budget SECONDS   wall-clock budget (default 300; the final check may add a few\n"
    "                     kernel builds)\n"
    "  --shape N,L,E[,H]  a layer shape to tune for: batch, sequence length, embed_dim and\n"
    "                     heads (default H 8); up to 4 times; default 8,128,512,8\n"
    "  --no-store         apply and report, but do not write the tuning file\n"
    "  --candidates N     each search (CLBlast's two GEMM kernels, the fused tiles, the\n"
    "                     decode split) stops after N candidates (default: as many as the\n"
    "                     budget allows); with a budget not reached, every run tries the\n"
    "                     same candidates\n"
    "  --trace            print a line per candidate (its parameters and GFLOP/s or why it\n"
    "                     was rejected), the timings in turns, the split and the final check\n"
    "                     to stderr\n"
    "  --help, -h         print this help\n"
    "\n"
    "exit status: 0 success, 1 device or library failure, 2 usage error\n";

// "8,128,512" or "8,128,512,8".
static bool parse_shape(const char *text, clmha_tune_shape *s) {
    size_t v[4] = {0, 0, 0, 8};
    int n = 0;
    const char *p = text;
    while (n < 4) {
        if (!isdigit((unsigned char)*p)) return false;
        errno = 0;
        char *end;
        unsigned long long x = strtoull(p, &end, 10);
        if (errno || x == 0 || x > 1000000) return false;
        v[n++] = (size_t)x;
        if (*end == '\0') break;
        if (*end != ',') return false;
        p = end + 1;
    }
    if (n < 3 || *p == '\0') return false;
    if (n == 4 && strchr(p, ',')) return false;
    *s = (clmha_tune_shape){.batch = v[0], .tgt_len = v[1], .embed_dim = v[2], .num_heads = v[3]};
    return true;
}

typedef struct bar_state {
    bool tty;
    char last[256];
    bool open;  // a \r line is on the terminal
} bar_state;

static void on_progress(double fraction, const char *message, void *user_data) {
    bar_state *b = user_data;
    if (fraction < 0) {  // a trace line (--trace): a line of its own, the bar stays
        if (b->open) fputc('\n', stderr);
        b->open = false;
        fprintf(stderr, "%s\n", message);
        fflush(stderr);
        return;
    }
    enum { WIDTH = 20 };
    int full = (int)lround(fmin(1.0, fmax(0.0, fraction)) * WIDTH);
    char bar[WIDTH + 1];
    for (int i = 0; i < WIDTH; ++i) bar[i] = i < full ? '#' : '.';
    bar[WIDTH] = '\0';
    if (b->tty) {
        fprintf(stderr, "\r\033[K[%s] %s", bar, message);
        b->open = true;
    } else if (strcmp(b->last, message) != 0) {  // logs: one line per change
        fprintf(stderr, "[%s] %s\n", bar, message);
    }
    snprintf(b->last, sizeof b->last, "%s", message);
    fflush(stderr);
}

static void print_gain(const char *what, double before, double after) {
    if (before > 0)
        printf("  %-36s default %7.1f GFLOP/s  tuned %7.1f GFLOP/s  (x%.2f)\n", what, before,
               after, after / before);
}

// What the command line asks for.
typedef struct tune_args {
    const char *device;  // --device (NULL: $CLMHA_DEVICE, else the default)
    const char *budget_text, *candidates_text;
    bool device_given, no_store, trace;
    clmha_tune_shape shapes[MAX_TUNE_SHAPES];
    size_t num_shapes;
    double budget;  // seconds
    size_t candidates;  // --candidates (0: no limit)
} tune_args;

// The value of option @p which (0 --device, 1 --budget, 2 --shape, 3 --candidates) into @p a.
// Reports a usage error and returns false.
static bool take_value(tune_args *a, int which, const char *value) {
    if (which == 3) {
        char *end;
        errno = 0;
        unsigned long long n = strtoull(value, &end, 10);
        if (a->candidates_text) {
            clmha__cli_report("tune", "--candidates given twice");
            return false;
        }
        if (errno || end == value || *end || value[0] == '-' || n < 1 || n > 1000000) {
            clmha__cli_report("tune", "--candidates %s: expected a count from 1 to 1000000",
                              value);
            return false;
        }
        a->candidates_text = value, a->candidates = (size_t)n;
    } else if (which == 0) {
        if (a->device_given) {
            clmha__cli_report("tune", "--device given twice");
            return false;
        }
        a->device = value, a->device_given = true;
    } else if (which == 1) {
        if (a->budget_text) {
            clmha__cli_report("tune", "--budget given twice");
            return false;
        }
        a->budget_text = value;
    } else {
        if (a->num_shapes == MAX_TUNE_SHAPES) {
            clmha__cli_report("tune", "--shape given more than %d times", MAX_TUNE_SHAPES);
            return false;
        }
        clmha_tune_shape *s = &a->shapes[a->num_shapes];
        if (!parse_shape(value, s) || s->embed_dim % s->num_heads) {
            clmha__cli_report("tune",
                              "--shape %s: expected N,L,E or N,L,E,H (positive integers, E a "
                              "multiple of H), e.g. 8,128,512,8",
                              value);
            return false;
        }
        ++a->num_shapes;
    }
    return true;
}

// --budget SECONDS (default 300) into a->budget. Reports a usage error and returns false.
static bool parse_budget(tune_args *a) {
    a->budget = 300;
    if (!a->budget_text) return true;
    char *end;
    errno = 0;
    a->budget = strtod(a->budget_text, &end);
    if (errno || end == a->budget_text || *end || !(a->budget > 0) || a->budget > 86400) {
        clmha__cli_report("tune", "--budget %s: expected seconds, more than 0 and at most 86400",
                          a->budget_text);
        return false;
    }
    return true;
}

// Parses the command line into @p a. Returns true when the command goes on; else false with
// *rc EXIT_OK (after --help) or EXIT_USAGE (after reporting).
static bool parse_args(int argc, char **argv, tune_args *a, int *rc) {
    *rc = EXIT_USAGE;
    for (int i = 0; i < argc; ++i) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            fputs(usage_tune, stdout);
            *rc = EXIT_OK;
            return false;
        }
        bool *flag = strcmp(arg, "--no-store") == 0 ? &a->no_store
                     : strcmp(arg, "--trace") == 0  ? &a->trace
                                                    : NULL;
        if (flag) {
            *flag = true;
            continue;
        }
        const char *names[] = {"--device", "--budget", "--shape", "--candidates"};
        int which = -1;
        const char *value = NULL;
        for (int k = 0; k < 4 && which < 0; ++k) {
            size_t len = strlen(names[k]);
            if (strncmp(arg, names[k], len) == 0 && (arg[len] == '\0' || arg[len] == '=')) {
                which = k;
                if (arg[len] == '=')
                    value = arg + len + 1;
                else if (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0)
                    value = argv[++i];
            }
        }
        if (which < 0) {
            clmha__cli_report("tune", "%s '%s' (try 'clmha tune --help')",
                              strncmp(arg, "--", 2) == 0 ? "unknown option" : "unexpected argument",
                              arg);
            return false;
        }
        if (!value) {
            clmha__cli_report("tune", "%s needs a value", names[which]);
            return false;
        }
        if (!take_value(a, which, value)) return false;
    }
    if (!parse_budget(a)) return false;
    if (!a->num_shapes) {
        a->shapes[0] = (clmha_tune_shape){.batch = 8, .tgt_len = 128, .embed_dim = 512,
                                          .num_heads = 8};
        a->num_shapes = 1;
    }
    return true;
}

// The device, where its GEMMs run, the budget and the shapes.
static void print_header(clmha_context *ctx, const tune_args *a) {
    printf("device:   %s\n", clmha_context_device_name(ctx));
    char gemm_note[512];
    if (clmha_context_gemm_note(ctx, gemm_note, sizeof gemm_note) == CLMHA_SUCCESS)
        printf("gemm:     %s\n", gemm_note);
    printf("budget:   %.0f s, shapes:", a->budget);
    for (size_t i = 0; i < a->num_shapes; ++i)
        printf(" (N %zu, L %zu, E %zu, H %zu)", a->shapes[i].batch, a->shapes[i].tgt_len,
               a->shapes[i].embed_dim, a->shapes[i].num_heads);
    printf("\n");
    fflush(stdout);
}

// What was found, the gains and where the result went.
static void print_report(clmha_context *ctx, const clmha_tune_report *rep, bool no_store) {
    printf("result:   %s after %zu candidates (%zu rejected) in %.0f s\n",
           rep->improved ? "faster parameters found" : "nothing faster found", rep->candidates,
           rep->rejected, rep->seconds);
    if (clmha_context_gemm(ctx) != CLMHA_GEMM_HOST) {  // else CLBlast's GEMMs were not timed
        print_gain("sgemm 1024^3 (row-major, B^T)", rep->default_gflops, rep->tuned_gflops);
        char what[96];
        snprintf(what, sizeof what, "QKV projection of %s", rep->layer);
        print_gain(what, rep->default_layer_gflops, rep->tuned_layer_gflops);
        print_gain("all GEMMs of the layer shapes", rep->default_forward_gemm_gflops,
                   rep->tuned_forward_gemm_gflops);
    }
    if (rep->default_fused_gflops > 0)
        print_gain("fused attention (first layer shape)", rep->default_fused_gflops,
                   rep->tuned_fused_gflops);
    if (rep->default_decode_ms > 0)
        printf("  %-36s default %7.3f ms       tuned %7.3f ms       (x%.2f)\n",
               "decode step (512 + 8192 cached keys)", rep->default_decode_ms,
               rep->tuned_decode_ms, rep->default_decode_ms / rep->tuned_decode_ms);
    if (rep->parameters[0]) printf("params:   %s\n", rep->parameters);
    if (rep->stored)
        printf("written:  %s\n", rep->path);
    else if (rep->improved && no_store)
        printf("written:  nothing (--no-store); the file would be %s\n", rep->path);
    if (rep->message[0]) printf("note:     %s\n", rep->message);
}

int clmha__cli_tune(int argc, char **argv) {
    tune_args a = {0};
    int rc;
    if (!parse_args(argc, argv, &a, &rc)) return rc;
    // Compare with CLBlast's own parameters: do not load the stored tuning first.
    setenv("CLMHA_TUNING", "off", 1);
    clmha_context *ctx = clmha__cli_open_context("tune", a.device);
    if (!ctx) return EXIT_REFUSED;
    print_header(ctx, &a);
    bar_state bar = {.tty = isatty(STDERR_FILENO) != 0};
    clmha_tune_options opts = {.struct_size = sizeof opts,
                               .budget_seconds = a.budget,
                               .shapes = a.shapes,
                               .num_shapes = a.num_shapes,
                               .progress = on_progress,
                               .user_data = &bar,
                               .no_store = a.no_store,
                               .trace = a.trace,
                               .max_candidates = a.candidates};
    clmha_tune_report rep = {.struct_size = sizeof rep};
    clmha_status st = clmha_context_tune(ctx, &opts, &rep);
    if (bar.open) fputc('\n', stderr);
    if (st != CLMHA_SUCCESS) {
        clmha__cli_report("tune", "%s: %s", clmha_status_string(st), clmha_context_last_error(ctx));
        clmha_context_release(ctx);
        return EXIT_REFUSED;
    }
    print_report(ctx, &rep, a.no_store);
    clmha_context_release(ctx);
    return EXIT_OK;
}
