// The unfused core's backward kernels (host side: src/cores/unfused_backward.c), between its
// batched GEMMs. The host has recomputed the probabilities P (N*H, L, S') with the forward's
// masked_softmax, dropout off, and dPd = dO V'^T (N*H, L, S') into a second buffer.
//
// Build options: -DWG=<work-group size of softmax_backward, a power of two>.
// Needs cl/common.cl in front (philox_word0).

#ifndef WG
#define WG 64
#endif

// Weights-gradient modes (the forward call's weights layout): none, per head (N*H, L, S'),
// averaged over the heads (N, L, S').
#define GW_NONE 0
#define GW_PER_HEAD 1
#define GW_AVERAGED 2

// One work-group per score row (bh, i): with f = keep * keep_scale the dropout factor of
// weight (bh, i, j) (1 without dropout), replayed exactly as masked_softmax drew it,
//   dPd_j += grad_weights (divided by H when they were averaged),
//   dP_j = dPd_j * f,  Drow = sum_j P_j dP_j,  dS_j = P_j (dP_j - Drow),  Pd_j = P_j * f;
// p holds P and receives Pd (for dV' = Pd^T dO), g holds dPd and receives dS. Drow is summed in
// a fixed order (each work-item's strided part in order, then a fixed tree), so the result is
// the same on every run. A fully masked row has P = 0: dS = 0 and Pd = 0.
kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void softmax_backward(global REAL *p, global REAL *g, global const REAL *grad_weights,
                      ulong gw_off, uint gw_mode, REAL inv_heads, ulong tgt_len, ulong n_heads,
                      ulong src_len_padded,
                      uint dropout_on, uint dropout_threshold, REAL keep_scale,
                      uint seed_lo, uint seed_hi_xor_off_hi, uint offset_lo,
                      global REAL *drow_out, uint drow_on) {
    local REAL red[WG];
    // No early return: the host launches exactly one work-group per row, and every work-item
    // reaches every barrier (PoCL 3.1 miscompiles uniform returns in kernels with barriers).
    uint lid = get_local_id(0);
    ulong row = get_group_id(0);
    ulong bh = row / tgt_len;
    ulong i = row % tgt_len;
    ulong n = bh / n_heads;
    global REAL *x = p + row * src_len_padded;
    global REAL *y = g + row * src_len_padded;
    global const REAL *gw = grad_weights + gw_off +
                             (gw_mode == GW_AVERAGED ? (n * tgt_len + i) : row) * src_len_padded;
    REAL gw_scale = gw_mode == GW_AVERAGED ? inv_heads : (REAL)1;

    REAL acc = (REAL)0;
    for (ulong j = lid; j < src_len_padded; j += WG) {
        REAL dp = y[j];
        if (gw_mode != GW_NONE) dp += gw[j] * gw_scale;
        if (dropout_on) {
            uint w = philox_word0((uint)j, (uint)i, (uint)bh, offset_lo, seed_lo,
                                  seed_hi_xor_off_hi);
            dp = w >= dropout_threshold ? dp * keep_scale : (REAL)0;
        }
        y[j] = dp;
        acc = fma(x[j], dp, acc);
    }
    red[lid] = acc;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = WG / 2; s > 0; s >>= 1) {
        if (lid < s) red[lid] += red[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    REAL drow = red[0];
    if (drow_on && lid == 0) drow_out[row] = drow;  // for the sinks' gradient

    for (ulong j = lid; j < src_len_padded; j += WG) {
        REAL pj = x[j];
        y[j] = pj * (y[j] - drow);
        if (dropout_on) {
            uint w = philox_word0((uint)j, (uint)i, (uint)bh, offset_lo, seed_lo,
                                  seed_hi_xor_off_hi);
            x[j] = w >= dropout_threshold ? pj * keep_scale : (REAL)0;
        }
    }
}

// One work-item per element e of a mask broadcast to the scores (N*H, L, S') with strides
// (mask_sn, mask_sh, mask_si) along N, H, L (0 where it is broadcast; the forward's attn_mask
// strides, or (S, 0, 0) for key_padding_mask (N, S)): the gradient of the scores dS summed over
// every (n, h, i) whose score reads that element, in a fixed order (n, then h, then i),
// written to out[out_off + e] or added to it (accumulate). Only the first S keys have a mask.
kernel void mask_grad(global const REAL *ds, global REAL *out, ulong out_off, ulong count,
                      uint accumulate, ulong tgt_len, ulong n_heads, ulong n_batch,
                      ulong src_len, ulong src_len_padded, ulong mask_sn, ulong mask_sh,
                      ulong mask_si) {
    ulong e = get_global_id(0);
    if (e < count) {
        ulong j = e % src_len, r = e;
        // The element's own (n, h, i) along the dimensions it is not broadcast over; the
        // others run over the whole range.
        ulong n0 = 0, n1 = n_batch, h0 = 0, h1 = n_heads, i0 = 0, i1 = tgt_len;
        if (mask_sn) n0 = r / mask_sn, n1 = n0 + 1, r %= mask_sn;
        if (mask_sh) h0 = r / mask_sh, h1 = h0 + 1, r %= mask_sh;
        if (mask_si) i0 = r / mask_si, i1 = i0 + 1;
        REAL sum = (REAL)0;
        for (ulong n = n0; n < n1; ++n)
            for (ulong h = h0; h < h1; ++h) {
                global const REAL *plane = ds + (n * n_heads + h) * tgt_len * src_len_padded;
                for (ulong i = i0; i < i1; ++i) sum += plane[i * src_len_padded + j];
            }
        out[out_off + e] = accumulate ? out[out_off + e] + sum : sum;
    }
}

// With soft-capping or a user score function (-DSOFTCAP=1, -DUSER_SCORE=1): one work-item per
// score e of row bh * L + i, key j: raw[e] (the scaled score before the variants, s) becomes
// ds[e] times the variants' derivative there (cl/common.cl: soft-capping's 1 - tanh(s/c)^2,
// then clmha_score_mod_grad's at the score it was given), dS through them. A kernel that is
// never launched without one.
kernel void score_backward(global const REAL *ds, global REAL *raw, REAL softcap,
                           global const REAL *alibi_slopes, ulong alibi_off,
                           global const float *mod_p, ulong mod_off, ulong tgt_len,
                           ulong n_heads,
                           ulong src_len, ulong src_len_padded, ulong count) {
    ulong e = get_global_id(0);
    if (e < count) {
        ulong row = e / src_len_padded, j = e % src_len_padded, bh = row / tgt_len;
        ulong i = row % tgt_len, n = bh / n_heads, h = bh - n * n_heads;
        REAL g;
        REAL s = score_mod_grad(raw[e], softcap, ALIBI_SLOPE(h), i, j, j < src_len, &g);
#if USER_SCORE
        if (j < src_len) g *= USER_GRAD_OF(s, n, h, i, j);
#endif
        raw[e] = ds[e] * g;
    }
}
