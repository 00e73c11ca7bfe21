// Side-by-side sgemm: CLBlast with its generic parameters, CLBlast with the parameters context
// creation applied (the stored clmha tuning, else the device's built-in set), optionally tuning
// files and extra Xgemm parameter sets, and OpenBLAS, timed in turns in one process.
//
// usage: gemm_ratio [--size S] [--reps R] [--threads T] [--layouts L,...] [--openblas PATH]
//                   [--import FILE]... [--xgemm PARAMS [--transpose P]]... [--no-default]
//   --size S        m = n = k = S (default 1024)
//   --reps R        timed rounds (default 15); each round runs every configuration once, in an
//                   order that rotates from round to round
//   --threads T     OpenBLAS threads (default: the device's compute units)
//   --layouts L     comma-separated, of cm-nn, cm-nt, cm-tn, rm-nn, rm-nt (default
//                   cm-nt,rm-nt): column- or row-major, op(A) op(B) with N plain, T transposed.
//                   With GEMMK 0, CLBlast's indirect Xgemm wants col-major A and C and B
//                   transposed, so cm-nt runs no pad/transpose kernels at 1024³; rm-nt (what
//                   clmha's projections call, x·Wᵀ) transposes A, B and C; cm-tn (the same
//                   product computed as Cᵀ = W·xᵀ in column-major) transposes A and B only.
//   --xgemm PARAMS  an extra CLBlast configuration: the 16 Xgemm values in CLBlast's order
//                   (GEMMK KREG KWG KWI MDIMA MDIMC MWG NDIMB NDIMC NWG SA SB STRM STRN VWM VWN),
//                   separated by commas or spaces, or as NAME=VALUE pairs; the indirect path is
//                   forced (XGEMM_MIN_INDIRECT_SIZE=0). Up to 8.
//   --transpose P   CLBlast's "Transpose" kernel (TRA_DIM TRA_PAD TRA_SHUFFLE TRA_WPT) for the
//                   last --xgemm configuration; every other configuration gets CLBlast's
//                   generic 8 0 1 4. At 1024³ it runs for the layouts that transpose (rm-nt:
//                   A, B and C; cm-tn: A and B).
//   --import FILE   an extra configuration: a tuning file (clmha_context_tuning_import()), e.g.
//                   a stored tuning while the context runs the built-in set. Up to 4.
//   --no-default    skip CLBlast's generic parameters
// The device is $CLMHA_DEVICE's (see clmha_context_create_from_env()); the parameters in effect
// are those context creation applies: the stored tuning ($CLMHA_TUNING_DIR, else
// ~/.cache/clmha), else the device class's built-in set ("clblast-stored" or
// "clblast-builtin" below). Built-in against tuned, side by side:
//   CLMHA_TUNING=builtin gemm_ratio --import ~/.cache/clmha/<device>.json
//
// Every call is timed on the host clock (CLBlast: clFinish included, so the pad/transpose kernels
// and CLBlast's temporary buffers count). Prints the median, fastest and slowest GFLOP/s of each
// configuration and layout, and the ratio tuned/OpenBLAS: of the medians, and the median of the
// per-round ratios. Each CLBlast result is checked against OpenBLAS's (max |diff| / max |C|).
// Exit status: 0 done, 1 usage or setup error, 2 OpenBLAS not found, 3 a result was wrong.
#define _POSIX_C_SOURCE 200809L
#include <clmha.h>

#include <clblast_c.h>
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_CONFIGS 16
#define MAX_REPS 200
#define XGEMM_PARAMS 16

enum { CBLAS_ROW_MAJOR = 101, CBLAS_COL_MAJOR = 102, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };
typedef void (*cblas_sgemm_fn)(int layout, int ta, int tb, int m, int n, int k, float alpha,
                               const float *a, int lda, const float *b, int ldb, float beta,
                               float *c, int ldc);
typedef void (*set_threads_fn)(int);
typedef char *(*get_config_fn)(void);

static const char *const xgemm_names[XGEMM_PARAMS] = {
    "GEMMK", "KREG", "KWG", "KWI", "MDIMA", "MDIMC", "MWG", "NDIMB",
    "NDIMC", "NWG",  "SA",  "SB",  "STRM",  "STRN",  "VWM", "VWN"};
static const char *const direct_names[10] = {"KWID", "MDIMAD", "MDIMCD", "NDIMBD", "NDIMCD",
                                             "PADA", "PADB",   "VWMD",   "VWND",   "WGD"};
static const char *const routine_names[1] = {"XGEMM_MIN_INDIRECT_SIZE"};

// CLBlast 1.5.3's single-precision database entries for a device without its own (PoCL): what
// "default" means here.
static const size_t generic_xgemm[XGEMM_PARAMS] = {0, 1, 32, 2, 8, 8, 32, 16,
                                                   16, 32, 1, 1, 0, 0, 4, 2};
static const size_t generic_direct[10] = {2, 8, 8, 8, 8, 1, 1, 1, 1, 16};
static const size_t generic_min_indirect = 896;
static const char *const transpose_names[4] = {"TRA_DIM", "TRA_PAD", "TRA_SHUFFLE", "TRA_WPT"};
static const size_t generic_transpose[4] = {8, 0, 1, 4};

typedef enum { CFG_DEFAULT, CFG_TUNED, CFG_IMPORT, CFG_XGEMM, CFG_OPENBLAS } cfg_kind;

typedef struct config {
    cfg_kind kind;
    char name[40];
    size_t xgemm[XGEMM_PARAMS];  // CFG_XGEMM
    bool has_transpose;          // CFG_XGEMM: transpose[] replaces the generic Transpose set
    size_t transpose[4];
    const char *json;            // CFG_TUNED, CFG_IMPORT: the tuning imported for each turn
    double t[MAX_REPS];          // seconds per round, per layout (refilled for each layout)
} config;

typedef struct layout {
    const char *name;
    CLBlastLayout blast;
    int cblas;
    bool ta, tb;
} layout;

static const layout layouts_known[] = {
    {"cm-nn", CLBlastLayoutColMajor, CBLAS_COL_MAJOR, false, false},
    {"cm-nt", CLBlastLayoutColMajor, CBLAS_COL_MAJOR, false, true},
    {"cm-tn", CLBlastLayoutColMajor, CBLAS_COL_MAJOR, true, false},
    {"rm-nn", CLBlastLayoutRowMajor, CBLAS_ROW_MAJOR, false, false},
    {"rm-nt", CLBlastLayoutRowMajor, CBLAS_ROW_MAJOR, false, true},
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, size_t n) {
    double s[MAX_REPS];
    memcpy(s, v, n * sizeof *s);
    qsort(s, n, sizeof *s, cmp_double);
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

// "0 1 16 2 ..." or "0,1,16,..." (CLBlast's order) or "GEMMK=0,KREG=1,...".
static bool parse_xgemm(const char *spec, size_t *p) {
    bool named = strchr(spec, '=') != NULL, seen[XGEMM_PARAMS] = {false};
    char buf[512];
    snprintf(buf, sizeof buf, "%s", spec);
    size_t count = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok;
         tok = strtok_r(NULL, ", ", &save)) {
        int at = (int)count;
        char *value = tok;
        if (named) {
            char *eq = strchr(tok, '=');
            if (!eq) return false;
            *eq = '\0';
            value = eq + 1;
            at = -1;
            for (int i = 0; i < XGEMM_PARAMS; ++i)
                if (strcmp(tok, xgemm_names[i]) == 0) at = i;
        }
        char *end;
        unsigned long v = strtoul(value, &end, 10);
        if (at < 0 || at >= XGEMM_PARAMS || *end || end == value || seen[at]) return false;
        p[at] = v;
        seen[at] = true;
        ++count;
    }
    return count == XGEMM_PARAMS;
}

static bool override(cl_device_id dev, const char *kernel, size_t n, const char *const *names,
                     const size_t *values) {
    int st = CLBlastOverrideParameters(dev, kernel, CLBlastPrecisionSingle, n,
                                       (const char **)names, values);
    if (st != CLBlastSuccess)
        fprintf(stderr, "gemm_ratio: CLBlastOverrideParameters(%s) failed: %d\n", kernel, st);
    return st == CLBlastSuccess;
}

// Puts the parameters of @p c in effect (CLBlast keeps them per device, process-wide).
static bool select_config(clmha_context *ctx, cl_device_id dev, const config *c) {
    size_t zero = 0;
    if (c->kind != CFG_OPENBLAS &&
        !override(dev, "Transpose", 4, transpose_names,
                  c->has_transpose ? c->transpose : generic_transpose))
        return false;
    switch (c->kind) {
    case CFG_DEFAULT:
        return override(dev, "Xgemm", XGEMM_PARAMS, xgemm_names, generic_xgemm) &&
               override(dev, "XgemmDirect", 10, direct_names, generic_direct) &&
               override(dev, "GemmRoutine", 1, routine_names, &generic_min_indirect);
    case CFG_TUNED:
    case CFG_IMPORT:
        if (clmha_context_tuning_import(ctx, c->json) == CLMHA_SUCCESS) return true;
        fprintf(stderr, "gemm_ratio: %s: %s\n", c->name, clmha_context_last_error(ctx));
        return false;
    case CFG_XGEMM:
        return override(dev, "Xgemm", XGEMM_PARAMS, xgemm_names, c->xgemm) &&
               override(dev, "GemmRoutine", 1, routine_names, &zero);
    case CFG_OPENBLAS: return true;
    }
    return false;
}

typedef struct problem {
    size_t s;
    float *ha, *hb, *hc, *ref;
    cl_mem a, b, c;
    cl_command_queue queue;
    cblas_sgemm_fn sgemm;
} problem;

static bool run_one(problem *p, const layout *l, cfg_kind kind, double *seconds) {
    int n = (int)p->s;
    double t0 = now_s();
    if (kind == CFG_OPENBLAS) {
        p->sgemm(l->cblas, l->ta ? CBLAS_TRANS : CBLAS_NO_TRANS,
                 l->tb ? CBLAS_TRANS : CBLAS_NO_TRANS, n, n, n, 1.0f, p->ha, n, p->hb, n, 0.0f,
                 p->hc, n);
    } else {
        int st = CLBlastSgemm(l->blast, l->ta ? CLBlastTransposeYes : CLBlastTransposeNo,
                              l->tb ? CLBlastTransposeYes : CLBlastTransposeNo, p->s, p->s, p->s,
                              1.0f, p->a, 0, p->s, p->b, 0, p->s, 0.0f, p->c, 0, p->s, &p->queue,
                              NULL);
        cl_int err = clFinish(p->queue);
        if (st != CLBlastSuccess || err != CL_SUCCESS) {
            fprintf(stderr, "gemm_ratio: CLBlastSgemm failed: CLBlast %d, clFinish %d\n", st,
                    err);
            return false;
        }
    }
    *seconds = now_s() - t0;
    return true;
}

// max |C - ref| / max |ref| of the last CLBlast result.
static double check(problem *p) {
    size_t n = p->s * p->s;
    if (clEnqueueReadBuffer(p->queue, p->c, CL_TRUE, 0, n * sizeof(float), p->hc, 0, NULL, NULL))
        return INFINITY;
    double err = 0, ref = 0;
    for (size_t i = 0; i < n; ++i) {
        if (!isfinite(p->hc[i])) return INFINITY;
        err = fmax(err, fabs((double)p->hc[i] - p->ref[i]));
        ref = fmax(ref, fabs((double)p->ref[i]));
    }
    return err / fmax(ref, 1e-30);
}

// dlsym() into a function pointer (ISO C has no cast from void * to a function pointer; POSIX
// guarantees the representations match).
static bool load_fn(void *lib, const char *name, void *fn, size_t size) {
    void *sym = dlsym(lib, name);
    if (sym) memcpy(fn, &sym, size);
    return sym != NULL;
}

static void *open_openblas(const char *path) {
    const char *tries[] = {path, "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
                           "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
                           "libopenblas.so.0"};
    for (size_t i = 0; i < sizeof tries / sizeof tries[0]; ++i) {
        if (!tries[i] || (path && i > 0)) continue;  // a path given is the only one tried
        void *h = dlopen(tries[i], RTLD_NOW | RTLD_LOCAL);
        if (h && dlsym(h, "cblas_sgemm") && dlsym(h, "openblas_set_num_threads")) {
            printf("OpenBLAS: %s", tries[i]);
            return h;
        }
        if (h) dlclose(h);
    }
    return NULL;
}

// The whole of a text file (malloc'd), or NULL.
static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *text = NULL;
    long len = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (len >= 0 && len < (1 << 20) && fseek(f, 0, SEEK_SET) == 0 && (text = malloc((size_t)len + 1))) {
        if (fread(text, 1, (size_t)len, f) == (size_t)len) {
            text[len] = '\0';
        } else {
            free(text);
            text = NULL;
        }
    }
    fclose(f);
    return text;
}

static void usage(void) {
    fprintf(stderr, "usage: gemm_ratio [--size S] [--reps R] [--threads T] [--layouts L,...] "
                    "[--openblas PATH] [--import FILE]... [--xgemm PARAMS [--transpose P]]... "
                    "[--no-default]\n");
}

int main(int argc, char **argv) {
    size_t size = 1024, reps = 15;
    int threads = 0;
    const char *layout_list = "cm-nt,rm-nt", *openblas_path = NULL;
    bool with_default = true;
    size_t ncfg = 0, nextra = 0, nimport = 0;
    static config extra[8], imports[4];
    for (int i = 1; i < argc; ++i) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--no-default") == 0) {
            with_default = false;
            continue;
        }
        if (!v) {
            usage();
            return 1;
        }
        ++i;
        if (strcmp(a, "--size") == 0) {
            size = strtoul(v, NULL, 10);
        } else if (strcmp(a, "--reps") == 0) {
            reps = strtoul(v, NULL, 10);
        } else if (strcmp(a, "--threads") == 0) {
            threads = atoi(v);
        } else if (strcmp(a, "--layouts") == 0) {
            layout_list = v;
        } else if (strcmp(a, "--openblas") == 0) {
            openblas_path = v;
        } else if (strcmp(a, "--transpose") == 0 && nextra > 0) {
            config *c = &extra[nextra - 1];
            unsigned long t[4];
            if (sscanf(v, "%lu %lu %lu %lu", &t[0], &t[1], &t[2], &t[3]) != 4) {
                fprintf(stderr, "gemm_ratio: --transpose needs TRA_DIM TRA_PAD TRA_SHUFFLE "
                                "TRA_WPT (got \"%s\")\n", v);
                return 1;
            }
            for (int k = 0; k < 4; ++k) c->transpose[k] = t[k];
            c->has_transpose = true;
            snprintf(c->name, sizeof c->name, "xgemm#%zu+tra %lu/%lu/%lu/%lu", nextra, t[0],
                     t[1], t[2], t[3]);
        } else if (strcmp(a, "--import") == 0 && nimport < 4) {
            config *c = &imports[nimport++];
            *c = (config){.kind = CFG_IMPORT};
            const char *base = strrchr(v, '/');
            snprintf(c->name, sizeof c->name, "import %.28s", base ? base + 1 : v);
            if (!(c->json = read_file(v))) {
                fprintf(stderr, "gemm_ratio: cannot read %s\n", v);
                return 1;
            }
        } else if (strcmp(a, "--xgemm") == 0 && nextra < 8) {
            config *c = &extra[nextra];
            memset(c, 0, sizeof *c);
            c->kind = CFG_XGEMM;
            snprintf(c->name, sizeof c->name, "xgemm#%zu", nextra + 1);
            if (!parse_xgemm(v, c->xgemm)) {
                fprintf(stderr, "gemm_ratio: --xgemm needs the 16 Xgemm values (got \"%s\")\n", v);
                return 1;
            }
            ++nextra;
        } else {
            usage();
            return 1;
        }
    }
    if (size < 16 || size > 8192 || reps < 1 || reps > MAX_REPS) {
        fprintf(stderr, "gemm_ratio: --size must be 16 to 8192, --reps 1 to %d\n", MAX_REPS);
        return 1;
    }
    const layout *lays[5];
    size_t nlays = 0;
    {
        char buf[128];
        snprintf(buf, sizeof buf, "%s", layout_list);
        for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && nlays < 5;
             tok = strtok_r(NULL, ",", &save)) {
            const layout *found = NULL;
            for (size_t i = 0; i < 5; ++i)
                if (strcmp(tok, layouts_known[i].name) == 0) found = &layouts_known[i];
            if (!found) {
                fprintf(stderr, "gemm_ratio: unknown layout \"%s\" (cm-nn, cm-nt, cm-tn, rm-nn, "
                                "rm-nt)\n", tok);
                return 1;
            }
            lays[nlays++] = found;
        }
    }

    void *blas = open_openblas(openblas_path);
    if (!blas) {
        fprintf(stderr, "gemm_ratio: OpenBLAS not found (libopenblas.so.0 with cblas_sgemm; "
                        "install libopenblas0-pthread or pass --openblas PATH)\n");
        return 2;
    }

    clmha_context *ctx = NULL;
    config *cfg = calloc(MAX_CONFIGS, sizeof *cfg);
    if (!cfg || clmha_context_create_from_env(&ctx)) {
        fprintf(stderr, "gemm_ratio: %s\n", cfg ? clmha_last_create_error() : "out of memory");
        free(cfg);
        dlclose(blas);
        return 1;
    }
    cl_device_id dev;
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    clGetCommandQueueInfo(queue, CL_QUEUE_DEVICE, sizeof dev, &dev, NULL);
    char devname[256] = "", note[1024] = "";
    cl_uint units = 0;
    clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof devname, devname, NULL);
    clGetDeviceInfo(dev, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof units, &units, NULL);
    clmha_context_tuning_note(ctx, note, sizeof note);
    if (threads <= 0) threads = units ? (int)units : 1;
    set_threads_fn set_threads = NULL;
    get_config_fn get_config = NULL;
    load_fn(blas, "openblas_set_num_threads", &set_threads, sizeof set_threads);
    load_fn(blas, "openblas_get_config", &get_config, sizeof get_config);
    set_threads(threads);
    printf(" (%s), %d threads\n", get_config ? get_config() : "?", threads);
    printf("device: %s, %u compute units\n", devname, units);

    // The tuning that context creation applied, kept as JSON to re-apply between turns.
    size_t json_size = 0;
    char *tuned_json = NULL;
    if (clmha_context_tuning_export(ctx, NULL, 0, &json_size) == CLMHA_SUCCESS && json_size) {
        tuned_json = malloc(json_size);
        if (tuned_json && clmha_context_tuning_export(ctx, tuned_json, json_size, NULL)) {
            free(tuned_json);
            tuned_json = NULL;
        }
    }
    printf("tuning: %s\n", note);
    if (tuned_json) {
        const char *x = strstr(tuned_json, "\"Xgemm\"");
        const char *r = strstr(tuned_json, "XGEMM_MIN_INDIRECT_SIZE");
        if (x) {
            printf("  Xgemm:");
            for (int i = 0; i < XGEMM_PARAMS; ++i) {
                char key[24];
                snprintf(key, sizeof key, "\"%s\":", xgemm_names[i]);
                const char *at = strstr(x, key);
                if (at) printf(" %s=%ld", xgemm_names[i], strtol(at + strlen(key), NULL, 10));
            }
            printf("\n");
        }
        if (r) printf("  XGEMM_MIN_INDIRECT_SIZE=%ld\n", strtol(strchr(r, ':') + 1, NULL, 10));
    } else {
        printf("  (no tuning in effect (no stored tuning, no built-in set): only default, imports "
               "and OpenBLAS below)\n");
    }

    if (with_default) cfg[ncfg++] = (config){.kind = CFG_DEFAULT, .name = "clblast-default"};
    if (tuned_json) {
        clmha_tuning_source src = clmha_context_tuning_source(ctx);
        cfg[ncfg] = (config){.kind = CFG_TUNED, .json = tuned_json};
        snprintf(cfg[ncfg++].name, sizeof cfg->name, "%s",
                 src == CLMHA_TUNING_SOURCE_BUILTIN  ? "clblast-builtin"
                 : src == CLMHA_TUNING_SOURCE_STORED ? "clblast-stored"
                                                     : "clblast-tuned");
    }
    for (size_t i = 0; i < nimport; ++i) cfg[ncfg++] = imports[i];
    for (size_t i = 0; i < nextra; ++i) cfg[ncfg++] = extra[i];
    cfg[ncfg++] = (config){.kind = CFG_OPENBLAS, .name = "openblas"};

    problem p = {.s = size, .queue = queue};
    load_fn(blas, "cblas_sgemm", &p.sgemm, sizeof p.sgemm);
    size_t n = size * size;
    p.ha = malloc(n * sizeof(float));
    p.hb = malloc(n * sizeof(float));
    p.hc = malloc(n * sizeof(float));
    p.ref = malloc(n * sizeof(float));
    int rc = 1;
    if (!p.ha || !p.hb || !p.hc || !p.ref) goto done;
    uint64_t rng = 0x2545F4914F6CDD1Dull;
    for (size_t i = 0; i < n; ++i) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        p.ha[i] = (float)((rng >> 40) * (2.0 / 16777216.0) - 1.0);
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        p.hb[i] = (float)((rng >> 40) * (2.0 / 16777216.0) - 1.0);
    }
    cl_context cl = clmha_context_cl_context(ctx);
    cl_int err = CL_SUCCESS;
    p.a = clCreateBuffer(cl, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, n * 4, p.ha, &err);
    if (!err) p.b = clCreateBuffer(cl, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, n * 4, p.hb, &err);
    if (!err) p.c = clCreateBuffer(cl, CL_MEM_READ_WRITE, n * 4, NULL, &err);
    if (err) {
        fprintf(stderr, "gemm_ratio: clCreateBuffer failed: %d\n", err);
        goto done;
    }

    double flop = 2.0 * (double)size * (double)size * (double)size;
    bool wrong = false;
    double tuned_ratio[5] = {0}, tuned_gflops[5] = {0};
    printf("sgemm %zu^3, %zu rounds, configurations timed in turns (order rotates each round)\n",
           size, reps);
    for (size_t li = 0; li < nlays; ++li) {
        const layout *l = lays[li];
        double t;
        // Reference, then a warm-up (and the build: seconds on PoCL) and a check of each.
        if (!run_one(&p, l, CFG_OPENBLAS, &t)) goto done;
        memcpy(p.ref, p.hc, n * sizeof(float));
        for (size_t c = 0; c < ncfg; ++c) {
            if (cfg[c].kind == CFG_OPENBLAS) continue;
            if (!select_config(ctx, dev, &cfg[c]) || !run_one(&p, l, cfg[c].kind, &t))
                goto done;
            double rel = check(&p);
            if (!(rel <= 1e-4)) {
                printf("%s %s: WRONG RESULT (max rel error %.2e)\n", l->name, cfg[c].name, rel);
                wrong = true;
            }
        }
        for (size_t r = 0; r < reps; ++r)
            for (size_t j = 0; j < ncfg; ++j) {
                config *c = &cfg[(j + r) % ncfg];
                if (!select_config(ctx, dev, c) || !run_one(&p, l, c->kind, &c->t[r]))
                    goto done;
            }
        printf("\n%s (%s-major, C = %s·%s)%*s median  fastest  slowest GFLOP/s\n", l->name,
               l->blast == CLBlastLayoutColMajor ? "column" : "row", l->ta ? "Aᵀ" : "A",
               l->tb ? "Bᵀ" : "B", 12 - (l->ta ? 2 : 0) - (l->tb ? 2 : 0), "");
        double ob = 0;
        const config *blas_cfg = &cfg[ncfg - 1];
        for (size_t c = 0; c < ncfg; ++c) {
            double s[MAX_REPS];
            memcpy(s, cfg[c].t, reps * sizeof *s);
            qsort(s, reps, sizeof *s, cmp_double);
            double med = median(cfg[c].t, reps);
            printf("  %-36s %7.1f  %7.1f  %7.1f\n", cfg[c].name, flop / med / 1e9,
                   flop / s[0] / 1e9, flop / s[reps - 1] / 1e9);
            if (cfg[c].kind == CFG_OPENBLAS) ob = flop / med / 1e9;
        }
        for (size_t c = 0; c < ncfg; ++c) {
            if (cfg[c].kind == CFG_OPENBLAS) continue;
            double ratios[MAX_REPS];
            for (size_t r = 0; r < reps; ++r) ratios[r] = blas_cfg->t[r] / cfg[c].t[r];
            double ratio = flop / median(cfg[c].t, reps) / 1e9 / ob;
            printf("  ratio %s/openblas: %.3f (medians), %.3f (median of per-round ratios)\n",
                   cfg[c].name, ratio, median(ratios, reps));
            if (cfg[c].kind == CFG_TUNED) {
                tuned_ratio[li] = ratio;
                tuned_gflops[li] = flop / median(cfg[c].t, reps) / 1e9;
            }
        }
        // The context's parameters (stored or built-in) and the default against each import.
        for (size_t c = 0; c < ncfg; ++c) {
            if (cfg[c].kind != CFG_IMPORT) continue;
            for (size_t o = 0; o < ncfg; ++o) {
                if (cfg[o].kind != CFG_TUNED && cfg[o].kind != CFG_DEFAULT) continue;
                double ratios[MAX_REPS];
                for (size_t r = 0; r < reps; ++r) ratios[r] = cfg[c].t[r] / cfg[o].t[r];
                printf("  ratio %s/%s: %.3f (medians), %.3f (median of per-round ratios)\n",
                       cfg[o].name, cfg[c].name, median(cfg[c].t, reps) / median(cfg[o].t, reps),
                       median(ratios, reps));
            }
        }
    }
    // The layout where tuned CLBlast is fastest, and the ratio there and on every layout.
    if (tuned_json) {
        size_t best = 0;
        for (size_t li = 1; li < nlays; ++li)
            if (tuned_gflops[li] > tuned_gflops[best]) best = li;
        printf("\nsummary: tuned/openblas at %zu^3 = %.2f on %s (fastest layout for tuned CLBlast)",
               size, tuned_ratio[best], lays[best]->name);
        for (size_t li = 0; li < nlays; ++li)
            if (li != best) printf(", %.2f on %s", tuned_ratio[li], lays[li]->name);
        printf("\n");
    }
    // Leave the stored tuning in effect.
    if (tuned_json) clmha_context_tuning_import(ctx, tuned_json);
    rc = wrong ? 3 : 0;
done:
    if (p.a) clReleaseMemObject(p.a);
    if (p.b) clReleaseMemObject(p.b);
    if (p.c) clReleaseMemObject(p.c);
    free(p.ha);
    free(p.hb);
    free(p.hc);
    free(p.ref);
    free(tuned_json);
    for (size_t i = 0; i < nimport; ++i) free((char *)imports[i].json);
    free(cfg);
    clmha_context_release(ctx);
    dlclose(blas);
    return rc;
}
