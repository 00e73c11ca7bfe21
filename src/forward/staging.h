// The device copies of a host-array call's tensors (clmha_layer_forward_host(),
// clmha_layer_backward_host()): buffers the layer keeps between calls (layer->host[]), grown to
// the largest call, so that a repeated call allocates nothing and copies only its data.
#ifndef CLMHA_FORWARD_STAGING_H
#define CLMHA_FORWARD_STAGING_H

#include "base/defs.h"
#include "layer/layer.h"
#include "layer/shape.h"

// Slot @p slot (CLMHA__HOST_*) with room for @p bytes, its contents undefined: *out is the
// layer's buffer (not a new reference), replaced by a larger one when it is too small; @p what
// names the tensor in the message of a failure.
CLMHA__HIDDEN clmha_status clmha__host_room(clmha_layer *layer, int slot, const char *what,
                                            size_t bytes, cl_mem *out);

// clmha__host_room(), then @p bytes of @p data written into it (a blocking write: @p data may
// be freed on return).
CLMHA__HIDDEN clmha_status clmha__host_upload(clmha_layer *layer, int slot, const char *what,
                                              const void *data, size_t bytes, cl_mem *out);

// Reads @p n device buffers into the caller's arrays whole or not at all: @p bytes[i] from
// @p src[i] into @p dst[i] (a NULL dst is skipped; n at most 4) in blocking reads, every array
// but the last asked for through a host copy that is moved into place only once every read has
// succeeded, so that a failed read writes none of them. @p what names each array in a
// failure's message.
CLMHA__HIDDEN clmha_status clmha__host_read_all(clmha_context *ctx, int n, const cl_mem *src,
                                                void *const *dst, const size_t *bytes,
                                                const char *const *what);

// After a failed host-array call: lets go of every slot (the driver frees a buffer once the work
// queued on it has finished), so that a refused call leaves no allocation behind and
// clmha_layer_scratch_bytes() is what it was before the layer's first host-array call.
CLMHA__HIDDEN void clmha__host_drop(clmha_layer *layer);

// Uploads @p count values of a host call (@p data: floats, or doubles with @p f64) into slot
// @p slot as the layer's dtype: as they are where the types agree, else converted (to nearest
// even; a double for a 16-bit layer through float32).
CLMHA__HIDDEN clmha_status clmha__host_upload_values(clmha_layer *layer, int slot,
                                                     const char *what, const void *data,
                                                     size_t count, bool f64, cl_mem *out);

// clmha__host_upload_values() of tensor @p t's data (@p count values), @p t then pointing at
// the slot's buffer from offset 0.
CLMHA__HIDDEN clmha_status clmha__host_upload_tensor(clmha_layer *layer, int slot,
                                                     const char *what, clmha_tensor *t,
                                                     size_t count, bool f64);

// The query, key, value and masks of a host call of sizes @p d (floats, or doubles with @p f64)
// into their slots, @p dev (a copy of the call's arguments) then pointing at them: values as
// the layer's dtype, boolean masks as they are.
CLMHA__HIDDEN clmha_status clmha__host_upload_inputs(clmha_layer *layer, const clmha__dims *d,
                                                     bool f64, clmha_forward_args *dev);

#endif
