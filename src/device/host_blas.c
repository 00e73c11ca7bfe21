// Loading the host BLAS (device/host_blas.h says why and which).
#include "device/host_blas.h"

#include "device/host_pool.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- the two interfaces ----------------------------------------------------------------------

// oneDNN: dnnl_status_t dnnl_sgemm(char transa, char transb, dnnl_dim_t M, dnnl_dim_t N,
// dnnl_dim_t K, float alpha, const float *A, dnnl_dim_t lda, const float *B, dnnl_dim_t ldb,
// float beta, float *C, dnnl_dim_t ldc), row-major, dnnl_dim_t = int64_t (v2 and v3).
typedef int (*dnnl_sgemm_fn)(char, char, int64_t, int64_t, int64_t, float, const float *,
                             int64_t, const float *, int64_t, float, float *, int64_t);

// Every CBLAS: cblas_sgemm(order, transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)
// with CblasRowMajor = 101, CblasNoTrans = 111, CblasTrans = 112 and int sizes (LP64).
typedef void (*cblas_sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                               const float *, int, float, float *, int);

typedef void (*cblas_dgemm_fn)(int, int, int, int, int, int, double, const double *, int,
                               const double *, int, double, double *, int);

// oneDNN's OpenMP runtime (found through libdnnl's dependencies; NULL if it has none): its
// thread count is an ICV of the calling thread, so setting it affects only that thread's
// GEMMs (here a driver's worker thread running the native kernel).
static int (*omp_get_max)(void);
static void (*omp_set_num)(int);

// The product in plain loops (row-major, C = alpha op(A) op(B) + beta C; beta 0 ignores what C
// held): what a GEMM that reported a failure is replaced by. A native kernel cannot fail its
// command, so the product is made here rather than left unwritten (a wrong answer).
static void sgemm_plain(bool ta, bool tb, size_t m, size_t n, size_t k, float alpha,
                        const float *a, size_t lda, const float *b, size_t ldb, float beta,
                        float *c, size_t ldc) {
    for (size_t i = 0; i < m; ++i)
        for (size_t j = 0; j < n; ++j) {
            double sum = 0;
            for (size_t p = 0; p < k; ++p)
                sum += (double)(ta ? a[p * lda + i] : a[i * lda + p]) *
                       (double)(tb ? b[j * ldb + p] : b[p * ldb + j]);
            float *out = &c[i * ldc + j];
            *out = (float)(alpha * sum) + (beta != 0.0f ? beta * *out : 0.0f);
        }
}

// oneDNN reports a failure (out of memory for its packed copies, say) by its status.
static void sgemm_dnnl(const void *impl, bool ta, bool tb, size_t m, size_t n, size_t k,
                       float alpha, const float *a, size_t lda, const float *b, size_t ldb,
                       float beta, float *c, size_t ldc) {
    dnnl_sgemm_fn f = *(const dnnl_sgemm_fn *)impl;
    if (f(ta ? 'T' : 'N', tb ? 'T' : 'N', (int64_t)m, (int64_t)n, (int64_t)k, alpha, a,
          (int64_t)lda, b, (int64_t)ldb, beta, c, (int64_t)ldc) != 0)
        sgemm_plain(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

static void sgemm_cblas(const void *impl, bool ta, bool tb, size_t m, size_t n, size_t k,
                        float alpha, const float *a, size_t lda, const float *b, size_t ldb,
                        float beta, float *c, size_t ldc) {
    cblas_sgemm_fn f = *(const cblas_sgemm_fn *)impl;
    f(101, ta ? 112 : 111, tb ? 112 : 111, (int)m, (int)n, (int)k, alpha, a, (int)lda, b,
      (int)ldb, beta, c, (int)ldc);
}

static void dgemm_cblas(const void *impl, bool ta, bool tb, size_t m, size_t n, size_t k,
                        double alpha, const double *a, size_t lda, const double *b, size_t ldb,
                        double beta, double *c, size_t ldc) {
    cblas_dgemm_fn f = *(const cblas_dgemm_fn *)impl;
    f(101, ta ? 112 : 111, tb ? 112 : 111, (int)m, (int)n, (int)k, alpha, a, (int)lda, b,
      (int)ldb, beta, c, (int)ldc);
}

// ---- the libraries -----------------------------------------------------------------------------

static clmha__host_blas blas;
static const clmha__host_blas *loaded;
static char tried[400];
static pthread_once_t once = PTHREAD_ONCE_INIT;
// The resolved entry points (sgemm_* read them through clmha__host_blas::impl).
static dnnl_sgemm_fn dnnl_entry;
static cblas_sgemm_fn cblas_entry;

// OpenBLAS kernels for CPUs without AVX2: on a CPU with AVX2 they mean OpenBLAS 0.3.21 did not
// recognise it (it takes recent Intel CPUs for "Prescott") and runs ~5x slower than it could.
static bool old_openblas_core(const char *core) {
    static const char *const old[] = {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem",
                                      "Sandybridge", "Atom", "Katmai", "Coppermine", "Northwood",
                                      "Banias", "Opteron", "Barcelona", "Bobcat"};
    for (size_t i = 0; i < sizeof old / sizeof old[0]; ++i)
        if (strcmp(core, old[i]) == 0) return true;
    return false;
}

static bool cpu_has_avx2(void) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return false;
#endif
}

static bool cpu_has_avx512(void) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
#else
    return false;
#endif
}

// Fills blas from the opened library @p h of kind @p name; false when its symbol is missing.
static bool take(void *h, const char *name, const char *file) {
    memset(&blas, 0, sizeof blas);
    snprintf(blas.name, sizeof blas.name, "%s", name);
    snprintf(blas.file, sizeof blas.file, "%s", file);
    if (strcmp(name, "oneDNN") == 0) {
        dnnl_entry = (dnnl_sgemm_fn)(uintptr_t)dlsym(h, "dnnl_sgemm");
        if (!dnnl_entry) return false;
        typedef struct {
            int major, minor, patch;
            const char *hash;
        } version;
        typedef const version *(*version_fn)(void);
        version_fn v = (version_fn)(uintptr_t)dlsym(h, "dnnl_version");
        const version *ver = v ? v() : NULL;
        if (ver) snprintf(blas.detail, sizeof blas.detail, "%d.%d.%d", ver->major, ver->minor,
                          ver->patch);
        omp_get_max = (int (*)(void))(uintptr_t)dlsym(h, "omp_get_max_threads");
        omp_set_num = (void (*)(int))(uintptr_t)dlsym(h, "omp_set_num_threads");
        blas.sgemm = sgemm_dnnl;
        blas.impl = &dnnl_entry;
        blas.max_dim = (size_t)INT64_MAX;
        return true;
    }
    cblas_entry = (cblas_sgemm_fn)(uintptr_t)dlsym(h, "cblas_sgemm");
    if (!cblas_entry) return false;
    blas.sgemm = sgemm_cblas;
    blas.impl = &cblas_entry;
    blas.max_dim = (size_t)INT_MAX;
    typedef const char *(*text_fn)(void);
    if (strcmp(name, "OpenBLAS") == 0) {
        text_fn config = (text_fn)(uintptr_t)dlsym(h, "openblas_get_config");
        text_fn core = (text_fn)(uintptr_t)dlsym(h, "openblas_get_corename");
        const char *c = core ? core() : NULL, *conf = config ? config() : "";
        if (strncmp(conf, "OpenBLAS ", 9) == 0) conf += 9;  // the name is printed already
        snprintf(blas.detail, sizeof blas.detail, "%.60s%s%.40s", conf,
                 c ? ", kernels for " : "", c ? c : "");
        if (c && old_openblas_core(c) && cpu_has_avx2())
            snprintf(blas.warning, sizeof blas.warning,
                     "OpenBLAS took this CPU for a %.40s and runs its slower kernels: set "
                     "OPENBLAS_CORETYPE=%s in the environment (or install oneDNN, libdnnl)",
                     c, cpu_has_avx512() ? "SkylakeX" : "Haswell");
    } else if (strcmp(name, "BLIS") == 0) {
        text_fn v = (text_fn)(uintptr_t)dlsym(h, "bli_info_get_version_str");
        if (v) snprintf(blas.detail, sizeof blas.detail, "%.60s", v());
    }
    return true;
}

// The libraries the search tries, in order.
static const struct {
    const char *name, *file;
} search[] = {{"oneDNN", "libdnnl.so.3"},   {"oneDNN", "libdnnl.so.2"},
              {"OpenBLAS", "libopenblas.so.0"}, {"BLIS", "libblis.so.4"},
              {"BLIS", "libblis.so.3"},     {"MKL", "libmkl_rt.so.2"},
              {"MKL", "libmkl_rt.so"}};

static void load(void) {
    const char *env = getenv("CLMHA_HOST_BLAS");
    if (env && *env) {
        if (strcmp(env, "none") == 0) {
            snprintf(tried, sizeof tried, "CLMHA_HOST_BLAS=none");
            return;
        }
        void *h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            snprintf(tried, sizeof tried, "CLMHA_HOST_BLAS=%.200s does not load", env);
            return;
        }
        // The kind by its symbols: oneDNN's, then OpenBLAS's, BLIS's, any CBLAS.
        const char *name = dlsym(h, "dnnl_sgemm")              ? "oneDNN"
                           : dlsym(h, "openblas_get_config")     ? "OpenBLAS"
                           : dlsym(h, "bli_info_get_version_str") ? "BLIS"
                                                                  : "CBLAS";
        if (take(h, name, env)) {
            loaded = &blas;
            return;
        }
        snprintf(tried, sizeof tried, "CLMHA_HOST_BLAS=%.200s has neither dnnl_sgemm nor "
                 "cblas_sgemm", env);
        dlclose(h);
        return;
    }
    for (size_t i = 0; i < sizeof search / sizeof search[0]; ++i) {
        void *h = dlopen(search[i].file, RTLD_NOW | RTLD_LOCAL);
        if (!h) continue;
        if (take(h, search[i].name, search[i].file)) {
            loaded = &blas;
            return;
        }
        dlclose(h);
    }
    snprintf(tried, sizeof tried,
             "no host BLAS found (tried libdnnl.so.3/.2, libopenblas.so.0, libblis.so.4/.3, "
             "libmkl_rt.so.2; CLMHA_HOST_BLAS names another)");
}

const clmha__host_blas *clmha__host_blas_get(const char **why) {
    pthread_once(&once, load);
    if (why) *why = loaded ? "" : tried;
    return loaded;
}

// Products of at most this many multiply-adds in all run in one thread under oneDNN: a decode
// step's projections (m = 1: 1 x 1536 x 512 is 0.8 M) take ~40 us on one core, and waking
// other threads from a driver's worker thread (then OpenMP's team, whose threads spun on the
// cores the driver's kernels need) cost more than the second core gave: a decode step at S 4096
// took 0.17 instead of 0.26 ms with 2 key/value heads on PoCL (2 cores). The thread count is an OpenMP setting of
// the calling thread (here the driver's worker), set to 1 around the products and restored.
#define ONE_THREAD_MACS ((double)(1 << 22))

// Items of a batched product of at most this many multiply-adds each are shared out among the
// team (then OpenMP's), each item in one thread, rather than each item split over the team: a
// per-head product is too small for the split to pay its fork and join. oneDNN, 2 cores (AMD
// EPYC), alone: 64 items of 128 x 128 x 64 took 0.39 ms shared against 0.64 split; 4 of 512 x
// 512 x 64, 0.36 against 0.38. Inside PoCL's native kernels the split cost more: the training
// step at N 8, L 128 (E 512, H 8) took 38 against 51 ms, the unfused forward with weights 14
// against 22 ms (interleaved runs, medians).
#define SHARED_ITEM_MACS ((double)(1 << 24))

// A product with more columns than this per thread of oneDNN's team, of more multiply-adds in
// all than ONE_THREAD_MACS, is split by columns, each thread computing its slice in one thread:
// oneDNN 2.6 splits a product with few rows poorly over its team. 2 cores (AMD EPYC, Zen 4),
// alone, medians of 400: 128 x 1536 x 512 (a forward's QKV projection at N 1, L 128) at 197
// GFLOP/s split against 131; 128 x 512 x 512, 193 against 132; 512 x 512 x 512, 207 against
// 166; 2048 x 1536 x 512, 215 against 213; 4096 x 1536 x 512, 220 against 224; by rows instead
// of columns, 175 at 128 rows.
#define SPLIT_MIN_COLS 64

// A product too narrow for that, of at least this many rows per thread, is split by rows, each
// thread's rows in one thread (rather than over oneDNN's OpenMP team, whose threads would share
// the cores with the host threads'): the per-head products of 64 columns in the training step
// at N 1, L 2048 (2048 x 64 x 512, and 512 x 64 x 2048 with A transposed) took the step to
// 0.95x the time, the unfused forward with weights at N 2, L 1024 to 0.98x (AMD EPYC, 2 cores,
// 5 alternated rounds).
#define SPLIT_MIN_ROWS 64

// The size of oneDNN's OpenMP team for the calling thread: the members of the host path's
// regions (0: another library, or no OpenMP runtime found).
static int dnnl_team(const clmha__host_blas *b) {
    return b == &blas && b->sgemm == sgemm_dnnl && omp_get_max && omp_set_num ? omp_get_max() : 0;
}

typedef struct {
    void (*fn)(void *, size_t, size_t);
    void *arg;
} region_job;

// A member of a region, in whichever thread the pool runs it: oneDNN's products in it keep to
// that thread (its OpenMP thread count, a setting of the thread, 1 while the member runs).
static void one_thread_member(void *arg, size_t t, size_t team) {
    const region_job *j = arg;
    int threads = omp_get_max();
    omp_set_num(1);
    j->fn(j->arg, t, team);
    omp_set_num(threads);
}

// Runs @p fn(@p arg, t, @p team) for every member t, over the process's pool of threads
// (device/host_pool.h).
static void run_region(size_t team, void (*fn)(void *, size_t, size_t), void *arg) {
    region_job j = {fn, arg};
    clmha__host_pool_run(team, one_thread_member, &j);
}

typedef struct {
    const clmha__host_blas *b;
    const clmha__host_batch *p;
} batch_job;

// row[j] += bias[j] for j < n: in runs of 16 through restrict pointers, which GCC vectorises at
// -O2 (the plain loop over the row stayed scalar: 2.5% of a forward's cycles at N 8, L 128 by
// `perf`).
static void add_row(float *restrict row, const float *restrict bias, size_t n) {
    size_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (size_t u = 0; u < 16; ++u) row[j + u] += bias[j + u];
    for (; j < n; ++j) row[j] += bias[j];
}

// Adds @p p's bias (when it has one) to columns [first, last) of every row of @p c.
static void add_bias(const clmha__host_batch *p, float *c, size_t first, size_t last) {
    if (!p->bias) return;
    for (size_t r = 0; r < p->m; ++r)
        add_row(c + r * p->ldc + first, p->bias + first, last - first);
}

// Items first, first + step, first + 2 step, ... of @p p, in turn.
static void run_items(const clmha__host_blas *b, const clmha__host_batch *p, size_t first,
                      size_t step) {
    for (size_t i = first; i < p->batch; i += step) {
        b->sgemm(b->impl, p->ta, p->tb, p->m, p->n, p->k, p->alpha, p->a + i * p->a_stride,
                 p->lda, p->b + i * p->b_stride, p->ldb, p->beta, p->c + i * p->c_stride, p->ldc);
        add_bias(p, p->c + i * p->c_stride, 0, p->n);
    }
}

// Member t's share of a batch: items t, t + team, t + 2 team, ... (a fixed split, so that every
// item is computed the same way on every run).
static void batch_share(void *arg, size_t t, size_t team) {
    const batch_job *j = arg;
    run_items(j->b, j->p, t, team);
}

// Member t's columns of every item of a batch: an equal share of the columns, rounded to 16
// (an AVX-512 register of floats), the last member's the rest. op(B)'s columns j are B's rows j
// (tb) or its columns j; C's are its columns j.
static void column_share(void *arg, size_t t, size_t team) {
    const batch_job *j = arg;
    const clmha__host_batch *p = j->p;
    size_t per = (p->n + team - 1) / team;
    per = (per + 15) / 16 * 16;
    size_t first = t * per, last = first + per < p->n ? first + per : p->n;
    if (first >= last) return;
    for (size_t i = 0; i < p->batch; ++i) {
        j->b->sgemm(j->b->impl, p->ta, p->tb, p->m, last - first, p->k, p->alpha,
                    p->a + i * p->a_stride, p->lda,
                    p->b + i * p->b_stride + first * (p->tb ? p->ldb : 1), p->ldb, p->beta,
                    p->c + i * p->c_stride + first, p->ldc);
        add_bias(p, p->c + i * p->c_stride, first, last);
    }
}

// Member t's rows of every item of a batch: an equal share of C's rows (op(A)'s: A's rows, or its
// columns when ta), the last member's the rest.
static void row_share(void *arg, size_t t, size_t team) {
    const batch_job *j = arg;
    const clmha__host_batch *p = j->p;
    size_t per = (p->m + team - 1) / team;
    size_t first = t * per, last = first + per < p->m ? first + per : p->m;
    if (first >= last) return;
    for (size_t i = 0; i < p->batch; ++i) {
        float *c = p->c + i * p->c_stride + first * p->ldc;
        j->b->sgemm(j->b->impl, p->ta, p->tb, last - first, p->n, p->k, p->alpha,
                    p->a + i * p->a_stride + first * (p->ta ? 1 : p->lda), p->lda,
                    p->b + i * p->b_stride, p->ldb, p->beta, c, p->ldc);
        if (p->bias)
            for (size_t r = 0; r < last - first; ++r) add_row(c + r * p->ldc, p->bias, p->n);
    }
}

void clmha__host_blas_sgemm_batch(const clmha__host_blas *b, const clmha__host_batch *p) {
    double item = (double)p->m * (double)p->n * (double)p->k;
    int team = dnnl_team(b);
    batch_job j = {b, p};
    if (team > 1 && item * (double)p->batch <= ONE_THREAD_MACS) {
        omp_set_num(1);
        run_items(b, p, 0, 1);
        omp_set_num(team);
    } else if (team > 1 && p->batch > 1 && item <= SHARED_ITEM_MACS) {
        run_region((size_t)team, batch_share, &j);
    } else if (team > 1 && p->n >= SPLIT_MIN_COLS * (size_t)team) {
        run_region((size_t)team, column_share, &j);
    } else if (team > 1 && p->m >= SPLIT_MIN_ROWS * (size_t)team) {
        run_region((size_t)team, row_share, &j);
    } else {
        run_items(b, p, 0, 1);
    }
}

// Products of at most this many rows take the packed weight's kernel (2 cores, AMD EPYC, alone:
// 1.08-1.18x oneDNN's split at 128 rows, 0.82-1.0x at 512-1024, where oneDNN's packing of the
// weight is paid back over the rows; in a forward at N 1, L 512 the output projection, 512 rows,
// took 0.74-0.78x the time). 1024 rows, measured inside clmha (`clmha bench` stage medians, 7-9
// alternated processes): the output projection 0.80x the time at N 8, L 128 and 0.90x at N 1,
// L 1024, the QKV projection 1.0x; at 2048 rows the QKV projection took 1.05x, out_proj 0.95x.
#define PACKED_MAX_ROWS 1024

typedef struct {
    const clmha__host_batch *p;
    const clmha__packed_weight *w;
    size_t first;
} packed_job;

// Member t's columns of a packed product: an equal share rounded to the panels' 32.
static void packed_share(void *arg, size_t t, size_t team) {
    const packed_job *j = arg;
    const clmha__host_batch *p = j->p;
    size_t per = (p->n + team - 1) / team;
    per = (per + CLMHA__PACKED_PANEL - 1) / CLMHA__PACKED_PANEL * CLMHA__PACKED_PANEL;
    size_t first = t * per, last = first + per < p->n ? first + per : p->n;
    if (first < last)
        clmha__packed_weight_gemm(j->w, j->first, p->m, p->n, p->a, p->lda, p->c, p->ldc,
                                  p->bias, p->beta != 0.0f, first, last);
}

bool clmha__host_blas_sgemm_packed(const clmha__host_blas *b, const clmha__host_batch *p,
                                   const clmha__packed_weight *w, size_t first) {
    int team = dnnl_team(b);
    if (team < 1 || p->batch > 1 || p->ta || !p->tb || p->alpha != 1.0f ||
        (p->beta != 0.0f && p->beta != 1.0f) || p->m > PACKED_MAX_ROWS || p->ldb != p->k ||
        !clmha__packed_weight_fits(w, first, p->n, p->k))
        return false;
    packed_job j = {p, w, first};
    if (team == 1 || (double)p->m * (double)p->n * (double)p->k <= ONE_THREAD_MACS)
        clmha__packed_weight_gemm(w, first, p->m, p->n, p->a, p->lda, p->c, p->ldc, p->bias,
                                  p->beta != 0.0f, 0, p->n);
    else
        run_region((size_t)team, packed_share, &j);
    return true;
}

size_t clmha__host_blas_team(const clmha__host_blas *b) {
    int team = dnnl_team(b);
    return team > 0 ? (size_t)team : 0;
}

void clmha__host_blas_team_run(const clmha__host_blas *b, size_t most,
                               void (*fn)(void *arg, size_t t, size_t team), void *arg) {
    size_t team = clmha__host_blas_team(b);
    if (team > most) team = most;
    if (team <= 1) {
        fn(arg, 0, 1);
        return;
    }
    run_region(team, fn, arg);
}

// ---- dgemm -------------------------------------------------------------------------------------

static clmha__host_dgemm dgemm_lib;
static const clmha__host_dgemm *dgemm_loaded;
static cblas_dgemm_fn dgemm_entry;
static pthread_once_t dgemm_once = PTHREAD_ONCE_INIT;

// Takes cblas_dgemm from @p file (kind @p name); false, with the library closed, without it.
static bool take_dgemm(const char *file, const char *name) {
    void *h = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    if (!h) return false;
    dgemm_entry = (cblas_dgemm_fn)(uintptr_t)dlsym(h, "cblas_dgemm");
    if (!dgemm_entry) {
        dlclose(h);
        return false;
    }
    snprintf(dgemm_lib.name, sizeof dgemm_lib.name, "%s", name);
    dgemm_lib.dgemm = dgemm_cblas;
    dgemm_lib.impl = &dgemm_entry;
    dgemm_loaded = &dgemm_lib;
    return true;
}

static void load_dgemm(void) {
    const char *env = getenv("CLMHA_HOST_BLAS");
    if (env && *env) {
        if (strcmp(env, "none") != 0) take_dgemm(env, "CBLAS");
        return;
    }
    for (size_t i = 0; i < sizeof search / sizeof search[0]; ++i)
        if (strcmp(search[i].name, "oneDNN") != 0 && take_dgemm(search[i].file, search[i].name))
            return;
}

const clmha__host_dgemm *clmha__host_dgemm_get(void) {
    pthread_once(&dgemm_once, load_dgemm);
    return dgemm_loaded;
}
