// The state of one clmha_context_tune() run (src/tuning_search/tune.c) and of its GEMM search,
// and the small helpers every file of src/tuning_search/ uses (the clock, random numbers, a
// GEMM's FLOPs). The short type names (tuner, gshape) are this folder's own: include this header
// from src/tuning_search/ only. The GEMM search's files (gemm_search.h) all use it; none of them is used by it.
#ifndef CLMHA_TUNING_SEARCH_TUNER_STATE_H
#define CLMHA_TUNING_SEARCH_TUNER_STATE_H

#include "base/message.h"
#include "context/context.h"
#include "device/held.h"
#include "errors/errors.h"

#include "tuning_store/store.h"

#include <stdint.h>
#include <time.h>

#define CHECK_TOLERANCE 1e-4
#define MAX_LAYERS 4
#define MAX_SHAPES (1 + 4 * MAX_LAYERS)
#define FORCE_DIRECT 1048576  // XGEMM_MIN_INDIRECT_SIZE that makes every GEMM direct

typedef struct gshape {
    char label[64];
    size_t m, n, k, batch;  // batch 0: plain sgemm; >= 1: strided batched
    bool tb;                // B transposed (B is n×k), else k×n; row-major, C m×n
    cl_mem a, b, c;
    float *ha, *hb;
    double t_ind, t_dir;    // fastest seconds with each path (phase A/B/C), 0 unknown
    double before, after;   // median seconds before and after tuning
    double before_best;     // fastest before tuning
} gshape;

typedef struct tuner {
    clmha_context *ctx;
    clmha__tuning_target tg;  // ctx as the tuning store sees it
    const clmha_tune_options *opts;
    gshape shapes[MAX_SHAPES];
    size_t nshapes;
    gshape checks[6];  // odd-sized correctness GEMMs: 2 plain, 2 batched, 2 plain above the split
    size_t nchecks;
    size_t skip_direct_below;  // final check: XgemmDirect untouched, skip its GEMMs (0: none)
    double start, budget;
    double decode_reserve;  // seconds kept for the decode split (phase E) at the end
    size_t tried, rejected;
    double cost_sum;   // seconds spent in candidates (for the estimate of the next one)
    double best_gflops;  // sgemm 1024³ of the best Xgemm so far
    uint64_t rng;
    bool overridden;   // CLBlast's parameters were changed by this run
    double phase_cost[2];  // seconds spent in Xgemm [0] and XgemmDirect [1] candidates
    size_t phase_tried[2];
    char msg[1024];
} tuner;

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline uint64_t next_rand(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static inline float rand_unit(uint64_t *s) {
    return (float)((next_rand(s) >> 40) * (2.0 / 16777216.0) - 1.0);  // [-1, 1)
}

static inline double flops(const gshape *s) {
    return 2.0 * (double)s->m * (double)s->n * (double)s->k * (double)(s->batch ? s->batch : 1);
}

static inline double elapsed(const tuner *T) { return now_s() - T->start; }

static inline bool goes_direct(const gshape *s, size_t min_indirect) {
    double c = (double)min_indirect;
    return (double)s->m * (double)s->n * (double)s->k < c * c * c;
}

#endif
