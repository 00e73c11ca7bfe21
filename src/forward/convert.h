// The conversions of a 16-bit layer's device forward calls (include/clmha.h, clmha_dtype): its
// tensors are widened into the layer's float32 copies (clmha_layer::staged) before the float32
// pass, and the pass's results narrowed into the caller's buffers after it (cl/convert.cl).
// Everything is enqueued on the context's queue, in order.
#ifndef CLMHA_FORWARD_CONVERT_H
#define CLMHA_FORWARD_CONVERT_H

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"
#include "layer/shape.h"

// Widens @p count elements of buffer @p src, from element @p offset, into the layer's float32
// copy @p slot (CLMHA__STAGED_*, grown to fit; @p what names it in messages); *out receives the
// copy (read from offset 0).
CLMHA__HIDDEN clmha_status clmha__convert_in(clmha_layer *layer, int slot, const char *what,
                                             cl_mem src, size_t offset, size_t count,
                                             cl_mem *out);

// Grows the float32 copy @p slot to @p count floats for a result of the pass; *out receives it.
CLMHA__HIDDEN clmha_status clmha__convert_result(clmha_layer *layer, int slot, const char *what,
                                                 size_t count, cl_mem *out);

// Narrows the first @p count floats of copy @p slot into @p dst from element @p offset.
CLMHA__HIDDEN clmha_status clmha__convert_out(clmha_layer *layer, int slot, cl_mem dst,
                                              size_t offset, size_t count);

// Widens the query, key, value and float masks of @p f (a 16-bit call of sizes @p d, checked)
// into the layer's float32 copies and points @p f at them (from offset 0).
CLMHA__HIDDEN clmha_status clmha__convert_inputs(clmha_layer *layer, const clmha__dims *d,
                                                 clmha_forward_args *f);

#endif
