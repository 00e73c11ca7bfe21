// Shapes: checks of layer descriptors and forward arguments and the sizes of one call, shared
// by the OpenCL forward pass and the CPU reference so that both accept and refuse exactly the
// same calls.
#ifndef CLMHA_LAYER_SHAPE_H
#define CLMHA_LAYER_SHAPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "clmha.h"

#include "base/defs.h"

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
    // attn_mask's broadcast strides, in elements, 0 along a dimension it is broadcast over:
    // the term of score (n, h, i, j) is element n*attn_sn + h*attn_sh + i*attn_si + j of the
    // mask (from its offset). The layer's (L, S) is (0, 0, S), (N*H, L, S) (H*L*S, L*S, S),
    // per_batch (N, L, S) (L*S, 0, S); attention as a function's (a, b, c, S) likewise.
    // All 0 without a mask (attn_kind NONE).
    size_t attn_sn, attn_sh, attn_si;
    // The sliding window (clmha_layer_desc::window): query position p sees key j < s only when
    // p - win_left <= j <= p + win_right; -1 leaves a side unbounded, and no window is (-1, -1).
    int64_t win_left, win_right;
    // Soft-capping (clmha_layer_desc::softcap; 0: off) and ALiBi (clmha_layer_desc::alibi).
    double softcap;
    bool alibi;
    bool sinks;  // attention sinks (clmha_layer_desc::sinks, clmha_attention_args::sinks)
    // The attention function's user functions (clmha_attention_args::mod_source; NULL or "":
    // none; a layer's calls take the layer's own).
    const char *mod_source;
    // Partial attention's positions of the call's first query row and key
    // (clmha_forward_args::query_position, key_position; 0 elsewhere).
    size_t q_pos, k_pos;
    // A packed call (clmha_forward_args::seq_lens): n sequences of seq_lens[i] queries and
    // kv_seq_lens[i] keys (the caller's arrays; kv_seq_lens is seq_lens when the caller gave
    // none), t_q and t_kv tokens in all, l and s the longest. The element counts are the packed
    // tensors'; batched is true, batch_first false.
    bool packed;
    const size_t *seq_lens, *kv_seq_lens;
    size_t t_q, t_kv;
    clmha_mask_kind attn_kind, kpm_kind;
    size_t query_count, key_count, value_count;  // elements of each input
    size_t attn_count, kpm_count;                // elements of each mask (0 if none)
    size_t output_count, weights_count;          // elements of each output
    size_t scores_count;                         // n * h * l * s_padded
} clmha__dims;

// Sets d->attn_sn, attn_sh, attn_si for a contiguous attn_mask of sizes (a, b, c, S), each of
// a, b, c either 1 (broadcast) or d->n, d->h, d->l (d->s set).
CLMHA__HIDDEN void clmha__attn_strides(clmha__dims *d, size_t a, size_t b, size_t c);

// Checks a sliding window's bounds (clmha_layer_desc::window, clmha_attention_args::window):
// each -1 or at least 0; the message names them as fields of @p where.
CLMHA__HIDDEN clmha_status clmha__window_check(bool window, int64_t left, int64_t right,
                                               const char *where, char *msg, size_t msg_size);

// Sets @p d's win_left, win_right from a checked window (off: -1, -1).
CLMHA__HIDDEN void clmha__window_set(clmha__dims *d, bool window, int64_t left, int64_t right);

// Checks a soft-capping value (clmha_layer_desc::softcap): 0 or positive and finite.
CLMHA__HIDDEN clmha_status clmha__softcap_check(double softcap, const char *where, char *msg,
                                                size_t msg_size);

// Slope @p h of the ALiBi paper's slopes for @p heads heads (clmha_alibi_slopes()), in double.
CLMHA__HIDDEN double clmha__alibi_slope(size_t heads, size_t h);

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
