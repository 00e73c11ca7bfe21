// The fused attention core (src/cores/fused.c, kernel cl/cores/fused.cl): what the tuner, the
// bake step and the tests use of it besides the core interface (core.h). Its per-layer state
// (kernel, tiles, build failure, the backward pass's state) is private to fused.c; these
// functions read it. Its backward pass is src/cores/fused_backward.c (its header
// fused_backward.h), and what both use is in src/cores/fused_shared.c (fused_shared.h): fused.c
// calls fused_backward.c, and both call fused_shared.c, never the other way.
#ifndef CLMHA_CORES_FUSED_H
#define CLMHA_CORES_FUSED_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "context/context.h"
#include "device/device_class.h"
#include "layer/layer.h"
#include "layer/shape.h"

#include "cores/fused_backward.h"
#include "cores/fused_shared.h"

// The fused attention kernel's tiles.
typedef struct clmha__fused_tiles {
    size_t bq;   // work-group size (a power of two within the device's limit)
    size_t bk;   // keys per tile (0: not even one key fits in local memory)
    size_t rpw;  // query rows per work-item; a work-group covers bq * rpw rows
    size_t vw;   // vector width: 1, 2, 4, 8 or 16, dividing bk and hd
    bool q_local;    // query rows in local memory (coalesced loads and stores), not private
    bool acc_local;  // accumulators in local memory too (the private budget is too small)
    bool lanes;      // the lanes mapping (CPUs): rows as vector lanes, no local memory
} clmha__fused_tiles;

// The rows of a work-item of the lanes mapping: rpw rounded up to whole vectors of vw.
static inline size_t clmha__fused_lane_rows(const clmha__fused_tiles *t) {
    size_t vw = t->vw ? t->vw : 1;
    return (t->rpw + vw - 1) / vw * vw;
}

// The fused kernel's private floats per work-item for tiles @p t and head dim @p hd: per row,
// the tile's scores (bk) plus the scaled query and the accumulator where they are private
// (lanes: all three, for the rows rounded up to whole vectors).
static inline size_t clmha__fused_private_floats(const clmha__fused_tiles *t, size_t hd) {
    if (t->lanes) return clmha__fused_lane_rows(t) * (t->bk + 2 * hd);
    return t->rpw * (t->bk + (t->q_local ? 0 : hd) + (t->acc_local ? 0 : hd));
}

// The fused kernel's local memory in floats (cl/cores/fused.cl): the key tile hd x bk (row
// stride bk|1 with q_local), the value tile bk x hd, and the query rows and accumulators
// bq*rpw x (hd|1) each where they are local; none in the lanes mapping.
static inline size_t clmha__fused_local_floats(const clmha__fused_tiles *t, size_t hd) {
    if (t->lanes) return 0;
    size_t rows = t->bq * t->rpw * (hd | 1);
    return hd * (t->q_local ? t->bk | 1 : t->bk) + t->bk * hd + (t->q_local ? rows : 0) +
           (t->acc_local ? rows : 0);
}

// Tiles of the fused attention kernel for head dim @p hd on the device of @p ctx: the context's
// preferred ones (a stored tuning) or its device class's defaults, fitted by
// clmha__fused_tiles_fit().
CLMHA__HIDDEN clmha__fused_tiles clmha__fused_tiles_for(const clmha_context *ctx, size_t hd);

// Makes tiles @p t usable for head dim @p hd on the device of @p ctx:
// clmha__fused_tiles_fit_limits() with its class, local memory and work-group limit; vw 1
// where vloadN is unsafe (clmha__quirks).
CLMHA__HIDDEN void clmha__fused_tiles_fit(const clmha_context *ctx, size_t hd,
                                          clmha__fused_tiles *t);

// Makes tiles @p t usable for head dim @p hd under class @p cls with @p local_mem bytes of
// local memory and work-groups of at most @p max_wg: bq the largest power of two within both;
// lanes and q_local from the class. In the lanes mapping, while the private arrays exceed the
// class's budget, rpw halved, then bk halved down to 8, else the tiled mapping with one row per
// work-item, bq 64 and bk 32 at most. Then (tiled mapping), while the private arrays exceed the
// class's budget (clmha__fused_private_floats()), one row per work-item, bk halved down to 8,
// the query rows and then the accumulators moved to local memory; then, while the local memory
// (clmha__fused_local_floats()) exceeds the device's less 1 KiB, bk halved down to 8, bq down to
// 32, then either further (bk 0: nothing fits); last, vw narrowed (a power of two up to 16, at
// most the given vw) until it divides hd and bk.
CLMHA__HIDDEN void clmha__fused_tiles_fit_limits(const clmha__device_class *cls,
                                                 cl_ulong local_mem, size_t max_wg, size_t hd,
                                                 clmha__fused_tiles *t);

// Builds the fused attention kernel of @p layer on first use and picks its tile sizes.
CLMHA__HIDDEN clmha_status clmha__layer_fused(clmha_layer *layer);

// The fused kernel of @p layer, or NULL when not built (yet).
CLMHA__HIDDEN cl_kernel clmha__fused_kernel(const clmha_layer *layer);

// The tiles @p layer's fused kernel was built with (zero when not built).
CLMHA__HIDDEN clmha__fused_tiles clmha__fused_tiles_of(const clmha_layer *layer);

// Whether the last forward call of @p layer ran the fused core (for the tests).
CLMHA__HIDDEN bool clmha__fused_ran(const clmha_layer *layer);

// Whether the fused kernel, as built, stays within the device's loop limit
// (clmha__quirks::loop_limit) on the call of @p dims (@p causal: is_causal): a conservative
// count of the loop iterations one work-item runs, every loop counted as if the compiler kept
// it (the key tiles as the window bounds them), must stay below half the limit. Always true on
// devices without that limit.
CLMHA__HIDDEN bool clmha__fused_loops_fit(const clmha_layer *layer, const clmha__dims *dims,
                                          bool causal, bool dropout);

// Rebuilds the fused attention kernel of @p layer with tiles @p t (the tuner's candidates):
// bk is halved until the tile fits in local memory and vw until it divides head_dim and bk.
// @p used receives the tiles built (may be NULL).
CLMHA__HIDDEN clmha_status clmha__layer_set_fused_tiles(clmha_layer *layer,
                                                        const clmha__fused_tiles *t,
                                                        clmha__fused_tiles *used);

// The rows one work-group of the fused backward kernels of @p layer covers (work-group size
// times rows per work-item; 0: not built).
CLMHA__HIDDEN size_t clmha__fused_backward_tile(const clmha_layer *layer);

#endif
