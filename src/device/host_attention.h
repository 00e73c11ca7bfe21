// Attention of head dimension 64 on the CPU itself: the host fused core's arithmetic
// (src/cores/host_fused.c runs it from a native kernel over a team of the host threads,
// device/host_pool.h).
//
// Why: on CPU drivers the fused OpenCL kernel (cl/cores/fused.cl), as PoCL 3.1 compiles it,
// reached ~0.66 of the FMA peak at L 2048 (155 GFLOP/s on 2 cores of an AMD EPYC, Zen 4); this
// C kernel, with the same online softmax, reaches ~185 there (docs/design.md, "The host fused
// core").
//
// How: for each (batch, key/value head) the keys are first copied transposed, in tiles of 64
// keys (64 dimensions × 64 keys, the bias added), and the values contiguous (the bias added);
// then each block of 12 query rows (scaled by scale·log2(e), the bias added) runs over the key
// tiles: per 6 rows, the tile's scores (6 × 64), the row maxima, p = 2^(score − max) (a
// polynomial, ~1 ulp), the running sums kept in lanes, the accumulators rescaled when a
// maximum grows, then acc += p·V (6 rows × 64 columns, over the tile's values). Past the last
// key of a partial tile the scores are -inf and p exactly 0; past the last query row the block
// computes on the last row and stores nothing. With is_causal each row's scores past its last
// key get p = 0 and the block runs over the tiles its last row reaches only; the blocks are
// then dealt out in turn (thread t takes t, t + T, ...), not in runs, so that the threads share
// the triangle evenly. Every output element is the same sum in the same order whatever the
// team's size. The copies and the 6 rows against a tile exist in AVX-512 and in AVX2 with FMA
// (device/host_attention_kernels.h); this file runs the rest and picks one.
// Compiled at -O3 in optimised builds (CMakeLists.txt).
//
// Only on x86-64 with AVX-512 (F) or AVX2 and FMA, compiled by GCC or Clang: elsewhere
// clmha__host_attention_fits() is false and the fused OpenCL kernel runs.
#ifndef CLMHA_DEVICE_HOST_ATTENTION_H
#define CLMHA_DEVICE_HOST_ATTENTION_H

#include <stdbool.h>
#include <stddef.h>

#include "base/defs.h"

// The one head dimension the kernel takes.
#define CLMHA__HOST_ATTENTION_HD 64

// One call: out = softmax(q·kᵀ·scale)·v for every (batch, query head), no mask but is_causal
// or a boolean key_padding_mask. Element d of row t of head h of batch b of q is
// q[q_at[0] + b·q_at[1] + h·q_at[2] + t·q_at[3] + d]; k and v are read at key/value head
// h / kv_group with their strides; out as q.
typedef struct clmha__host_attention {
    size_t batch, heads, kv_group, rows, keys;  // N, H, H / KVH, L, S (each at least 1)
    const float *q, *k, *v;
    float *out;
    size_t q_at[4], k_at[4], v_at[4], o_at[4];
    // Optional (NULL: none): the query, key and value biases of head 0, head h's (key/value
    // head's) 64 floats at h·64, added to the rows as they are read.
    const float *bq, *bk, *bv;
    float scale;
    // Optional (NULL: none): each row's log-sum-exp m + log(sum) of its scaled scores (natural
    // log), row t of head h of batch b at (b·H + h)·L + t; with lse_split, each row's maximum m
    // and log(sum) apart lse_split and 2·lse_split floats further (N·H·L: the fused core's
    // lse_on 2, cl/cores/fused.cl, which its backward reads).
    float *lse;
    size_t lse_split;
    // is_causal: query row t attends the keys j <= t only (top-left aligned).
    bool causal;
    // Optional (NULL: none; not with causal): a boolean key_padding_mask, batch b's S bytes at
    // kpm + b·kpm_ld; key j is left out where its byte is non-zero (nn.MultiheadAttention's
    // kind), or where it is zero with kpm_attend. The copies of the keys and values take the
    // other keys only, in order: every row sees them and nothing else. A batch whose every key
    // is left out gives zero rows and log-sum-exp -inf (maximum -inf, log-sum 0 with
    // lse_split), as the fused core's fully masked rows.
    const unsigned char *kpm;
    size_t kpm_ld;
    bool kpm_attend;
    // clmha__host_attention_scratch() floats for each member of the team, 64-byte aligned.
    float *scratch;
} clmha__host_attention;

// Whether this CPU and build run the kernel at head dimension @p head_dim.
CLMHA__HIDDEN bool clmha__host_attention_fits(size_t head_dim);

// The instruction set the kernel runs in on this CPU: "AVX-512", "AVX2", or NULL (none).
CLMHA__HIDDEN const char *clmha__host_attention_isa(void);

// For the tests: true makes a CPU with AVX-512 run the AVX2 kernel (set it while no kernel
// runs).
CLMHA__HIDDEN extern bool clmha__host_attention_avx2_only;

// The scratch floats one thread needs for @p keys keys (their transposed copy and the values';
// with @p kpm, also the kept keys and values gathered), or 0 when that size overflows.
CLMHA__HIDDEN size_t clmha__host_attention_scratch(size_t keys, bool kpm);

// Thread @p t of @p team: its share of the (batch, head, block of rows) items, in order.
CLMHA__HIDDEN void clmha__host_attention_run(const clmha__host_attention *p, size_t t,
                                             size_t team);

#endif
