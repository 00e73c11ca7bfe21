// The candidate spaces of the GEMM search (src/tuning_search/gemm_candidates.c): the CPU seeds, the
// candidates' coordinates and CLBlast's constraints, neighbours and random draws. Used by the
// search (gemm_search.c); uses only the tuner's state (tuner_state.h).
#ifndef CLMHA_TUNING_SEARCH_GEMM_CANDIDATES_H
#define CLMHA_TUNING_SEARCH_GEMM_CANDIDATES_H

#include "tuning_search/tuner_state.h"

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

#endif
