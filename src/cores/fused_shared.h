// What the fused core's forward (src/cores/fused.c) and its backward pass
// (src/cores/fused_backward.c) both use, the decode core too: the vector width of kernels that
// take whole head rows, and the loop limit the fused kernels keep to. A file of its own so that
// the arrows run one way: fused.c calls fused_backward.c, and both call this file.
#ifndef CLMHA_CORES_FUSED_SHARED_H
#define CLMHA_CORES_FUSED_SHARED_H

#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "context/context.h"
#include "layer/layer.h"

// The fused kernel's default vector width on the device of @p ctx: the class table's, or
// (CPUs) the device's native float width.
CLMHA__HIDDEN size_t clmha__fused_default_vw(const clmha_context *ctx);

// The vector width of the kernels that take whole head rows (the fused backward's, the decode
// core's): clmha__fused_default_vw() narrowed to divide @p hd; 1 where vloadN is unsafe.
CLMHA__HIDDEN size_t clmha__fused_row_vw(const clmha_context *ctx, size_t hd);

// Test hook: pretends that the device has the loop limit @p limit (0: the device's own).
CLMHA__HIDDEN void clmha__test_set_loop_limit(size_t limit);

// The loop limit the fused kernels (forward and backward) keep to: the test hook's, else the
// device's (0: none).
CLMHA__HIDDEN size_t clmha__fused_loop_limit(const clmha_layer *layer);

// The tiles of @p tile keys (or query rows) a loop over one block of @p rows query rows (or
// keys) walks at most under the sliding window of @p dims (and @p causal, which bounds the
// right side at 0): the block's span of positions and both window sides, plus a tile for the
// unaligned start and two for the appended keys; @p all (every tile) where a side is unbounded.
CLMHA__HIDDEN double clmha__window_tiles(const clmha__dims *dims, bool causal, double rows,
                                         double tile, double all);

#endif
