// Shapes of scaled dot-product attention (clmha_attention_args): the checks and sizes of one
// call, shared by the device function (src/forward/attention.c) and the CPU reference
// (src/reference/reference_attention.c), so that both accept and refuse exactly the same calls;
// and the call as the attention cores see it (a clmha__dims, the masks in their layouts).
#ifndef CLMHA_LAYER_ATTENTION_SHAPE_H
#define CLMHA_LAYER_ATTENTION_SHAPE_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/shape.h"

// One resolved call.
typedef struct clmha__attention_dims {
    // What the cores read: n, l, s (= s_padded: no appended keys), h, d, kvh, e = h * d, the
    // mask kind and its broadcast strides (attn_sn, attn_sh, attn_si), scores_count = n*h*l*s;
    // batch_first (the NLHD rows are the layer's batch-first projected rows), batched as the
    // query. kpm_kind is NONE: every mask is the cores' attn_mask.
    clmha__dims core;
    clmha_attention_layout layout;
    size_t dv;      // the value's last dimension (D_v)
    double scale;   // the scores' factor: the caller's, or 1/sqrt(D)
    // The caller's attn_mask as the cores take it (their attn_mask, read through
    // core.attn_sn, attn_sh, attn_si); kind NONE without one.
    clmha_mask attn;
    size_t query_count, key_count, value_count, mask_count;  // elements
    size_t output_count, lse_count, weights_count;           // elements
    // A packed call (clmha_attention_args::seq_lens): core.packed, core.seq_lens and
    // core.kv_seq_lens (the caller's arrays, kv_seq_lens defaulted), core.t_q, core.t_kv;
    // core.n the sequences, core.l and core.s the longest; the counts the packed tensors'.
} clmha__attention_dims;

// The one-sequence call of sequence @p i (which has queries) of packed call @p a (sizes @p d)
// whose tokens start at @p q0 and @p k0: (1, L_i, H, D) query, key and value in the NLHD
// layout at their rows (offsets in floats; host data pointers advanced likewise), the rng
// offset advanced by i * 2^32, not packed.
CLMHA__HIDDEN void clmha__attention_packed_args(const clmha__attention_dims *d,
                                                const clmha_attention_args *a, size_t i,
                                                size_t q0, size_t k0,
                                                clmha_attention_args *sub);

// Checks @p args (in this library's layout) and fills @p d. On failure writes a message naming
// the argument and its shape (in the call's layout) to @p msg and returns the status. Does not
// look at buffers or data pointers; D_v may differ from D here (the caller refuses what it
// cannot run).
CLMHA__HIDDEN clmha_status clmha__attention_resolve(const clmha_attention_args *args,
                                                    clmha__attention_dims *d, char *msg,
                                                    size_t msg_size);

// The (n, heads, seq, feat) of tensor @p t in @p layout (3-D: n = 1).
CLMHA__HIDDEN void clmha__attention_sizes(const clmha_tensor *t, clmha_attention_layout layout,
                                          size_t out[4]);

#endif
