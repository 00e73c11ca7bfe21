// Helpers shared by the attention cores' kernels (cl/cores/*.cl); the
// library builds this file in front of them.
//
// Mask kinds (host enum clmha_mask_kind): 0 none, 1 bool "true = ignore", 2 bool "true = may
// attend", 3 float (added). attn_mask is read through its broadcast strides (in elements, 0
// along a dimension it is broadcast over; clmha__dims::attn_sn, attn_sh, attn_si): the term of
// score (n, h, i, j) is element n*attn_sn + h*attn_sh + i*attn_si + j.

#define MASK_NONE 0
#define MASK_BOOL_IGNORE 1
#define MASK_BOOL_ATTEND 2
#define MASK_FLOAT 3

// The mask and dropout parameters that end the attention kernels' parameter lists, in the order
// the host passes them (CLMHA__MASK_ARGS, src/cores/kernel_args.h). q_pos and k_pos: the
// positions of the call's first query row and key (partial attention, which runs the fused
// forward only; 0 elsewhere): query row i is at q_pos + i and key j at k_pos + j for is_causal,
// the window, ALiBi and the user functions; masks and dropout read the indices.
#define MASK_PARAMS                                                                             \
    global const uchar *attn_mask, ulong attn_off, uint attn_kind, ulong attn_sn,              \
        ulong attn_sh, ulong attn_si,                                                           \
        global const uchar *kpm, ulong kpm_off, uint kpm_kind, uint causal, long win_left,      \
        long win_right, REAL softcap, global const REAL *alibi_slopes, ulong alibi_off,        \
        global const REAL *sinks, ulong sinks_off, global const float *mod_p, ulong mod_off,    \
        global const uchar *mod_blocks, ulong q_pos, ulong k_pos, uint dropout_on,              \
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

// Where row i of attn_mask starts for plane bh = n * n_heads + h (its strides above), offset
// included.
inline ulong attn_row_of(ulong attn_off, ulong attn_sn, ulong attn_sh, ulong attn_si, ulong bh,
                         ulong n, ulong n_heads, ulong i) {
    return attn_off + n * attn_sn + (bh - n * n_heads) * attn_sh + i * attn_si;
}

// attn_row_of() with a kernel's MASK_PARAMS.
#define ATTN_ROW(bh, n, n_heads, i)                                                             \
    attn_row_of(attn_off, attn_sn, attn_sh, attn_si, bh, n, n_heads, i)

// Whether the sliding window (win_left, win_right; -1: that side unbounded, both -1: no window)
// lets the query at position p see key j (a real key, j < S: the appended keys are never
// windowed).
inline bool in_window(long win_left, long win_right, long p, long j) {
    return (win_left < 0 || j >= p - win_left) && (win_right < 0 || j <= p + win_right);
}

// Whether a kernel's MASK_PARAMS have a window.
#define WINDOWED (win_left >= 0 || win_right >= 0)

// Whether the window lets every query at positions [p_first, p_last] see every key in
// [j_first, j_last] (true without a window): the "plain tile" test of the fused kernels.
inline bool in_window_all(long win_left, long win_right, ulong p_first, ulong p_last,
                          ulong j_first, ulong j_last) {
    return in_window(win_left, win_right, (long)p_last, (long)j_first) &&
           in_window(win_left, win_right, (long)p_first, (long)j_last);
}

// ---- Score variants: soft-capping and ALiBi (-DSOFTCAP=1, -DALIBI=1) ---------------------------
//
// A layer's programs are built with the variants it has (clmha__layer_variant_options()), so
// that a plain layer's kernels are what they were. The values come with MASK_PARAMS: softcap c
// (> 0 with SOFTCAP) and the slopes (H, one per query head, at alibi_off). Score s of query
// position p against key j becomes c*tanh(s/c) (every key, the appended ones too), then gains
// -slope*|p - j| (real keys only), before the masks: include/clmha.h, clmha_layer_desc::softcap.
#ifndef SOFTCAP
#define SOFTCAP 0
#endif
#ifndef ALIBI
#define ALIBI 0
#endif
#ifndef SINKS
#define SINKS 0
#endif
// Whether the program modifies scores: then every tile takes the masks' pass.
#define SCORE_MODS (SOFTCAP || ALIBI)

// ---- User functions (-DUSER_SCORE=1, -DUSER_GRAD=1, -DUSER_MASK=1) ----------------------------
//
// A layer's OpenCL C source (clmha_layer_desc::mod_source) comes after this file and before the
// core's (src/context/programs.c), built with the functions its text defines
// (src/layer/mods.c): clmha_score_mod, clmha_score_mod_grad, clmha_mask_mod, each taking the
// batch item, query head, query position and key (real keys only) and p, the layer's
// mod_params (MASK_PARAMS' mod_p at mod_off). The cores call them through these macros, which expand
// where the user's functions are declared. clmha_real is what the user writes for s.
#ifndef USER_SCORE
#define USER_SCORE 0
#endif
#ifndef USER_GRAD
#define USER_GRAD 0
#endif
#ifndef USER_MASK
#define USER_MASK 0
#endif
#define USER_MODS (USER_SCORE || USER_MASK)
typedef REAL clmha_real;
#if USER_SCORE
#define USER_SCORE_OF(s, n, h, p, j) \
    clmha_score_mod((s), (int)(n), (int)(h), (int)(p), (int)(j), mod_p + mod_off)
#else
#define USER_SCORE_OF(s, n, h, p, j) (s)
#endif
#if USER_GRAD
#define USER_GRAD_OF(s, n, h, p, j) \
    clmha_score_mod_grad((s), (int)(n), (int)(h), (int)(p), (int)(j), mod_p + mod_off)
#else
#define USER_GRAD_OF(s, n, h, p, j) ((REAL)1.0f)
#endif
#if USER_MASK
#define USER_ALLOWS(n, h, p, j) \
    (clmha_mask_mod((int)(n), (int)(h), (int)(p), (int)(j), mod_p + mod_off) != 0)
#else
// Every key (a call, not the constant, which compilers warn about in a || of conditions).
inline bool user_allows_all(void) { return true; }
#define USER_ALLOWS(n, h, p, j) user_allows_all()
#endif

// The block mask of clmha_mask_mod (src/cores/block_mask.c): per plane bh and tile of rows
// (first / rows) x keys (j0 / keys), MOD_BLOCK_NONE where the function forbids every key of the
// tile to every row, MOD_BLOCK_ALL where it allows them all, MOD_BLOCK_SOME otherwise (and for
// a tile holding an appended key, which must be visited); the kernels skip the first and need
// no per-key call for the last. Tiles: ceil(L / rows) x ceil(S' / keys) per plane.
#define MOD_BLOCK_NONE 0
#define MOD_BLOCK_SOME 1
#define MOD_BLOCK_ALL 2
#if USER_MASK
#define MOD_BLOCK(bh, first, rows, j0, keys, tgt_len, src_len_padded)                         \
    (mod_blocks[((bh) * (((tgt_len) + (rows) - 1) / (rows)) + (first) / (rows)) *              \
                    (((src_len_padded) + (keys) - 1) / (keys)) + (j0) / (keys)])
#else
#define MOD_BLOCK(bh, first, rows, j0, keys, tgt_len, src_len_padded) MOD_BLOCK_ALL
#endif

// The sink logit of query head h (-INFINITY, no sink, without SINKS), from a kernel's
// MASK_PARAMS: one more term exp(sink - m) in each row's softmax denominator, with a zero value
// (clmha_layer_desc::sinks).
#if SINKS
#define SINK_OF(h) (sinks[sinks_off + (h)])
#else
#define SINK_OF(h) ((REAL)(-INFINITY))
#endif

// The ALiBi slope of query head h (0 without ALIBI), from a kernel's MASK_PARAMS.
#if ALIBI
#define ALIBI_SLOPE(h) (alibi_slopes[alibi_off + (h)])
#else
#define ALIBI_SLOPE(h) ((REAL)0.0f)
#endif

// Score s soft-capped with c (SOFTCAP; else s).
inline REAL softcapped(REAL s, REAL c) {
#if SOFTCAP
    return c * tanh(s / c);
#else
    return s;
#endif
}

// ALiBi's term for query position p and key j with @p slope (0 without ALIBI).
inline REAL alibi_term(REAL slope, ulong p, ulong j) {
#if ALIBI
    return -slope * (REAL)(p > j ? p - j : j - p);
#else
    return 0.0f;
#endif
}

// Score s of query position p against key j (real: j < S) with the variants applied.
inline REAL score_mod(REAL s, REAL c, REAL slope, ulong p, ulong j, bool real) {
    s = softcapped(s, c);
    return real ? s + alibi_term(slope, p, j) : s;
}

// The derivative of the soft-capped score c*tanh(s/c) in s, from its value t: 1 - (t/c)^2.
inline REAL softcap_grad(REAL t, REAL c) {
    REAL u = t / c;
    return 1.0f - u * u;
}

// score_mod(), and in *grad the derivative of the result in s (the backward's factor on dS:
// soft-capping's, 1 without SOFTCAP; ALiBi's term does not depend on s).
inline REAL score_mod_grad(REAL s, REAL c, REAL slope, ulong p, ulong j, bool real,
                           REAL *grad) {
    REAL t = softcapped(s, c);
    *grad = SOFTCAP ? softcap_grad(t, c) : 1.0f;
    return real ? t + alibi_term(slope, p, j) : t;
}

// ---- The tiles a block of rows visits: is_causal and the window as loop bounds -----------------
//
// The fused kernels walk the keys in tiles of `tile` (aligned at 0) for a block of query rows,
// or the query rows in tiles for a block of keys (the backward's dK/dV), and skip the tiles
// whose real keys (j < src_len) is_causal and the window forbid for the whole block, computing
// the bounds instead of testing each tile, so that for a fixed window the work grows linearly in
// the length. A tile that holds an appended key (j >= src_len: add_bias_kv, add_zero_attn,
// never masked) is always visited. (The host passes a window bound that allows every key as -1:
// clmha__masks_of(), so p + bound does not overflow here.)

// The key tiles that query rows at positions [first, last] visit, as a loop:
//   for (ulong j0 = kt.begin; j0 < src_len_padded; j0 = key_tile_next(kt, j0, tile))
// [begin, end) are the tiles of the real keys some row may see (is_causal: j <= last; the
// window: first - win_left <= j <= last + win_right), then the loop jumps to `tail` and walks to
// the end: without a window `tail` is the first tile not all of real keys (the tiles is_causal
// alone skipped are exactly the bounds it always had), with one the first holding an appended
// key.
typedef struct key_tiles {
    ulong begin, end, tail;
} key_tiles;

// (first and last are positions, and key j is at position k_pos + j: partial attention's
// ranges, MASK_PARAMS; 0 elsewhere.)
inline key_tiles key_tiles_of(ulong first, ulong last, ulong src_len, ulong src_len_padded,
                              uint causal, long win_left, long win_right, ulong tile,
                              ulong k_pos) {
    bool windowed = win_left >= 0 || win_right >= 0;
    ulong lo = win_left >= 0 && first > (ulong)win_left ? first - (ulong)win_left : 0;
    ulong hi = src_len + k_pos;  // one past the last real key seen, as a position
    if (causal) hi = min(hi, last + 1);
    if (win_right >= 0) hi = min(hi, last + (ulong)win_right + 1);
    // As key indices, in signed arithmetic: LLVM makes x > y ? x - y : 0 on unsigned values
    // llvm.usub.sat, which Oclgrind 21.10 cannot run (positions are below 2^24).
    long lo_k = (long)lo - (long)k_pos, hi_k = (long)hi - (long)k_pos;
    lo = lo_k > 0 ? (ulong)lo_k : 0;
    hi = hi_k > 0 ? (ulong)hi_k : 0;
    key_tiles kt;
    kt.tail = windowed && src_len_padded == src_len ? src_len_padded : src_len / tile * tile;
    kt.end = min((hi + tile - 1) / tile * tile, (src_len + tile - 1) / tile * tile);
    kt.begin = lo < hi ? lo / tile * tile : kt.tail;
    return kt;
}

// The tile after j0 in the loop of key_tiles_of().
inline ulong key_tile_next(key_tiles kt, ulong j0, ulong tile) {
    ulong next = j0 + tile;
    return next == kt.end && kt.end < kt.tail ? kt.tail : next;
}

// The query tiles [*begin, *end) (tiles of `tile` rows aligned at 0, end at most tgt_len) that
// visit keys [first, last] of one plane: every tile when the block holds an appended key (last
// >= src_len), else from the first row that may see a key of the block (is_causal: i >= first;
// the window: i >= first - win_right) to the last (the window: i <= last + win_left). Without a
// window these are the bounds is_causal always had.
inline void query_tiles_of(ulong first, ulong last, ulong tgt_len, ulong src_len, uint causal,
                           long win_left, long win_right, ulong tile, ulong *begin,
                           ulong *end) {
    ulong lo = 0, hi = tgt_len;  // rows [lo, hi)
    if (last < src_len) {
        if (causal) lo = first;
        if (win_right >= 0 && first > (ulong)win_right) lo = max(lo, first - (ulong)win_right);
        if (win_left >= 0) hi = min(hi, last + (ulong)win_left + 1);
    }
    *begin = lo / tile * tile;
    *end = hi;
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

// ---- Vectors of VW lanes ------------------------------------------------------------------------
//
// The cores that compute on VW-wide vectors (-DVW=1, 2, 4, 8 or 16; 1 when not given) share
// these: the fused forward (cl/cores/fused.cl), its backward (cl/cores/fused_backward.cl) and
// the decode core (cl/cores/decode.cl, which takes VT only).
#ifndef VW
#define VW 1
#endif
// VT: REAL with VW lanes (cl/real.cl); AS_VTI/AS_VT: a float vector's lanes as intVW bits and
// back (for exp_nonpos); LOADV/STOREV: VW reals at element i of a private, local or global
// array (vloadN/vstoreN: element alignment is enough); LANE0: the first lane.
#if VW == 1
#define VT REAL
#define AS_VTI(x) as_int(x)
#define AS_VT(x) as_float(x)
#define LOADV(i, p) ((p)[(i)])
#define STOREV(v, i, p) ((p)[(i)] = (v))
#define LANE0(v) (v)
#else
#define VT_(n) REAL##n
#define VT__(n) VT_(n)
#define VT VT__(VW)
#define AS_VTI_(n) as_int##n
#define AS_VTI__(n) AS_VTI_(n)
#define AS_VTI(x) AS_VTI__(VW)(x)
#define AS_VT_(n) as_float##n
#define AS_VT__(n) AS_VT_(n)
#define AS_VT(x) AS_VT__(VW)(x)
#define VLOAD_(n) vload##n
#define VLOAD__(n) VLOAD_(n)
#define VSTORE_(n) vstore##n
#define VSTORE__(n) VSTORE_(n)
#define LOADV(i, p) VLOAD__(VW)(0, (p) + (i))
#define STOREV(v, i, p) VSTORE__(VW)((v), 0, (p) + (i))
#define LANE0(v) ((v).s0)
#endif

// select() of VT by a condition built from VT comparisons and VT_ISNAN: double lanes need
// long conditions, which scalar double comparisons (int) are not, so scalars use ?: there;
// and isnan of double vectors gives int lanes in PoCL 3.1 (OpenCL C wants long), so the
// double programs test NaN as x != x.
#if REAL_F64
#define VT_ISNAN(x) ((x) != (x))
#if VW == 1
#define VT_SELECT(a, b, c) ((c) ? (b) : (a))
#else
#define VT_SELECT(a, b, c) select((a), (b), (c))
#endif
#else
#define VT_ISNAN(x) isnan(x)
#define VT_SELECT(a, b, c) select((a), (b), (c))
#endif

// exp(x) on VW lanes for x <= 0 (scores minus a running maximum in the forward) and a little
// above (scores minus their row's log-sum-exp in the backward, which rounding may leave
// slightly positive), in plain arithmetic: exp(x) = 2^n * e^r with n = round(x / ln 2),
// |r| <= ln2 / 2 (ln2 split in two for an exact product), e^r by its degree-7 Taylor polynomial
// (Horner; truncation error below 1e-8 relative, under float rounding). The rounding is the
// 1.5 * 2^23 trick: t = x / ln 2 + 1.5 * 2^23 + 127 lies in [2^23, 2^24) for x in [-87, 88],
// where a float's unit is 1, so t holds round(x / ln 2) + 127 in its low mantissa bits, and
// shifting its bits left by 23 gives 2^n (rint was a dozen instructions in PoCL's AVX-512 code,
// the conversion back to an integer two more). -inf and anything below -87 give 0; NaN stays
// NaN. Float64 programs (REAL_F64) take the library's exp, whose double precision the
// polynomial does not have. The one definition, so that the backward's recomputed
// probabilities round as the forward's did (tests/device/test_kernel_helpers.c checks it).
#if REAL_F64
inline VT exp_nonpos(VT x) { return exp(x); }
#else
// The argument reduction and polynomial of exp_nonpos (and tanh_lanes): *t, whose low bits hold
// n + 127 with n = round(x / ln 2) (so AS_VT(AS_VTI(*t) << 23) is 2^n), *r = x - n ln 2, and
// P(r) = 1 + r/2 + ... + r^6/7! returned, with e^r = 1 + r P(r).
inline VT exp_reduced(VT x, VT *t, VT *r) {
    *t = fma(x, (VT)(1.44269504088896341f), (VT)(12583039.0f));  // 1.5 * 2^23 + 127
    VT n = *t - (VT)(12583039.0f);
    *r = fma(n, (VT)(-0.693145751953125f), x);
    *r = fma(n, (VT)(-1.428606765330187045e-06f), *r);
    VT p = (VT)(1.0f / 5040.0f);
    p = fma(p, *r, (VT)(1.0f / 720.0f));
    p = fma(p, *r, (VT)(1.0f / 120.0f));
    p = fma(p, *r, (VT)(1.0f / 24.0f));
    p = fma(p, *r, (VT)(1.0f / 6.0f));
    p = fma(p, *r, (VT)(0.5f));
    return fma(p, *r, (VT)(1.0f));
}

inline VT exp_nonpos(VT x) {
    VT t, r;
    VT p = fma(exp_reduced(x, &t, &r), r, (VT)(1.0f));
    VT y = p * AS_VT(AS_VTI(t) << 23);
    return select(y, (VT)(0.0f), x < -87.0f);
}
#endif

// The largest of the VW lanes of v and m, where NaN wins.
inline REAL lanes_max_nan(VT v, REAL m) {
    REAL lane[VW];
    STOREV(v, 0, lane);
    for (uint i = 0; i < VW; ++i) m = max_nan(m, lane[i]);
    return m;
}

// The sum of the VW lanes of v, in lane order. It starts from -0.0, the identity of addition
// (0.0 + -0.0 is 0.0), so that a single lane comes back as it is and the compiler may drop the
// add.
inline REAL lanes_sum(VT v) {
    REAL lane[VW];
    STOREV(v, 0, lane);
    REAL sum = -0.0f;
    for (uint i = 0; i < VW; ++i) sum += lane[i];
    return sum;
}

// ---- Score variants on VW lanes (the CPU mappings' vector passes) ------------------------------

// tanh on VW lanes. Float programs: tanh|x| = -m / (2 + m), m = expm1(-2|x|), the sign put
// back; expm1(y) for y <= 0 as 2^n (e^r - 1) + (2^n - 1), n = round(y / ln 2), e^r - 1 =
// r (1 + r/2 + ... + r^6/7!) (Horner; no cancellation near 0, so small |x| keep their relative
// precision: 2.5 units of 2^-24 at most, tests/device/test_kernel_helpers.c), y clamped at -60
// (tanh is 1 in float beyond 30), NaN kept. The library's scalar tanh cost PoCL's fused
// forward 6x. Float64 programs take the library's.
#if REAL_F64
inline VT tanh_lanes(VT x) { return tanh(x); }
#else
inline VT tanh_lanes(VT x) {
    VT y = -2.0f * fabs(x);
    y = select(y, (VT)(-60.0f), y < -60.0f);  // not fmax: a NaN must stay NaN
    VT t, r;
    VT q = exp_reduced(y, &t, &r) * r;         // e^r - 1
    VT two_n = AS_VT(AS_VTI(t) << 23);         // 2^n, n in [-87, 0]
    VT m = fma(two_n, q, two_n - 1.0f);        // expm1(y)
    return copysign(-m / (2.0f + m), x);
}
#endif

// The lane numbers 0 ... VW - 1 as a VT: a vector literal (built lane by lane in a private
// array, PoCL kept the array in memory and a training step with ALiBi took 1.3x).
#if VW == 1
#define LANE_INDEX ((VT)(0.0f))
#elif VW == 2
#define LANE_INDEX ((VT)(0.0f, 1.0f))
#elif VW == 4
#define LANE_INDEX ((VT)(0.0f, 1.0f, 2.0f, 3.0f))
#elif VW == 8
#define LANE_INDEX ((VT)(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f))
#else
#define LANE_INDEX \
    ((VT)(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f, 8.0f, 9.0f, 10.0f, 11.0f, 12.0f, \
          13.0f, 14.0f, 15.0f))
#endif

// score_mod() on VW lanes of scores s whose query positions p and keys j are given per lane
// (as REAL: exact below 2^24), ALiBi's term where j < src_len; into *grad the soft-capping's
// derivative (1 without SOFTCAP).
inline VT score_mod_lanes(VT s, REAL c, REAL slope, VT p, VT j, REAL src_len, VT *grad) {
#if SOFTCAP
    REAL inv_c = 1.0f / c;  // loop-invariant where the caller loops
    VT u = tanh_lanes(s * inv_c);
    *grad = 1.0f - u * u;
    s = c * u;
#else
    *grad = (VT)(1.0f);
#endif
#if ALIBI
    VT term = -slope * fabs(p - j);
    s += VT_SELECT((VT)(0.0f), term, j < (VT)(src_len));
#endif
    return s;
}
