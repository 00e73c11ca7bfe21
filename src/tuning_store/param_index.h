// Positions of the parameters in clmha__tuning's arrays (the order of clmha__xgemm_names and
// clmha__direct_names), for the files that check or build parameter sets: tuning_store/params.c and
// the search (tuning_search/gemm_candidates.c). Short names: include it in .c files only.
#ifndef CLMHA_TUNING_STORE_PARAM_INDEX_H
#define CLMHA_TUNING_STORE_PARAM_INDEX_H

enum { GEMMK, KREG, KWG, KWI, MDIMA, MDIMC, MWG, NDIMB, NDIMC, NWG, SA, SB, STRM, STRN, VWM, VWN };
enum { KWID, MDIMAD, MDIMCD, NDIMBD, NDIMCD, PADA, PADB, VWMD, VWND, WGD };

#endif
