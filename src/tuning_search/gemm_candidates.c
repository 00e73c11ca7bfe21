// The candidate spaces of the GEMM search (see gemm_search.h): the CPU seeds, each parameter's
// ladder of values, the candidates' CLBlast parameters and validity, the priors that order
// them, a candidate's neighbours and prior-weighted random draws.
#define _POSIX_C_SOURCE 200809L

#include "tuning_search/gemm_candidates.h"

#include "tuning_store/param_index.h"

#include <math.h>
#include <string.h>

// CPU sets that seed the Xgemm search, most promising first: what the searches found on a
// 2-core Zen 4 with PoCL 3.1 (skylake-avx512 target) and their closest rivals, measured there
// with bench/gemm_ratio (sgemm 1024³, CLBlast and OpenBLAS 0.3.21 on 2 threads timed in turns).
// All have 16×16 floats per work-item in float8 × float4 steps (VWM 8, VWN 4) and no local
// memory; they differ in the work-group's shape and the K loop:
//   0. 2×8 work-items, KWG 32, STRM (found by a 300 s search): on a quiet machine ~154 GFLOP/s
//      column-major with B transposed (no pad/transpose kernels) against OpenBLAS's ~194 (0.79),
//      ~130 row-major with B transposed (0.67); CLBlast's generic set: ~27 (0.14). A later
//      300 s search on a busy machine chose 4×16 work-items, KWG 32, no STRM: the same speed.
//   1. 4×4 work-items, KWG 8, STRM (found by a 600 s search): ~0.74 and ~0.64.
//   2. the earlier hand-picked set (4×4, KWG 16, VWN 8, no STRM): about set 1's speed.
//   3. set 1 on 128×128 tiles (8×8 work-items).
// Measured slower there, left to the walk and the random draws: VWM 16 (~6× slower), GEMMK 1
// (KREG 4: 10-50 % slower even where it needs no transposes), VWN 1, 32×8 or 8×32 floats per
// work-item, 8×16, KWI 8.
const size_t clmha__xgemm_seeds[][CLMHA__XGEMM_PARAMS] = {
    {0, 1, 32, 2, 2, 2, 32, 8, 8, 128, 0, 0, 1, 0, 8, 4},
    {0, 1, 8, 2, 4, 4, 64, 4, 4, 64, 0, 0, 1, 0, 8, 4},
    {0, 1, 16, 2, 4, 4, 64, 4, 4, 64, 0, 0, 0, 0, 8, 8},
    {0, 1, 8, 2, 8, 8, 128, 8, 8, 128, 0, 0, 1, 0, 8, 4},
};
const size_t clmha__xgemm_seed_count = sizeof clmha__xgemm_seeds / sizeof clmha__xgemm_seeds[0];

// ---- ladders --------------------------------------------------------------------------------

// Xgemm, GEMMK 0: work-group MDIMC×NDIMC, each work-item MWI×NWI.
static const size_t xc_ladder[XC_DIMS][6] = {
    {1, 2, 4, 8, 16, 0}, {1, 2, 4, 8, 16, 0}, {4, 8, 16, 32, 64, 0}, {2, 4, 8, 16, 32, 0},
    {1, 2, 4, 8, 16, 0}, {1, 2, 4, 8, 16, 0}, {8, 16, 32, 64, 0, 0}, {1, 2, 4, 8, 0, 0},
    {0, 1, 0, 0, 0, 0},  {0, 1, 0, 0, 0, 0},  {0, 1, 0, 0, 0, 0},    {0, 1, 0, 0, 0, 0}};
static const size_t xc_ladder_len[XC_DIMS] = {5, 5, 5, 5, 5, 5, 4, 4, 2, 2, 2, 2};

// XgemmDirect: MDIMAD = MDIMCD, NDIMBD = NDIMCD.
static const size_t dc_ladder[DC_DIMS][5] = {
    {8, 16, 32, 64, 0}, {1, 2, 4, 8, 16}, {1, 2, 4, 8, 16}, {1, 2, 4, 8, 16},
    {1, 2, 4, 8, 16},   {1, 2, 4, 8, 16}, {0, 1, 0, 0, 0},  {0, 1, 0, 0, 0}};
static const size_t dc_ladder_len[DC_DIMS] = {4, 5, 5, 5, 5, 5, 2, 2};

void clmha__cand_xgemm_params(const cand *x, size_t *p) {
    const size_t *c = x->c;
    size_t v[CLMHA__XGEMM_PARAMS] = {0,           1,           c[XC_KWG],  c[XC_KWI],
                                     c[XC_MDIMC], c[XC_MDIMC], c[XC_MDIMC] * c[XC_MWI],
                                     c[XC_NDIMC], c[XC_NDIMC], c[XC_NDIMC] * c[XC_NWI],
                                     c[XC_SA],    c[XC_SB],    c[XC_STRM], c[XC_STRN],
                                     c[XC_VWM],   c[XC_VWN]};
    memcpy(p, v, sizeof v);
}

bool clmha__cand_from_xgemm(const size_t *p, cand *x) {
    if (p[GEMMK] != 0 || p[MDIMA] != p[MDIMC] || p[NDIMB] != p[NDIMC] || !p[MDIMC] ||
        !p[NDIMC] || p[MWG] % p[MDIMC] || p[NWG] % p[NDIMC])
        return false;
    size_t c[XC_DIMS] = {p[MDIMC],        p[NDIMC], p[MWG] / p[MDIMC], p[NWG] / p[NDIMC],
                         p[VWM],          p[VWN],   p[KWG],            p[KWI],
                         p[SA],           p[SB],    p[STRM],           p[STRN]};
    memcpy(x->c, c, sizeof c);
    return true;
}

void clmha__cand_direct_params(const cand *d, size_t *p) {
    const size_t *c = d->c;
    size_t v[CLMHA__DIRECT_PARAMS] = {c[DC_KWID],   c[DC_MDIMCD], c[DC_MDIMCD], c[DC_NDIMCD],
                                      c[DC_NDIMCD], c[DC_PADA],   c[DC_PADB],   c[DC_VWMD],
                                      c[DC_VWND],   c[DC_WGD]};
    memcpy(p, v, sizeof v);
}

static bool xc_valid(const tuner *T, const cand *x) {
    const size_t *c = x->c;
    if (c[XC_MDIMC] * c[XC_MWI] > 256 || c[XC_NDIMC] * c[XC_NWI] > 256) return false;
    if (c[XC_MWI] * c[XC_NWI] > 1024) return false;  // accumulators per work-item
    size_t p[CLMHA__XGEMM_PARAMS];
    clmha__cand_xgemm_params(x, p);
    return clmha__tuning_check_xgemm(p, clmha__tuning_local_mem(&T->tg), T->tg.max_work_group,
                                     NULL, 0);
}

static bool dc_valid(const tuner *T, const cand *d) {
    size_t p[CLMHA__DIRECT_PARAMS];
    clmha__cand_direct_params(d, p);
    return clmha__tuning_check_direct(p, clmha__tuning_local_mem(&T->tg), T->tg.max_work_group,
                                      NULL, 0);
}

bool clmha__cand_valid(const tuner *T, bool direct, const cand *x) {
    return direct ? dc_valid(T, x) : xc_valid(T, x);
}

static double log2d(double v) { return log(v) / log(2.0); }

// Prior for a CPU device (higher is tried first): 256 accumulators per work-item (16 AVX-512
// registers), wide vectors, small work-groups, no local memory (barriers make PoCL keep every
// work-item's registers in memory), KWG 16/32. On a GPU the same order is merely a start.
static double xc_prior(const tuner *T, const cand *x) {
    const size_t *c = x->c;
    bool cpu = (T->ctx->info.type & CL_DEVICE_TYPE_CPU) != 0;
    double acc = (double)(c[XC_MWI] * c[XC_NWI]);
    double s = -fabs(log2d(acc / 256.0));
    // PoCL on AVX-512 measured: VWM 8 best, 16 about half as fast (float16 is split badly).
    s -= c[XC_VWM] == 8 ? 0 : c[XC_VWM] == 4 ? 0.5 : c[XC_VWM] == 16 ? 1.5 : 2;
    s -= c[XC_VWN] == 4 || c[XC_VWN] == 8 ? 0 : c[XC_VWN] == 16 ? 0.5 : 1;
    s -= 1.5 * (double)(c[XC_SA] + c[XC_SB]) * (cpu ? 1 : -0.5);
    s -= 0.5 * (double)(c[XC_STRM] + c[XC_STRN]);
    double wg = (double)(c[XC_MDIMC] * c[XC_NDIMC]);
    s -= cpu ? fabs(log2d(wg / 24.0)) * 0.5 : fabs(log2d(wg / 256.0)) * 0.5;
    s -= c[XC_KWG] == 16 || c[XC_KWG] == 32 ? 0 : 0.5;
    s -= c[XC_KWI] == 2 || c[XC_KWI] == 4 ? 0 : 0.5;
    return s;
}

// XgemmDirect on PoCL: its work-items share local memory across barriers, and the kernel's
// build time grows steeply with the tile per work-item (WGD/MDIMCD × WGD/NDIMCD): 16 builds in
// ~40 s, 64 took over 3 minutes. On a CPU small tiles per work-item come first.
static double dc_prior(const tuner *T, const cand *d) {
    const size_t *c = d->c;
    bool cpu = (T->ctx->info.type & CL_DEVICE_TYPE_CPU) != 0;
    double mwi = (double)(c[DC_WGD] / c[DC_MDIMCD]), nwi = (double)(c[DC_WGD] / c[DC_NDIMCD]);
    double s = cpu ? -fmax(0.0, log2d(mwi * nwi / 16.0)) * 1.5 - fabs(log2d(mwi * nwi / 16.0)) * 0.3
                   : -fabs(log2d(mwi * nwi / 64.0)) * 0.7;
    s -= c[DC_VWMD] >= 2 ? 0 : 1;
    s -= c[DC_VWND] >= 2 ? 0 : 0.5;
    double wg = (double)(c[DC_MDIMCD] * c[DC_NDIMCD]);
    s -= fabs(log2d(wg / 64.0)) * 0.5;
    s -= c[DC_KWID] >= 2 && c[DC_KWID] <= 8 ? 0 : 0.5;
    s -= 0.3 * (double)(c[DC_PADA] + c[DC_PADB]) * (cpu ? 1 : -1);
    s -= c[DC_WGD] == 16 || c[DC_WGD] == 32 ? 0 : 0.3;
    return s;
}

// Index of @p v on a ladder, or -1.
static int ladder_index(const size_t *ladder, size_t len, size_t v) {
    for (size_t i = 0; i < len; ++i)
        if (ladder[i] == v) return (int)i;
    return -1;
}

static bool same_cand(const cand *a, const cand *b) { return memcmp(a, b, sizeof *a) == 0; }

bool clmha__cand_list_has(const cand *items, size_t count, const cand *x) {
    for (size_t i = 0; i < count; ++i)
        if (same_cand(&items[i], x)) return true;
    return false;
}

// Neighbours of @p centre: one coordinate one step along its ladder, and the work moved
// between the work-group and the work-item (MDIMC×2 with MWI/2 and so on: same tile).
void clmha__cand_neighbours(const tuner *T, bool direct, const cand *centre, const cand *seen,
                            size_t nseen, cand_list *out) {
    out->count = 0;
    size_t dims = direct ? DC_DIMS : XC_DIMS;
    for (size_t d = 0; d < dims; ++d) {
        const size_t *ladder = direct ? dc_ladder[d] : xc_ladder[d];
        size_t len = direct ? dc_ladder_len[d] : xc_ladder_len[d];
        int at = ladder_index(ladder, len, centre->c[d]);
        for (int step = -1; step <= 1; step += 2) {
            cand x = *centre;
            if (at < 0) {
                if (step > 0) continue;
                x.c[d] = ladder[0];
            } else {
                int to = at + step;
                if (to < 0 || to >= (int)len) continue;
                x.c[d] = ladder[to];
            }
            if (out->count < 512 && !clmha__cand_list_has(seen, nseen, &x) &&
                !clmha__cand_list_has(out->items, out->count, &x) &&
                (direct ? dc_valid(T, &x) : xc_valid(T, &x)))
                out->items[out->count++] = x;
        }
    }
    if (!direct) {  // same tile, threads traded for work per thread
        for (int dim = 0; dim < 2; ++dim) {
            size_t th = dim ? XC_NDIMC : XC_MDIMC, wi = dim ? XC_NWI : XC_MWI;
            for (int up = 0; up < 2; ++up) {
                cand x = *centre;
                if (up) {
                    if (x.c[wi] < 2) continue;
                    x.c[th] *= 2, x.c[wi] /= 2;
                } else {
                    if (x.c[th] < 2) continue;
                    x.c[th] /= 2, x.c[wi] *= 2;
                }
                if (ladder_index(xc_ladder[th], xc_ladder_len[th], x.c[th]) < 0 ||
                    ladder_index(xc_ladder[wi], xc_ladder_len[wi], x.c[wi]) < 0)
                    continue;
                if (out->count < 512 && !clmha__cand_list_has(seen, nseen, &x) &&
                    !clmha__cand_list_has(out->items, out->count, &x) && xc_valid(T, &x))
                    out->items[out->count++] = x;
            }
        }
    }
    for (size_t i = 0; i < out->count; ++i)
        out->prior[i] = direct ? dc_prior(T, &out->items[i]) : xc_prior(T, &out->items[i]);
    // Highest prior first (insertion sort: short lists).
    for (size_t i = 1; i < out->count; ++i) {
        cand x = out->items[i];
        double p = out->prior[i];
        size_t j = i;
        for (; j > 0 && out->prior[j - 1] < p; --j) {
            out->items[j] = out->items[j - 1];
            out->prior[j] = out->prior[j - 1];
        }
        out->items[j] = x;
        out->prior[j] = p;
    }
}

// A random valid candidate, drawn by prior (the best of a few random draws).
bool clmha__cand_random(tuner *T, bool direct, const cand *seen, size_t nseen, cand *out) {
    size_t dims = direct ? DC_DIMS : XC_DIMS;
    double best_prior = -INFINITY;
    bool found = false;
    for (int draw = 0; draw < 400; ++draw) {
        cand x = {{0}};
        for (size_t d = 0; d < dims; ++d) {
            size_t len = direct ? dc_ladder_len[d] : xc_ladder_len[d];
            x.c[d] = (direct ? dc_ladder[d] : xc_ladder[d])[next_rand(&T->rng) % len];
        }
        if (!clmha__cand_valid(T, direct, &x) || clmha__cand_list_has(seen, nseen, &x)) continue;
        // A random jitter keeps the draws diverse.
        double p = (direct ? dc_prior(T, &x) : xc_prior(T, &x)) +
                   (double)(next_rand(&T->rng) % 1000) / 400.0;
        if (p > best_prior) best_prior = p, *out = x, found = true;
        if (draw > 40 && found) break;
    }
    return found;
}

