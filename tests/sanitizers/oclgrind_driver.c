// Small forward (and backward) passes that reach every branch of the kernels clmha launches
// (cl/heads.cl, cl/backward.cl, cl/cores/*.cl) and the CLBlast GEMMs it calls, meant to run under
// Oclgrind (tools/oclgrind-check.sh), which checks every work-item's memory accesses. A plain C
// program, not a Criterion test: Oclgrind intercepts the OpenCL calls of this one process.
//
// Each case runs clmha_layer_forward_host on the default OpenCL device (CLMHA_DEVICE selects
// another) and compares the output and the attention weights with clmha_reference_forward; one
// line per case, exit status 1 if any case fails or differs by more than 1e-4.
//
// What the cases reach (besides the shapes, masks and options themselves):
//   split_heads    has_bias 0/1, has_extra 0/1 (row t == seq), zero key rows (t > seq),
//                  batch_first 0/1
//   merge_heads    batch_first 0/1
//   fill_rows      bias layers (out_proj.bias); no-bias layers do not launch it
//   average_heads  need_weights averaged (per-head weights are a buffer copy)
//   masked_softmax every attn_mask kind x layout, key_padding_mask kinds, causal, padded keys
//                  (j >= S), a fully masked row (dead), dropout, S' above and below the
//                  work-group size (16 on CPU-type devices, Oclgrind included: S 37 and S 3)
//   accumulate_heads  averaged weights of a chunked unfused core (the "chunked" cases lower the
//                  largest allocation through a test hook, so the driver links libclmha.a)
//   fused_attention  (the "fused" cases, default tiles of 64 query rows and 32 keys) several
//                  query and key tiles with partial last tiles, causal with a key tile skipped
//                  (L = S = 100), every mask kind and layout, appended keys, fully masked rows,
//                  dropout, head_dim 1, 3, 64 and 128 (with --class gpu: accumulators
//                  private at 64, in local memory at 128); and, through an imported tuning
//                  ("tiles": it stays in effect for the later fused cases of the same process),
//                  8- and 4-wide vectors with one and two rows per work-item (Oclgrind prefers
//                  scalars, which the default tiles then use); sliding windows (key tiles
//                  outside every row's window skipped, rows whose window holds no key)
//   merge_partials (the "partial" case: two key ranges of clmha_layer_attend merged)
//   f16_to_f32, f32_to_f16, bf16_to_f32, f32_to_bf16 (the "f16"/"bf16" cases: 16-bit layers,
//                  inputs and float masks widened, output and weights narrowed)
//   decode_*       (the "decode" cases: self-attention through a KV cache, chunk by chunk)
//                  appends, key ranges empty and partial, the appended keys in the combine
//   the backward   (the "backward" cases: forward with args.save, then every gradient through
//                  the same core, compared with clmha_reference_backward) merge_rows,
//                  appended_row_sums, and each core's backward kernels: weights
//                  gradients, float mask gradients of every layout, dropout replay, causal
//                  and window tile skipping (the GEMM blocks' window key ranges), fully masked
//                  rows, head_dim 1 and 64
//
// Usage: oclgrind_driver [-v] [--whole-writes] [--list] [--class NAME] [case number...]
//   -v              print the device name
//   --whole-writes  only the cases whose parameter buffers are each written by one host write
//                   covering the whole buffer (see below)
//   --list          print the numbers of the selected cases, one a line, and run nothing
//   --class NAME    contexts take row NAME of the device class table (src/device/device_class.c)
//                   whatever the device: "gpu" runs the GPU mappings (coalesced split/merge,
//                   the fused kernel's query rows and accumulators in local memory); the cases
//                   marked forced_class_only run only then
//   numbers         only those cases (1-based)
//
// --whole-writes exists for Oclgrind 21.10's --uninitialized plugin, which loses track of a
// buffer written by several partial host writes (clEnqueueWriteBuffer at an offset): each host
// write re-creates the shadow state of the whole buffer, sized to that write, so the rest reads
// as uninitialised (or as garbage). clmha writes q/k/v_proj_weight (kdim or vdim != embed_dim)
// and bias_k/bias_v (add_bias_kv) as slices of one buffer, so those cases are false positives
// there; they still run under every other check.
#define _POSIX_C_SOURCE 200112L  // setenv
#include <clmha.h>
#include <math.h>

#include "base/half.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOLERANCE 1e-4

// Test hooks of libclmha.a (src/context/context.h): the largest scratch allocation, 0 = the
// device's; (src/device/device_class.h) the device class table row every context takes;
// (src/cores/fused.h) the block of the fused backward's GEMM variant.
void clmha__test_set_max_alloc(size_t bytes);
void clmha__test_set_fused_backward_block(size_t floats);
void clmha__test_set_decode_parts(size_t parts);
bool clmha__test_force_device_class(const char *name);

// ---- deterministic random numbers (splitmix64) -----------------------------------------------

static uint64_t rng_state;

static uint64_t next_u64(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double uniform01(void) { return (double)(next_u64() >> 11) * 0x1.0p-53; }

static double normal01(void) {
    double u1 = 1.0 - uniform01(), u2 = uniform01();
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

// ---- cases -----------------------------------------------------------------------------------

enum { SHARED, PER_HEAD, PER_BATCH };  // attn_mask layouts: (L,S), (N*H,L,S), (N,L,S)

typedef struct dcase {
    const char *name;
    size_t e, h, kdim, vdim;  // kdim/vdim 0: embed_dim
    size_t n, l, s;           // n ignored when unbatched; s ignored for self-attention
    bool nobias, bias_kv, zero_attn, batch_first, unbatched;
    bool self_attn, value_is_key;
    clmha_mask_kind kpm, am;
    int layout;
    bool causal, weights, per_head, train;
    float dropout;
    bool mask_row;    // attn_mask row 1 forbids every key (BOOL_IGNORE)
    bool mask_item;   // key_padding_mask of item 0 forbids every key (BOOL_IGNORE)
    bool fused;       // through the fused core (no weights)
    size_t max_alloc; // > 0: the unfused core works in chunks (test hook, bytes)
    const char *tiles;  // fused tiles "BQ BK RPW VW" imported as a tuning (NULL: the defaults)
    bool forced_class_only;  // only with --class (costly under Oclgrind, new only there)
    bool backward;           // then the backward pass through the same core, every gradient
    size_t gemm_block;       // > 0: the fused backward's products in GEMMs, in blocks of this
                             // many floats (CLMHA_FUSED_BACKWARD=gemms and a test hook)
    size_t decode_chunk;     // > 0: through a KV cache (the decode core), this many query rows
                             // a call (self-attention, sequence-first rows)
    size_t decode_parts;     // key ranges per sequence (test hook; 0: the core's choice)
    size_t page_size;        // > 0: a paged KV cache of pages of this many tokens
    clmha_kv_dtype kv_dtype; // the KV cache's elements (narrower ones: within their contract)
    size_t kv_heads;         // > 0: grouped-query attention with this many key/value heads
    size_t partial_split;    // > 0: partial attention over keys [0, split) and [split, S),
                             // merged and projected (cross-attention, sequence-first, no masks)
    clmha_dtype dtype;       // the layer's (parameters, inputs and float masks rounded to it)
    bool window;             // a sliding window: query i sees key j < S only when
    int64_t wl, wr;          // i - wl <= j <= i + wr (-1: that side unbounded)
    double softcap;          // soft-capping (0: off)
    bool alibi;              // ALiBi, the geometric slopes
    bool sinks;              // attention sinks ~ N(0, 1), with their gradient in a backward case
    // The layer computes some built-in variants through user functions that reproduce them
    // (clmha_layer_desc::mod_source), the reference the built-in ones: USER_SCORE ALiBi as
    // clmha_score_mod (with its derivative), USER_MASK the window as clmha_mask_mod.
    unsigned user;
} dcase;

enum { USER_SCORE = 1, USER_MASK = 2 };

// The user functions of dcase::user; p: the window's bounds, then the H slopes.
static const char user_score_source[] =
    "clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k,\n"
    "                           __global const float *p) {\n"
    "    return s - p[2 + h] * fabs((clmha_real)(q - k));\n"
    "}\n"
    "clmha_real clmha_score_mod_grad(clmha_real s, int b, int h, int q, int k,\n"
    "                                __global const float *p) { return 1.0f; }\n";
static const char user_mask_source[] =
    "int clmha_mask_mod(int b, int h, int q, int k, __global const float *p) {\n"
    "    int left = (int)p[0], right = (int)p[1];\n"
    "    return (left < 0 || k >= q - left) && (right < 0 || k <= q + right);\n"
    "}\n";

#define I CLMHA_MASK_BOOL_IGNORE
#define A CLMHA_MASK_BOOL_ATTEND
#define F CLMHA_MASK_FLOAT

static const dcase cases[] = {
    // Self-attention: one packed QKV GEMM; S 3 < work-group; averaged weights.
    {"self packed, seq-first, S3, w=avg", .e = 8, .h = 2, .n = 2, .l = 3, .self_attn = true,
     .weights = true},
    {"self packed, batch_first, causal L=S, w=per_head", .e = 8, .h = 2, .n = 2, .l = 4,
     .self_attn = true, .batch_first = true, .causal = true, .weights = true, .per_head = true},
    // Cross-attention, separate Q, K, V GEMMs.
    {"cross L2 S37 (> work-group), kdim/vdim, nobias, w=per_head", .e = 8, .h = 2, .kdim = 5,
     .vdim = 3, .n = 2, .l = 2, .s = 37, .nobias = true, .weights = true, .per_head = true},
    {"cross key==value (one K/V GEMM), batch_first, kpm=ignore", .e = 8, .h = 2, .n = 2, .l = 3,
     .s = 5, .value_is_key = true, .batch_first = true, .kpm = I, .weights = true},
    {"cross kdim=vdim key==value, bias_kv, kpm=attend", .e = 8, .h = 2, .kdim = 6, .vdim = 6,
     .n = 2, .l = 4, .s = 3, .value_is_key = true, .bias_kv = true, .kpm = A, .weights = true},
    {"cross zero_attn, kpm=float, nobias", .e = 8, .h = 4, .n = 2, .l = 3, .s = 4,
     .zero_attn = true, .nobias = true, .kpm = F, .weights = true, .per_head = true},
    {"cross bias_kv + zero_attn, S37, batch_first, w=avg", .e = 8, .h = 2, .n = 1, .l = 2,
     .s = 37, .bias_kv = true, .zero_attn = true, .batch_first = true, .weights = true},
    // Every attn_mask kind x layout.
    {"am=ignore (L,S)", .e = 8, .h = 2, .n = 2, .l = 3, .s = 5, .am = I, .layout = SHARED,
     .weights = true},
    {"am=ignore (N*H,L,S), kpm=float", .e = 8, .h = 2, .n = 2, .l = 3, .s = 5, .am = I,
     .layout = PER_HEAD, .kpm = F, .weights = true, .per_head = true},
    {"am=ignore (N,L,S) per_batch, batch_first", .e = 8, .h = 2, .n = 2, .l = 3, .s = 5, .am = I,
     .layout = PER_BATCH, .batch_first = true, .weights = true},
    {"am=attend (L,S), kpm=ignore, zero_attn", .e = 8, .h = 2, .n = 2, .l = 3, .s = 5, .am = A,
     .layout = SHARED, .kpm = I, .zero_attn = true, .weights = true},
    {"am=attend (N*H,L,S), bias_kv", .e = 8, .h = 2, .n = 2, .l = 3, .s = 5, .am = A,
     .layout = PER_HEAD, .bias_kv = true, .weights = true},
    {"am=attend (N,L,S) per_batch, kpm=attend", .e = 8, .h = 2, .n = 2, .l = 3, .s = 5, .am = A,
     .layout = PER_BATCH, .kpm = A, .weights = true, .per_head = true},
    {"am=float (L,S), causal L5>S3", .e = 8, .h = 2, .n = 2, .l = 5, .s = 3, .am = F,
     .layout = SHARED, .causal = true, .weights = true},
    {"am=float (N*H,L,S), kpm=ignore, no weights", .e = 8, .h = 2, .n = 2, .l = 3, .s = 5,
     .am = F, .layout = PER_HEAD, .kpm = I},
    {"am=float (N,L,S) per_batch, kpm=float, bias_kv+zero_attn", .e = 8, .h = 2, .n = 2, .l = 3,
     .s = 5, .am = F, .layout = PER_BATCH, .kpm = F, .bias_kv = true, .zero_attn = true,
     .weights = true},
    // Causal L < S, fully masked rows and items.
    {"causal L3<S7, kpm=attend", .e = 8, .h = 2, .n = 2, .l = 3, .s = 7, .causal = true,
     .kpm = A, .weights = true, .per_head = true},
    {"fully masked row 1 (am) and item 0 (kpm)", .e = 8, .h = 2, .n = 2, .l = 3, .s = 5,
     .am = I, .layout = SHARED, .mask_row = true, .kpm = I, .mask_item = true, .weights = true},
    // Unbatched inputs.
    {"unbatched, am=float (H,L,S), kpm=ignore, zero_attn", .e = 8, .h = 2, .l = 3, .s = 4,
     .unbatched = true, .am = F, .layout = PER_HEAD, .kpm = I, .zero_attn = true,
     .weights = true, .per_head = true},
    {"unbatched self, am=attend (L,S), batch_first layer", .e = 8, .h = 2, .l = 4,
     .unbatched = true, .self_attn = true, .batch_first = true, .am = A, .layout = SHARED,
     .weights = true},
    // Dropout in training (and a layer with dropout in eval).
    {"dropout 0.25 train, S37, w=avg", .e = 8, .h = 2, .n = 2, .l = 2, .s = 37, .dropout = 0.25f,
     .train = true, .weights = true},
    {"dropout 0.25 train, self, w=per_head", .e = 8, .h = 2, .n = 1, .l = 3, .self_attn = true,
     .dropout = 0.25f, .train = true, .weights = true, .per_head = true},
    {"dropout 0.25 eval", .e = 8, .h = 2, .n = 2, .l = 3, .s = 4, .dropout = 0.25f,
     .weights = true},
    // head_dim 1.
    {"head_dim 1 (E4 H4), kpm=float, w=per_head", .e = 4, .h = 4, .n = 2, .l = 3, .s = 3,
     .kpm = F, .weights = true, .per_head = true},
    {"head_dim 1 (E4 H4) self, batch_first, w=avg", .e = 4, .h = 4, .n = 2, .l = 2,
     .self_attn = true, .batch_first = true, .weights = true},
    // The fused core.
    {"fused: self causal L=S=100 (2 query tiles, 4 key tiles, one skipped)", .e = 8, .h = 2,
     .n = 1, .l = 100, .self_attn = true, .causal = true, .fused = true},
    {"fused: L3 S37, kpm=ignore, am=float (N*H,L,S), bias_kv+zero_attn", .e = 8, .h = 2, .n = 2,
     .l = 3, .s = 37, .kpm = I, .am = F, .layout = PER_HEAD, .bias_kv = true, .zero_attn = true,
     .fused = true},
    {"fused: am=attend (N,L,S) per_batch, kpm=float, batch_first", .e = 8, .h = 2, .n = 2,
     .l = 70, .s = 5, .am = A, .layout = PER_BATCH, .kpm = F, .batch_first = true,
     .fused = true},
    {"fused: fully masked row 1 (am) and item 0 (kpm), causal L5>S3", .e = 8, .h = 2, .n = 2,
     .l = 5, .s = 3, .am = I, .layout = SHARED, .mask_row = true, .kpm = I, .mask_item = true,
     .causal = true, .fused = true},
    {"fused: dropout 0.25 train, S37", .e = 8, .h = 2, .n = 2, .l = 2, .s = 37,
     .dropout = 0.25f, .train = true, .fused = true},
    {"fused: head_dim 1 (E4 H4) unbatched, am=ignore (L,S)", .e = 4, .h = 4, .l = 3, .s = 4,
     .unbatched = true, .am = I, .layout = SHARED, .fused = true},
    {"fused: head_dim 3 (E6 H2), am=float (L,S), zero_attn", .e = 6, .h = 2, .n = 2, .l = 33,
     .s = 65, .am = F, .layout = SHARED, .zero_attn = true, .fused = true},
    // Head dims where the private budget of the GPU classes decides (--class gpu: 64 keeps
    // the accumulators private, 128 moves them to local memory; CPU classes keep both private).
    // (Short sequences: Oclgrind pays mostly for the E x E projections here, about two minutes
    // for E 128 in pass 2, so that case runs only with --class.)
    {"fused: head_dim 64 (E64 H1), self L4, causal, kpm=ignore", .e = 64, .h = 1, .n = 1,
     .l = 4, .self_attn = true, .causal = true, .kpm = I, .fused = true},
    {"fused: head_dim 128 (E128 H1), self L2, am=float (L,S), dropout", .e = 128, .h = 1,
     .n = 1, .l = 2, .self_attn = true, .am = F, .layout = SHARED, .dropout = 0.25f,
     .train = true, .fused = true, .forced_class_only = true},
    // Other tiles (a stored tuning's): 8-wide vectors, one row per work-item; 4-wide, two.
    {"fused tiles 16/16/1/8: head_dim 8, causal L=S=40, kpm=float", .e = 16, .h = 2, .n = 2,
     .l = 40, .self_attn = true, .causal = true, .kpm = F, .fused = true,
     .tiles = "16 16 1 8"},
    {"fused tiles 8/8/2/4: head_dim 4, am=ignore (N*H,L,S), dropout", .e = 8, .h = 2, .n = 1,
     .l = 19, .s = 21, .am = I, .layout = PER_HEAD, .dropout = 0.25f, .train = true,
     .fused = true, .tiles = "8 8 2 4"},
    // The backward pass (cl/backward.cl, the cores' backward kernels): every gradient.
    {"backward unfused: cross bias_kv+zero_attn, am=float (N*H,L,S), kpm=float, w=per_head",
     .e = 8, .h = 2, .n = 2, .l = 3, .s = 5, .bias_kv = true, .zero_attn = true, .am = F,
     .layout = PER_HEAD, .kpm = F, .weights = true, .per_head = true, .backward = true},
    {"backward unfused: self batch_first, am=float (L,S), causal, dropout, w=avg", .e = 8,
     .h = 2, .n = 2, .l = 4, .self_attn = true, .batch_first = true, .am = F, .layout = SHARED,
     .causal = true, .dropout = 0.25f, .train = true, .weights = true, .backward = true},
    {"backward unfused: kdim/vdim, am=float (N,L,S) per_batch, fully masked item 0", .e = 8,
     .h = 2, .kdim = 5, .vdim = 3, .n = 2, .l = 3, .s = 6, .am = F, .layout = PER_BATCH,
     .kpm = I, .mask_item = true, .weights = true, .backward = true},
    {"backward fused: self causal L=S=100", .e = 8, .h = 2, .n = 1, .l = 100, .self_attn = true,
     .causal = true, .fused = true, .backward = true},
    {"backward fused: L3 S37, kpm=ignore, am=float, bias_kv+zero_attn, dropout", .e = 8, .h = 2,
     .n = 2, .l = 3, .s = 37, .kpm = I, .am = F, .layout = PER_HEAD, .bias_kv = true,
     .zero_attn = true, .dropout = 0.25f, .train = true, .fused = true, .backward = true},
    {"backward fused: unbatched, fully masked row 1, head_dim 1 (E4 H4)", .e = 4, .h = 4,
     .l = 3, .s = 4, .unbatched = true, .am = I, .layout = SHARED, .mask_row = true,
     .fused = true, .backward = true},
    {"backward fused: head_dim 64 (E64 H1), self L5, causal", .e = 64, .h = 1, .n = 1, .l = 5,
     .self_attn = true, .causal = true, .fused = true, .backward = true},
    // The fused backward's products in GEMMs (fused_backward_block): blocks of rows with
    // is_causal (partial vectors, fewer keys), blocks of planes with masks and dropout.
    {"backward fused gemms: self causal L=S=37, kpm=ignore, blocks of 8 rows", .e = 8, .h = 2,
     .n = 1, .l = 37, .self_attn = true, .causal = true, .kpm = I, .fused = true,
     .backward = true, .gemm_block = 8 * 37},
    {"backward fused gemms: L3 S37, am=float, bias_kv+zero_attn, dropout, 2 planes a block",
     .e = 8, .h = 2, .n = 2, .l = 3, .s = 37, .am = F, .layout = PER_HEAD, .bias_kv = true,
     .zero_attn = true, .dropout = 0.25f, .train = true, .fused = true, .backward = true,
     .gemm_block = 2 * 3 * 39},
    // Sliding windows: the fused kernels' key and query tiles outside every window of a block
    // skipped (loop bounds), the appended keys always visited, rows whose window holds no key;
    // the products in GEMMs over each row block's window keys and the appended keys apart.
    {"fused: window (3, 2) self L=S=100, zero_attn, kpm=ignore", .e = 8, .h = 2, .n = 2,
     .l = 100, .self_attn = true, .zero_attn = true, .kpm = I, .fused = true, .window = true,
     .wl = 3, .wr = 2},
    {"fused: window (-1, 1) L40 S100, am=float (N*H,L,S), dropout", .e = 8, .h = 2, .n = 1,
     .l = 40, .s = 100, .am = F, .layout = PER_HEAD, .dropout = 0.25f, .train = true,
     .fused = true, .window = true, .wl = -1, .wr = 1},
    {"backward fused: window (3, 0) self causal L=S=100, zero_attn", .e = 8, .h = 2, .n = 1,
     .l = 100, .self_attn = true, .causal = true, .zero_attn = true, .fused = true,
     .backward = true, .window = true, .wl = 3, .wr = 0},
    {"backward fused gemms: window (2, 5) self L70, zero_attn, kpm=ignore, blocks of 16 rows",
     .e = 8, .h = 2, .n = 1, .l = 70, .self_attn = true, .zero_attn = true, .kpm = I,
     .fused = true, .backward = true, .gemm_block = 16 * 71, .window = true, .wl = 2, .wr = 5},
    // Score variants (programs built with -DSOFTCAP/-DALIBI): the fused forward's vector pass,
    // masked_softmax's, both fused backward paths, the unfused backward's softcap_backward
    // (its own GEMM of the raw scores), the decode core's blocks and bias_k score.
    {"fused: softcap 2 alibi self causal L=S=70, zero_attn, kpm=ignore", .e = 8, .h = 2,
     .n = 2, .l = 70, .self_attn = true, .causal = true, .zero_attn = true, .kpm = I,
     .fused = true, .softcap = 2.0, .alibi = true},
    {"unfused: softcap 1 alibi cross L5 S37, bias_kv, w=per_head", .e = 8, .h = 2, .n = 2,
     .l = 5, .s = 37, .bias_kv = true, .weights = true, .per_head = true, .softcap = 1.0,
     .alibi = true},
    {"backward fused: softcap 1.5 alibi self L=S=40, zero_attn", .e = 8, .h = 2, .n = 1,
     .l = 40, .self_attn = true, .zero_attn = true, .fused = true, .backward = true,
     .softcap = 1.5, .alibi = true},
    {"backward fused gemms: softcap 1.5 alibi self causal L=S=37, blocks of 8 rows", .e = 8,
     .h = 2, .n = 1, .l = 37, .self_attn = true, .causal = true, .fused = true,
     .backward = true, .gemm_block = 8 * 37, .softcap = 1.5, .alibi = true},
    {"backward unfused: softcap 0.8 alibi cross L3 S5, am=float, zero_attn", .e = 8, .h = 2,
     .n = 2, .l = 3, .s = 5, .am = F, .zero_attn = true, .backward = true, .softcap = 0.8,
     .alibi = true},
    {"decode: softcap 2 alibi self causal L=S=21, bias_kv+zero_attn, chunks of 4, 3 ranges",
     .e = 8, .h = 2, .n = 2, .l = 21, .self_attn = true, .causal = true, .bias_kv = true,
     .zero_attn = true, .decode_chunk = 4, .decode_parts = 3, .softcap = 2.0, .alibi = true},
    // User functions (ALiBi as clmha_score_mod, the window as clmha_mask_mod): the fused
    // forward's user pass and its block mask (mod_block_mask, tiles skipped), masked_softmax's,
    // both fused backward paths, the unfused backward's score_backward, decode_partial's.
    {"fused: user alibi and window (9, 0) self causal L=S=150, zero_attn", .e = 8, .h = 2,
     .n = 1, .l = 150, .self_attn = true, .causal = true, .zero_attn = true, .fused = true,
     .alibi = true, .window = true, .wl = 9, .wr = 0, .user = USER_SCORE | USER_MASK},
    {"unfused: user alibi and window (2, 1) cross L5 S37, w=per_head", .e = 8, .h = 2, .n = 2,
     .l = 5, .s = 37, .weights = true, .per_head = true, .alibi = true, .window = true,
     .wl = 2, .wr = 1, .user = USER_SCORE | USER_MASK},
    {"backward fused: user alibi and window (3, 0) self L=S=40", .e = 8, .h = 2, .n = 1,
     .l = 40, .self_attn = true, .fused = true, .backward = true, .alibi = true,
     .window = true, .wl = 3, .wr = 0, .user = USER_SCORE | USER_MASK},
    {"backward fused gemms: user alibi and window (2, 2) self L=S=37, blocks of 32 rows",
     .e = 8, .h = 2, .n = 1, .l = 37, .self_attn = true, .fused = true, .backward = true,
     .gemm_block = 8 * 37, .alibi = true, .window = true, .wl = 2, .wr = 2,
     .user = USER_SCORE | USER_MASK},
    // A mask function that allows whole tiles of the GEMM blocks' block mask (32 rows by 64
    // keys) below the diagonal and some of others: the block kernel's lookups.
    {"backward fused gemms: user window (-1, 0) self L=S=100, blocks of 32 rows", .e = 8,
     .h = 2, .n = 1, .l = 100, .self_attn = true, .fused = true, .backward = true,
     .gemm_block = 32 * 100, .window = true, .wl = -1, .wr = 0, .user = USER_MASK},
    {"backward unfused: user alibi cross L3 S5, zero_attn", .e = 8, .h = 2, .n = 2, .l = 3,
     .s = 5, .zero_attn = true, .backward = true, .alibi = true, .user = USER_SCORE},
    {"decode: user alibi and window (5, 0) self causal L=S=21, chunks of 4, 3 ranges", .e = 8,
     .h = 2, .n = 2, .l = 21, .self_attn = true, .causal = true, .decode_chunk = 4,
     .decode_parts = 3, .alibi = true, .window = true, .wl = 5, .wr = 0,
     .user = USER_SCORE | USER_MASK},
    // Sinks: the cores' denominators, sinks_grad (from dO.O, and from the unfused backward's
    // D rows with a weights gradient), decode_combine's term.
    {"fused: sinks self causal L=S=70, kpm=ignore", .e = 8, .h = 2, .n = 2, .l = 70,
     .self_attn = true, .causal = true, .kpm = I, .fused = true, .sinks = true},
    {"backward fused: sinks softcap self L=S=40", .e = 8, .h = 2, .n = 1, .l = 40,
     .self_attn = true, .fused = true, .backward = true, .sinks = true, .softcap = 1.5},
    {"backward unfused: sinks cross L3 S5, w=avg (D rows), zero_attn", .e = 8, .h = 2, .n = 2,
     .l = 3, .s = 5, .zero_attn = true, .weights = true, .backward = true, .sinks = true},
    {"decode: sinks self causal L=S=21, chunks of 4, 3 ranges", .e = 8, .h = 2, .n = 2,
     .l = 21, .self_attn = true, .causal = true, .decode_chunk = 4, .decode_parts = 3,
     .sinks = true},
    // The decode core (KV cache): decode_append of ragged counts, decode_partial with empty
    // and partial key blocks and ranges, decode_combine with bias_k/bias_v and the zero key.
    {"decode: self causal L=S=37, bias_kv+zero_attn, token by token, 3 ranges", .e = 8, .h = 2,
     .n = 2, .l = 37, .self_attn = true, .causal = true, .bias_kv = true, .zero_attn = true,
     .decode_chunk = 1, .decode_parts = 3},
    {"decode: self causal L=S=40, head_dim 64 (E64 H1), chunks of 17, default ranges",
     .e = 64, .h = 1, .n = 1, .l = 40, .self_attn = true, .causal = true, .decode_chunk = 17},
    // Paged and narrower caches: cache_at's page table (a key block per page), each kind's
    // decode_append (store_row) and decode_partial (KEYS_AT, VAL_AT; int8 and int4: the key
    // blocks' scales, the value rows' scales; int4: several groups a row; pages of 8).
    {"decode paged: self causal L=S=37, 4 heads on 2, pages of 16, chunks of 5, 3 ranges",
     .e = 8, .h = 4, .kv_heads = 2, .n = 2, .l = 37, .self_attn = true, .causal = true,
     .decode_chunk = 5, .decode_parts = 3, .page_size = 16},
    {"decode int8 paged: self causal L=S=37, E16 H2, pages of 16, chunks of 5, 3 ranges",
     .e = 16, .h = 2, .n = 2, .l = 37, .self_attn = true, .causal = true, .decode_chunk = 5,
     .decode_parts = 3, .page_size = 16, .kv_dtype = CLMHA_KV_INT8},
    {"decode f16 paged: self causal L=S=37, 4 heads on 2, pages of 8, chunks of 5, 3 ranges",
     .e = 16, .h = 4, .kv_heads = 2, .n = 2, .l = 37, .self_attn = true, .causal = true,
     .decode_chunk = 5, .decode_parts = 3, .page_size = 8, .kv_dtype = CLMHA_KV_FLOAT16},
    {"decode bf16: self causal L=S=23, E16 H2, chunks of 4, 2 ranges", .e = 16, .h = 2,
     .n = 2, .l = 23, .self_attn = true, .causal = true, .decode_chunk = 4, .decode_parts = 2,
     .kv_dtype = CLMHA_KV_BFLOAT16},
    {"decode int4 paged: self causal L=S=27, E48 H1 (3 groups of 16), pages of 8, chunks of 3",
     .e = 48, .h = 1, .n = 1, .l = 27, .self_attn = true, .causal = true, .decode_chunk = 3,
     .decode_parts = 2, .page_size = 8, .kv_dtype = CLMHA_KV_INT4},
    // Grouped-query attention: the fused kernel's kv_group planes, split_heads repeating the
    // key/value heads for the unfused core, the decode kernels' groups (G query heads a
    // work-item) with bias_k/bias_v per key/value head.
    {"gqa fused: cross L5 S37, 4 heads on 2 key/value heads, kpm=ignore", .e = 8, .h = 4,
     .kv_heads = 2, .n = 2, .l = 5, .s = 37, .kpm = I, .fused = true},
    {"gqa unfused: self causal L6, multi-query, bias_kv, w=per_head", .e = 8, .h = 4,
     .kv_heads = 1, .n = 2, .l = 6, .self_attn = true, .causal = true, .bias_kv = true,
     .weights = true, .per_head = true},
    {"gqa decode: self causal L=S=21, 4 heads on 2, bias_kv+zero_attn, chunks of 4, 3 ranges",
     .e = 8, .h = 4, .kv_heads = 2, .n = 2, .l = 21, .self_attn = true, .causal = true,
     .bias_kv = true, .zero_attn = true, .decode_chunk = 4, .decode_parts = 3},
    // Grouped-query backward: merge_rows and appended_row_sums summing the repeated heads.
    {"backward gqa unfused: cross L3 S5, 4 heads on 2, bias_kv, kdim/vdim", .e = 8, .h = 4,
     .kv_heads = 2, .kdim = 5, .vdim = 3, .n = 2, .l = 3, .s = 5, .bias_kv = true,
     .backward = true},
    {"backward gqa fused: self causal L6, multi-query", .e = 8, .h = 2, .kv_heads = 1, .n = 2,
     .l = 6, .self_attn = true, .causal = true, .fused = true, .backward = true},
    // Partial attention: two key ranges (the appended keys with the second), merge_partials,
    // the head merge and output projection of clmha_layer_project_heads.
    {"partial: cross L3 S37 split at 16, bias_kv+zero_attn, merged", .e = 8, .h = 2, .n = 2,
     .l = 3, .s = 37, .bias_kv = true, .zero_attn = true, .partial_split = 16},
    {"partial: cross L20 S37 split at 16, causal, window (5, 0), alibi, sinks, zero_attn",
     .e = 8, .h = 2, .n = 1, .l = 20, .s = 37, .zero_attn = true, .partial_split = 16,
     .causal = true, .window = true, .wl = 5, .wr = 0, .alibi = true, .sinks = true},
    {"partial: cross L20 S37 split at 16, causal, user alibi and window (5, 0)", .e = 8,
     .h = 2, .n = 1, .l = 20, .s = 37, .partial_split = 16, .causal = true, .window = true,
     .wl = 5, .wr = 0, .alibi = true, .user = USER_SCORE | USER_MASK},
    // 16-bit layers: the conversions of inputs, float masks, output and weights.
    {"f16 unfused: cross kdim/vdim, kpm=float, am=float (N*H,L,S), w=per_head", .e = 8, .h = 2,
     .kdim = 5, .vdim = 3, .n = 2, .l = 3, .s = 7, .kpm = F, .am = F, .layout = PER_HEAD,
     .weights = true, .per_head = true, .dtype = CLMHA_DTYPE_F16},
    {"bf16 fused: self batch_first, am=float (L,S), causal", .e = 8, .h = 2, .n = 2, .l = 5,
     .self_attn = true, .batch_first = true, .am = F, .causal = true, .fused = true,
     .dtype = CLMHA_DTYPE_BF16},
    // Float64 layers: the double builds of heads.cl and both cores (local memory in doubles),
    // CLBlast's DGEMM.
    {"f64 unfused: cross kdim/vdim, kpm=float, am=float (N*H,L,S), w=avg", .e = 8, .h = 2,
     .kdim = 5, .vdim = 3, .n = 2, .l = 3, .s = 7, .kpm = F, .am = F, .layout = PER_HEAD,
     .weights = true, .dtype = CLMHA_DTYPE_F64},
    {"f64 fused: self batch_first L37, am=float (L,S), causal, zero_attn", .e = 8, .h = 2,
     .n = 2, .l = 37, .self_attn = true, .batch_first = true, .am = F, .causal = true,
     .zero_attn = true, .fused = true, .dtype = CLMHA_DTYPE_F64},
    // Training in those dtypes: the double builds of backward.cl and unfused_backward.cl (a
    // float64 layer's backward is the unfused core's), the 16-bit conversions of grad_output
    // and the gradients around the float32 backward.
    {"f64 backward: cross bias_kv, kpm=float, am=float (N*H,L,S), w=avg", .e = 8, .h = 2,
     .n = 2, .l = 3, .s = 7, .bias_kv = true, .kpm = F, .am = F, .layout = PER_HEAD,
     .weights = true, .backward = true, .dtype = CLMHA_DTYPE_F64},
    {"bf16 backward fused: self causal L=S=20, kpm=float", .e = 8, .h = 2, .n = 2, .l = 20,
     .self_attn = true, .causal = true, .kpm = F, .fused = true, .backward = true,
     .dtype = CLMHA_DTYPE_BF16},
    // Float64 decoding and partial attention: the double builds of decode.cl (a cache of
    // doubles, REAL16 shuffles and lane masks, pages of 8) and of merge_partials.
    {"f64 decode paged: self causal L=S=21, 4 heads on 2, bias_kv, pages of 8, chunks of 4",
     .e = 8, .h = 4, .kv_heads = 2, .n = 2, .l = 21, .self_attn = true, .causal = true,
     .bias_kv = true, .decode_chunk = 4, .decode_parts = 3, .page_size = 8,
     .dtype = CLMHA_DTYPE_F64},
    {"f64 partial: cross L3 S37 split at 16, bias_kv+zero_attn, merged", .e = 8, .h = 2,
     .n = 2, .l = 3, .s = 37, .bias_kv = true, .zero_attn = true, .partial_split = 16,
     .dtype = CLMHA_DTYPE_F64},
    // The unfused core in chunks: groups of heads, then rows of one head (the last case also
    // with grouped-query attention: each chunk's keys from its query head's key/value plane).
    {"chunked gqa: rows of a head, 4 heads on 2, causal, w=avg", .e = 8, .h = 4, .kv_heads = 2,
     .n = 1, .l = 40, .self_attn = true, .causal = true, .weights = true, .max_alloc = 4096},
    {"chunked: 2 of 4 heads, am=float (N*H,L,S), w=avg", .e = 8, .h = 4, .n = 2, .l = 16,
     .s = 16, .am = F, .layout = PER_HEAD, .weights = true, .max_alloc = 4096},
    {"chunked: rows of a head, causal, kpm=ignore, w=avg", .e = 4, .h = 2, .n = 1, .l = 40,
     .self_attn = true, .causal = true, .kpm = I, .weights = true, .max_alloc = 4096},
    {"chunked: rows of a head, dropout train, w=per_head", .e = 4, .h = 2, .n = 1, .l = 40,
     .s = 37, .dropout = 0.25f, .train = true, .weights = true, .per_head = true,
     .max_alloc = 4096},
};

#undef I
#undef A
#undef F

// ---- one case ----------------------------------------------------------------------------------

static float *floats(size_t count, bool normal, double bound) {
    float *p = malloc((count ? count : 1) * sizeof *p);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    for (size_t i = 0; i < count; ++i)
        p[i] = (float)(normal ? normal01() : (2.0 * uniform01() - 1.0) * bound);
    return p;
}

// Boolean masks: a fraction @p forbid_p of the keys forbidden; float masks: N(0,1) with that
// fraction of -inf.
static void *make_mask(clmha_mask_kind kind, size_t count, double forbid_p) {
    if (kind == CLMHA_MASK_FLOAT) {
        float *m = floats(count, true, 0);
        for (size_t i = 0; i < count; ++i)
            if (uniform01() < forbid_p) m[i] = -INFINITY;
        return m;
    }
    unsigned char *m = malloc(count ? count : 1);
    if (!m) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    for (size_t i = 0; i < count; ++i) {
        bool forbidden = uniform01() < forbid_p;
        unsigned char nonzero = (unsigned char)(1 + next_u64() % 255);
        m[i] = (forbidden == (kind == CLMHA_MASK_BOOL_IGNORE)) ? nonzero : 0;
    }
    return m;
}

static clmha_tensor tensor(const void *data, size_t ndim, size_t a, size_t b, size_t c) {
    return (clmha_tensor){.ndim = ndim, .shape = {a, b, c}, .data = data};
}

static clmha_tensor input(const dcase *c, size_t n, const float *data, size_t seq, size_t feat) {
    if (c->unbatched) return tensor(data, 2, seq, feat, 0);
    if (c->batch_first) return tensor(data, 3, n, seq, feat);
    return tensor(data, 3, seq, n, feat);
}

static double max_abs(const double *x, size_t count) {
    double m = 0;
    for (size_t i = 0; i < count; ++i) m = fmax(m, fabs(x[i]));
    return m;
}

static double max_abs_error(const float *got, const double *want, size_t count) {
    double m = 0.0;
    for (size_t i = 0; i < count; ++i) {
        double d = fabs((double)got[i] - want[i]);
        if (!(d <= m)) m = isnan(d) ? INFINITY : d;  // NaN counts as infinite
    }
    return m;
}

#define SET(name, ptr, count)                                                                  \
    if ((ptr) && !st) st = clmha_layer_set_parameter(layer, name, ptr, count)

// True when the layer of @p c gets a parameter buffer by several host writes at offsets:
// q/k/v_proj_weight (kdim or vdim != embed_dim, or grouped-query attention) and bias_k/bias_v
// (see the usage above).
static bool partial_host_writes(const dcase *c) {
    bool separate = (c->kdim && c->kdim != c->e) || (c->vdim && c->vdim != c->e);
    return separate || c->bias_kv || c->kv_heads;
}

// Imports fused tiles "BQ BK RPW VW" as the device's tuning (a layer built afterwards uses
// them). Returns false with a message when the import fails.
static bool import_tiles(clmha_context *ctx, const char *tiles, char *msg, size_t size) {
    unsigned bq, bk, rpw, vw;
    if (sscanf(tiles, "%u %u %u %u", &bq, &bk, &rpw, &vw) != 4) {
        snprintf(msg, size, "bad tiles \"%s\"", tiles);
        return false;
    }
    clmha_device_info info = {.struct_size = sizeof info};
    if (clmha_device_select(getenv("CLMHA_DEVICE"), &info, msg, size) != CLMHA_SUCCESS)
        return false;
    char json[2048];
    snprintf(json, sizeof json,
             "{\"format\": \"clmha-gemm-tuning\", \"version\": 1, \"platform\": \"%s\", "
             "\"device\": \"%s\", \"driver\": \"%s\", \"kernels\": {\"FusedAttention\": "
             "{\"BQ\": %u, \"BK\": %u, \"RPW\": %u, \"VW\": %u}}}",
             info.platform_name, info.device_name, info.driver_version, bq, bk, rpw, vw);
    if (clmha_context_tuning_import(ctx, json) != CLMHA_SUCCESS) {
        snprintf(msg, size, "tuning import: %s", clmha_context_last_error(ctx));
        return false;
    }
    return true;
}

// The gradients a backward case asks for, in clmha_backward_args order (see gradients()).
enum { G_QUERY, G_KEY, G_VALUE, G_IN_W, G_Q_W, G_K_W, G_V_W, G_IN_B, G_OUT_W, G_OUT_B,
       G_BIAS_K, G_BIAS_V, G_ATTN, G_KPM, G_SINKS, G_COUNT };

// Runs the backward pass of the forward call @p args just made with @p saved on the device and
// on the reference, every gradient the case has; the largest error goes to *err (INFINITY when
// a call fails, with the message in @p msg).
static clmha_status run_backward(clmha_layer *layer, clmha_saved *saved, const dcase *c,
                                 const clmha_layer_desc *desc, const clmha_reference_params *p,
                                 const clmha_forward_args *args, size_t oc, size_t wc,
                                 double *err, char *msg, size_t msg_size) {
    const size_t e = c->e, n = c->unbatched ? 1 : c->n, l = c->l;
    const size_t s = c->self_attn ? c->l : c->s;
    const size_t kdim = c->kdim ? c->kdim : e, vdim = c->vdim ? c->vdim : e;
    const size_t kve = c->kv_heads ? c->kv_heads * (e / c->h) : e;  // key/value width
    const bool packed = kdim == e && vdim == e && kve == e, masks = !c->fused;
    const size_t planes = c->layout == PER_HEAD ? n * c->h : c->layout == PER_BATCH ? n : 1;
    size_t count[G_COUNT] = {
        n * l * e, c->self_attn ? 0 : n * s * kdim,
        c->self_attn || c->value_is_key ? 0 : n * s * vdim, packed ? 3 * e * e : 0,
        packed ? 0 : e * e, packed ? 0 : kve * kdim, packed ? 0 : kve * vdim,
        c->nobias ? 0 : e + 2 * kve, e * e, c->nobias ? 0 : e, c->bias_kv ? kve : 0,
        c->bias_kv ? kve : 0,
        masks && c->am == CLMHA_MASK_FLOAT ? planes * l * s : 0,
        masks && c->kpm == CLMHA_MASK_FLOAT ? n * s : 0, c->sinks ? c->h : 0};
    float *gy = floats(oc, true, 0), *gw = wc ? floats(wc, true, 0) : NULL;
    clmha_backward_args b = {.struct_size = sizeof b, .forward = args, .saved = saved,
                             .grad_output = args->query, .impl = args->impl};
    b.grad_output.data = gy;
    if (wc) {
        b.grad_weights = (clmha_tensor){.data = gw};
        clmha_tensor *t = &b.grad_weights;
        if (!c->unbatched) t->shape[t->ndim++] = n;
        if (c->per_head) t->shape[t->ndim++] = c->h;
        t->shape[t->ndim++] = l;
        t->shape[t->ndim++] = s + c->bias_kv + c->zero_attn;
    }
    clmha_reference_grads r = {.struct_size = sizeof r};
    clmha_grad *dst[G_COUNT] = {&b.query, &b.key, &b.value, &b.in_proj_weight, &b.q_proj_weight,
                                &b.k_proj_weight, &b.v_proj_weight, &b.in_proj_bias,
                                &b.out_proj_weight, &b.out_proj_bias, &b.bias_k, &b.bias_v,
                                &b.attn_mask, &b.key_padding_mask, &b.sinks};
    double **ref[G_COUNT] = {&r.query, &r.key, &r.value, &r.in_proj_weight, &r.q_proj_weight,
                             &r.k_proj_weight, &r.v_proj_weight, &r.in_proj_bias,
                             &r.out_proj_weight, &r.out_proj_bias, &r.bias_k, &r.bias_v,
                             &r.attn_mask, &r.key_padding_mask, &r.sinks};
    for (int g = 0; g < G_COUNT; ++g) {
        if (!count[g]) continue;
        dst[g]->data = floats(count[g], false, 0);
        for (size_t i = 0; i < count[g]; ++i) dst[g]->data[i] = NAN;
        *ref[g] = malloc(count[g] * sizeof(double));
    }
    clmha_status st = clmha_layer_backward_host(layer, &b);
    if (st) {
        snprintf(msg, msg_size, "backward: %s",
                 clmha_context_last_error(clmha_layer_context(layer)));
    } else {
        st = clmha_reference_backward(desc, p, args, gy, gw, &r, msg, msg_size);
    }
    *err = st ? INFINITY : 0;
    for (int g = 0; g < G_COUNT; ++g) {
        if (!count[g]) continue;
        if (!st) {
            double scale = 0;
            for (size_t i = 0; i < count[g]; ++i) scale = fmax(scale, fabs((*ref[g])[i]));
            *err = fmax(*err, max_abs_error(dst[g]->data, *ref[g], count[g]) / (1 + scale));
        }
        free(dst[g]->data);
        free(*ref[g]);
    }
    free(gy);
    free(gw);
    return st;
}

// Runs case @p c; returns true when it passes.
static clmha_status decode_forward(clmha_layer *layer, const dcase *c,
                                   const clmha_forward_args *args, float *out, size_t n,
                                   size_t l, size_t e);
static clmha_status partial_forward(clmha_context *ctx, clmha_layer *layer, const dcase *c,
                                    const clmha_forward_args *args, float *out, size_t n,
                                    size_t l, size_t s, size_t e, size_t kdim, size_t vdim);

static bool run_case(clmha_context *ctx, size_t index, const dcase *c) {
    rng_state = 1000 + index;
    const size_t e = c->e, n = c->unbatched ? 1 : c->n, l = c->l;
    const size_t s = c->self_attn ? c->l : c->s;
    const size_t kdim = c->kdim ? c->kdim : e, vdim = c->vdim ? c->vdim : e;
    const size_t sp = s + c->bias_kv + c->zero_attn;
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = e, .num_heads = c->h, .kdim = c->kdim,
                             .vdim = c->vdim, .bias = !c->nobias, .add_bias_kv = c->bias_kv,
                             .add_zero_attn = c->zero_attn, .batch_first = c->batch_first,
                             .dropout = c->dropout, .num_kv_heads = c->kv_heads,
                             .dtype = c->dtype, .window = c->window, .window_left = c->wl,
                             .window_right = c->wr, .softcap = c->softcap, .alibi = c->alibi,
                             .sinks = c->sinks};
    const size_t kve = c->kv_heads ? c->kv_heads * (e / c->h) : e;  // key/value width
    // The layer's descriptor: desc, with the variants of c->user moved into user functions.
    clmha_layer_desc ldesc = desc;
    char user_source[sizeof user_score_source + sizeof user_mask_source];
    float *user_p = c->user ? floats(2 + c->h, false, 0) : NULL;
    if (c->user) {
        user_p[0] = (float)(c->window ? c->wl : -1), user_p[1] = (float)(c->window ? c->wr : -1);
        clmha_alibi_slopes(c->h, user_p + 2);
        snprintf(user_source, sizeof user_source, "%s%s",
                 c->user & USER_SCORE ? user_score_source : "",
                 c->user & USER_MASK ? user_mask_source : "");
        if (c->user & USER_SCORE) ldesc.alibi = false;
        if (c->user & USER_MASK) ldesc.window = false;
        ldesc.mod_source = user_source;
        ldesc.mod_params = user_p;
        ldesc.mod_params_count = 2 + c->h;
    }

    // Parameters.
    const double bound = 1.0 / sqrt((double)e);
    clmha_reference_params p = {.struct_size = sizeof p};
    float *w_in = NULL, *wq = NULL, *wk = NULL, *wv = NULL, *b_in = NULL, *bo = NULL;
    float *bk = NULL, *bv = NULL, *sk = c->sinks ? floats(c->h, true, 0) : NULL;
    p.sinks = sk;
    if (kdim == e && vdim == e && kve == e) {
        p.in_proj_weight = w_in = floats(3 * e * e, false, bound);
    } else {
        p.q_proj_weight = wq = floats(e * e, false, bound);
        p.k_proj_weight = wk = floats(kve * kdim, false, bound);
        p.v_proj_weight = wv = floats(kve * vdim, false, bound);
    }
    float *wo = floats(e * e, false, bound);
    p.out_proj_weight = wo;
    if (!c->nobias) {
        p.in_proj_bias = b_in = floats(e + 2 * kve, false, bound);
        p.out_proj_bias = bo = floats(e, false, bound);
    }
    if (c->bias_kv) {
        p.bias_k = bk = floats(kve, true, 0);
        p.bias_v = bv = floats(kve, true, 0);
    }

    // Inputs and masks.
    clmha_forward_args args = {.struct_size = sizeof args};
    float *query = floats(l * n * e, true, 0), *key = NULL, *value = NULL;
    args.query = input(c, n, query, l, e);
    if (!c->self_attn) {
        key = floats(s * n * kdim, true, 0);
        args.key = input(c, n, key, s, kdim);
        if (!c->value_is_key) {
            value = floats(s * n * vdim, true, 0);
            args.value = input(c, n, value, s, vdim);
        }
    }
    void *kpm = NULL, *am = NULL;
    const double forbid_p = c->mask_row || c->mask_item ? 0.1 : 0.25;
    if (c->kpm) {
        kpm = make_mask(c->kpm, n * s, forbid_p);
        if (c->mask_item) memset(kpm, 1, s);  // item 0 (BOOL_IGNORE): every key forbidden
        args.key_padding_mask.kind = c->kpm;
        args.key_padding_mask.tensor =
            c->unbatched ? tensor(kpm, 1, s, 0, 0) : tensor(kpm, 2, n, s, 0);
    }
    if (c->am) {
        size_t planes = c->layout == PER_HEAD ? n * c->h : c->layout == PER_BATCH ? n : 1;
        am = make_mask(c->am, planes * l * s, forbid_p);
        if (c->mask_row) memset((unsigned char *)am + s, 1, s);  // row 1 (BOOL_IGNORE)
        args.attn_mask.kind = c->am;
        args.attn_mask.per_batch = c->layout == PER_BATCH;
        args.attn_mask.tensor =
            c->layout == SHARED ? tensor(am, 2, l, s, 0) : tensor(am, 3, planes, l, s);
    }
    args.is_causal = c->causal;
    if (c->dtype) {  // the reference computes on the values the layer holds
        float *arrays[] = {w_in, wq, wk, wv, b_in, wo, bo, bk, bv, query, key, value};
        size_t counts[] = {3 * e * e, e * e, kve * kdim, kve * vdim, e + 2 * kve, e * e, e,
                           kve, kve, l * n * e, s * n * kdim, s * n * vdim};
        for (size_t a = 0; a < sizeof arrays / sizeof arrays[0]; ++a)
            for (size_t i = 0; arrays[a] && i < counts[a]; ++i)
                arrays[a][i] = clmha__dtype_round(c->dtype, arrays[a][i]);
        float *fm[] = {c->kpm == CLMHA_MASK_FLOAT ? kpm : NULL,
                       c->am == CLMHA_MASK_FLOAT ? am : NULL};
        size_t fc[] = {n * s, (c->layout == PER_HEAD ? n * c->h : c->layout == PER_BATCH ? n : 1) *
                                  l * s};
        for (size_t m = 0; m < 2; ++m)
            for (size_t i = 0; fm[m] && i < fc[m]; ++i)
                fm[m][i] = clmha__dtype_round(c->dtype, fm[m][i]);
    }
    clmha__test_set_max_alloc(c->max_alloc);
    clmha__test_set_fused_backward_block(c->gemm_block);
    if (c->gemm_block) setenv("CLMHA_FUSED_BACKWARD", "gemms", 1);
    else unsetenv("CLMHA_FUSED_BACKWARD");
    args.need_weights = c->weights;
    args.impl = c->fused ? CLMHA_IMPL_FUSED : CLMHA_IMPL_UNFUSED;
    args.per_head_weights = c->per_head;
    args.training = c->train;
    args.rng = (clmha_dropout_rng){0x0123456789ABCDEFull + index, 7 + index};

    const size_t oc = n * l * e, wc = c->weights ? n * (c->per_head ? c->h : 1) * l * sp : 0;
    float *out = floats(oc, false, 0), *w = floats(wc, false, 0);
    double *ref_out = malloc(oc * sizeof *ref_out), *ref_w = malloc((wc ? wc : 1) * sizeof *ref_w);
    for (size_t i = 0; i < oc; ++i) out[i] = NAN;  // anything not written shows up
    for (size_t i = 0; i < wc; ++i) w[i] = NAN;

    // Device.
    clmha_layer *layer = NULL;
    char msg[512] = "";
    clmha_status st = CLMHA_SUCCESS;
    if (c->tiles && !import_tiles(ctx, c->tiles, msg, sizeof msg)) st = CLMHA_INVALID_ARGUMENT;
    if (!st) st = clmha_layer_create(&layer, ctx, &ldesc);
    SET("in_proj_weight", w_in, 3 * e * e);
    SET("q_proj_weight", wq, e * e);
    SET("k_proj_weight", wk, kve * kdim);
    SET("v_proj_weight", wv, kve * vdim);
    SET("in_proj_bias", b_in, e + 2 * kve);
    SET("out_proj.weight", wo, e * e);
    SET("out_proj.bias", bo, e);
    SET("bias_k", bk, kve);
    SET("bias_v", bv, kve);
    SET("sinks", sk, c->h);
    clmha_saved *saved = NULL;
    if (!st && c->backward) st = clmha_saved_create(&saved, layer);
    args.save = saved;
    if (!st && c->partial_split)
        st = partial_forward(ctx, layer, c, &args, out, n, l, s, e, kdim, vdim);
    else if (!st && c->decode_chunk) st = decode_forward(layer, c, &args, out, n, l, e);
    else if (!st) st = clmha_layer_forward_host(layer, &args, out, oc, c->weights ? w : NULL, wc);
    if (st) snprintf(msg, sizeof msg, "device: %s", clmha_context_last_error(ctx));

    // Reference.
    if (!st && ref_out && ref_w) {
        char rmsg[256] = "";
        st = clmha_reference_forward(&desc, &p, &args, ref_out, oc, wc ? ref_w : NULL, wc, rmsg,
                                     sizeof rmsg);
        if (st) snprintf(msg, sizeof msg, "reference: %s", rmsg);
    } else if (!st) {
        st = CLMHA_OUT_OF_MEMORY;
        snprintf(msg, sizeof msg, "out of memory");
    }

    double eb = 0;
    if (!st && c->backward)
        st = run_backward(layer, saved, c, &desc, &p, &args, oc, wc, &eb, msg, sizeof msg);
    bool ok = st == CLMHA_SUCCESS;
    double eo = ok ? max_abs_error(out, ref_out, oc) : INFINITY;
    double ew = ok ? max_abs_error(w, ref_w, wc) : INFINITY;
    // A 16-bit layer's results are rounded once: half an ulp of the dtype more (clmha_dtype).
    // A narrower KV cache: its contract, of the largest output (docs/accuracy.md).
    double rel = c->dtype == CLMHA_DTYPE_F16 ? 0x1p-11 : c->dtype == CLMHA_DTYPE_BF16 ? 0x1p-8 : 0;
    static const double kv_rel[] = {0, 1e-2, 1e-3, 5e-3, 2e-1};  // by clmha_kv_dtype
    rel += kv_rel[c->kv_dtype];
    double tol_o = TOLERANCE + (ok ? rel * max_abs(ref_out, oc) : 0);
    double tol_w = TOLERANCE + (ok ? rel * max_abs(ref_w, wc) : 0);
    // Gradients (normalised by 1 + their largest value): a 16-bit layer's rounded once more.
    ok = ok && eo <= tol_o && ew <= tol_w && eb <= TOLERANCE + rel;
    if (st)
        printf("case %2zu %-4s %-60s %s (%s)\n", index + 1, "FAIL", c->name, msg,
               clmha_status_string(st));
    else if (c->backward)
        printf("case %2zu %-4s %-60s out %.1e grads %.1e\n", index + 1, ok ? "ok" : "FAIL",
               c->name, eo, eb);
    else if (wc)
        printf("case %2zu %-4s %-60s out %.1e weights %.1e\n", index + 1, ok ? "ok" : "FAIL",
               c->name, eo, ew);
    else
        printf("case %2zu %-4s %-60s out %.1e\n", index + 1, ok ? "ok" : "FAIL", c->name, eo);
    fflush(stdout);

    clmha_saved_release(saved);
    clmha_layer_release(layer);
    clmha__test_set_decode_parts(0);
    clmha__test_set_max_alloc(0);
    clmha__test_set_fused_backward_block(0);
    float *arrays[] = {w_in, wq,    wk,  wv,    b_in, wo, bo, bk, bv, sk,
                       query, key, value, out, w, user_p};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; ++i) free(arrays[i]);
    free(kpm);
    free(am);
    free(ref_out);
    free(ref_w);
    return ok;
}

// The self-attention call @p args fed through a KV cache c->decode_chunk query rows at a time
// (sequence-first rows: a chunk of rows is contiguous), the outputs into @p out in order.
static clmha_status decode_forward(clmha_layer *layer, const dcase *c,
                                   const clmha_forward_args *args, float *out, size_t n,
                                   size_t l, size_t e) {
    clmha_kv_cache *cache = NULL;
    clmha__test_set_decode_parts(c->decode_parts);
    size_t ps = c->page_size;
    clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = ps ? 0 : l,
                                .page_size = ps, .num_pages = ps ? n * ((l + ps - 1) / ps) : 0,
                                .kv_dtype = c->kv_dtype};
    clmha_status st = clmha_kv_cache_create_with(&cache, layer, n, &o);
    for (size_t t0 = 0; !st && t0 < l; t0 += c->decode_chunk) {
        size_t rows = t0 + c->decode_chunk < l ? c->decode_chunk : l - t0;
        clmha_forward_args a = *args;
        a.kv_cache = cache;
        a.impl = CLMHA_IMPL_AUTO;  // the decode core takes no other
        a.query.shape[0] = rows;
        a.query.data = (const float *)args->query.data + t0 * n * e;
        st = clmha_layer_forward_host(layer, &a, out + t0 * n * e, rows * n * e, NULL, 0);
    }
    clmha_kv_cache_release(cache);
    return st;
}

// A buffer of @p count elements: floats, or with @p f64 doubles (@p data widened); NULL on
// failure.
static cl_mem device_copy(clmha_context *ctx, const float *data, size_t count, bool f64) {
    cl_int err;
    double *wide = f64 && data ? malloc(count * sizeof *wide + 1) : NULL;
    if (f64 && data && !wide) return NULL;
    for (size_t i = 0; wide && i < count; ++i) wide[i] = data[i];
    const void *host = wide ? (const void *)wide : (const void *)data;
    cl_mem m = clCreateBuffer(clmha_context_cl_context(ctx),
                              CL_MEM_READ_WRITE | (data ? CL_MEM_COPY_HOST_PTR : 0),
                              count * (f64 ? sizeof(double) : sizeof(float)), (void *)host, &err);
    free(wide);
    return err == CL_SUCCESS ? m : NULL;
}

// The cross-attention call @p args as two partial calls over keys [0, split) and [split, S)
// (sequence-first rows: a range of keys is contiguous), merged and projected into @p out (a
// float64 layer's in doubles, merged by clmha_attention_merge_f64(), read back as floats).
static clmha_status partial_forward(clmha_context *ctx, clmha_layer *layer, const dcase *c,
                                    const clmha_forward_args *args, float *out, size_t n,
                                    size_t l, size_t s, size_t e, size_t kdim, size_t vdim) {
    const size_t rows = n * c->h * l, d = e / c->h, split = c->partial_split;
    const float *key = args->key.data, *value = args->value.data;
    bool f = c->dtype == CLMHA_DTYPE_F64;
    cl_mem q = device_copy(ctx, args->query.data, l * n * e, f);
    cl_mem k0 = device_copy(ctx, key, split * n * kdim, f);
    cl_mem k1 = device_copy(ctx, key + split * n * kdim, (s - split) * n * kdim, f);
    cl_mem v0 = device_copy(ctx, value, split * n * vdim, f);
    cl_mem v1 = device_copy(ctx, value + split * n * vdim, (s - split) * n * vdim, f);
    cl_mem ha = device_copy(ctx, NULL, rows * d, f), la = device_copy(ctx, NULL, rows, f);
    cl_mem hb = device_copy(ctx, NULL, rows * d, f), lb = device_copy(ctx, NULL, rows, f);
    cl_mem o = device_copy(ctx, NULL, l * n * e, f);
    cl_mem all[] = {q, k0, k1, v0, v1, ha, la, hb, lb, o};
    clmha_status st = CLMHA_SUCCESS;
    for (size_t i = 0; i < sizeof all / sizeof *all; ++i)
        if (!all[i]) st = CLMHA_OUT_OF_MEMORY;
    clmha_forward_args a = {.struct_size = sizeof a, .is_causal = args->is_causal};
    a.query = (clmha_tensor){.ndim = 3, .shape = {l, n, e}, .buffer = q};
    a.key = (clmha_tensor){.ndim = 3, .shape = {split, n, kdim}, .buffer = k0};
    a.value = (clmha_tensor){.ndim = 3, .shape = {split, n, vdim}, .buffer = v0};
    if (!st) st = clmha_layer_attend(layer, &a, false, ha, 0, la, 0, 0, NULL, NULL);
    a.key.shape[0] = a.value.shape[0] = s - split;
    a.key_position = split;  // the second range's keys at their positions
    a.key.buffer = k1;
    a.value.buffer = v1;
    if (!st) st = clmha_layer_attend(layer, &a, true, hb, 0, lb, 0, 0, NULL, NULL);
    if (!st)
        st = (f ? clmha_attention_merge_f64 : clmha_attention_merge)(ctx, rows, d, ha, 0, la, 0,
                                                                      hb, 0, lb, 0, 0, NULL,
                                                                      NULL);
    if (!st) st = clmha_layer_project_heads(layer, n, l, ha, 0, o, 0, 0, NULL, NULL);
    size_t oc = l * n * e, es = f ? sizeof(double) : sizeof(float);
    void *host = f ? malloc(oc * es) : out;
    if (!st && (!host || clEnqueueReadBuffer(clmha_context_cl_queue(ctx), o, CL_TRUE, 0,
                                             oc * es, host, 0, NULL, NULL) != CL_SUCCESS))
        st = host ? CLMHA_OPENCL_ERROR : CLMHA_OUT_OF_MEMORY;
    for (size_t i = 0; f && !st && i < oc; ++i) out[i] = (float)((const double *)host)[i];
    if (f) free(host);
    for (size_t i = 0; i < sizeof all / sizeof *all; ++i)
        if (all[i]) clReleaseMemObject(all[i]);
    return st;
}

int main(int argc, char **argv) {
    enum { COUNT = sizeof cases / sizeof cases[0] };
    bool verbose = false, whole_writes = false, list = false;
    const char *cls = NULL;
    bool wanted[COUNT], any_number = false;
    memset(wanted, 0, sizeof wanted);
    for (int i = 1; i < argc; ++i) {
        char *end = NULL;
        unsigned long k = strtoul(argv[i], &end, 10);
        if (strcmp(argv[i], "-v") == 0) {
            verbose = true;
        } else if (strcmp(argv[i], "--whole-writes") == 0) {
            whole_writes = true;
        } else if (strcmp(argv[i], "--list") == 0) {
            list = true;
        } else if (strcmp(argv[i], "--class") == 0 && i + 1 < argc) {
            cls = argv[++i];
            if (!clmha__test_force_device_class(cls)) {
                fprintf(stderr, "oclgrind_driver: no device class \"%s\"\n", cls);
                return 2;
            }
        } else if (end != argv[i] && *end == '\0' && k >= 1 && k <= COUNT) {
            wanted[k - 1] = any_number = true;
        } else {
            fprintf(stderr,
                    "usage: %s [-v] [--whole-writes] [--list] [--class NAME] "
                    "[case number (1-%d)...]\n",
                    argv[0], (int)COUNT);
            return 2;
        }
    }
    for (size_t i = 0; i < COUNT; ++i)
        wanted[i] = (wanted[i] || !any_number) &&
                    !(whole_writes && partial_host_writes(&cases[i])) &&
                    !(cases[i].forced_class_only && !cls);
    if (list) {
        for (size_t i = 0; i < COUNT; ++i)
            if (wanted[i]) printf("%zu\n", i + 1);
        return 0;
    }

    clmha_context *ctx = NULL;
    if (clmha_context_create_from_env(&ctx) != CLMHA_SUCCESS) {
        fprintf(stderr, "oclgrind_driver: no OpenCL context: %s\n", clmha_last_create_error());
        return 2;
    }
    if (verbose)
        printf("device: %s, class %s%s\n", clmha_context_device_name(ctx),
               cls ? cls : "detected", cls ? " (forced)" : "");
    size_t ran = 0, failed = 0;
    for (size_t i = 0; i < COUNT; ++i) {
        if (!wanted[i]) continue;
        ++ran;
        if (!run_case(ctx, i, &cases[i])) ++failed;
    }
    clmha_context_release(ctx);
    printf("cases: %zu, failed: %zu\n", ran, failed);
    return failed ? 1 : 0;
}
