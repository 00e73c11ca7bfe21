// Random cases of a whole layer call (shared by test_random.c and test_backward_random.c): a
// layer configuration, shapes and options drawn from a seed, made into the parameters, inputs
// and masks that clmha_layer_forward_host() and the CPU reference take.
#ifndef CLMHA_TESTS_RANDOM_CASE_H
#define CLMHA_TESTS_RANDOM_CASE_H

#include <clmha.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "support.h"

typedef enum attn_layout { LAYOUT_SHARED, LAYOUT_PER_HEAD, LAYOUT_PER_BATCH } attn_layout;

enum { RC_USER_SCORE = 1, RC_USER_MASK = 2, RC_USER_HOST = 4 };  // rcase::user

// One forward call: the layer, the shapes and the options.
typedef struct rcase {
    size_t e, h, kdim, vdim;  // kdim/vdim 0 = embed_dim
    size_t kv_heads;          // 0 = h; below h: grouped-query attention (decode tests only)
    size_t n, l, s;           // n is ignored (1) when unbatched
    bool bias, add_bias_kv, add_zero_attn, batch_first;
    bool unbatched, self_attn, value_is_key;
    clmha_mask_kind kpm, am;
    attn_layout layout;
    bool is_causal, need_weights, per_head, training;
    bool window;                    // a sliding window (win_left, win_right; -1 unbounded)
    int64_t win_left, win_right;
    double softcap;                 // soft-capping (0: off)
    bool alibi, alibi_random;       // ALiBi; its slopes random in (0, 1] (else geometric)
    bool sinks;                     // attention sinks, ~ N(0, 1)
    // The layer under test computes some built-in variants through user functions
    // (clmha_layer_desc::mod_source) that reproduce them, while the reference computes the
    // built-in ones: RC_USER_SCORE ALiBi (and soft-capping, when no key is appended: a user
    // function sees only the real keys) as clmha_score_mod with its derivative, RC_USER_MASK
    // the window as clmha_mask_mod. RC_USER_HOST (alone): support.h's user functions, which
    // reproduce no built-in variant, in the layer and, in their host forms, in the reference.
    unsigned user;
    float dropout;
    uint64_t rng_seed, rng_offset;  // dropout randomness
    double mask_p;                  // probability of a forbidden / -inf mask entry
    bool mask_row;                  // attn_mask (shared, BOOL_IGNORE) forbids every key of row 1
    bool mask_batch;                // key_padding_mask (BOOL_IGNORE) forbids every key of item 0
    uint64_t data_seed;             // parameters, inputs and masks
} rcase;

// A case with everything the forward call and the reference need.
typedef struct instance {
    rcase c;
    clmha_layer_desc desc;  // the reference's layer (the layer under test's: layer_desc_of())
    float *mod_p;           // with c.user: the user functions' p and source
    char *mod_source;
    clmha_reference_params params;
    clmha_forward_args args;
    size_t n, kdim, vdim, kve, s_padded, output_count, weights_count;  // kve: K/V proj. rows
    float *w_in, *wq, *wk, *wv, *b_in, *wo, *bo, *bk, *bv, *slopes, *sinks;
    float *query, *key, *value;
    void *kpm, *am;
} instance;

// A sliding window at the fused kernels' tile edges: lengths, bounds (-1 unbounded), is_causal
// and the appended keys (bit 0 add_bias_kv, bit 1 add_zero_attn).
typedef struct window_edge {
    size_t l, s;
    int64_t left, right;
    bool causal;
    unsigned appended;
} window_edge;

// Case @p k of a list of window_edge cases: E 16, H 2, the edge's window and lengths, and by k
// the batch, batch_first, a float attn_mask (per head), a key_padding_mask of @p kpm kind and
// dropout in training; no weights (the fused core runs it). Data from @p seed.
rcase rcase_window_edge(const window_edge *w, size_t k, uint64_t seed, clmha_mask_kind kpm);

// One line naming the case's options, for messages.
void rcase_describe(const rcase *c, char *buf, size_t size);

// Draws @p c's parameters, inputs and masks into @p in (free with instance_free()).
void instance_make(instance *in, const rcase *c);
void instance_free(instance *in);
// Makes @p in a case of a layer of dtype @p t (16-bit): desc.dtype (the layer under test's;
// the reference takes any) and every float (parameters, inputs, float masks) rounded to @p t,
// so that the reference computes on exactly the values that layer holds.
void instance_as_dtype(instance *in, clmha_dtype t);

// The layer under test's descriptor: in->desc as it is now, with the variants of in->c.user
// moved into user functions.
clmha_layer_desc layer_desc_of(const instance *in);

// A layer on @p ctx with @p in's configuration and parameters (fails the test on error).
clmha_layer *instance_layer(clmha_context *ctx, const instance *in);

// A base case: E 8, 2 heads, N 2, L 3, S 5, bias, weights averaged.
rcase rcase_base(uint64_t data_seed);

// A random combination of every option, drawn from @p r.
rcase rcase_random(prng *r);

#endif
