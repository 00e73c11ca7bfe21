// Shapes: checks of layer descriptors and forward arguments and the sizes of one call, shared
// by the OpenCL forward pass and the CPU reference so that both accept and refuse exactly the
// same calls.
#ifndef CLMHA_LAYER_SHAPE_H
#define CLMHA_LAYER_SHAPE_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// How attn_mask is laid out once its shape is checked.
typedef enum clmha__attn_layout {
    CLMHA__ATTN_NONE = 0,
    CLMHA__ATTN_SHARED,    // (L, S): every batch item and head
    CLMHA__ATTN_PER_HEAD,  // (N*H, L, S)
    CLMHA__ATTN_PER_BATCH, // (N, L, S): shared by the heads of a batch item
    CLMHA__ATTN_PER_HEAD_SHARED,  // (H, L, S): a mask per head, shared by the batch items
                                  // (attention as a function's (1, H, L, S) with N > 1)
} clmha__attn_layout;

// The sizes of one forward call, resolved from the layer and the arguments.
typedef struct clmha__dims {
    bool batched;        // false: unbatched 2-D inputs (N = 1)
    bool batch_first;    // batched and the layer is batch_first
    size_t n, l, s;      // batch, target length, source length
    size_t e, kdim, vdim, h, d;
    size_t kvh;          // key/value heads (grouped-query attention; h without)
    size_t s_padded;     // s + add_bias_kv + add_zero_attn
    bool key_is_query;   // args->key.ndim == 0
    bool value_is_key;   // args->value.ndim == 0
    clmha__attn_layout attn_layout;
    clmha_mask_kind attn_kind, kpm_kind;
    size_t query_count, key_count, value_count;  // elements of each input
    size_t attn_count, kpm_count;                // elements of each mask (0 if none)
    size_t output_count, weights_count;          // elements of each output
    size_t scores_count;                         // n * h * l * s_padded
} clmha__dims;

// Checks @p args against @p desc (already validated) and fills @p dims. On failure writes a
// message naming the argument and the shapes to @p msg and returns the status.
CLMHA__HIDDEN clmha_status clmha__dims_resolve(const clmha_layer_desc *desc,
                                               const clmha_forward_args *args, clmha__dims *dims,
                                               char *msg, size_t msg_size);

// Checks that every tensor the resolved call reads has a host data pointer.
CLMHA__HIDDEN clmha_status clmha__check_host_data(const clmha__dims *dims,
                                                  const clmha_forward_args *args, char *msg,
                                                  size_t msg_size);

// Checks a layer descriptor and fills kdim/vdim defaults into @p out.
CLMHA__HIDDEN clmha_status clmha__desc_check(const clmha_layer_desc *desc, clmha_layer_desc *out,
                                             char *msg, size_t msg_size);

#endif
