// Helpers shared by the attention cores' kernels (cl/cores/*.cl); the
// library builds this file in front of them.
//
// Mask kinds (host enum clmha_mask_kind): 0 none, 1 bool "true = ignore", 2 bool "true = may
// attend", 3 float (added). attn_mask layouts: 1 (L, S) shared, 2 (N*H, L, S) per head,
// 3 (N, L, S) per batch item.

#define MASK_NONE 0
#define MASK_BOOL_IGNORE 1
#define MASK_BOOL_ATTEND 2
#define MASK_FLOAT 3

// The mask and dropout parameters that end the attention kernels' parameter lists, in the order
// the host passes them (CLMHA__MASK_ARGS, src/cores/kernel_args.h).
#define MASK_PARAMS                                                                             \
    global const uchar *attn_mask, ulong attn_off, uint attn_kind, uint attn_layout,            \
        global const uchar *kpm, ulong kpm_off, uint kpm_kind, uint causal, uint dropout_on,    \
        uint dropout_threshold, REAL keep_scale, uint seed_lo, uint seed_hi_xor_off_hi,        \
        uint offset_lo

// The row of token t of sequence n in a (sequence, batch) tensor of n_batch sequences of seq
// tokens: n * seq + t with batch_first, else t * n_batch + n.
inline ulong token_row(ulong n, ulong t, ulong n_batch, ulong seq, uint batch_first) {
    return batch_first ? n * seq + t : t * n_batch + n;
}

// Philox4x32-10, first output word (the same function as clmha__philox_word0 in src/base/philox.h).
inline uint philox_word0(uint c0, uint c1, uint c2, uint c3, uint k0, uint k1) {
    for (int round = 0; round < 10; ++round) {
        uint hi0 = mul_hi(0xD2511F53u, c0);
        uint lo0 = 0xD2511F53u * c0;
        uint hi1 = mul_hi(0xCD9E8D57u, c2);
        uint lo1 = 0xCD9E8D57u * c2;
        uint n0 = hi1 ^ c1 ^ k0;
        uint n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

// The additive value of mask `kind` at element idx of `mask`.
inline REAL mask_value(global const uchar *mask, uint kind, ulong idx) {
    if (kind == MASK_FLOAT) return ((global const REAL *)mask)[idx];
    if (kind == MASK_BOOL_IGNORE) return mask[idx] ? -INFINITY : 0.0f;
    if (kind == MASK_BOOL_ATTEND) return mask[idx] ? 0.0f : -INFINITY;
    return 0.0f;
}

// The larger of a and b, where NaN wins (so that a NaN score propagates through a row).
inline REAL max_nan(REAL a, REAL b) { return (b > a || isnan(b)) ? b : a; }
