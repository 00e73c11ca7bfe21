// The tuner's GEMM shapes (src/tuning_search/gemm_timing.c): random matrices, one timed GEMM, its
// check against a double-precision CPU GEMM, the progress and trace lines. Used by the search
// (gemm_search.c); uses only the tuner's state (tuner_state.h).
#ifndef CLMHA_TUNING_SEARCH_GEMM_TIMING_H
#define CLMHA_TUNING_SEARCH_GEMM_TIMING_H

#include "tuning_search/tuner_state.h"

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

#endif
