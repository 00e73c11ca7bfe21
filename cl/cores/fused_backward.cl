// The fused core's backward pass (host side: src/cores/fused_backward.c), FlashAttention-2's
// algorithm: the probabilities are recomputed tile by tile from q, k and the log-sum-exp rows
// the forward kernel saved (cl/cores/fused.cl, lse_on), P = exp(score - lse), and never stored.
// With `split` (N*H*L, the layer's saved rows: lse_on 2) lse holds each row's maximum m from
// row `split` and log(sum) from row 2 * split, and P = exp((score - m) - log(sum)): score - m
// is the forward's own, so that a row whose every key carries a huge finite mask value (-1e30,
// -FLT_MAX; all its scores the same float) gets 1/S where m + log(S) rounds to m and
// exp(score - lse) would give 1. Without (split 0: a caller's log-sum-exp rows) m = lse and
// log(sum) = 0, the same P.
//
// Per batch*head plane, with S' keys (the appended bias_k and zero rows never masked) and
// scale = 1/sqrt(HD):
//   score = scale * q.k + masks, P = exp(score - lse), Pd = P * keep * keep_scale (dropout),
//   dPd = dO.v, dP = dPd * keep * keep_scale, Drow = sum_j P dP = dO.o,
//   dS = P * (dP - Drow), dq = scale * dS k, dk = scale * dS^T q, dv = Pd^T dO.
// Three kernels:
//   - fused_backward_drow: Drow = dO.o per query row (the rowsum(dO * O) identity, which saves
//     a pass over the keys);
//   - fused_backward_dkdv: one work-group per (plane, tile of B key rows), one key row per
//     work-item; it loops over the query tiles (q, dO, lse, Drow staged in local memory) and
//     accumulates its dk and dv rows in private memory, stored once;
//   - fused_backward_dq: one work-group per (plane, tile of B query rows), one query row per
//     work-item; it loops over the key tiles (k, v staged in local memory) and accumulates its dq
//     row in private memory, stored once.
// Two mappings of dkdv and dq, chosen on the host per device class: with -DROWS_PRIVATE=1
// (CPUs) each work-item owns R rows and the other side's tiles of BT rows are staged twice
// (rows and transposed) so that all products run VW rows or dimensions wide in registers (see
// that section); without it (GPUs, and what builds everywhere) one row per work-item, tiles of
// B rows, products summed across the VW lanes.
// Each gradient element is thus a sum in one fixed order by one work-item: the result is the
// same on every run (no atomics).
//
// is_causal and the sliding window (query i sees key j < S only when i - win_left <= j <= i +
// win_right) mask scores; whole tiles they mask are skipped through loop bounds (cl/common.cl):
// dkdv visits only the query tiles holding a row that may see a key of its block when every key
// of the block is a real one (j < S: query_tiles_of), dq only the key tiles some row of its block
// may see, and every tile holding an appended key (key_tiles_of), as the forward does.
//
// Build options: -DHD=<head dim> -DB=<work-group size> -DVW=<vector width: 1, 2, 4, 8 or 16,
// dividing HD (and BT)>, and -DROWS_PRIVATE=<0|1>. Without ROWS_PRIVATE a tile has B rows;
// local memory per work-group: 2 * B * HD + 2 * B floats (dkdv), 2 * B * HD floats (dq);
// private: 4 * HD (dkdv) and 3 * HD (dq) floats per work-item. With ROWS_PRIVATE: -DR=<rows
// per work-item> -DBT=<rows per staged tile>; local memory 4 * BT * HD + 2 * BT floats (dkdv),
// 3 * BT * HD (dq); private R * (4 * HD + 3 * BT) (dkdv), R * (3 * HD + 2 * BT + 2) (dq).
// Needs cl/common.cl in front (mask kinds, mask_value, philox_word0, the VW-lane helpers).
//
// Layouts: q, o, dO, dq (N*H, L, HD); k, v, dk, dv (N*H, S', HD); lse (N*H*L, 3*N*H*L with
// split), drow (N*H*L). Masks as
// the forward kernels take them. No early return and no divergent barrier: work-items past the
// last row compute on a clamped row and store nothing.

#ifndef HD
#define HD 64
#endif
#ifndef B
#define B 32
#endif
#ifndef ROWS_PRIVATE
#define ROWS_PRIVATE 0
#endif
#ifndef R
#define R 2
#endif
#ifndef BT
#define BT 16
#endif
// The inner products and row updates run on VW-wide vectors (VW divides HD): VT, LOADV,
// STOREV, lanes_sum and exp_nonpos (the forward's, so that the recomputed probabilities round
// as the forward's did) come from cl/common.cl. (A CPU driver maps the vectors to its SIMD
// registers; scalar loops over HD it would only vectorise across work-items.)

// Whether dS passes through a score function's derivative: soft-capping's, the user's.
#define GRAD_FACTOR (SOFTCAP || USER_SCORE)
// fused_backward_block's loops over the lanes of a vector that call the user's functions or
// look up masks, unrolled: PoCL 3.1 otherwise ran them as loops through private arrays (a
// training step with ALiBi as a user function took 1.18x the built-in's; unrolled, 1.01x).
#define LANES_UNROLL _Pragma("unroll")

// The additive masks, is_causal and the window of score (bh, i, j), j < src_len; attn_row is
// the start of row i of attn_mask for plane bh (already offset), kpm_row that of the batch item.
inline float masks_of(global const uchar *attn_mask, uint attn_kind, ulong attn_row,
                      global const uchar *kpm, uint kpm_kind, ulong kpm_row, uint causal,
                      long win_left, long win_right, ulong i, ulong j) {
    float x = mask_value(attn_mask, attn_kind, attn_row + j);
    x += mask_value(kpm, kpm_kind, kpm_row + j);
    return (causal && j > i) || !in_window(win_left, win_right, (long)i, (long)j) ? -INFINITY
                                                                                  : x;
}

// Row r's maximum (with split) or log-sum-exp, and the log of its sum (0 without split).
inline float row_max(global const float *lse, ulong split, ulong r) { return lse[split + r]; }
inline float row_log_sum(global const float *lse, ulong split, ulong r) {
    return split ? lse[2 * split + r] : 0.0f;
}

// The probabilities of VW scores s: exp((s - m) - ls), 0 where m = -inf (a fully masked query
// row); m and ls are the row's row_max() and row_log_sum() (per lane where the lanes are rows).
// Those below 1e-30 are taken as 0:
// their products with dO and dP would be subnormal floats, which x86 cores compute some 100x
// slower (the host BLAS's GEMMs on dS and Pd too): ALiBi's far keys gave a training step 1.3x a
// plain one at L 2048. What is dropped is below 1e-30 of a gradient's terms.
inline VT probs_of(VT s, VT m, VT ls) {
    VT p = select(exp_nonpos((s - m) - ls), (VT)(0.0f), m == (VT)(-INFINITY));
    return select(p, (VT)(0.0f), p < 1e-30f);
}

// Drow[r] = dO[r].o[r] for every query row r of every plane (n_rows = N*H*L), summed over the
// head dimension in order.
kernel void fused_backward_drow(global const float *d_o, global const float *o,
                                global float *drow, ulong n_rows) {
    ulong r = get_global_id(0);
    if (r < n_rows) {
        global const float *a = d_o + r * HD;
        global const float *b = o + r * HD;
        float s = 0.0f;
        for (uint d = 0; d < HD; ++d) s = fma(a[d], b[d], s);
        drow[r] = s;
    }
}

#if ROWS_PRIVATE
// ---- rows in private memory (CPU classes) -------------------------------------------------------
// Each work-item owns R rows (row r of work-item lid: first + r * B + lid) and keeps them, and
// their gradient accumulators, in private arrays; a work-group covers B * R rows. The other side
// comes through local memory in tiles of BT rows, both row by row (for the gradient updates,
// VW dimensions at a time) and transposed (for the scores, VW rows of the tile at a time), so
// that every product accumulates in VW-wide registers without summing across lanes, and every
// vector read from local memory serves the R rows. Per tile and row the probabilities,
// dropout and dS are a few vector passes over BT values; the masks add a scalar pass only
// where the row has any on that tile (none without masks, below the causal diagonal, inside the
// window, past S).


// The two products of a tile, for the R private rows a (scaled queries or keys) and b (dO or
// value rows) against the other side's tile, transposed in local memory (at, bt: [d * BT + c]):
// s[r][c] = a[r] . at[., c] and dp[r][c] = b[r] . bt[., c], VW columns at a time, so that each
// vector read from local memory serves the R rows.
inline void tile_products(float a[R][HD], float b[R][HD], local const float *at,
                          local const float *bt, float s[R][BT], float dp[R][BT]) {
    for (uint c = 0; c < BT; c += VW) {
        VT as[R], ap[R];
        for (uint r = 0; r < R; ++r) as[r] = ap[r] = (VT)(0.0f);
        for (uint d = 0; d < HD; ++d) {
            VT av = LOADV(c, at + d * BT), bv = LOADV(c, bt + d * BT);
            for (uint r = 0; r < R; ++r) {
                as[r] = fma((VT)(a[r][d]), av, as[r]);
                ap[r] = fma((VT)(b[r][d]), bv, ap[r]);
            }
        }
        for (uint r = 0; r < R; ++r) {
            STOREV(as[r], c, s[r]);
            STOREV(ap[r], c, dp[r]);
        }
    }
}

// NDRange: (ceil(S' / (B * R)) * B, N*H) in groups of (B, 1).
kernel __attribute__((reqd_work_group_size(B, 1, 1)))
void fused_backward_dkdv(global const float *q, global const float *k, global const float *v,
                         global const float *d_o, global const float *lse, ulong split,
                         global const float *drow, global float *dk, global float *dv,
                         ulong tgt_len, ulong n_heads, ulong src_len, ulong src_len_padded,
                         float scale,
                         MASK_PARAMS) {
    local float qt[HD * BT];   // the query tile, scaled and transposed: qt[d * BT + ii]
    local float dot_t[HD * BT];  // its dO rows, transposed
    local float qs[BT * HD];   // the query tile's rows (unscaled): qs[ii * HD + d]
    local float dos[BT * HD];  // its dO rows
    local float ls[BT];        // their row_max (-inf: no probability, also past the end)
    local float lls[BT];       // their row_log_sum
    local float ds[BT];        // their Drow

    uint lid = get_local_id(0);
    ulong bh = get_group_id(1);
    ulong n = bh / n_heads;
    ulong first = get_group_id(0) * (ulong)(B * R);
    ulong last = min(first + B * R, src_len_padded) - 1;  // the group's last real key
    ulong kpm_row = kpm_off + n * src_len;

    // The work-item's key rows (past the end: the group's last, computed and not stored), their
    // k and v, and the dk and dv accumulators.
    ulong jr[R];
    float kr[R][HD], vr[R][HD], dkr[R][HD], dvr[R][HD];
    for (uint r = 0; r < R; ++r) {
        jr[r] = min(first + r * B + lid, last);
        global const float *kp = k + (bh * src_len_padded + jr[r]) * HD;
        global const float *vp = v + (bh * src_len_padded + jr[r]) * HD;
        for (uint d = 0; d < HD; ++d) {
            kr[r][d] = kp[d];
            vr[r][d] = vp[d];
            dkr[r][d] = 0.0f;
            dvr[r][d] = 0.0f;
        }
    }
    float s[R][BT];   // scores, then probabilities, then dS
    float pd[R][BT];  // the probabilities after dropout
    float dp[R][BT];  // dO.v, then after dropout
#if GRAD_FACTOR
    float sg[R][BT];  // the score functions' derivative (score_mod_grad, clmha_score_mod_grad)
#endif
    float slope = ALIBI_SLOPE(bh - n * n_heads);
    ulong h = bh - n * n_heads;

    // With a group of real keys only, the query tiles whose rows is_causal or the window keep
    // from every key of the group see only masked scores (P = 0): the loop visits the others.
    ulong i_begin, i_end;
    query_tiles_of(first, last, tgt_len, src_len, causal, win_left, win_right, BT, &i_begin,
                   &i_end);
    global const float *qb = q + bh * tgt_len * HD;
    global const float *dob = d_o + bh * tgt_len * HD;
    for (ulong i0 = i_begin; i0 < i_end; i0 += BT) {
        // A tile clmha_mask_mod forbids to the whole group is skipped, uniformly (P = 0).
        if (MOD_BLOCK(bh, i0, BT, first, B * R, tgt_len, src_len_padded) == MOD_BLOCK_NONE)
            continue;
        barrier(CLK_LOCAL_MEM_FENCE);  // the previous tile is no longer read
        uint rows = (uint)min((ulong)BT, tgt_len - i0);  // the tile's real rows
        for (uint t = lid; t < BT * HD; t += B) {
            uint ii = t / HD, d = t % HD;
            bool in = ii < rows;
            float x = in ? qb[i0 * HD + t] : 0.0f, y = in ? dob[i0 * HD + t] : 0.0f;
            qs[t] = x;
            dos[t] = y;
            qt[d * BT + ii] = x * scale;
            dot_t[d * BT + ii] = y;
        }
        for (uint t = lid; t < BT; t += B) {
            bool in = t < rows;
            ls[t] = in ? row_max(lse, split, bh * tgt_len + i0 + t) : -INFINITY;
            lls[t] = in ? row_log_sum(lse, split, bh * tgt_len + i0 + t) : 0.0f;
            ds[t] = in ? drow[bh * tgt_len + i0 + t] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        // Scores and dO.v of the R key rows against the query tile.
        tile_products(kr, vr, qt, dot_t, s, dp);
        for (uint r = 0; r < R; ++r) {
            ulong j = jr[r];
#if SCORE_MODS
            // The score variants (cl/common.cl), VW query rows at a time.
            for (uint c = 0; c < BT; c += VW) {
                VT g, x = LOADV(c, s[r]);
                VT pv = (VT)((float)(i0 + c)) + LANE_INDEX;
                x = score_mod_lanes(x, softcap, slope, pv, (VT)((float)j), (float)src_len, &g);
                STOREV(x, c, s[r]);
#if SOFTCAP
                STOREV(g, c, sg[r]);
#endif
            }
#endif
#if USER_SCORE
            // The user's score function and its derivative (cl/common.cl), real keys only.
            for (uint ii = 0; ii < BT; ++ii) {
                float x = s[r][ii], g = 1.0f;
                ulong i = min(i0 + ii, tgt_len - 1);
                if (j < src_len) {
                    g = USER_GRAD_OF(x, n, h, i, j);
                    s[r][ii] = USER_SCORE_OF(x, n, h, i, j);
                }
                sg[r][ii] = SOFTCAP ? sg[r][ii] * g : g;
            }
#endif
            // Masks: only for a real key (j < S) with masks, with is_causal above the diagonal
            // of some row of the tile, or outside some row's window. Rows past the end keep
            // their score (l = -inf).
            if (j < src_len &&
                (attn_kind || kpm_kind || USER_MASK || (causal && j > i0) ||
                 !in_window_all(win_left, win_right, i0, i0 + rows - 1, j, j))) {
                float kx = mask_value(kpm, kpm_kind, kpm_row + j);
                for (uint ii = 0; ii < rows; ++ii) {
                    ulong i = i0 + ii;
                    ulong ar = ATTN_ROW(bh, n, n_heads, i);
                    float x = s[r][ii] + mask_value(attn_mask, attn_kind, ar + j) + kx;
                    s[r][ii] = (causal && j > i) ||
                                       !in_window(win_left, win_right, (long)i, (long)j) ||
                                       !USER_ALLOWS(n, h, i, j)
                                   ? -INFINITY
                                   : x;
                }
            }
            for (uint c = 0; c < BT; c += VW) {
                VT p = probs_of(LOADV(c, s[r]), LOADV(c, ls), LOADV(c, lls));
                STOREV(p, c, s[r]);
                STOREV(p, c, pd[r]);
            }
            if (dropout_on) {
                for (uint ii = 0; ii < BT; ++ii) {
                    uint w = philox_word0((uint)j, (uint)(i0 + ii), (uint)bh, offset_lo, seed_lo,
                                          seed_hi_xor_off_hi);
                    float f = w >= dropout_threshold ? keep_scale : 0.0f;
                    pd[r][ii] *= f;
                    dp[r][ii] *= f;
                }
            }
            for (uint c = 0; c < BT; c += VW)  // dS = P * (dP - Drow)
                STOREV(LOADV(c, s[r]) * (LOADV(c, dp[r]) - LOADV(c, ds)), c, s[r]);
#if GRAD_FACTOR
            for (uint c = 0; c < BT; c += VW)  // through the soft-capping and user's function
                STOREV(LOADV(c, s[r]) * LOADV(c, sg[r]), c, s[r]);
#endif
        }
        // dv += Pd^T dO, dk += dS^T q over the tile's rows in order, VW dimensions at a time.
        for (uint c = 0; c < HD; c += VW) {
            VT ak[R], av[R];
            for (uint r = 0; r < R; ++r) {
                ak[r] = LOADV(c, dkr[r]);
                av[r] = LOADV(c, dvr[r]);
            }
            for (uint ii = 0; ii < BT; ++ii) {
                VT qv = LOADV(c, qs + ii * HD), ov = LOADV(c, dos + ii * HD);
                for (uint r = 0; r < R; ++r) {
                    ak[r] = fma((VT)(s[r][ii]), qv, ak[r]);
                    av[r] = fma((VT)(pd[r][ii]), ov, av[r]);
                }
            }
            for (uint r = 0; r < R; ++r) {
                STOREV(ak[r], c, dkr[r]);
                STOREV(av[r], c, dvr[r]);
            }
        }
    }
    for (uint r = 0; r < R; ++r) {
        ulong j = first + r * B + lid;
        if (j < src_len_padded) {
            global float *dkp = dk + (bh * src_len_padded + j) * HD;
            global float *dvp = dv + (bh * src_len_padded + j) * HD;
            for (uint d = 0; d < HD; ++d) {
                dkp[d] = dkr[r][d] * scale;
                dvp[d] = dvr[r][d];
            }
        }
    }
}

// NDRange: (ceil(L / (B * R)) * B, N*H) in groups of (B, 1).
kernel __attribute__((reqd_work_group_size(B, 1, 1)))
void fused_backward_dq(global const float *q, global const float *k, global const float *v,
                       global const float *d_o, global const float *lse, ulong split,
                       global const float *drow, global float *dq,
                       ulong tgt_len, ulong n_heads, ulong src_len, ulong src_len_padded,
                       float scale,
                       MASK_PARAMS) {
    local float kt[HD * BT];  // the key tile, transposed: kt[d * BT + jj]
    local float vt[HD * BT];  // the value tile, transposed
    local float ks[BT * HD];  // the key tile's rows: ks[jj * HD + d]

    uint lid = get_local_id(0);
    ulong bh = get_group_id(1);
    ulong n = bh / n_heads;
    ulong first = get_group_id(0) * (ulong)(B * R);
    ulong last = min(first + B * R, tgt_len) - 1;  // the group's last real row
    ulong kpm_row = kpm_off + n * src_len;

    // The work-item's query rows (past the end: the group's last), scaled as the forward
    // scaled them, their dO rows, lse, Drow and attn_mask rows, and the dq accumulators.
    ulong ir[R], attn_row[R];
    float qr[R][HD], dor[R][HD], dqr[R][HD], l[R], ll[R], dr[R];
    for (uint r = 0; r < R; ++r) {
        ir[r] = min(first + r * B + lid, last);
        attn_row[r] = ATTN_ROW(bh, n, n_heads, ir[r]);
        global const float *qp = q + (bh * tgt_len + ir[r]) * HD;
        global const float *dop = d_o + (bh * tgt_len + ir[r]) * HD;
        for (uint d = 0; d < HD; ++d) {
            qr[r][d] = qp[d] * scale;
            dor[r][d] = dop[d];
            dqr[r][d] = 0.0f;
        }
        l[r] = row_max(lse, split, bh * tgt_len + ir[r]);
        ll[r] = row_log_sum(lse, split, bh * tgt_len + ir[r]);
        dr[r] = drow[bh * tgt_len + ir[r]];
    }
    float s[R][BT];   // scores, then probabilities, then dS
    float dp[R][BT];  // dO.v, then after dropout
#if GRAD_FACTOR
    float sg[R][BT];  // the score functions' derivative (score_mod_grad, clmha_score_mod_grad)
#endif
    float slope = ALIBI_SLOPE(bh - n * n_heads);
    ulong h = bh - n * n_heads;

    global const float *kb = k + bh * src_len_padded * HD;
    global const float *vb = v + bh * src_len_padded * HD;
    // The key tiles some row of the group may see: is_causal and the window skip the others
    // (key_tiles_of); the bounds are the same for the whole group, so the barriers stay uniform.
    key_tiles span = key_tiles_of(first, last, src_len, src_len_padded, causal, win_left,
                                  win_right, BT, 0);
    for (ulong j0 = span.begin; j0 < src_len_padded; j0 = key_tile_next(span, j0, BT)) {
        // A tile clmha_mask_mod forbids to the whole group is skipped, uniformly (P = 0).
        if (MOD_BLOCK(bh, first, B * R, j0, BT, tgt_len, src_len_padded) == MOD_BLOCK_NONE)
            continue;
        barrier(CLK_LOCAL_MEM_FENCE);  // the previous tile is no longer read
        uint keys = (uint)min((ulong)BT, src_len_padded - j0);  // the tile's real keys
        for (uint t = lid; t < BT * HD; t += B) {
            uint jj = t / HD, d = t % HD;
            bool in = jj < keys;
            float x = in ? kb[j0 * HD + t] : 0.0f;
            ks[t] = x;
            kt[d * BT + jj] = x;
            vt[d * BT + jj] = in ? vb[j0 * HD + t] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        // Scores and dO.v of the R query rows against the key tile.
        tile_products(qr, dor, kt, vt, s, dp);
        for (uint r = 0; r < R; ++r) {
            ulong i = ir[r];
#if SCORE_MODS
            // The score variants (cl/common.cl), VW keys at a time.
            for (uint c = 0; c < BT; c += VW) {
                VT g, x = LOADV(c, s[r]);
                VT jv = (VT)((float)(j0 + c)) + LANE_INDEX;
                x = score_mod_lanes(x, softcap, slope, (VT)((float)i), jv, (float)src_len, &g);
                STOREV(x, c, s[r]);
#if SOFTCAP
                STOREV(g, c, sg[r]);
#endif
            }
#endif
#if USER_SCORE
            // The user's score function and its derivative (cl/common.cl), real keys only.
            for (uint jj = 0; jj < BT; ++jj) {
                ulong j = j0 + jj;
                float x = s[r][jj], g = 1.0f;
                if (j < src_len) {
                    g = USER_GRAD_OF(x, n, h, i, j);
                    s[r][jj] = USER_SCORE_OF(x, n, h, i, j);
                }
                sg[r][jj] = SOFTCAP ? sg[r][jj] * g : g;
            }
#endif
            // Masks: only where this row has any on the tile (keys past the end, masks, keys
            // above the causal diagonal or outside the row's window, a user mask function).
            bool plain = !(attn_kind || kpm_kind || USER_MASK) && keys == BT &&
                         (!causal || j0 + BT <= i + 1) &&
                         in_window_all(win_left, win_right, i, i, j0, j0 + BT - 1);
            if (!plain) {
                for (uint jj = 0; jj < BT; ++jj) {
                    ulong j = j0 + jj;
                    float x = s[r][jj];
                    if (jj >= keys) {
                        x = -INFINITY;
                    } else if (j < src_len) {
                        x += mask_value(attn_mask, attn_kind, attn_row[r] + j);
                        x += mask_value(kpm, kpm_kind, kpm_row + j);
                        if ((causal && j > i) || !in_window(win_left, win_right, (long)i, (long)j) ||
                            !USER_ALLOWS(n, h, i, j))
                            x = -INFINITY;
                    }
                    s[r][jj] = x;
                }
            }
            for (uint c = 0; c < BT; c += VW)
                STOREV(probs_of(LOADV(c, s[r]), (VT)(l[r]), (VT)(ll[r])), c, s[r]);
            if (dropout_on) {
                for (uint jj = 0; jj < BT; ++jj) {
                    uint w = philox_word0((uint)(j0 + jj), (uint)i, (uint)bh, offset_lo, seed_lo,
                                          seed_hi_xor_off_hi);
                    dp[r][jj] = w >= dropout_threshold ? dp[r][jj] * keep_scale : 0.0f;
                }
            }
            for (uint c = 0; c < BT; c += VW)  // dS = P * (dP - Drow)
                STOREV(LOADV(c, s[r]) * (LOADV(c, dp[r]) - (VT)(dr[r])), c, s[r]);
#if GRAD_FACTOR
            for (uint c = 0; c < BT; c += VW)  // through the soft-capping and user's function
                STOREV(LOADV(c, s[r]) * LOADV(c, sg[r]), c, s[r]);
#endif
        }
        // dq += dS k over the tile's keys in order, VW dimensions at a time.
        for (uint c = 0; c < HD; c += VW) {
            VT a[R];
            for (uint r = 0; r < R; ++r) a[r] = LOADV(c, dqr[r]);
            for (uint jj = 0; jj < BT; ++jj) {
                VT kv = LOADV(c, ks + jj * HD);
                for (uint r = 0; r < R; ++r) a[r] = fma((VT)(s[r][jj]), kv, a[r]);
            }
            for (uint r = 0; r < R; ++r) STOREV(a[r], c, dqr[r]);
        }
    }
    for (uint r = 0; r < R; ++r) {
        ulong i = first + r * B + lid;
        if (i < tgt_len) {
            global float *dqp = dq + (bh * tgt_len + i) * HD;
            for (uint d = 0; d < HD; ++d) dqp[d] = dqr[r][d] * scale;
        }
    }
}

#else
// ---- one row per work-item (GPU classes and other devices) --------------------------------------

// NDRange: (ceil(S' / B) * B, N*H) in groups of (B, 1).
kernel __attribute__((reqd_work_group_size(B, 1, 1)))
void fused_backward_dkdv(global const float *q, global const float *k, global const float *v,
                         global const float *d_o, global const float *lse, ulong split,
                         global const float *drow, global float *dk, global float *dv,
                         ulong tgt_len, ulong n_heads, ulong src_len, ulong src_len_padded,
                         float scale,
                         MASK_PARAMS) {
    local float qs[B * HD];   // the query tile's rows
    local float dos[B * HD];  // the query tile's dO rows
    local float ls[B];        // their row_max (-inf: no probability, also past the end)
    local float lls[B];       // their row_log_sum
    local float ds[B];        // their Drow

    uint lid = get_local_id(0);
    ulong bh = get_group_id(1);
    ulong n = bh / n_heads;
    ulong j0 = get_group_id(0) * B;
    ulong j = j0 + lid;
    ulong jc = min(j, src_len_padded - 1);  // rows past the end compute on the last key
    ulong kpm_row = kpm_off + n * src_len;
    float slope = ALIBI_SLOPE(bh - n * n_heads);
    ulong h = bh - n * n_heads;

    float kr[HD], vr[HD], dkr[HD], dvr[HD];
    global const float *kp = k + (bh * src_len_padded + jc) * HD;
    global const float *vp = v + (bh * src_len_padded + jc) * HD;
    for (uint d = 0; d < HD; ++d) {
        kr[d] = kp[d];
        vr[d] = vp[d];
        dkr[d] = 0.0f;
        dvr[d] = 0.0f;
    }

    // With a tile of real keys only, the query tiles whose rows is_causal or the window keep
    // from every key of the tile see only masked scores (P = 0): the loop visits the others.
    ulong i_begin, i_end;
    query_tiles_of(j0, min(j0 + B, src_len_padded) - 1, tgt_len, src_len, causal, win_left,
                   win_right, B, &i_begin, &i_end);
    global const float *qb = q + bh * tgt_len * HD;
    global const float *dob = d_o + bh * tgt_len * HD;
    for (ulong i0 = i_begin; i0 < i_end; i0 += B) {
        // A tile clmha_mask_mod forbids to the whole group is skipped, uniformly (P = 0).
        if (MOD_BLOCK(bh, i0, B, j0, B, tgt_len, src_len_padded) == MOD_BLOCK_NONE) continue;
        barrier(CLK_LOCAL_MEM_FENCE);  // the previous tile is no longer read
        for (uint t = lid; t < B * HD; t += B) {
            ulong i = i0 + t / HD;
            bool in = i < tgt_len;
            qs[t] = in ? qb[i0 * HD + t] : 0.0f;
            dos[t] = in ? dob[i0 * HD + t] : 0.0f;
        }
        {
            ulong i = i0 + lid;
            bool in = i < tgt_len;
            ls[lid] = in ? row_max(lse, split, bh * tgt_len + i) : -INFINITY;
            lls[lid] = in ? row_log_sum(lse, split, bh * tgt_len + i) : 0.0f;
            ds[lid] = in ? drow[bh * tgt_len + i] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        uint rows = (uint)min((ulong)B, tgt_len - i0);  // the same for the whole group
        for (uint ii = 0; ii < rows; ++ii) {
            ulong i = i0 + ii;
            local const float *qi = qs + ii * HD;
            local const float *doi = dos + ii * HD;
            VT sv = (VT)(0.0f), dv_ = (VT)(0.0f);
            for (uint d = 0; d < HD; d += VW) {
                sv = fma(LOADV(d, qi), LOADV(d, kr), sv);
                dv_ = fma(LOADV(d, doi), LOADV(d, vr), dv_);
            }
            float s = lanes_sum(sv) * scale, dpd = lanes_sum(dv_), g = 1.0f;
#if SCORE_MODS
            s = score_mod_grad(s, softcap, slope, i, jc, jc < src_len, &g);
#endif
            if (jc < src_len) {
#if USER_SCORE
                g *= USER_GRAD_OF(s, n, h, i, jc);  // the user's function (cl/common.cl)
                s = USER_SCORE_OF(s, n, h, i, jc);
#endif
                ulong ar = ATTN_ROW(bh, n, n_heads, i);
                s += masks_of(attn_mask, attn_kind, ar, kpm, kpm_kind, kpm_row, causal, win_left,
                              win_right, i, jc);
                if (!USER_ALLOWS(n, h, i, jc)) s = -INFINITY;
            }
            float l = ls[ii];
            // A fully masked row (m = -inf) has no probabilities: 0, not exp(-inf + inf).
            float p = l == -INFINITY ? 0.0f : exp((s - l) - lls[ii]);
            float pd = p, dp = dpd;
            if (dropout_on) {
                uint w = philox_word0((uint)jc, (uint)i, (uint)bh, offset_lo, seed_lo,
                                      seed_hi_xor_off_hi);
                float f = w >= dropout_threshold ? keep_scale : 0.0f;
                pd = p * f;
                dp = dpd * f;
            }
            float dsv = p * (dp - ds[ii]) * g;
            for (uint d = 0; d < HD; d += VW) {
                STOREV(fma((VT)(pd), LOADV(d, doi), LOADV(d, dvr)), d, dvr);
                STOREV(fma((VT)(dsv), LOADV(d, qi), LOADV(d, dkr)), d, dkr);
            }
        }
    }
    if (j < src_len_padded) {
        global float *dkp = dk + (bh * src_len_padded + j) * HD;
        global float *dvp = dv + (bh * src_len_padded + j) * HD;
        for (uint d = 0; d < HD; ++d) {
            dkp[d] = dkr[d] * scale;
            dvp[d] = dvr[d];
        }
    }
}

// NDRange: (ceil(L / B) * B, N*H) in groups of (B, 1).
kernel __attribute__((reqd_work_group_size(B, 1, 1)))
void fused_backward_dq(global const float *q, global const float *k, global const float *v,
                       global const float *d_o, global const float *lse, ulong split,
                       global const float *drow, global float *dq,
                       ulong tgt_len, ulong n_heads, ulong src_len, ulong src_len_padded,
                       float scale,
                       MASK_PARAMS) {
    local float ks[B * HD];  // the key tile's rows
    local float vs[B * HD];  // the value tile's rows

    uint lid = get_local_id(0);
    ulong bh = get_group_id(1);
    ulong n = bh / n_heads;
    ulong i0 = get_group_id(0) * B;
    ulong last = min(i0 + B, tgt_len) - 1;  // the group's last real row
    ulong i = i0 + lid;
    ulong ic = min(i, last);
    ulong attn_row = ATTN_ROW(bh, n, n_heads, ic);
    ulong kpm_row = kpm_off + n * src_len;
    float slope = ALIBI_SLOPE(bh - n * n_heads);
    ulong h = bh - n * n_heads;

    float qr[HD], dor[HD], dqr[HD];
    global const float *qp = q + (bh * tgt_len + ic) * HD;
    global const float *dop = d_o + (bh * tgt_len + ic) * HD;
    for (uint d = 0; d < HD; ++d) {
        qr[d] = qp[d];
        dor[d] = dop[d];
        dqr[d] = 0.0f;
    }
    float l = row_max(lse, split, bh * tgt_len + ic);
    float ll = row_log_sum(lse, split, bh * tgt_len + ic);
    float drow_i = drow[bh * tgt_len + ic];

    global const float *kb = k + bh * src_len_padded * HD;
    global const float *vb = v + bh * src_len_padded * HD;
    // The key tiles some row of the group may see: is_causal and the window skip the others
    // (key_tiles_of); the bounds are the same for the whole group, so the barriers stay uniform.
    key_tiles span = key_tiles_of(i0, last, src_len, src_len_padded, causal, win_left, win_right,
                                  B, 0);
    for (ulong j0 = span.begin; j0 < src_len_padded; j0 = key_tile_next(span, j0, B)) {
        // A tile clmha_mask_mod forbids to the whole group is skipped, uniformly (P = 0).
        if (MOD_BLOCK(bh, i0, B, j0, B, tgt_len, src_len_padded) == MOD_BLOCK_NONE) continue;
        barrier(CLK_LOCAL_MEM_FENCE);  // the previous tile is no longer read
        for (uint t = lid; t < B * HD; t += B) {
            bool in = j0 + t / HD < src_len_padded;
            ks[t] = in ? kb[j0 * HD + t] : 0.0f;
            vs[t] = in ? vb[j0 * HD + t] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        uint keys = (uint)min((ulong)B, src_len_padded - j0);
        for (uint jj = 0; jj < keys; ++jj) {
            ulong j = j0 + jj;
            local const float *kj = ks + jj * HD;
            local const float *vj = vs + jj * HD;
            VT sv = (VT)(0.0f), dv_ = (VT)(0.0f);
            for (uint d = 0; d < HD; d += VW) {
                sv = fma(LOADV(d, qr), LOADV(d, kj), sv);
                dv_ = fma(LOADV(d, dor), LOADV(d, vj), dv_);
            }
            float s = lanes_sum(sv) * scale, dpd = lanes_sum(dv_), g = 1.0f;
#if SCORE_MODS
            s = score_mod_grad(s, softcap, slope, ic, j, j < src_len, &g);
#endif
            if (j < src_len) {
#if USER_SCORE
                g *= USER_GRAD_OF(s, n, h, ic, j);  // the user's function (cl/common.cl)
                s = USER_SCORE_OF(s, n, h, ic, j);
#endif
                s += masks_of(attn_mask, attn_kind, attn_row, kpm, kpm_kind, kpm_row, causal,
                              win_left, win_right, ic, j);
                if (!USER_ALLOWS(n, h, ic, j)) s = -INFINITY;
            }
            float p = l == -INFINITY ? 0.0f : exp((s - l) - ll);
            float dp = dpd;
            if (dropout_on) {
                uint w = philox_word0((uint)j, (uint)ic, (uint)bh, offset_lo, seed_lo,
                                      seed_hi_xor_off_hi);
                dp = w >= dropout_threshold ? dpd * keep_scale : 0.0f;
            }
            float dsv = p * (dp - drow_i) * g;
            for (uint d = 0; d < HD; d += VW)
                STOREV(fma((VT)(dsv), LOADV(d, kj), LOADV(d, dqr)), d, dqr);
        }
    }
    if (i < tgt_len) {
        global float *dqp = dq + (bh * tgt_len + i) * HD;
        for (uint d = 0; d < HD; ++d) dqp[d] = dqr[d] * scale;
    }
}
#endif

// ---- the products in the host's GEMMs (CPU devices whose GEMMs run in the host BLAS) -----------
// The host cuts the query rows into blocks (rows [row0, row0 + rows) of planes [plane0,
// plane0 + planes)) and, per block, has the GEMMs write, transposed, s = k.q (unscaled) and
// dPd = v.dO of every (key, row) pair into sp and gp: `cols` keys of each plane from key col0
// (keys that is_causal or the window mask for every row of the block may be left out), each a
// row of `rows` floats.
// (Transposed, two of the three GEMMs after this kernel read A as it is stored, which a CPU
// BLAS runs faster.) This kernel turns the pair in place into Pd (for dv += Pd^T dO) and dS
// (for dk += dS^T q and dq = dS k). One work-group per key, its work-items striding over the
// rows (NDRange (WG, planes * cols), WG from the host); the scores, masks, dropout and
// probabilities as in the kernels above (P = exp((scale * s + masks - m) - log(sum)), 0 on a
// fully masked row). With clmha_mask_mod, mod_blocks is the host's block mask of tiles of
// mask_rows rows (a multiple of VW; the block's rows start a tile) by mask_keys keys, of
// keys_padded keys a plane.
kernel void fused_backward_block(global float *sp, global float *gp, global const float *lse,
                                 ulong split, global const float *drow, ulong row0, ulong rows,
                                 ulong plane0, ulong cols, ulong col0, ulong tgt_len, ulong n_heads,
                                 ulong src_len, float scale, ulong mask_rows, ulong mask_keys,
                                 ulong keys_padded, MASK_PARAMS) {
    ulong t = get_global_id(1);
    ulong bh = plane0 + t / cols, j = col0 + t % cols, n = bh / n_heads;
    global const float *drw = drow + bh * tgt_len + row0;
    // The rows' row_max() and row_log_sum() (read only with split; 0 without).
    global const float *lrow = lse + split + bh * tgt_len + row0;
    global const float *llrow = lse + 2 * split + bh * tgt_len + row0;
    // The masks of a real key (j < S): its key_padding_mask value, and whether any row has
    // an attn_mask, is_causal or window entry to look up (the appended keys have none).
    bool real = j < src_len;
    float kx = real ? mask_value(kpm, kpm_kind, kpm_off + n * src_len + j) : 0.0f;
    float slope = ALIBI_SLOPE(bh - n * n_heads);
    ulong h = bh - n * n_heads;
    bool per_row = real && (attn_kind || (causal && j > row0) ||
                            !in_window_all(win_left, win_right, row0, row0 + rows - 1, j, j));
    global float *srow = sp + t * rows, *grow = gp + t * rows;
    // VW rows at a time (what a CPU driver runs in its vector registers), the last ones in a
    // partial vector; attn_mask, is_causal and dropout lane by lane where there are any. Each
    // private array below is written one way (whole vector or lane by lane) and read the
    // other: PoCL 3.1 reloads a vector stored to a private array and then updated lane by lane
    // as it was before the updates (tools/driver-bugs/pocl-private-vector-reload/).
    ulong whole = rows / VW * VW;
    for (ulong u0 = get_local_id(0) * VW; u0 < rows; u0 += get_local_size(0) * VW) {
        uint lanes = u0 < whole ? VW : (uint)(rows - u0);
        VT sv, gv, lv, llv = (VT)(0.0f), dv;
        if (lanes == VW) {
            sv = LOADV(u0, srow);
            gv = LOADV(u0, grow);
            lv = LOADV(u0, lrow);
            if (split) llv = LOADV(u0, llrow);
            dv = LOADV(u0, drw);
        } else {
            float s_in[VW], g_in[VW], l_in[VW], ll_in[VW], d_in[VW];  // written, read as vectors
            for (uint u = 0; u < VW; ++u) {
                bool in = u < lanes;
                s_in[u] = in ? srow[u0 + u] : 0.0f;
                g_in[u] = in ? grow[u0 + u] : 0.0f;
                l_in[u] = in ? lrow[u0 + u] : -INFINITY;
                ll_in[u] = in && split ? llrow[u0 + u] : 0.0f;
                d_in[u] = in ? drw[u0 + u] : 0.0f;
            }
            sv = LOADV(0, s_in);
            gv = LOADV(0, g_in);
            lv = LOADV(0, l_in);
            llv = LOADV(0, ll_in);
            dv = LOADV(0, d_in);
        }
        VT gsc = (VT)(1.0f);  // the score variants' derivative (cl/common.cl)
#if SCORE_MODS || USER_SCORE
#if SCORE_MODS
        VT pv = (VT)((float)(row0 + u0)) + LANE_INDEX;
        sv = score_mod_lanes(sv * scale, softcap, slope, pv, (VT)((float)j), (float)src_len,
                             &gsc);
#else
        sv = sv * scale;
#endif
#if USER_SCORE
        if (real) {  // the user's function and its derivative, lane by lane (cl/common.cl)
            float s_in[VW], g_in[VW], s_out[VW], g_out[VW];  // written one way, read the other
            STOREV(sv, 0, s_in);
            STOREV(gsc, 0, g_in);
            int q0 = (int)(row0 + u0), qmax = (int)(row0 + rows - 1), kj = (int)j;
            LANES_UNROLL
            for (int u = 0; u < VW; ++u) {
                int qi = min(q0 + u, qmax);
                s_out[u] = USER_SCORE_OF(s_in[u], n, h, qi, kj);
                g_out[u] = g_in[u] * USER_GRAD_OF(s_in[u], n, h, qi, kj);
            }
            sv = LOADV(0, s_out);
            gsc = LOADV(0, g_out);
        }
#endif
        sv += kx;
#else
        sv = sv * scale + kx;
#endif
#if USER_MASK
        // clmha_mask_mod: by the block mask's tile of these rows (a whole vector of rows lies in
        // one) and this key; lane by lane, applied as a vector, where it neither allows nor
        // forbids the whole tile.
        uchar blk = real ? MOD_BLOCK(bh, row0 + u0, mask_rows, j / mask_keys * mask_keys,
                                     mask_keys, tgt_len, keys_padded)
                         : MOD_BLOCK_ALL;
        if (blk == MOD_BLOCK_NONE) {
            sv = (VT)(-INFINITY);
        } else if (blk == MOD_BLOCK_SOME) {
            float allowed[VW];  // lanes written, read as a vector
            int q0 = (int)(row0 + u0), qmax = (int)(row0 + rows - 1), kj = (int)j;
            LANES_UNROLL
            for (int u = 0; u < VW; ++u)
                allowed[u] = USER_ALLOWS(n, h, min(q0 + u, qmax), kj) ? 1.0f : 0.0f;
            sv = VT_SELECT((VT)(-INFINITY), sv, LOADV(0, allowed) > (VT)(0.0f));
        }
#endif
        if (per_row) {
            float s_lanes[VW], s_masked[VW];  // a vector read lane by lane; lanes written
            STOREV(sv, 0, s_lanes);
            LANES_UNROLL
            for (uint u = 0; u < VW; ++u) {
                ulong i = row0 + u0 + u;
                float x = s_lanes[u];
                if (u < lanes) {
                    x += mask_value(attn_mask, attn_kind, ATTN_ROW(bh, n, n_heads, i) + j);
                    if ((causal && j > i) || !in_window(win_left, win_right, (long)i, (long)j))
                        x = -INFINITY;
                }
                s_masked[u] = x;
            }
            sv = LOADV(0, s_masked);
        }
        VT p = probs_of(sv, lv, llv);
        VT f = (VT)(1.0f);
        if (dropout_on) {
            float f_lanes[VW];  // lanes written, read as a vector
            for (uint u = 0; u < VW; ++u) {
                uint w = philox_word0((uint)j, (uint)(row0 + u0 + u), (uint)bh, offset_lo,
                                      seed_lo, seed_hi_xor_off_hi);
                f_lanes[u] = w >= dropout_threshold ? keep_scale : 0.0f;
            }
            f = LOADV(0, f_lanes);
        }
        VT pd = p * f, ds = p * (gv * f - dv) * gsc;
        if (lanes == VW) {
            STOREV(pd, u0, srow);
            STOREV(ds, u0, grow);
        } else {
            float pd_out[VW], ds_out[VW];  // vectors read lane by lane
            STOREV(pd, 0, pd_out);
            STOREV(ds, 0, ds_out);
            for (uint u = 0; u < lanes; ++u) {
                srow[u0 + u] = pd_out[u];
                grow[u0 + u] = ds_out[u];
            }
        }
    }
}
