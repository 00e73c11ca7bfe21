// The GEMM search of clmha_context_tune(), private to src/tuning_search/: its phases
// (gemm_search.c), which call the timed GEMM shapes (gemm_timing.c, gemm_timing.h) and the
// candidate spaces (gemm_candidates.c, gemm_candidates.h); the three share the tuner's state
// (tuner_state.h), and the arrows run one way: gemm_search.c calls the other two, never they it.
// The short type names (tuner, gshape, cand, result) are this folder's own: include this header
// from src/tuning_search/ only.
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
#ifndef CLMHA_TUNING_SEARCH_GEMM_SEARCH_H
#define CLMHA_TUNING_SEARCH_GEMM_SEARCH_H

#include "tuning_search/tuner_state.h"

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
