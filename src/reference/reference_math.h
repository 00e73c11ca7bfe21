// The steps of the CPU reference that its forward and backward passes share: validation of a
// call, the input layouts, projections, head split and merge, masks, softmax, dropout and
// weights . V, in double precision on plain row-major arrays. The backward pass recomputes the
// forward quantities with exactly these functions, so that both passes see the same numbers.
#ifndef CLMHA_REFERENCE_MATH_H
#define CLMHA_REFERENCE_MATH_H

#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/shape.h"

// One validated call: the caller's structs read in this library's layout, and its sizes.
typedef struct clmha__ref_call {
    clmha_layer_desc desc;          // kdim/vdim defaults filled in
    clmha_forward_args args;
    clmha_reference_params params;
    clmha__dims d;
} clmha__ref_call;

// What the three input projections read: the inputs (resolved for self-attention and a shared
// key/value), the weight blocks (E, feat), the bias blocks (E) or NULL, and each input's length
// and features. Index 0 is the query, 1 the key, 2 the value.
typedef struct clmha__ref_operands {
    const float *x[3];
    const float *w[3];
    const float *b[3];
    size_t seq[3], feat[3];
    size_t width[3];  // the projections' widths: E, then num_kv_heads * D for key and value
} clmha__ref_operands;

// Reads and checks desc, params and args as clmha_reference_forward() documents (struct sizes,
// the descriptor, shapes, parameters, the user functions' host forms (for the backward pass
// when @p backward), host data pointers) into @p call.
CLMHA__HIDDEN clmha_status clmha__ref_validate(const clmha_layer_desc *desc,
                                               const clmha_reference_params *params,
                                               const clmha_forward_args *args, bool backward,
                                               clmha__ref_call *call, char *msg,
                                               size_t msg_size);

// The projections' operands of a validated call.
CLMHA__HIDDEN void clmha__ref_operands_of(const clmha__ref_call *call, clmha__ref_operands *ops);

// Element index of (position i, batch item n, feature f) in an input tensor of `seq` positions
// and `feat` features: (seq, N, feat), (N, seq, feat) with batch_first, or (seq, feat)
// unbatched (N == 1, where the seq-first formula gives the same index).
CLMHA__HIDDEN size_t clmha__ref_input_index(const clmha__dims *d, size_t seq, size_t feat,
                                            size_t i, size_t n, size_t f);

// out (N, seq, width) = x . W^T + b, where x is an input tensor (see clmha__ref_input_index)
// of `feat` features, W is (width, feat) row-major and b is (width) or NULL.
CLMHA__HIDDEN void clmha__ref_project(const clmha__dims *d, const float *x, size_t seq,
                                      size_t feat, const float *w, const float *b, size_t width,
                                      double *out);

// Splits x (N, seq, width) into heads (N*H, seq_out, D), head h taking the columns of head
// h / group (grouped-query attention: width = num_kv_heads * D, group = H / num_kv_heads;
// else width E, group 1); positions seq .. seq_out-1 are appended: first `extra` (width) when
// not NULL (bias_k / bias_v), then zeros (add_zero_attn).
CLMHA__HIDDEN void clmha__ref_split_heads(const clmha__dims *d, const double *x, size_t seq,
                                          size_t width, size_t group, const float *extra,
                                          size_t seq_out, double *out);

// Merges the first `seq` positions of heads x (N*H, seq_in, D) into (N, seq, E).
CLMHA__HIDDEN void clmha__ref_merge_heads(const clmha__dims *d, const double *x, size_t seq_in,
                                          size_t seq, double *out);

// Whether the sliding window (window_left, window_right; -1 unbounded) lets the query at
// position @p p see key @p j, as include/clmha.h defines it: p - left <= j <= p + right.
CLMHA__HIDDEN bool clmha__ref_window_allows(bool window, int64_t left, int64_t right, size_t p,
                                            size_t j);

// Score @p s of query position @p p against key @p j with the score variants of
// include/clmha.h (clmha_layer_desc::softcap, alibi): soft-capped with @p softcap (> 0; 0:
// off), then, for a real key (@p real: j < S), plus -slope·|p - j|. Into *@p grad (may be NULL)
// its derivative in s.
CLMHA__HIDDEN double clmha__ref_score_mod(double s, double softcap, double slope, size_t p,
                                          size_t j, bool real, double *grad);

// A call's user functions (clmha_layer_desc::mod_source) in their host forms
// (clmha_reference_params::score_mod, ...), and their p.
typedef struct clmha__ref_mods {
    clmha_host_score_fn score, grad;
    clmha_host_mask_fn mask;
    const float *p;
} clmha__ref_mods;

// Checks the host forms in @p m against @p source (NULL: no user functions): one for each
// function the source defines (the derivative only when @p backward, which also needs the
// source to define it with clmha_score_mod), none without a source. @p names are the three
// fields' names as the caller sees them, for the messages.
CLMHA__HIDDEN clmha_status clmha__ref_mods_check(const char *source, const clmha__ref_mods *m,
                                                 bool backward, const char *const names[3],
                                                 char *msg, size_t msg_size);

// Score @p s (after soft-capping and ALiBi) of real key @p k for batch item @p b, query head
// @p h at position @p q through the user score function, if any; *@p grad (may be NULL)
// multiplied by its derivative there.
CLMHA__HIDDEN double clmha__ref_user_score(const clmha__ref_mods *m, double s, size_t b,
                                           size_t h, size_t q, size_t k, double *grad);

// Whether the user mask function, if any, lets (b, h, q) attend real key @p k.
CLMHA__HIDDEN bool clmha__ref_user_allows(const clmha__ref_mods *m, size_t b, size_t h, size_t q,
                                          size_t k);

// ALiBi's slope of query head @p h of @p heads: @p given[h] (the caller's slopes), or the
// geometric one (clmha_alibi_slopes()) when @p given is NULL.
CLMHA__HIDDEN double clmha__ref_alibi_slope(const float *given, size_t heads, size_t h);

// Sum of every mask (attn_mask, key_padding_mask, is_causal) at score (n, h, i, j), j < S.
CLMHA__HIDDEN double clmha__ref_mask_sum(const clmha__dims *d, const clmha_forward_args *args,
                                         size_t n, size_t h, size_t i, size_t j);

// The forward pass up to the merged attention result, steps 2 to 9: projections q_in (N, L, E),
// k_in and v_in (N, S, E); heads q (N*H, L, D), k and v (N*H, S', D); the attention weights
// (N*H, L, S') after masks, softmax and dropout, and, when asked for, the probabilities before
// dropout (probs, else NULL); the attention result ctx_heads (N*H, L, D) and merged ctx
// (N, L, E). Fully masked rows have zero probabilities.
typedef struct clmha__ref_forward {
    double *q_in, *k_in, *v_in;
    double *q, *k, *v;
    double *probs, *weights;
    double *ctx_heads, *ctx;
    clmha__ref_mods mods;  // the layer's user functions, p its mod_params (or mod_zeros)
    float *mod_zeros;
} clmha__ref_forward;

// Allocates and computes @p f for a validated call (@p keep_probs: also keep probs).
// CLMHA_SIZE_OVERFLOW or CLMHA_OUT_OF_MEMORY with a message; @p f is then already freed.
CLMHA__HIDDEN clmha_status clmha__ref_forward_run(const clmha__ref_call *call, bool keep_probs,
                                                  clmha__ref_forward *f, char *msg,
                                                  size_t msg_size);

// Frees what clmha__ref_forward_run() allocated and zeroes @p f.
CLMHA__HIDDEN void clmha__ref_forward_free(clmha__ref_forward *f);

// Dropout on x (N*H, L, S') in place when the call trains with dropout > 0: an element
// is kept and scaled by 1/(1-p), or set to 0, by the call's Philox draw. Applied to a gradient
// of the dropped weights, it gives the gradient of the weights before dropout.
CLMHA__HIDDEN void clmha__ref_dropout(const clmha__ref_call *call, double *x);

#endif
