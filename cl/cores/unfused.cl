// The unfused attention core's kernel (host side: src/cores/unfused.c).
//
// Mask application, numerically stable row-wise softmax and dropout, in place on the scores
// (N*H, L, S') that the QK^T GEMM wrote (already scaled by 1/sqrt(head_dim)); optionally each
// row's log-sum-exp (attention as a function and partial attention ask for them).
//
// Build options: -DWG=<work-group size, a power of two>.
// Needs cl/common.cl in front (mask kinds, mask_value, philox_word0, max_nan).
//
// Masks cover the first S keys; the keys appended by add_bias_kv / add_zero_attn (j >= S) are
// never masked, as PyTorch pads its masks with an allowed column. Mask kinds (host enum
// clmha_mask_kind): 0 none, 1 bool "true = ignore", 2 bool "true = may attend", 3 float (added).
// attn_mask is read through its broadcast strides (cl/common.cl's attn_row_of).
// A row whose every key is masked becomes zeros (PyTorch would give NaN).
//
// The scores may be a chunk: n_rows consecutive rows of the (N*H*L, S') scores starting at row
// row_off (the unfused core works in chunks when the scores exceed the largest allocation);
// `scores` holds the chunk from its first row, and the masks, causal and dropout see the global
// row (bh, i).

#ifndef WG
#define WG 64
#endif

// One work-group per row (bh, i) of the scores (of the chunk).
kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void masked_softmax(global REAL *scores, ulong n_rows, ulong row_off, ulong tgt_len,
                    ulong n_heads,
                    ulong src_len, ulong src_len_padded, global REAL *lse, uint has_lse,
                    MASK_PARAMS) {
    local REAL red[WG];
    ulong local_row = get_group_id(0);
    // No early return anywhere in this kernel: every work-item must reach every barrier, and
    // PoCL 3.1 miscompiles even work-group-uniform returns in kernels with barriers. The host
    // launches exactly n_rows work-groups.
    uint lid = get_local_id(0);
    ulong row = row_off + local_row;
    ulong bh = row / tgt_len;
    ulong i = row % tgt_len;
    ulong n = bh / n_heads;
    global REAL *x = scores + local_row * src_len_padded;

    ulong attn_row = ATTN_ROW(bh, n, n_heads, i);
    ulong kpm_row = kpm_off + n * src_len;

    // Pass 1: the score variants (cl/common.cl), the masks, write back, find the row maximum
    // (NaN wins, so it propagates).
    REAL m = -INFINITY;
    REAL slope = ALIBI_SLOPE(bh - n * n_heads);
    for (ulong j = lid; j < src_len_padded; j += WG) {
        REAL v = x[j];
#if SCORE_MODS
        v = score_mod(v, softcap, slope, i, j, j < src_len);
#endif
        if (j < src_len) {
            v = USER_SCORE_OF(v, n, bh - n * n_heads, i, j);  // the user's (cl/common.cl)
            v += mask_value(attn_mask, attn_kind, attn_row + j);
            v += mask_value(kpm, kpm_kind, kpm_row + j);
            if ((causal && j > i) || !in_window(win_left, win_right, (long)i, (long)j) ||
                !USER_ALLOWS(n, bh - n * n_heads, i, j))
                v = -INFINITY;
        }
        x[j] = v;
        m = max_nan(m, v);
    }
    red[lid] = m;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = WG / 2; s > 0; s >>= 1) {
        if (lid < s) {
            REAL o = red[lid + s];
            red[lid] = max_nan(red[lid], o);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    m = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);
#if SINKS
    REAL sink = SINK_OF(bh - n * n_heads);  // one more logit, with a zero value (cl/common.cl)
    m = max_nan(m, sink);
#endif

    bool dead = m == -INFINITY;  // fully masked row: all zeros

    // Pass 2: exponentials and their sum.
    REAL sum = 0.0f;
    for (ulong j = lid; j < src_len_padded; j += WG) {
        REAL e = dead ? 0.0f : exp(x[j] - m);
        x[j] = e;
        sum += e;
    }
    red[lid] = sum;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = WG / 2; s > 0; s >>= 1) {
        if (lid < s) red[lid] += red[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    REAL total = red[0];
#if SINKS
    total += exp(sink - m);
#endif
    REAL inv = dead ? 0.0f : 1.0f / total;
    // The row's log-sum-exp (of the scaled, masked scores, before dropout; the sink's term
    // included), as the fused core writes it: -INFINITY for a fully masked row; in the
    // layer's REAL, as the fused core's and the backward's sinks_grad read them.
    if (has_lse && lid == 0) lse[row] = dead ? (REAL)(-INFINITY) : (REAL)(m + log(total));

    // Pass 3: normalise, then dropout.
    for (ulong j = lid; j < src_len_padded; j += WG) {
        REAL p = x[j] * inv;
        if (dropout_on) {
            uint w = philox_word0((uint)j, (uint)i, (uint)bh, offset_lo, seed_lo,
                                  seed_hi_xor_off_hi);
            p = w >= dropout_threshold ? p * keep_scale : 0.0f;
        }
        x[j] = p;
    }
}
