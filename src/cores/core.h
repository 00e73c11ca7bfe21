// Attention cores: the middle of the forward pass, from the head tiles Q, K, V (and the masks)
// to the attention output tiles (and, for the cores that have them, the weights), and its
// backward. Every core implements this one interface, and everything of a core is behind it:
// what it runs and why not (supports, backward_supports), what it needs built (create, bake),
// what it saves for its backward (the log-sum-exp rows, writes_lse), its kernels. The forward
// and backward passes walk the dispatch table (core.c) and ask; they never name a core.
//
// The cores today: decode (calls with a KV cache, split-K), user (the caller's
// clmha_attention_fn), host_fused (plain calls on the host path, in C on the CPU), fused (one
// kernel, no weights; its backward from the saved log-sum-exp rows), unfused (GEMMs and a softmax kernel, weights, chunks; the fallback of every call).
//
// Adding a core takes:
//   - src/cores/NAME.c: a `const clmha__core clmha__core_NAME` and everything of the core, its
//     per-layer state included (create/release; clmha__core_state(layer, &clmha__core_NAME));
//     more files of its own may follow its name (NAME_backward.c, NAME_shared.c);
//   - cl/cores/NAME.cl: its kernels; the core builds them as program family "NAME"
//     (clmha__program_get() finds every embedded cl/ file by name, with cl/common.cl in front
//     of those in cl/cores/: no entry in src/context/programs.c);
//   - in src/cores/core.c, its row in CLMHA__CORE_TABLE, where its turn comes.
// The build picks up src/cores/*.c and cl/cores/*.cl by themselves (CMakeLists.txt globs
// them). A core that others use beyond this interface (the tuner, tests) adds its own header
// (fused.h, decode.h).
#ifndef CLMHA_CORES_CORE_H
#define CLMHA_CORES_CORE_H

#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "clmha.h"

#include "base/defs.h"
#include "cache/kv_cache.h"
#include "layer/layer.h"
#include "layer/shape.h"

// One call of a core: the forward call's arguments, their sizes, and where weights go.
typedef struct clmha__core_call {
    const clmha_forward_args *args;
    const clmha__dims *dims;
    cl_mem weights;         // the caller's weights buffer (when args->need_weights)
    size_t weights_offset;  // in floats
    bool weights_written;   // set by the core when it wrote the weights there itself
    // When not NULL (a forward call that saves for its backward): N*H*L floats where a core
    // that can writes each score row's log-sum-exp (see clmha__backward_call::lse), setting
    // lse_written.
    cl_mem lse;
    bool lse_written;
    // With lse (a call that saves): lse has 3*N*H*L floats, and a core that can (the fused
    // one, for its backward: cl/cores/fused.cl, lse_on 2) writes each row's maximum and the
    // log of its sum apart in the next two blocks of N*H*L, setting lse_split_written.
    bool lse_split, lse_split_written;
    // The call needs the log-sum-exp rows (partial attention, clmha_layer_attend()): only a core
    // with clmha__core::writes_lse runs it, and its impl is the call's own, not the layer's.
    bool need_lse;
    // With a KV cache (clmha_forward_args::kv_cache; only a core with clmha__core::kv_cache
    // runs such calls): the call's plan of lengths (NULL while the call is validated), and
    // whether the new key and value tiles are to be appended (false: kv_attend_only, no new
    // keys).
    const clmha__kv_plan *kv;
    bool kv_append;
    // Grouped-query attention: the query heads per key/value plane of this call's key and value
    // tiles (the layer's h / kvh where the core reads them grouped, clmha__core::grouped_kv;
    // 1 where the forward pass repeated them: the user core, and calls that save for the
    // backward pass, whose cores take one key/value plane per query head).
    size_t kv_group;
    // For a core with clmha__core::takes_rows, and with `rows` for one with
    // clmha__core::reads_rows: where the call's projected query, key and value rows are in
    // layer->proj (floats: head 0's first column in the first row, and the row pitch;
    // in_proj_bias not added: the core adds it), and for takes_rows the caller's output rows
    // (offset in floats), which the core fills with out_proj.bias for the output projection
    // to add to.
    bool rows;
    size_t q_at, q_ld, k_at, k_ld, v_at, v_ld;
    cl_mem output;
    size_t output_offset;
    // The factor of the scores q·kᵀ (clmha_attention_args::scale); 0: 1/sqrt(D), the layer's
    // (clmha__core_scale()).
    double scale;
} clmha__core_call;

// One backward call of a core: what the forward call saved, the gradient of the attention
// result, and where the gradients of the head tiles go (src/backward/backward.c does the rest:
// output projection, head merge/split, input projections).
typedef struct clmha__backward_call {
    const clmha_forward_args *args;  // the forward call's arguments, device buffers: masks,
                                     // is_causal, training, rng
    const clmha__dims *dims;
    // The backward call's impl (clmha_backward_args::impl; CLMHA_IMPL_AUTO: the layer's), and
    // whether its forward call fell back (a core it asked for answered
    // CLMHA__CORE_FALLS_BACK: a driver kept it from that call), so that its backward may too.
    clmha_impl impl;
    bool fell_back;
    // Saved by the forward call: q (N*H, L, D), k and v (N*H, S', D) as the core saw them
    // (in_proj_bias added, bias_k/bias_v and the zero row appended), o (N*H, L, D) the attention
    // result (weights · V); lse (N*H*L floats, natural log of the row's sum of exp(score),
    // scores scaled and masked, -INFINITY on a fully masked row) when the forward's core wrote
    // them (clmha__core::writes_lse), else NULL. With lse_split_rows (N*H*L; 0: none) the
    // rows of lse from there hold each row's maximum m and from twice that log(sum) apart
    // (clmha__core_call::lse_split), which a backward that recomputes the probabilities takes
    // as exp((score - m) - log(sum)): exact where m + log(sum) rounds to m.
    cl_mem q, k, v, o, lse;
    size_t lse_split_rows;
    cl_mem d_o;  // the gradient of o (N*H, L, D)
    // Optional (NULL): the caller's gradient of the returned weights, in the forward's weights
    // layout: (N, H, L, S') with per_head_weights, else (N, L, S') (the mean over heads).
    cl_mem grad_weights;
    size_t grad_weights_offset;  // floats
    // Where the core writes (overwrites) the gradients of the tiles: dq (N*H, L, D), dk and dv
    // (N*H, S', D), the appended rows included (the bias_k/bias_v row's gradient; the zero
    // row's is written too and ignored).
    cl_mem dq, dk, dv;
    // Optional (NULL): a float mask's gradient, in the mask's own layout (attn_mask: the
    // dims->attn_count elements its strides dims->attn_sn, attn_sh, attn_si address;
    // key_padding_mask (N, S)): the gradient of the scores summed over the dimensions the mask
    // is broadcast along, added to what is there when *_accumulate.
    cl_mem grad_attn_mask, grad_kpm;
    size_t grad_attn_offset, grad_kpm_offset;  // floats
    bool grad_attn_accumulate, grad_kpm_accumulate;
    // The forward call's factor of the scores (clmha__core_call::scale); 0: 1/sqrt(D).
    double scale;
    // Optional (NULL): where a core that takes grad_weights (the unfused one) writes each
    // row's D = sum_j P_ij dP_ij (N*H*L floats), which the weights' gradient makes differ from
    // dO.O: the sinks' gradient reads it (src/backward/backward.c).
    cl_mem drow;
} clmha__backward_call;

// One merge of partial attention results (clmha_attention_merge(), checked): rows of head_dim
// elements (rs bytes) and their log-sum-exp, the other's merged into heads and lse. Offsets in
// elements. The
// merge waits for @p wait_list (a barrier, enqueued only once its kernel is built).
typedef struct clmha__merge_call {
    size_t rows, head_dim;
    size_t rs;  // the elements' bytes: 4 (floats) or 8 (doubles)
    cl_mem heads, lse, other_heads, other_lse;
    size_t heads_offset, lse_offset, other_heads_offset, other_lse_offset;
    cl_uint num_wait;
    const cl_event *wait_list;
} clmha__merge_call;

// How a core answers whether it runs a call (clmha__core::supports, ::backward_supports).
typedef enum clmha__core_reason {
    CLMHA__CORE_RUNS = 0,    // it runs the call
    // Not this core's call: the call's impl asks for another core, or the call is of a kind the
    // core does not take (a KV cache, weights where the impl leaves the choice, no user core
    // set): the next row is asked.
    CLMHA__CORE_PASSES,
    // The call asks for this core (its impl), but the device keeps the core from it (a driver's
    // loop limit, kernels that cannot be built here): the next row is asked, and the call
    // records that it fell back (clmha__backward_call::fell_back: its backward may too).
    CLMHA__CORE_FALLS_BACK,
    // The call is this core's (its impl asks for it, or it is of a kind only this core runs)
    // and has an option the core does not take: the call fails with the answer's status and
    // message; no other row is asked.
    CLMHA__CORE_REFUSES,
} clmha__core_reason;

// A core's answer: the reason, and why not in words (a complete sentence with CLMHA__CORE_REFUSES,
// which the call fails with; a clause naming the core otherwise, which the dispatch puts into its
// message when no core runs a call).
typedef struct clmha__core_answer {
    clmha__core_reason reason;
    clmha_status status;  // with CLMHA__CORE_REFUSES: CLMHA_UNSUPPORTED, _INVALID_ARGUMENT, ...
    char why[384];
} clmha__core_answer;

// Sets @p answer: @p reason, @p status (CLMHA__CORE_REFUSES), and the message @p fmt.
static inline void clmha__core_answer_set(clmha__core_answer *answer, clmha__core_reason reason,
                                          clmha_status status, const char *fmt, ...)
    CLMHA__PRINTF(4, 5);
static inline void clmha__core_answer_set(clmha__core_answer *answer, clmha__core_reason reason,
                                          clmha_status status, const char *fmt, ...) {
    answer->reason = reason;
    answer->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(answer->why, sizeof answer->why, fmt, ap);
    va_end(ap);
}

// Whether call sizes @p d have a sliding window (clmha__dims::win_left, win_right).
static inline bool clmha__windowed(const clmha__dims *d) {
    return d->win_left >= 0 || d->win_right >= 0;
}

// Sets @p answer to CLMHA__CORE_RUNS.
static inline void clmha__core_runs(clmha__core_answer *answer) {
    answer->reason = CLMHA__CORE_RUNS;
    answer->status = CLMHA_SUCCESS;
    answer->why[0] = '\0';
}

typedef struct clmha__core {
    const char *name;
    // The clmha_impl value that asks for this core (CLMHA_IMPL_AUTO: none does).
    clmha_impl impl;
    // The core runs the calls with a KV cache (clmha_forward_args::kv_cache), and only those;
    // a core without this flag is never asked about them.
    bool kv_cache;
    // The core returns the attention weights a call asks for (need_weights). A core without
    // them is not asked about such a call, unless the call's impl names it: then a
    // CLMHA__CORE_RUNS answer has the call refused (CLMHA_INVALID_ARGUMENT) by the dispatch.
    bool returns_weights;
    // Grouped-query attention: the core reads the key and value tiles as the layer's kvh heads
    // ((N*KVH, S', D), each shared by h / kvh query heads); false: the forward pass repeats
    // them for every query head ((N*H, S', D)) before the core runs.
    bool grouped_kv;
    // The core takes the projected rows, not head tiles, for its queries, keys and values
    // (clmha__core_call::q_at ...) and writes the attention result as merged rows (rows, E)
    // into layer->tiles[CLMHA__TILE_OUT] (not layer->proj, which it reads), the output rows
    // filled with out_proj.bias: the forward pass then skips the head split, the merge and the
    // bias fill (the decode core: fewer commands in a decode step, whose fixed cost they are).
    bool takes_rows;
    // The core reads the projected rows where the forward pass offers them
    // (clmha__core_call::rows: self- or cross-attention with no appended keys, no KV cache,
    // nothing saved, not partial), adding in_proj_bias itself, and writes the attention result
    // as merged rows into layer->tiles[CLMHA__TILE_OUT]; the forward pass then skips the head
    // split and merge. Other calls give it head tiles.
    bool reads_rows;
    // Optional (NULL: the core keeps no state). Called by clmha_layer_create() on a new layer
    // (parameters and cl/heads.cl kernels made): makes the core's per-layer state, stored in
    // *state as soon as it exists (clmha__core_state() finds it later), and builds what the core
    // builds up front. On failure the layer is released, release() included.
    clmha_status (*create)(clmha_layer *layer, void **state);
    // Optional: frees @p state (NULL or what create() left, also after a failed create()).
    void (*release)(void *state);
    // Optional: called by clmha_layer_bake() after its pass on zeros: builds what the core
    // would build on a later call of the layer (a core the pass did not run), so that those
    // calls do not compile. A device that cannot build it is no failure here.
    clmha_status (*bake)(clmha_layer *layer);
    // Whether the core runs @p call on @p layer (*answer), building what it needs on first use
    // (kernels, kept in its state). Asked when the call is validated (call->kv, q_at ...
    // not set yet: call->args says whether it has a KV cache) and again when it is enqueued.
    // A status other than CLMHA_SUCCESS (a failed build the call asked for) fails the forward
    // call before anything is enqueued.
    clmha_status (*supports)(clmha_layer *layer, const clmha__core_call *call,
                             clmha__core_answer *answer);
    // The core writes each score row's log-sum-exp where clmha__core_call::lse asks for it: for
    // a call with clmha__core_call::need_lse (partial attention, attention as a function; a
    // core without this flag is not asked about such a call), and the fused core also for the
    // saved state's backward.
    bool writes_lse;
    // The core reads and writes layer->scores (clmha__layer_reserve()'s `scores`).
    bool uses_scores;
    // Enqueues the core's work on the context's queue, marking its profiling stages
    // (clmha__layer_mark()). Weights asked for go to layer->scores, (N*H, L, S'), for the
    // forward pass to return, or straight to call->weights (then call->weights_written).
    clmha_status (*run)(clmha_layer *layer, clmha__core_call *call);
    // Optional (NULL: the core never runs a backward call). Whether it runs backward call
    // @p call (*answer), building what it needs on first use. A core without a backward pass
    // may still answer CLMHA__CORE_REFUSES for the calls that are its own (the user core).
    clmha_status (*backward_supports)(clmha_layer *layer, const clmha__backward_call *call,
                                      clmha__core_answer *answer);
    // Enqueues the backward pass of the core on the context's queue: fills call->dq, dk, dv
    // and the mask gradients asked for. Its scratch is its own (kept in its state) or the
    // layer's scores buffer (clmha__layer_reserve()). Set when backward_supports can answer
    // CLMHA__CORE_RUNS.
    clmha_status (*backward)(clmha_layer *layer, clmha__backward_call *call);
    // Optional: merges partial attention results (clmha_attention_merge(), clmha__core_merge()):
    // the first row that has it does the merges.
    clmha_status (*merge)(clmha_context *ctx, const struct clmha__merge_call *call);
} clmha__core;

// What a slot of clmha_layer::core_state holds (clmha__cores_create()): the core, and the state
// its create() made.
typedef struct clmha__core_slot {
    const clmha__core *core;
    void *state;
} clmha__core_slot;

// The state of @p core (a row of the dispatch table) in @p layer: what its create() made, or NULL.
// Read from the layer alone, so that a core finds its state without calling the dispatch.
static inline void *clmha__core_state(const clmha_layer *layer, const clmha__core *core) {
    for (size_t i = 0; i < CLMHA__CORE_SLOTS; ++i) {
        const clmha__core_slot *slot = layer->core_state[i];
        if (slot && slot->core == core) return slot->state;
    }
    return NULL;
}

// The core that runs backward call @p call: the first row of the dispatch table whose
// backward_supports answers CLMHA__CORE_RUNS; fails with the message of a core that refuses it,
// or with every core's reason when none runs it.
CLMHA__HIDDEN clmha_status clmha__backward_select(clmha_layer *layer,
                                                  const clmha__backward_call *call,
                                                  const clmha__core **out);

// Runs every core's create() on @p layer, in table order; stops at the first failure.
CLMHA__HIDDEN clmha_status clmha__cores_create(clmha_layer *layer);

// Runs every core's release() on its state in @p layer and clears the slots.
CLMHA__HIDDEN void clmha__cores_release(clmha_layer *layer);

// Runs every core's bake() on @p layer (clmha_layer_bake()).
CLMHA__HIDDEN clmha_status clmha__cores_bake(clmha_layer *layer);

// The core that runs @p call: the first row of the dispatch table that answers
// CLMHA__CORE_RUNS (a call that needs the log-sum-exp rows asks only the cores that write
// them); fails with the message of a core that refuses the call, or with every core's reason
// when none runs it. @p fell_back (may be NULL): a core the call asked for answered
// CLMHA__CORE_FALLS_BACK.
CLMHA__HIDDEN clmha_status clmha__core_select(clmha_layer *layer, const clmha__core_call *call,
                                              const clmha__core **out, bool *fell_back);

// Merges partial attention results with the first core of the table that merges
// (clmha__core::merge); the call's arguments are checked.
CLMHA__HIDDEN clmha_status clmha__core_merge(clmha_context *ctx, const clmha__merge_call *call);

// The factor of the scores of a call with scale @p scale (clmha__core_call::scale) on @p layer:
// @p scale, or 1/sqrt(D) when it is 0.
static inline double clmha__core_scale(const clmha_layer *layer, double scale) {
    return scale != 0.0 ? scale : 1.0 / sqrt((double)layer->d);
}

// The core a call asks for: its own impl, else the layer's (either may be CLMHA_IMPL_AUTO).
static inline clmha_impl clmha__impl_of(const clmha_layer *layer,
                                        const clmha_forward_args *args) {
    return args->impl != CLMHA_IMPL_AUTO ? args->impl : layer->impl;
}

// The core forward call @p call asks for: clmha__impl_of(), except that a call that needs the
// log-sum-exp rows takes its own impl only (the layer's choice is for calls that return
// outputs).
static inline clmha_impl clmha__impl_of_call(const clmha_layer *layer,
                                             const clmha__core_call *call) {
    return call->need_lse ? call->args->impl : clmha__impl_of(layer, call->args);
}

// The core backward call @p call prefers: its own impl, else the layer's. Only its own
// CLMHA_IMPL_FUSED makes a refusal of the fused backward fail the call (fused_backward.c).
static inline clmha_impl clmha__backward_impl_of(const clmha_layer *layer,
                                                 const clmha__backward_call *call) {
    return call->impl != CLMHA_IMPL_AUTO ? call->impl : layer->impl;
}

#endif
