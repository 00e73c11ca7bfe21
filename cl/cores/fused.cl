// The fused attention core's kernel (host side: src/cores/fused.c).
//
// Fused attention core: out = softmax(mask(Q*K^T*scale)) * V for every (batch, head), without
// storing the scores. Online softmax over tiles of keys (FlashAttention's recurrence). Two
// mappings, chosen per device class (-DLANES):
//   - LANES 1 (the lanes mapping, CPU classes that measured it): each work-item owns RPW
//     consecutive query rows as the lanes of VW-wide vectors and computes both products as
//     register-blocked GEMM micro-kernels; no local memory, no barrier. Described at its kernel
//     below.
//   - LANES 0 (the tiled mapping, everything else): described from here on.
// Tiled mapping: each work-item owns RPW query rows, keeps their running maxima, running sums
// and HD-wide accumulators, and the work-group shares each tile of keys and values through
// local memory. With RPW = 2 every key and value read from local memory serves two rows. The
// two products (scores = q*K^T over the tile, acc += p*V) run on VW-wide vectors (floatVW), so
// that their accumulators stay in registers across the inner loop.
//
// Build options: -DHD=<head dim> -DBQ=<work-group size> -DRPW=<query rows per work-item>
//                -DBK=<keys per tile> -DVW=<vector width: 1, 2, 4, 8 or 16, dividing HD and
//                BK> -DQ_LOCAL=<0|1> -DACC_LOCAL=<0|1> -DLANES=<0|1>. A work-group covers
//                BQ*RPW query rows: row r of work-item lid is first + r*BQ + lid (tiled), or
//                first + lid*RPW + r (lanes).
//
// Where the per-row state lives (chosen on the host per device class, src/device/device_class.c,
// and by clmha__fused_tiles_fit(), which keeps the private arrays within the class's budget):
//   - Q_LOCAL 0 (CPUs): the scaled query rows are private, read by each work-item from its own
//     rows (contiguous for one work-item: what a CPU core wants), and the output is stored the
//     same way;
//   - Q_LOCAL 1 (GPUs): the group's query rows are loaded into local memory by adjacent
//     work-items at adjacent addresses (coalesced), and the output goes back through local
//     memory the same way; the scores loop runs dimension by dimension, so a query float is
//     read once per tile and dimension;
//   - ACC_LOCAL 1 (head dims too large for the private budget): the accumulators live in local
//     memory too (each work-item touches only its own rows but in the final store).
// Private floats per work-item: RPW * (BK + HD * (2 - Q_LOCAL - ACC_LOCAL)) (the tile's scores,
// the query rows, the accumulators) plus a few scalars per row. Local memory, in floats:
// HD * KS + BK * HD + (Q_LOCAL + ACC_LOCAL) * BQ * RPW * (HD|1) (clmha__fused_local_floats()),
// KS the key tile's row stride below.
//
// Bank conflicts: local memory is interleaved over 32 (or 64) banks of 4 bytes, and the lanes of
// a warp conflict when they touch different addresses in one bank, i.e. addresses a multiple of
// 32 floats apart. Two access patterns here would do that without padding:
//   - the key tile is stored transposed, kt[d][jj], by adjacent work-items on adjacent d (so
//     that the global reads of a key row coalesce): with a row stride of BK (a power of two, 16
//     or 32 or more) a warp's 32 stores would all fall in one bank; the stride BK|1 is odd, so
//     32 consecutive d hit 32 different banks. (The scores loop reads kt[d][c..] at the same
//     address in every work-item: a broadcast, free either way.) Padded with Q_LOCAL only.
//   - the query rows and accumulators in local memory are read by work-item lid at row
//     r*BQ + lid, dimension d: with a row stride of HD (often a multiple of 32) every lane would
//     hit the same bank; the stride HD|1 is odd.
// The value tile vt[jj][d] needs no padding: it is stored with adjacent work-items on adjacent d
// and read as a broadcast.
// Needs cl/common.cl in front (mask kinds, mask_value, philox_word0, max_nan, and the VW-lane
// helpers: VT, LOADV, STOREV, LANE0, exp_nonpos, lanes_max_nan, lanes_sum).
//
// Layouts: each of q, k, v and out comes with its strides, q_at = (offset, per batch, per head,
// per row) in elements (AT below), so that element d of row t of head h of batch n is
// q[AT(q_at, n, h, t) + d]. The head tiles (the unfused path's layouts: q (N*H, L, HD), k and v
// (N*KVH, S', HD), KVH = H / kv_group key/value heads with grouped-query attention, out
// (N*H, L, HD)) are one case; the projections' rows (N*L or L*N rows of Q, N*S or S*N of K and
// V: one packed projection, or one for the query and one for key and value, or one each; head
// h in columns h*HD.. of its tensor's) and the merged rows the output projection reads are
// another (src/cores/fused.c, clmha__core_call::rows). Key/value head h / kv_group serves head h.
// The rows come without in_proj_bias: with bias_at.s0 set, the kernel adds it, the slices of
// qkv_bias from bias_at.s1 (queries), .s2 (keys) and .s3 (values), head h's at h*HD (key/value
// head h / kv_group's). The tiled mapping adds them as it loads; the lanes mapping, whose key
// and value reads are its inner loops, adds q.bk to each row's scores and bv times the row's
// weight sum to its output. The masks cover the first S keys, the appended keys (add_bias_kv,
// add_zero_attn) are never masked. A query row whose every key is masked gives zeros, as in
// the unfused path. Dropout drops weight (bh, i, j) exactly where masked_softmax does (same
// Philox counter and key).
//
// With lse_on, lse (N*H*L floats) receives each row's log-sum-exp m + log(sum) (-INFINITY on a
// fully masked row). With lse_on 2 (a call that saves for the backward pass,
// cl/cores/fused_backward.cl) lse has 3*N*H*L floats and the next two blocks of N*H*L receive
// each row's maximum m and log(sum) apart: the backward takes P = exp((score - m) - log(sum)),
// exact where m + log(sum) rounds to m (every key masked by a huge finite value, -1e30 or
// -FLT_MAX: all scores equal, P = 1/S, where exp(score - lse) gives 1).
//
// NDRange: (ceil(L / (BQ*RPW)) * BQ, N*H) in groups of (BQ, 1). No early return and no divergent
// barrier: work-items past the last row compute on a clamped row and store nothing.

#ifndef HD
#define HD 64
#endif
#ifndef BQ
#define BQ 32
#endif
#ifndef RPW
#define RPW 1
#endif
#ifndef BK
#define BK 64
#endif
#ifndef Q_LOCAL
#define Q_LOCAL 0
#endif
#ifndef ACC_LOCAL
#define ACC_LOCAL 0
#endif
#ifndef LANES
#define LANES 0
#endif
// Padded row strides (odd: see the bank conflicts above): the key tile's where the query rows
// are local (GPU classes; CPUs have no banks, and their VW-wide reads of kt stay aligned), and
// that of the query rows and accumulators in local memory.
#if Q_LOCAL
#define KS (BK | 1)
#else
#define KS BK
#endif
#define RS (HD | 1)

// Where row t of head h of batch n starts in a tensor with strides @p a (see Layouts above).
#define AT(a, n, h, t) ((a).s0 + (n) * (a).s1 + (h) * (a).s2 + (t) * (a).s3)

// Stores row r's log-sum-exp from its maximum m and sum (see lse_on above); with lse_on 2 also
// m and log(sum) apart, N*H*L (the planes of the NDRange times tgt_len) and twice that further.
inline void lse_store(global REAL *lse, uint lse_on, ulong tgt_len, ulong r, REAL m, REAL sum) {
    bool dead = m == -INFINITY;
    REAL ls = dead ? (REAL)0 : log(sum);
    lse[r] = dead ? -INFINITY : m + ls;
    if (lse_on == 2) {
        ulong rows = get_global_size(1) * tgt_len;
        lse[rows + r] = m;
        lse[2 * rows + r] = ls;
    }
}

#if LANES
// ---- The lanes mapping (CPU classes that measured it: src/device/device_class.c) ---------------
//
// Each work-item owns RPW consecutive query rows and works on them as RV vectors of VW rows:
// vector lane r is row first + r, so a row's running maximum, sum and log-sum-exp are one lane
// of a vector, and nothing is ever summed across lanes. The work-items of a group share
// nothing (no local memory, no barrier): a CPU runs a work-item as one plain loop nest, which
// is what its compiler optimises best. Per tile of BK keys, read straight from global memory
// (the caches hold them; a local copy would only add a copy):
//   - scores, transposed (st[jj][r] = q_r . k_j): a register block of JB keys x RV vectors of
//     rows accumulates over head_dim, one vector load of the transposed query rows (qt[d][r])
//     per RV vectors and one broadcast of k[j][d] per JB keys for JB * RV FMAs: a GEMM
//     micro-kernel whose accumulators stay in registers (JB * RV <= 16 of AVX-512's 32);
//   - masks lane by lane where the tile needs any, then the online softmax, a vector of VW
//     rows at a time (exp_nonpos on whole vectors);
//   - weights.V into the transposed accumulators (ot[d][r]): a register block of DB head
//     dimensions x RV vectors of rows, one vector load of probabilities per RV vectors and
//     one broadcast of v[j][d] per DB dimensions; the rescaling by exp(m_old - m_new) comes
//     with the block's load.
// Private floats per work-item: RV * VW * (2 * HD + BK) (clmha__fused_private_floats()), in
// the core's L1 cache, not in registers.
#define RV ((RPW + VW - 1) / VW)  // vectors of rows
#define RP (RV * VW)              // rows, rounded up to whole vectors
// The register blocks' loops, unrolled so that their accumulators are registers.
#define UNROLL _Pragma("unroll")
// Register blocks: JB keys (scores) and DB head dimensions (weights.V) times RV vectors of rows,
// at most 16 accumulators where the divisors allow.
#define BLOCK_OF(n, cap) \
    ((n) % (cap) == 0 ? (cap) : (n) % 4 == 0 && (cap) >= 4 ? 4 : (n) % 2 == 0 ? 2 : 1)
#define ACC_CAP (RV >= 4 ? 4 : 8)
#ifndef JB
#define JB BLOCK_OF(BK, ACC_CAP)
#endif
#ifndef DB
#define DB BLOCK_OF(HD, ACC_CAP)
#endif

// Transposes the VW x VW block x in registers (x[i] lane j <-> x[j] lane i): the query rows
// come in as rows and the output goes out as rows, while the micro-kernels hold a vector of VW
// rows per head dimension. log2(VW) rounds; round k swaps bit k of the row and lane numbers,
// each new vector a two-input shuffle of the vectors k apart (lane j of the lower one: its own
// lane j where bit k of j is 0, else the upper one's lane j - k; of the upper one: the lower
// one's lane j + k where bit k is 0, else its own). VW*log2(VW) shuffles where element by
// element copies cost PoCL a gather or a scatter per VW/2 elements (~20% of the kernel's time
// at L 128).
#define TR_LO(k, j) (((j) & (k)) ? VW + (j) - (k) : (j))
#define TR_HI(k, j) (((j) & (k)) ? VW + (j) : (j) + (k))
#if VW == 2
#define TR_LANES(f, k) f(k, 0), f(k, 1)
#elif VW == 4
#define TR_LANES(f, k) f(k, 0), f(k, 1), f(k, 2), f(k, 3)
#elif VW == 8
#define TR_LANES(f, k) f(k, 0), f(k, 1), f(k, 2), f(k, 3), f(k, 4), f(k, 5), f(k, 6), f(k, 7)
#elif VW == 16
#define TR_LANES(f, k)                                                                        \
    f(k, 0), f(k, 1), f(k, 2), f(k, 3), f(k, 4), f(k, 5), f(k, 6), f(k, 7), f(k, 8), f(k, 9), \
        f(k, 10), f(k, 11), f(k, 12), f(k, 13), f(k, 14), f(k, 15)
#endif
#define TR_ROUND(x, k)                                                       \
    UNROLL                                                                   \
    for (uint i = 0; i < VW; ++i)                                            \
        if (!(i & (k))) {                                                    \
            VT lo = x[i], hi = x[i + (k)];                                   \
            x[i] = __builtin_shufflevector(lo, hi, TR_LANES(TR_LO, k));      \
            x[i + (k)] = __builtin_shufflevector(lo, hi, TR_LANES(TR_HI, k)); \
        }
inline void transpose_lanes(VT x[VW]) {
#if VW >= 16
    TR_ROUND(x, 8)
#endif
#if VW >= 8
    TR_ROUND(x, 4)
#endif
#if VW >= 4
    TR_ROUND(x, 2)
#endif
#if VW >= 2
    TR_ROUND(x, 1)
#endif
}

kernel __attribute__((reqd_work_group_size(BQ, 1, 1)))
void fused_attention(global const REAL *q, global const REAL *k, global const REAL *v,
                     global REAL *out, ulong4 q_at, ulong4 k_at, ulong4 v_at, ulong4 o_at,
                     global const REAL *qkv_bias, ulong4 bias_at,
                     ulong tgt_len, ulong n_heads, ulong src_len,
                     ulong src_len_padded, REAL scale,
                     MASK_PARAMS,
                     global REAL *lse, uint lse_on, ulong kv_group) {
    ulong bh = get_global_id(1);
    ulong n = bh / n_heads, h = bh - n * n_heads;
    ulong first = get_global_id(0) * RPW;
    if (first >= tgt_len) return;  // no barrier in this mapping
    ulong last = min(first + RPW, tgt_len) - 1;  // the last real row; lanes past it repeat it
    ulong kpm_row = kpm_off + n * src_len;
    ulong srcp = src_len_padded;
    REAL slope = ALIBI_SLOPE(bh - n * n_heads);
#if SCORE_MODS
    VT pv[RV];  // the rows' positions, lane by lane (rows past the last repeat it)
    UNROLL
    for (uint rv = 0; rv < RV; ++rv)
        pv[rv] = min((VT)((REAL)(q_pos + first + rv * VW)) + LANE_INDEX,
                     (VT)((REAL)(q_pos + last)));
#endif

    REAL qt[HD * RP];  // the scaled query rows, transposed: qt[d * RP + r]
    REAL ot[HD * RP];  // the accumulators of p*v, transposed: ot[d * RP + r]
    REAL st[BK * RP];  // the tile's scores, then its probabilities: st[jj * RP + r]
    // With in_proj_bias (bias_at.s0): its slices for this head (else never read).
    global const REAL *bq = qkv_bias + bias_at.s1 + h * HD;
    global const REAL *bk = qkv_bias + bias_at.s2 + h / kv_group * HD;
    global const REAL *bv = qkv_bias + bias_at.s3 + h / kv_group * HD;
    // VW rows by VW dimensions at a time, transposed in registers (transpose_lanes).
    UNROLL
    for (uint rv = 0; rv < RV; ++rv) {
        global const REAL *qp[VW];
        UNROLL
        for (uint i = 0; i < VW; ++i) qp[i] = q + AT(q_at, n, h, min(first + rv * VW + i, last));
        for (uint d0 = 0; d0 < HD; d0 += VW) {
            VT x[VW];
            UNROLL
            for (uint i = 0; i < VW; ++i) x[i] = LOADV(d0, qp[i]);
            if (bias_at.s0) {
                VT b = LOADV(d0, bq);
                UNROLL
                for (uint i = 0; i < VW; ++i) x[i] += b;
            }
            UNROLL
            for (uint i = 0; i < VW; ++i) x[i] *= scale;
            transpose_lanes(x);
            UNROLL
            for (uint j = 0; j < VW; ++j) STOREV(x[j], (d0 + j) * RP + rv * VW, qt);
        }
    }
    for (uint i = 0; i < HD * RP; i += VW) STOREV((VT)(0.0f), i, ot);
    // With in_proj_bias: each row's q.bk, added to every score (q.(k + bk)), and the running
    // sum of its weights after dropout (kept), by which bv is added at the end (the weights
    // times (v + bv)).
    VT qbk[RV], kept[RV];
    UNROLL
    for (uint rv = 0; rv < RV; ++rv) qbk[rv] = (VT)(0.0f), kept[rv] = (VT)(0.0f);
    if (bias_at.s0)
        for (uint d = 0; d < HD; ++d) {
            VT kd = (VT)(bk[d]);
            UNROLL
            for (uint rv = 0; rv < RV; ++rv)
                qbk[rv] = fma(LOADV(d * RP + rv * VW, qt), kd, qbk[rv]);
        }
    // Per row (lane): the running maximum (NaN once a NaN score appears) and the running sum of
    // exp(score - maximum).
    VT m[RV], sum[RV];
    UNROLL
    for (uint rv = 0; rv < RV; ++rv) m[rv] = (VT)(-INFINITY), sum[rv] = (VT)(0.0f);

    // Grouped-query attention: kv_group query heads share key/value head h / kv_group. Row j
    // of the keys at kb + j * kst.
    global const REAL *kb = k + AT(k_at, n, h / kv_group, 0);
    global const REAL *vb = v + AT(v_at, n, h / kv_group, 0);
    ulong kst = k_at.s3, vst = v_at.s3;
    // The key tiles some row may see: is_causal and the window skip the others (cl/common.cl,
    // key_tiles_of).
    key_tiles span = key_tiles_of(q_pos + first, q_pos + last, src_len, srcp, causal, win_left,
                                  win_right, BK, k_pos);
    for (ulong j0 = span.begin; j0 < srcp; j0 = key_tile_next(span, j0, BK)) {
        // The tiles clmha_mask_mod forbids to every row here are skipped (cl/common.cl).
        uchar blk = MOD_BLOCK(bh, first, RPW, j0, BK, tgt_len, srcp);
        if (blk == MOD_BLOCK_NONE) continue;
        for (uint jb = 0; jb < BK; jb += JB) {
            global const REAL *kr[JB];  // past the last key: the last key's row (masked below)
            UNROLL
            for (uint jj = 0; jj < JB; ++jj) kr[jj] = kb + min(j0 + jb + jj, srcp - 1) * kst;
            VT a[JB][RV];
            UNROLL
            for (uint jj = 0; jj < JB; ++jj)
                UNROLL
                for (uint rv = 0; rv < RV; ++rv) a[jj][rv] = (VT)(0.0f);
            for (uint d = 0; d < HD; ++d) {
                VT qv[RV];
                UNROLL
                for (uint rv = 0; rv < RV; ++rv) qv[rv] = LOADV(d * RP + rv * VW, qt);
                UNROLL
                for (uint jj = 0; jj < JB; ++jj) {
                    VT kd = (VT)(kr[jj][d]);
                    UNROLL
                    for (uint rv = 0; rv < RV; ++rv) a[jj][rv] = fma(qv[rv], kd, a[jj][rv]);
                }
            }
            UNROLL
            for (uint jj = 0; jj < JB; ++jj)
                UNROLL
                for (uint rv = 0; rv < RV; ++rv)
                    STOREV(a[jj][rv] + qbk[rv], (jb + jj) * RP + rv * VW, st);
        }
#if SCORE_MODS
        // The score variants (cl/common.cl), a vector of VW rows at a time.
        for (uint jj = 0; jj < BK; ++jj) {
            VT jv = (VT)((REAL)(k_pos + j0 + jj)), g;  // positions (MASK_PARAMS)
            UNROLL
            for (uint rv = 0; rv < RV; ++rv) {
                VT x = LOADV(jj * RP + rv * VW, st);
                x = score_mod_lanes(x, softcap, slope, pv[rv], jv, (REAL)(k_pos + src_len), &g);
                STOREV(x, jj * RP + rv * VW, st);
            }
        }
#endif
#if USER_SCORE
        // The user's score function (cl/common.cl) on the tile's real keys, key by key over
        // the rows (contiguous, positions as int), so that the compiler may vectorise it across
        // them.
        {
            long rest = (long)src_len - (long)j0;  // signed: see key_tiles_of()
            int keys = rest <= 0 ? 0 : rest < BK ? (int)rest : BK;
            int q0 = (int)(q_pos + first), qmax = (int)(q_pos + last);  // positions
            for (int jj = 0; jj < keys; ++jj) {
                int kj = (int)(k_pos + j0) + jj;
                for (int r = 0; r < RP; ++r)
                    st[jj * RP + r] = USER_SCORE_OF(st[jj * RP + r], n, h, min(q0 + r, qmax), kj);
            }
        }
#endif
        // Masks: only where the tile needs any (inside the real keys, no masks, below the
        // causal diagonal of the first row, inside every row's window and allowed to every row
        // by clmha_mask_mod needs none).
        bool user_mask = USER_MASK && blk != MOD_BLOCK_ALL;
        // (Rows and keys at their positions: q_pos + i, k_pos + j, MASK_PARAMS.)
        ulong kp0 = k_pos + j0;
        bool plain = !attn_kind && !kpm_kind && !user_mask && j0 + BK <= srcp &&
                     (!causal || kp0 + BK <= q_pos + first + 1) &&
                     in_window_all(win_left, win_right, q_pos + first, q_pos + last, kp0,
                                   kp0 + BK - 1);
        if (!plain) {
            for (uint r = 0; r < RP; ++r) {
                ulong i = min(first + r, last), qi = q_pos + i;
                ulong ar = ATTN_ROW(bh, n, n_heads, i);
                for (uint jj = 0; jj < BK; ++jj) {
                    ulong j = j0 + jj, kj = kp0 + jj;
                    REAL x = st[jj * RP + r];
                    if (j >= srcp) {
                        x = -INFINITY;
                    } else if (j < src_len) {
                        x += mask_value(attn_mask, attn_kind, ar + j);
                        x += mask_value(kpm, kpm_kind, kpm_row + j);
                        if ((causal && kj > qi) ||
                            !in_window(win_left, win_right, (long)qi, (long)kj) ||
                            (user_mask && !USER_ALLOWS(n, h, qi, kj)))
                            x = -INFINITY;
                    }
                    st[jj * RP + r] = x;
                }
            }
        }
        VT corr[RV];
        UNROLL
        for (uint rv = 0; rv < RV; ++rv) {
            VT mv = (VT)(-INFINITY);
            for (uint jj = 0; jj < BK; ++jj) {
                VT x = LOADV(jj * RP + rv * VW, st);
                mv = VT_SELECT(mv, x, (x > mv) | VT_ISNAN(x));
            }
            VT m_new = VT_SELECT(m[rv], mv, (mv > m[rv]) | VT_ISNAN(mv));  // max_nan, lane by lane
            // While every key so far is masked (m_new = -inf) nothing is accumulated.
            VT base = VT_SELECT(m_new, (VT)(0.0f), m_new == (VT)(-INFINITY));
            corr[rv] = exp_nonpos(m[rv] - base);  // 0 on the first live tile
            VT sv = (VT)(0.0f);
            for (uint jj = 0; jj < BK; ++jj) {
                VT p = exp_nonpos(LOADV(jj * RP + rv * VW, st) - base);
                sv += p;
                STOREV(p, jj * RP + rv * VW, st);
            }
            sum[rv] = fma(sum[rv], corr[rv], sv);
            m[rv] = m_new;
        }
        if (dropout_on) {
            for (uint r = 0; r < RP; ++r) {
                uint i = (uint)min(first + r, last);
                for (uint jj = 0; jj < BK; ++jj) {
                    uint w = philox_word0((uint)(j0 + jj), i, (uint)bh, offset_lo, seed_lo,
                                          seed_hi_xor_off_hi);
                    REAL p = st[jj * RP + r];
                    st[jj * RP + r] = w >= dropout_threshold ? p * keep_scale : 0.0f;
                }
            }
        }
        if (bias_at.s0) {
            UNROLL
            for (uint rv = 0; rv < RV; ++rv) {
                VT ks = (VT)(0.0f);
                for (uint jj = 0; jj < BK; ++jj) ks += LOADV(jj * RP + rv * VW, st);
                kept[rv] = fma(kept[rv], corr[rv], ks);
            }
        }
        // The real keys of the tile only: a key past the end has p = 0, but its clamped value
        // row might hold an infinity.
        uint nk = (uint)min((ulong)BK, srcp - j0);
        for (uint d0 = 0; d0 < HD; d0 += DB) {
            VT o[DB][RV];
            UNROLL
            for (uint dd = 0; dd < DB; ++dd)
                UNROLL
                for (uint rv = 0; rv < RV; ++rv)
                    o[dd][rv] = LOADV((d0 + dd) * RP + rv * VW, ot) * corr[rv];
            global const REAL *vr = vb + j0 * vst + d0;
            for (uint jj = 0; jj < nk; ++jj, vr += vst) {
                VT p[RV];
                UNROLL
                for (uint rv = 0; rv < RV; ++rv) p[rv] = LOADV(jj * RP + rv * VW, st);
                UNROLL
                for (uint dd = 0; dd < DB; ++dd) {
                    VT vd = (VT)(vr[dd]);
                    UNROLL
                    for (uint rv = 0; rv < RV; ++rv) o[dd][rv] = fma(p[rv], vd, o[dd][rv]);
                }
            }
            UNROLL
            for (uint dd = 0; dd < DB; ++dd)
                UNROLL
                for (uint rv = 0; rv < RV; ++rv)
                    STOREV(o[dd][rv], (d0 + dd) * RP + rv * VW, ot);
        }
    }
#if SINKS
    // The sink (cl/common.cl): one more logit in each row's denominator, with a zero value.
    {
        VT sink = (VT)(SINK_OF(bh - n * n_heads));
        UNROLL
        for (uint rv = 0; rv < RV; ++rv) {
            VT m2 = VT_SELECT(m[rv], sink, sink > m[rv]);  // a NaN maximum stays
            // 0 for a row with no key yet; a sink of -inf (partial attention's ranges but the
            // one that holds the sinks: src/forward/partial.c) leaves a row with none as it is.
            VT gone = VT_SELECT((VT)(0.0f), (VT)(1.0f), m2 == (VT)(-INFINITY));
            VT c = VT_SELECT(exp_nonpos(m[rv] - m2), (VT)(1.0f), gone != (VT)(0.0f));
            sum[rv] = fma(sum[rv], c,
                          VT_SELECT(exp_nonpos(sink - m2), (VT)(0.0f), gone != (VT)(0.0f)));
            for (uint d = 0; d < HD; ++d) STOREV(LOADV(d * RP + rv * VW, ot) * c, d * RP + rv * VW, ot);
            kept[rv] *= c;
            m[rv] = m2;
        }
    }
#endif
    // A fully masked row (m = -inf) has sum 0 and gives zeros; NaN propagates. The output rows
    // go out VW dimensions by VW rows at a time, scaled while a vector still holds one
    // dimension of VW rows, then transposed (transpose_lanes).
    UNROLL
    for (uint rv = 0; rv < RV; ++rv) {
        VT inv = VT_SELECT((VT)(1.0f) / sum[rv], (VT)(0.0f), m[rv] == (VT)(-INFINITY));
        for (uint d0 = 0; d0 < HD; d0 += VW) {
            VT x[VW];
            UNROLL
            for (uint j = 0; j < VW; ++j) x[j] = LOADV((d0 + j) * RP + rv * VW, ot);
            if (bias_at.s0) {
                UNROLL
                for (uint j = 0; j < VW; ++j) x[j] = fma((VT)(bv[d0 + j]), kept[rv], x[j]);
            }
            UNROLL
            for (uint j = 0; j < VW; ++j) x[j] *= inv;
            transpose_lanes(x);
            UNROLL
            for (uint i = 0; i < VW; ++i) {
                uint r = rv * VW + i;
                if (r < RPW && first + r < tgt_len)
                    STOREV(x[i], AT(o_at, n, h, first + r) + d0, out);
            }
        }
    }
    // For the backward pass (lse_on): each row's log-sum-exp m + log(sum), taken before
    // dropout.
    if (lse_on) {
        REAL mf[RP], sf[RP];
        UNROLL
        for (uint rv = 0; rv < RV; ++rv) {
            STOREV(m[rv], rv * VW, mf);
            STOREV(sum[rv], rv * VW, sf);
        }
        for (uint r = 0; r < RPW && first + r < tgt_len; ++r)
            lse_store(lse, lse_on, tgt_len, bh * tgt_len + first + r, mf[r], sf[r]);
    }
}

#else  // the tiled mapping: work-items share key tiles through local memory

kernel __attribute__((reqd_work_group_size(BQ, 1, 1)))
void fused_attention(global const REAL *q, global const REAL *k, global const REAL *v,
                     global REAL *out, ulong4 q_at, ulong4 k_at, ulong4 v_at, ulong4 o_at,
                     global const REAL *qkv_bias, ulong4 bias_at,
                     ulong tgt_len, ulong n_heads, ulong src_len,
                     ulong src_len_padded, REAL scale,
                     MASK_PARAMS,
                     global REAL *lse, uint lse_on, ulong kv_group) {
    local REAL kt[HD * KS];  // the tile's keys, transposed: kt[d * KS + jj]
    local REAL vt[BK * HD];  // the tile's values: vt[jj * HD + d]
#if Q_LOCAL
    local REAL qs[BQ * RPW * RS];  // the group's scaled query rows, then its output rows
#endif
#if ACC_LOCAL
    local REAL accl[BQ * RPW * RS];  // the accumulators of the group's rows
#endif

    uint lid = get_local_id(0);
    ulong bh = get_group_id(1);
    ulong n = bh / n_heads, h = bh - n * n_heads;
    ulong first = get_group_id(0) * (BQ * RPW);
    ulong last = min(first + BQ * RPW, tgt_len) - 1;  // the group's last real row
    // Rows past the end compute on a clamped row and store nothing.
    ulong rows[RPW], attn_row[RPW];
    for (uint r = 0; r < RPW; ++r) {
        ulong i = first + r * BQ + lid;
        rows[r] = i < tgt_len ? i : last;
        attn_row[r] = ATTN_ROW(bh, n, n_heads, rows[r]);
    }
    ulong kpm_row = kpm_off + n * src_len;
    REAL slope = ALIBI_SLOPE(bh - n * n_heads);

    // Per row: the scaled query, the accumulator of p*v, the running maximum (NaN once a NaN
    // score appears) and the running sum of exp(score - maximum).
    REAL m[RPW], sum[RPW];
#if Q_LOCAL
    // Adjacent work-items load adjacent floats of the group's rows. (The first key tile's
    // barrier comes before any work-item reads them.)
    for (uint t = lid; t < BQ * RPW * HD; t += BQ) {
        uint rr = t / HD, d = t % HD;
        ulong i = min(first + rr, last);
        REAL x = q[AT(q_at, n, h, i) + d];
        qs[rr * RS + d] = (bias_at.s0 ? x + qkv_bias[bias_at.s1 + h * HD + d] : x) * scale;
    }
#define QROW(r) (qs + ((r) * BQ + lid) * RS)
#else
    REAL qr[RPW][HD];
    for (uint r = 0; r < RPW; ++r) {
        global const REAL *qp = q + AT(q_at, n, h, rows[r]);
        global const REAL *bq = qkv_bias + bias_at.s1 + h * HD;
        for (uint d = 0; d < HD; ++d) qr[r][d] = (bias_at.s0 ? qp[d] + bq[d] : qp[d]) * scale;
    }
#define QROW(r) (qr[r])
#endif
#if ACC_LOCAL
#define ACCROW(r) (accl + ((r) * BQ + lid) * RS)
#else
    REAL acc[RPW][HD];
#define ACCROW(r) (acc[r])
#endif
    for (uint r = 0; r < RPW; ++r) {
        for (uint d = 0; d < HD; ++d) ACCROW(r)[d] = 0.0f;
        m[r] = -INFINITY;
        sum[r] = 0.0f;
    }

    global const REAL *kb = k + AT(k_at, n, h / kv_group, 0);
    global const REAL *vb = v + AT(v_at, n, h / kv_group, 0);
    ulong kst = k_at.s3, vst = v_at.s3;
    global const REAL *bk = qkv_bias + bias_at.s2 + h / kv_group * HD;  // with bias_at.s0
    global const REAL *bv = qkv_bias + bias_at.s3 + h / kv_group * HD;
    // The key tiles some row of the group may see: is_causal and the window skip the others
    // (cl/common.cl, key_tiles_of). The bounds are the same for the whole group, so the barriers
    // stay uniform.
    key_tiles span = key_tiles_of(q_pos + first, q_pos + last, src_len, src_len_padded, causal,
                                  win_left, win_right, BK, k_pos);
    for (ulong j0 = span.begin; j0 < src_len_padded; j0 = key_tile_next(span, j0, BK)) {
        // The tiles clmha_mask_mod forbids to every row of the group are skipped, uniformly
        // (cl/common.cl).
        uchar blk = MOD_BLOCK(bh, first, BQ * RPW, j0, BK, tgt_len, src_len_padded);
        if (blk == MOD_BLOCK_NONE) continue;
        bool user_mask = USER_MASK && blk != MOD_BLOCK_ALL;
        barrier(CLK_LOCAL_MEM_FENCE);  // the previous tile is no longer read
        for (uint t = lid; t < BK * HD; t += BQ) {
            uint jj = t / HD, d = t % HD;
            ulong j = j0 + jj;
            bool in = j < src_len_padded;
            REAL kx = in ? kb[j * kst + d] : 0.0f, vx = in ? vb[j * vst + d] : 0.0f;
            kt[d * KS + jj] = in && bias_at.s0 ? kx + bk[d] : kx;
            vt[jj * HD + d] = in && bias_at.s0 ? vx + bv[d] : vx;
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        REAL s[RPW][BK];  // the tile's scores, then its probabilities
#if Q_LOCAL
        // Dimension by dimension: each query float is read from local memory once per tile,
        // and the BK scores of a row accumulate in registers.
        for (uint r = 0; r < RPW; ++r)
            for (uint jj = 0; jj < BK; ++jj) s[r][jj] = 0.0f;
        for (uint d = 0; d < HD; ++d) {
            REAL qd[RPW];
            for (uint r = 0; r < RPW; ++r) qd[r] = QROW(r)[d];
            for (uint c = 0; c < BK; c += VW) {
                VT kv = LOADV(c, kt + d * KS);
                for (uint r = 0; r < RPW; ++r)
                    STOREV(fma((VT)(qd[r]), kv, LOADV(c, s[r])), c, s[r]);
            }
        }
#else
        for (uint c = 0; c < BK; c += VW) {  // VW keys at a time
            VT acc_s[RPW];
            for (uint r = 0; r < RPW; ++r) acc_s[r] = (VT)(0.0f);
            for (uint d = 0; d < HD; ++d) {
                VT kv = LOADV(c, kt + d * KS);
                for (uint r = 0; r < RPW; ++r) acc_s[r] = fma((VT)(qr[r][d]), kv, acc_s[r]);
            }
            for (uint r = 0; r < RPW; ++r) STOREV(acc_s[r], c, s[r]);
        }
#endif
        for (uint r = 0; r < RPW; ++r) {
            // Masks: only where this row has any (a tile inside the real keys, without masks,
            // below the causal diagonal and inside the row's window needs none).
            // (Rows and keys at their positions: q_pos + i, k_pos + j, MASK_PARAMS.)
            ulong qi = q_pos + rows[r], kp0 = k_pos + j0;
            bool plain = !(SCORE_MODS || USER_SCORE) && !user_mask && !attn_kind && !kpm_kind &&
                         j0 + BK <= src_len_padded && (!causal || kp0 + BK <= qi + 1) &&
                         in_window_all(win_left, win_right, qi, qi, kp0, kp0 + BK - 1);
            if (!plain) {
                for (uint jj = 0; jj < BK; ++jj) {
                    ulong j = j0 + jj, kj = kp0 + jj;
                    REAL x = s[r][jj];
#if SCORE_MODS
                    x = score_mod(x, softcap, slope, qi, kj, j < src_len);
#endif
                    if (j >= src_len_padded) {
                        x = -INFINITY;
                    } else if (j < src_len) {
                        x = USER_SCORE_OF(x, n, h, qi, kj);  // the user's (cl/common.cl)
                        x += mask_value(attn_mask, attn_kind, attn_row[r] + j);
                        x += mask_value(kpm, kpm_kind, kpm_row + j);
                        if ((causal && kj > qi) ||
                            !in_window(win_left, win_right, (long)qi, (long)kj) ||
                            (user_mask && !USER_ALLOWS(n, h, qi, kj)))
                            x = -INFINITY;
                    }
                    s[r][jj] = x;
                }
            }
            VT mv = (VT)(-INFINITY);
            for (uint c = 0; c < BK; c += VW) {
                VT x = LOADV(c, s[r]);
                mv = VT_SELECT(mv, x, (x > mv) | VT_ISNAN(x));
            }
            REAL m_new = lanes_max_nan(mv, m[r]);
            // While every key so far is masked (m_new = -inf) nothing is accumulated.
            bool none = m_new == -INFINITY;
            REAL base = none ? 0.0f : m_new;
            REAL corr = LANE0(exp_nonpos((VT)(m[r] - base)));  // 0 on the first live tile
            sum[r] *= corr;
            for (uint d = 0; d < HD; ++d) ACCROW(r)[d] *= corr;
            VT sv = (VT)(0.0f);
            for (uint c = 0; c < BK; c += VW) {
                VT p = exp_nonpos(LOADV(c, s[r]) - base);
                sv += p;
                STOREV(p, c, s[r]);
            }
            sum[r] += lanes_sum(sv);
            if (dropout_on) {
                for (uint jj = 0; jj < BK; ++jj) {
                    uint w = philox_word0((uint)(j0 + jj), (uint)rows[r], (uint)bh, offset_lo,
                                          seed_lo, seed_hi_xor_off_hi);
                    s[r][jj] = w >= dropout_threshold ? s[r][jj] * keep_scale : 0.0f;
                }
            }
            m[r] = m_new;
        }
        for (uint c = 0; c < HD; c += VW) {  // VW dimensions at a time
            VT a[RPW];
            for (uint r = 0; r < RPW; ++r) a[r] = LOADV(c, ACCROW(r));
            for (uint jj = 0; jj < BK; ++jj) {
                VT vv = LOADV(c, vt + jj * HD);
                for (uint r = 0; r < RPW; ++r) a[r] = fma((VT)(s[r][jj]), vv, a[r]);
            }
            for (uint r = 0; r < RPW; ++r) STOREV(a[r], c, ACCROW(r));
        }
    }
#if SINKS
    // The sink (cl/common.cl): one more logit in each row's denominator, with a zero value.
    {
        REAL sink = SINK_OF(bh - n * n_heads);
        for (uint r = 0; r < RPW; ++r) {
            REAL m2 = max_nan(m[r], sink);
            // 0 for a row with no key; a sink of -inf (partial attention's ranges but the one
            // that holds the sinks: src/forward/partial.c) leaves a row with none as it is.
            bool gone = m2 == -INFINITY;
            REAL c = gone ? 1.0f : LANE0(exp_nonpos((VT)(m[r] - m2)));
            sum[r] = sum[r] * c + (gone ? 0.0f : LANE0(exp_nonpos((VT)(sink - m2))));
            for (uint d = 0; d < HD; ++d) ACCROW(r)[d] *= c;
            m[r] = m2;
        }
    }
#endif
    // A fully masked row (m = -inf) has sum 0 and gives zeros; NaN propagates.
#if Q_LOCAL || ACC_LOCAL
    // Each work-item writes its own output rows into local memory (the accumulators in place,
    // or its own query rows, which only it reads), then the group stores the rows it covers
    // with adjacent work-items on adjacent floats.
#if ACC_LOCAL
#define OUTROW(r) ACCROW(r)
    local REAL *stage = accl;
#else
#define OUTROW(r) QROW(r)
    local REAL *stage = qs;
#endif
    // The query rows' loads must be over before a work-item overwrites its rows: the key loop's
    // barriers see to it, but a group whose every key tile is skipped (a window or clmha_mask_mod
    // forbidding them all, a partial-attention range it sees nothing of) runs no iteration.
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint r = 0; r < RPW; ++r) {
        REAL inv = m[r] == -INFINITY ? 0.0f : 1.0f / sum[r];
        for (uint d = 0; d < HD; ++d) OUTROW(r)[d] = ACCROW(r)[d] * inv;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    uint nrows = (uint)(last - first + 1);
    for (uint t = lid; t < nrows * HD; t += BQ)
        out[AT(o_at, n, h, first + t / HD) + t % HD] = stage[t / HD * RS + t % HD];
#else
    for (uint r = 0; r < RPW; ++r) {
        ulong i = first + r * BQ + lid;
        REAL inv = m[r] == -INFINITY ? 0.0f : 1.0f / sum[r];
        if (i < tgt_len) {
            global REAL *op = out + AT(o_at, n, h, i);
            for (uint d = 0; d < HD; ++d) op[d] = acc[r][d] * inv;
        }
    }
#endif
    // For the backward pass (lse_on): each row's log-sum-exp of its scaled, masked scores,
    // m + log(sum), from which it recomputes the probabilities as exp(score - lse). Dropout
    // leaves the normaliser alone, so the value is taken before it (sum never saw it).
    if (lse_on) {
        for (uint r = 0; r < RPW; ++r) {
            ulong i = first + r * BQ + lid;
            if (i < tgt_len) lse_store(lse, lse_on, tgt_len, bh * tgt_len + i, m[r], sum[r]);
        }
    }
}
#endif  // LANES
