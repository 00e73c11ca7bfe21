// The GEMM search of clmha_context_tune(), private to src/tuner/: the tuner's state, the timed
// GEMM shapes (gemm_timing.c), the candidate spaces (gemm_candidates.c) and the phases
// (gemm_search.c). The short type names (tuner, gshape, cand, result) are this module's own:
// include this header from src/tuner/ only.
//
// The GEMMs are timed on the device with clFinish around each call (wall clock, so the indirect
// path's pad/transpose kernels and buffer allocations count). A candidate is compiled by its
// first call (several seconds on PoCL), so the budget buys a few dozen candidates; the search
// spends it as follows:
//   0. "before": the GEMM shapes timed with the parameters in effect (nothing overridden yet).
//   A. Xgemm (indirect path forced: XGEMM_MIN_INDIRECT_SIZE = 0), timed on the plain sgemm
//      shapes (1024³ and each layer's projections): the seeds, then a greedy walk from the best
//      found (first improvement, single-parameter steps, CPU-friendly order), then
//      prior-weighted random samples. Sgemm program only.
//   B. XgemmDirect (direct path forced), timed on the strided batched shapes (QKᵀ and A·V of
//      each layer). Strided batched program only.
//   C. Both paths timed on the shapes of the other phase; XGEMM_MIN_INDIRECT_SIZE is the split
//      of m·n·k that minimises the summed time; the final set is applied, checked on every shape
//      and timed again.
// On a machine shared with other work, timings taken a minute apart differ by 2× and more, so
// within A and B every candidate is timed again in turns with the best so far (both programs
// are built by then: switching costs nothing) and judged on those turns, and the three leaders
// are timed in turns before a phase picks its winner.
// Every candidate must pass a correctness check against a double-precision CPU GEMM on the same
// random data (odd-sized GEMMs that exercise padding, plus samples of each timed product):
// max |C - ref| / max |ref| <= 1e-4.
//
// With clmha_tune_options.trace set, the search reports every candidate, the turns, the leaders,
// the split and the final check as trace lines through the progress callback (fraction -1).
#ifndef CLMHA_TUNER_GEMM_SEARCH_H
#define CLMHA_TUNER_GEMM_SEARCH_H

#include "base/message.h"
#include "context/context.h"
#include "device/held.h"
#include "errors/errors.h"

#include "tuning/store.h"

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

// ---- timing (gemm_timing.c) --------------------------------------------------------------------

// Random host matrices and their device buffers for @p s.
CLMHA__HIDDEN clmha_status clmha__tuner_shape_alloc(tuner *T, gshape *s);
CLMHA__HIDDEN void clmha__tuner_shape_free(gshape *s);

// Runs the correctness GEMMs of the given kinds (plain, batched): false when a run fails or an
// error exceeds the tolerance (the reason goes to T->msg).
CLMHA__HIDDEN bool clmha__tuner_run_checks(tuner *T, bool plain, bool batched);

// Times the shapes of one kind (plain or batched) and checks samples of their products.
// times[i] gets the fastest time of shape i (0 for shapes of the other kind). *total is their
// sum; a candidate slower than 2.5× @p reference (a total, 0 = none) is cut short and returns
// true with *total = INFINITY. False on a failure (T->msg says why).
CLMHA__HIDDEN bool clmha__tuner_time_kind(tuner *T, bool batched, int reps, double reference,
                                          double *times, double *total);

// Times every shape with the current parameters: 5 runs, median into before/after.
CLMHA__HIDDEN bool clmha__tuner_time_all(tuner *T, bool after, double *plain_total,
                                         double *batched_total);

// The progress line "12/40 candidates, best 85.3 GFLOP/s (phase)" to the caller's callback.
CLMHA__HIDDEN void clmha__tuner_progress(tuner *T, const char *phase);

// True when the caller asked for trace lines (clmha_tune_options.trace with a callback).
CLMHA__HIDDEN bool clmha__tuner_tracing(const tuner *T);

// One trace line, "[tune  12.3s] " and the text, to the progress callback with fraction -1
// (nothing unless clmha__tuner_tracing()).
CLMHA__HIDDEN void clmha__tuner_trace(const tuner *T, const char *fmt, ...) CLMHA__PRINTF(2, 3);

// A trace line "<what>: g1 g2 ... GFLOP/s" with the GFLOP/s of every shape whose time is set.
CLMHA__HIDDEN void clmha__tuner_trace_shapes(const tuner *T, const char *what,
                                             const double *times);

// ---- candidate spaces (gemm_candidates.c) ------------------------------------------------------

// A candidate in "natural" coordinates: Xgemm (GEMMK 0) as work-group MDIMC×NDIMC with MWI×NWI
// per work-item, or XgemmDirect with MDIMAD = MDIMCD and NDIMBD = NDIMCD.
enum { XC_MDIMC, XC_NDIMC, XC_MWI, XC_NWI, XC_VWM, XC_VWN, XC_KWG, XC_KWI, XC_SA, XC_SB, XC_STRM,
       XC_STRN, XC_DIMS };
enum { DC_WGD, DC_MDIMCD, DC_NDIMCD, DC_KWID, DC_VWMD, DC_VWND, DC_PADA, DC_PADB, DC_DIMS };

typedef struct cand {
    size_t c[XC_DIMS];  // XC_DIMS >= DC_DIMS
} cand;

typedef struct cand_list {
    cand items[512];
    double prior[512];
    size_t count;
} cand_list;

// The CPU sets that seed the Xgemm search, most promising first (CLBlast's parameter order).
CLMHA__HIDDEN extern const size_t clmha__xgemm_seeds[][CLMHA__XGEMM_PARAMS];
CLMHA__HIDDEN extern const size_t clmha__xgemm_seed_count;

// Candidate <-> CLBlast parameters (in the order of clmha__xgemm_names / clmha__direct_names).
CLMHA__HIDDEN void clmha__cand_xgemm_params(const cand *x, size_t *p);
CLMHA__HIDDEN bool clmha__cand_from_xgemm(const size_t *p, cand *x);
CLMHA__HIDDEN void clmha__cand_direct_params(const cand *d, size_t *p);

// Within CLBlast's constraints and the device's limits (and the search's own bounds).
CLMHA__HIDDEN bool clmha__cand_valid(const tuner *T, bool direct, const cand *x);

CLMHA__HIDDEN bool clmha__cand_list_has(const cand *items, size_t count, const cand *x);

// Neighbours of @p centre not in @p seen, valid, highest prior first.
CLMHA__HIDDEN void clmha__cand_neighbours(const tuner *T, bool direct, const cand *centre,
                                          const cand *seen, size_t nseen, cand_list *out);

// A random valid candidate not in @p seen, drawn by prior (false when none was found).
CLMHA__HIDDEN bool clmha__cand_random(tuner *T, bool direct, const cand *seen, size_t nseen,
                                      cand *out);

// ---- phases (gemm_search.c) ----------------------------------------------------------------------

// What the GEMM phases chose.
typedef struct gemm_outcome {
    clmha__tuning final;     // the parameters chosen (what was in effect where not searched)
    bool have_x, have_d;     // an Xgemm / XgemmDirect winner was found
    bool final_ok;           // the chosen set passed the final check and was timed
    bool improved;           // and the shapes' summed time beat "before"
} gemm_outcome;

// Runs phases 0 ("before"), A, C1, B, C2 and the final check on T's shapes and checks.
// @p fallback is what is in effect where nothing is searched; @p before, when not NULL, the
// tuning in effect (its Xgemm is tried first). The chosen set is left applied (to CLBlast, not
// to the registry); the caller puts @p fallback back when it is not an improvement.
// CLMHA_BLAS_ERROR when the GEMMs fail with the current parameters.
CLMHA__HIDDEN clmha_status clmha__gemm_search(tuner *T, const clmha__tuning *fallback,
                                              const clmha__tuning *before, gemm_outcome *out);

#endif
