// The tuner's GEMM shapes (see gemm_search.h): random matrices, one timed GEMM, its check
// against a double-precision CPU GEMM, timing a kind of shapes or all of them; progress and
// trace lines to the caller's callback.
#define _POSIX_C_SOURCE 200809L

#include "tuning_search/gemm_timing.h"

#include "device/blas.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <clblast_c.h>

static size_t a_count(const gshape *s) { return s->m * s->k * (s->batch ? s->batch : 1); }
static size_t b_count(const gshape *s) { return s->n * s->k * (s->batch ? s->batch : 1); }
static size_t c_count(const gshape *s) { return s->m * s->n * (s->batch ? s->batch : 1); }

void clmha__tuner_shape_free(gshape *s) {
    clmha__release_mem(s->a);
    clmha__release_mem(s->b);
    clmha__release_mem(s->c);
    free(s->ha);
    free(s->hb);
    s->a = s->b = s->c = NULL;
    s->ha = s->hb = NULL;
}

clmha_status clmha__tuner_shape_alloc(tuner *T, gshape *s) {
    clmha_context *ctx = T->ctx;
    size_t na = a_count(s), nb = b_count(s), nc = c_count(s);
    s->ha = malloc(na * sizeof(float));
    s->hb = malloc(nb * sizeof(float));
    if (!s->ha || !s->hb) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    for (size_t i = 0; i < na; ++i) s->ha[i] = rand_unit(&T->rng);
    for (size_t i = 0; i < nb; ++i) s->hb[i] = rand_unit(&T->rng);
    cl_int err;
    s->a = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
                          na * sizeof(float), s->ha, &err);
    clmha__held_new(CLMHA__HELD_MEM, s->a);
    if (err == CL_SUCCESS) {
        s->b = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
                              nb * sizeof(float), s->hb, &err);
        clmha__held_new(CLMHA__HELD_MEM, s->b);
    }
    if (err == CL_SUCCESS) {
        s->c = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE, nc * sizeof(float), NULL, &err);
        clmha__held_new(CLMHA__HELD_MEM, s->c);
    }
    if (err != CL_SUCCESS) return clmha__cl_fail(ctx, err, "clCreateBuffer(tuning matrices)");
    return CLMHA_SUCCESS;
}

// One GEMM of @p s, waited for. Returns 0, else the failed call's status, and its name in *call.
static int shape_run(clmha_context *ctx, const gshape *s, const char **call) {
    cl_command_queue q = ctx->queue;
    size_t ldb = s->tb ? s->k : s->n;
    CLBlastTranspose tb = s->tb ? CLBlastTransposeYes : CLBlastTransposeNo;
    int st;
    if (!s->batch)
        CLMHA__BLAS(st, CLBlastSgemm(CLBlastLayoutRowMajor, CLBlastTransposeNo, tb, s->m, s->n,
                                     s->k, 1.0f, s->a, 0, s->k, s->b, 0, ldb, 0.0f, s->c, 0,
                                     s->n, &q, NULL));
    else
        CLMHA__BLAS(st, CLBlastSgemmStridedBatched(
                            CLBlastLayoutRowMajor, CLBlastTransposeNo, tb, s->m, s->n, s->k,
                            1.0f, s->a, 0, s->k, s->m * s->k, s->b, 0, ldb, s->n * s->k, 0.0f,
                            s->c, 0, s->n, s->m * s->n, s->batch, &q, NULL));
    *call = s->batch ? "CLBlastSgemmStridedBatched" : "CLBlastSgemm";
    if (st != CLBlastSuccess) return st;
    *call = "clFinish";
    return clFinish(q);
}

// Notes in T->msg that shape @p s failed: call @p call returned @p st.
static void note_failure(tuner *T, const gshape *s, const char *call, int st) {
    const char *name = st <= -1000 ? clmha__blas_status_name(st, NULL) : clmha__cl_error_name(st);
    snprintf(T->msg, sizeof T->msg, "%s: %s returned %d (%s)", s->label, call, st, name);
}

// Compares C of the last run of @p s with a double-precision CPU GEMM: every element of small
// products, else @p samples random elements plus the corners. Writes the error to *rel.
static clmha_status shape_check(tuner *T, const gshape *s, size_t samples, double *rel) {
    clmha_context *ctx = T->ctx;
    size_t nc = c_count(s), batches = s->batch ? s->batch : 1;
    float *hc = malloc(nc * sizeof(float));
    if (!hc) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    cl_int err = clEnqueueReadBuffer(ctx->queue, s->c, CL_TRUE, 0, nc * sizeof(float), hc, 0, NULL,
                                     NULL);
    if (err != CL_SUCCESS) {
        free(hc);
        return clmha__cl_fail(ctx, err, "clEnqueueReadBuffer(tuning check)");
    }
    bool all = nc <= 65536;
    size_t count = all ? nc : samples + 4 * batches;
    double max_err = 0, max_ref = 0;
    bool nan = false;
    for (size_t t = 0; t < count; ++t) {
        size_t idx;
        if (all) {
            idx = t;
        } else if (t < samples) {
            idx = (size_t)(next_rand(&T->rng) % nc);
        } else {  // the four corners of every batch item
            size_t bi = (t - samples) / 4, corner = (t - samples) % 4;
            size_t i = corner & 1 ? s->m - 1 : 0, j = corner & 2 ? s->n - 1 : 0;
            idx = bi * s->m * s->n + i * s->n + j;
        }
        size_t bi = idx / (s->m * s->n), i = idx / s->n % s->m, j = idx % s->n;
        const float *a = s->ha + bi * s->m * s->k + i * s->k;
        const float *b = s->hb + bi * s->n * s->k;
        double ref = 0;
        if (s->tb)
            for (size_t p = 0; p < s->k; ++p) ref += (double)a[p] * b[j * s->k + p];
        else
            for (size_t p = 0; p < s->k; ++p) ref += (double)a[p] * b[p * s->n + j];
        double got = hc[idx];
        if (isnan(got) || isinf(got)) nan = true;
        max_err = fmax(max_err, fabs(got - ref));
        max_ref = fmax(max_ref, fabs(ref));
    }
    free(hc);
    *rel = nan ? INFINITY : max_err / fmax(max_ref, 1e-30);
    return CLMHA_SUCCESS;
}

bool clmha__tuner_run_checks(tuner *T, bool plain, bool batched) {
    for (size_t i = 0; i < T->nchecks; ++i) {
        const gshape *s = &T->checks[i];
        if ((s->batch ? !batched : !plain)) continue;
        if (T->skip_direct_below && goes_direct(s, T->skip_direct_below)) continue;
        const char *call;
        int st = shape_run(T->ctx, s, &call);
        if (st != 0) {
            note_failure(T, s, call, st);
            return false;
        }
        double rel;
        if (shape_check(T, s, 0, &rel)) return false;
        if (!(rel <= CHECK_TOLERANCE)) {
            snprintf(T->msg, sizeof T->msg, "%s: wrong result (max rel error %.2e)", s->label, rel);
            return false;
        }
    }
    return true;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// Times @p s: up to @p reps runs; stops after two when the faster of them is above @p slower_than
// seconds (0: no limit). *best = fastest, *median = median. False on a failed run (T->msg).
static bool shape_time(tuner *T, gshape *s, int reps, double slower_than, double *best,
                       double *median) {
    double t[16];
    int n = 0;
    for (; n < reps && n < 16; ++n) {
        double t0 = now_s();
        const char *call;
        int st = shape_run(T->ctx, s, &call);
        t[n] = now_s() - t0;
        if (st != 0) {
            note_failure(T, s, call, st);
            return false;
        }
        if (n == 1 && slower_than > 0 && fmin(t[0], t[1]) > slower_than) {
            ++n;
            break;
        }
    }
    qsort(t, (size_t)n, sizeof t[0], cmp_double);
    *best = t[0];
    *median = t[n / 2];
    return true;
}

bool clmha__tuner_time_kind(tuner *T, bool batched, int reps, double reference, double *times,
                            double *total) {
    *total = 0;
    for (size_t i = 0; i < T->nshapes; ++i) times[i] = 0;
    for (size_t i = 0; i < T->nshapes; ++i) {
        gshape *s = &T->shapes[i];
        times[i] = 0;
        if ((s->batch != 0) != batched) continue;
        double best, median;
        double limit = reference > 0 ? fmax(2.5 * reference - *total, 1e-3) : 0;
        if (!shape_time(T, s, reps, limit, &best, &median)) return false;
        double rel;
        if (shape_check(T, s, 256, &rel)) return false;
        if (!(rel <= CHECK_TOLERANCE)) {
            snprintf(T->msg, sizeof T->msg, "%s: wrong result (max rel error %.2e)", s->label, rel);
            return false;
        }
        times[i] = best;
        *total += best;
        if (reference > 0 && *total > 2.5 * reference) {
            *total = INFINITY;
            return true;
        }
    }
    return true;
}

void clmha__tuner_progress(tuner *T, const char *phase) {
    if (!T->opts || !T->opts->progress) return;
    double avg = T->tried ? T->cost_sum / (double)T->tried : 8.0;
    double left = T->budget - elapsed(T);
    size_t estimate = T->tried + (left > 0 ? (size_t)(left / fmax(avg, 0.5)) : 0);
    char line[256];
    if (T->best_gflops > 0)
        snprintf(line, sizeof line, "%zu/%zu candidates, best %.1f GFLOP/s (%s)", T->tried,
                 estimate, T->best_gflops, phase);
    else
        snprintf(line, sizeof line, "%zu/%zu candidates (%s)", T->tried, estimate, phase);
    double fraction = fmin(1.0, fmax(0.0, elapsed(T) / T->budget));
    T->opts->progress(fraction, line, T->opts->user_data);
}


bool clmha__tuner_time_all(tuner *T, bool after, double *plain_total, double *batched_total) {
    *plain_total = *batched_total = 0;
    for (size_t i = 0; i < T->nshapes; ++i) {
        gshape *s = &T->shapes[i];
        double best, median;
        if (!shape_time(T, s, 5, 0, &best, &median)) return false;
        double rel;
        if (shape_check(T, s, 256, &rel)) return false;
        if (!(rel <= CHECK_TOLERANCE)) {
            snprintf(T->msg, sizeof T->msg, "%s: wrong result (max rel error %.2e)", s->label, rel);
            return false;
        }
        if (after) {
            s->after = median;
        } else {
            s->before = median;
            s->before_best = best;
        }
        *(s->batch ? batched_total : plain_total) += best;
    }
    return true;
}


bool clmha__tuner_tracing(const tuner *T) {
    return T->opts && T->opts->trace && T->opts->progress;
}

void clmha__tuner_trace(const tuner *T, const char *fmt, ...) {
    if (!clmha__tuner_tracing(T)) return;
    char line[1024];
    size_t used = clmha__tuning_append(line, sizeof line, 0, "[tune %6.1fs] ", elapsed(T));
    if (used < sizeof line) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(line + used, sizeof line - used, fmt, ap);
        va_end(ap);
    }
    T->opts->progress(-1.0, line, T->opts->user_data);
}

void clmha__tuner_trace_shapes(const tuner *T, const char *what, const double *times) {
    if (!clmha__tuner_tracing(T)) return;
    char line[512];
    size_t used = clmha__tuning_append(line, sizeof line, 0, "%s:", what);
    for (size_t i = 0; i < T->nshapes; ++i)
        if (times[i] > 0)
            used = clmha__tuning_append(line, sizeof line, used, " %.1f",
                                        flops(&T->shapes[i]) / times[i] / 1e9);
    clmha__tuner_trace(T, "%s GFLOP/s", line);
}
