// The decode core (src/cores/decode.c): attention of a few new query rows over a KV cache,
// split-K. The cached keys of a (sequence, KV head) are cut into `parts` contiguous ranges;
// decode_partial gives, per query row and range, the weights*V sum and the (max, sum of exp)
// of its scores (a partial softmax); decode_combine merges the ranges of a row exactly (and
// the keys add_bias_kv and add_zero_attn append) into the attention result. So a step with
// one query row per head still spreads over parts x heads work-items.
//
// Layouts: the queries, new keys and values in the projected rows (in_proj_bias not added),
// token t of sequence n in row n*T + t (batch_first) or t*N + n; the result merged rows
// (N*L, E) in the query's row order; the cache in pages of PS positions (a multiple of BKEYS,
// or 8: HALF_PAGES), head by head: KV head kh's rows of page pg are vc (PS, HD) from
// vc + (kh*PAGES + pg)*PS*HD, and kc the same size in blocks of KB transposed keys, so that
// one head's pages taken in order lie one after another (a stream the CPU's prefetchers
// follow); sequence n's position j is in page pages[n*pages_ld + j/PS] (a contiguous cache:
// one page per sequence, page n); lens (N, 2) uint: each sequence's length before and after
// this call, followed by a paged cache's table (pages = lens + 2N; one buffer a call). Query
// head h reads KV head h / G (grouped-query attention: G query heads per KV head; G 1 is
// plain multi-head attention): each work-item of decode_partial
// holds the G query rows of a group and reads every key and value of its range once for all
// of them. Its scores need no sum across vector lanes: a key block's dimension c is one
// BKEYS-lane vector, multiplied by query element c and accumulated, so the lanes of the result
// are the block's scores (docs/design.md, "Incremental decoding", has the measurements).
// is_causal and the sliding window are bottom-right aligned: new query i of a sequence that held
// `old` tokens is at position old + i, and sees cache positions j <= old + i (is_causal) and
// old + i - win_left <= j <= old + i + win_right (a window; -1: that side unbounded). Each
// row's parts cut only the span its window allows, so a step costs what the window's keys cost,
// not the cache's.
// Needs cl/common.cl in front (max_nan, VT); the row pointers are cast to VT (HD % VW == 0 and the
// buffers start at offset 0, so every row is aligned): no vloadN, which Mesa clover cannot
// compile. The element type is REAL (cl/real.cl): a float64 layer's program is built with
// -DCLMHA_F64, and its rows, partial results and a float32 cache (KV_TYPE 0) hold doubles; the
// narrower caches' elements and scales are as a float32 layer's, read into doubles.

#ifndef HD
#define HD 64
#endif
#ifndef G
#define G 1
#endif
#define HV (HD / VW)
// Keys scored before their values are summed: one rescale of the accumulators per block; the
// width of the float16 score vectors and of the cache's key blocks (the host rounds the
// capacity up to a multiple: src/cache/kv_cache.c).
#define BKEYS 16
// Where a row is a few vectors (CPU drivers: HD 64 in 16-float vectors) decode_partial's loops
// over a row's vectors are unrolled, so that the compiler keeps the row accumulators in
// registers (without it PoCL kept them on the stack: a store and a reload per key; unrolled,
// the decode stage took 21% less at S 4096); long rows of scalars (GPUs) stay loops.
#if HV <= 8
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif
// Query heads whose weights*V accumulators are held at once (GB * HV vectors, at most 16: half
// of AVX-512's registers), the largest of 4, 2 and 1 that divides G.
#if HV <= 4 && G % 4 == 0
#define GB 4
#elif HV <= 8 && G % 2 == 0
#define GB 2
#else
#define GB 1
#endif

// Independent sums per query head in a block's scores: enough FMA chains (G * SPLIT, at least
// 8 where G allows) to hide the FMA's latency on a CPU core. The host passes 1 for GPUs.
#ifndef SPLIT
#if G >= 8
#define SPLIT 1
#elif G >= 4
#define SPLIT 2
#else
#define SPLIT 4
#endif
#endif

// The cache's elements (-DKV_TYPE=n, clmha_kv_cache_options::kv_dtype: 0 float32, 1 int8,
// 2 float16, 3 bfloat16, 4 int4; 0 is REAL: doubles in a float64 layer's cache): KST the
// stored type, KROW a row's KST elements (HD; int4: HD / 2 bytes, two dimensions a byte),
// KEYS_N(kt, c, n) the n-lane vector of dimension c of a stored key block as REAL (not int4),
// VAL_AT(vr, c) a value row's VW lanes from dimension c*VW as VT. float16 goes through
// vload_half (core OpenCL 1.2, no cl_khr_fp16), bfloat16 is the upper half of a float's bits.
// The quantised caches keep float scales per (position, KV head) for keys (kscale) and for
// values (vscale): int8 one per row, element x = scale * q,
// q = round(x / scale) in [-127, 127], scale = max |x| of its row / 127; int4 one per group
// of KGS dimensions (NG a row), q in [-7, 7] stored as the nibble q + 8, scale = max |x| of
// its group / 7, and a group's byte k holding dimensions k (low nibble) and k + KGS/2 (high),
// so that one byte vector gives two dimensions' vectors with no shuffle.
#ifndef KV_TYPE
#define KV_TYPE 0
#endif
#define KV_INT8 (KV_TYPE == 1)
#define KV_F16 (KV_TYPE == 2)
#define KV_BF16 (KV_TYPE == 3)
#define KV_INT4 (KV_TYPE == 4)
#define KV_QUANT (KV_INT8 || KV_INT4)
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#if VW == 1
#define VSUF
#else
#define VSUF VW
#endif
// REAL_NAME spells REAL for CAT, TO_REAL(n, x) converts an n-lane vector (n empty: a scalar) to
// REAL's, RMASK16 is a REAL16's shuffle mask and RINT16 its comparisons' result (a double16's
// are ulong16 and long16).
#if REAL_F64
#define REAL_NAME double
#define RMASK16 ulong16
#define RINT16 long16
#else
#define REAL_NAME float
#define RMASK16 uint16
#define RINT16 int16
#endif
#define TO_REAL(n, x) CAT(CAT(convert_, REAL_NAME), n)(x)
#if KV_INT4
#ifndef KGS
#define KGS 32
#endif
#define NG (HD / KGS)
#define KHALF (KGS / 2)
// Bytes of a group scored into separate sums (decode_partial): 2 where SPLIT asks for 4 chains
// and half a group is even.
#if SPLIT >= 4 && KHALF % 2 == 0
#define KSETS 2
#else
#define KSETS 1
#endif
#define KST uchar
#define KROW (HD / 2)
#else
#define NG 1
#define KROW HD
#endif
#if KV_INT8
#define KST char
#define KEYS_N(kt, c, n) TO_REAL(n, ((global const CAT(char, n) *)(kt))[c])
#define VAL_AT(vr, c) TO_REAL(VSUF, ((global const CAT(char, VSUF) *)(vr))[c])
#elif KV_F16
#define KST half
#define KEYS_N(kt, c, n) TO_REAL(n, CAT(vload_half, n)(c, kt))
#define VAL_AT(vr, c) TO_REAL(VSUF, CAT(vload_half, VSUF)(c, vr))
#elif KV_BF16
#define KST ushort
#define KEYS_N(kt, c, n)                                                                       \
    TO_REAL(n, CAT(as_float, n)(CAT(convert_uint, n)(((global const CAT(ushort, n) *)(kt))[c]) \
                                << 16))
#if VW == 1
#define VAL_AT(vr, c) ((REAL)as_float((uint)(vr)[c] << 16))
#else
#define VAL_AT(vr, c)                                                                          \
    TO_REAL(VW, CAT(as_float, VW)(CAT(convert_uint, VW)(((global const CAT(ushort, VW) *)(vr))[c]) \
                                  << 16))
#endif
#elif KV_INT4
// Dimensions c*VW ... of a value row (VW divides KHALF: the host narrows VW for int4), q + 8.
#define VAL_AT(vr, c)                                                                          \
    (((c) * VW) % KGS < KHALF                                                                  \
         ? TO_REAL(VSUF, VB4(vr, c) & (uchar)15)                                               \
         : TO_REAL(VSUF, VB4(vr, c) >> (uchar)4))
#define VB4(vr, c)                                                                             \
    ((global const CAT(uchar, VSUF) *)((vr) + ((c) * VW) / KGS * KHALF + ((c) * VW) % KHALF))[0]
#else
#define KST REAL
#define KEYS_N(kt, c, n) ((global const CAT(REAL, n) *)(kt))[c]
#define VAL_AT(vr, c) ((global const VT *)(vr))[c]
#endif

// Pages of 8 positions (-DHALF_PAGES=1: a paged cache's page_size 8): the keys are stored in
// transposed blocks of KB = 8 positions, and a key block of BKEYS = 16 that decode_partial
// scores is two of them, from two pages (ka, kb: their first positions' places). Otherwise KB
// is BKEYS and kb is ka. KEYS_AT: dimension c's 16 lanes as REAL (not int4); KBYTES_AT: an
// int4 block's byte vector i; KSCALES_AT: a quantised block's 16 key scales of group g (floats).
#if HALF_PAGES
// The halves joined by shuffle2 rather than a (float16)(a, b) literal, on which Oclgrind
// 21.10's uninitialised-value check (kernels built with -cl-opt-disable) crashes.
#define KB 8
#define JOIN8 ((uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))
#define JOIN8R ((RMASK16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))
#define KEYS_AT(ka, kb, c) shuffle2(KEYS_N(ka, c, 8), KEYS_N(kb, c, 8), JOIN8R)
#define KBYTES_AT(ka, kb, i)                                                                   \
    shuffle2(((global const uchar8 *)(ka))[i], ((global const uchar8 *)(kb))[i],               \
             convert_uchar16(JOIN8))
#define KSCALES_AT(sa, sb)                                                                     \
    shuffle2(*(global const float8 *)(sa), *(global const float8 *)(sb), JOIN8)
#else
#define KB BKEYS
#define KEYS_AT(ka, kb, c) KEYS_N(ka, c, 16)
#define KBYTES_AT(ka, kb, i) (((global const uchar16 *)(ka))[i])
#define KSCALES_AT(sa, sb) (*(global const float16 *)(sa))
#endif

// The sum of a row vector's VW lanes, as a tree (VT: cl/common.cl).
#if VW == 1
inline REAL hsum(REAL v) { return v; }
#elif VW == 2
inline REAL hsum(REAL2 v) { return v.x + v.y; }
#elif VW == 4
inline REAL hsum(REAL4 v) { return (v.x + v.y) + (v.z + v.w); }
#elif VW == 8
inline REAL hsum(REAL8 v) {
    REAL4 a = v.lo + v.hi;
    return (a.x + a.y) + (a.z + a.w);
}
#elif VW == 16
inline REAL hsum(REAL16 v) {
    REAL8 b = v.lo + v.hi;
    REAL4 a = b.lo + b.hi;
    return (a.x + a.y) + (a.z + a.w);
}
#endif

// The max and the sum of a key block's 16 lanes (BKEYS lanes, not VW: cl/common.cl's lanes_sum
// sums VW lanes in order), by butterfly shuffles of the whole vector (every lane ends with the
// result): no lane-by-lane extracts, and no halves (.lo, .hi, .even, .odd), which Oclgrind
// 21.10's uninitialised-value check (kernels built with -cl-opt-disable) takes for
// uninitialised. The max is a compare and a select (GREATER; fmax's NaN rules cost x86 two
// more instructions a step): a NaN lane may or may not win, and either way NaN reaches the
// block's probabilities (exp(NaN - mb) or exp(score - NaN)), so the row's result is NaN.
#define BUTTERFLY(op, v)                                                                       \
    v = op(v, shuffle(v, (RMASK16)(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)));     \
    v = op(v, shuffle(v, (RMASK16)(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)));     \
    v = op(v, shuffle(v, (RMASK16)(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)));     \
    v = op(v, shuffle(v, (RMASK16)(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)))
#define ADD(a, b) ((a) + (b))
#define GREATER(a, b) select(a, b, isgreater(b, a))
inline REAL block_max(REAL16 v) {
    BUTTERFLY(GREATER, v);
    return v.s0;
}
inline REAL block_sum(REAL16 v) {
    BUTTERFLY(ADD, v);
    return v.s0;
}

// Zeros the cache's keys before its first use: decode_partial reads a key block whole, the
// positions past a sequence's length too (their scores dropped), which must hold numbers.
// count: 32-bit words (every kind of cache's key buffer and scales are a multiple of them).
kernel void decode_zero(global uint *kc, ulong count) {
    ulong gid = get_global_id(0);
    if (gid < count) kc[gid] = 0;
}

// Where position j of key/value head kh of sequence n starts in the cache (floats / HD): its
// page's block of that head's rows, the position within the page. pshift: log2 of a paged
// cache's page size (a power of two: a shift and a mask, no division, whose 64-bit form cost
// about what a key block's scores cost); 0 for a contiguous cache, whose page is the sequence's
// own (page n, psize its capacity rounded up to BKEYS). num_pages: the cache's pages.
inline ulong cache_at(global const uint *pages, ulong pages_ld, uint pshift, ulong psize,
                      ulong num_pages, ulong n, ulong kh, ulong j) {
    if (!pshift) return (kh * num_pages + n) * psize + j;
    ulong pg = pages[n * pages_ld + (j >> pshift)];
    return ((kh * num_pages + pg) << pshift) + (j & (psize - 1));
}

// Copies the first new - old of each sequence's S new keys and values, in_proj_bias added, from
// the projected rows to positions old, old+1, ... of the cache. One work-item per new row of a
// key/value head (N*KVH*S of them). proj holds the rows as the input projection wrote them:
// token t of sequence n is row n*S + t (batch_first) or t*N + n, key head kh's HD columns start
// at k_at + row * k_ld + kh*HD (values: v_at, v_ld); bias (has_bias) is in_proj_bias, whose key
// part starts at kb_at and value part at vb_at. Values are stored row by row; keys in blocks
// of KB positions, transposed: the block of a (page, KV head) that holds position j holds
// dimension c of its keys at kc[(b0 * HD + c) * KB + j % KB], b0 the block's first
// position's cache_at(), so that decode_partial scores a block's keys as one BKEYS-lane vector
// (of two blocks of 8 with pages of 8) with no sum across lanes (a page's positions are a
// multiple of KB: no block straddles two pages).
// Element c of row x (HD floats), b added when not NULL.
#define ROW_AT(x, b, c) ((b) ? (x)[c] + (b)[c] : (x)[c])
#if KV_INT8
// Row @p x (@p b added) quantised to int8 at @p d (a stride of @p stride elements), its scale
// written to @p s (0 for a row of zeros).
inline void store_row(global const REAL *x, global const REAL *b, global char *d,
                      uint stride, global float *s, uint sstride) {
    REAL amax = 0.0f;
    for (uint c = 0; c < HD; ++c) amax = fmax(amax, fabs(ROW_AT(x, b, c)));
    REAL inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (uint c = 0; c < HD; ++c) d[c * stride] = convert_char_sat_rte(ROW_AT(x, b, c) * inv);
    *s = (float)(amax / 127.0f);
}
#elif KV_INT4
// Row @p x (@p b added) quantised to int4 group by group: group g's byte k (at d + (g*KHALF +
// k) * stride) holds dimension g*KGS + k in its low nibble and g*KGS + k + KHALF in its high
// one, each q + 8; the group's scale at s + g * sstride.
inline void store_row(global const REAL *x, global const REAL *b, global uchar *d,
                      uint stride, global float *s, uint sstride) {
    for (uint g = 0; g < NG; ++g) {
        uint c0 = g * KGS;
        REAL amax = 0.0f;
        for (uint c = 0; c < KGS; ++c) amax = fmax(amax, fabs(ROW_AT(x, b, c0 + c)));
        REAL inv = amax > 0.0f ? 7.0f / amax : 0.0f;
        for (uint k = 0; k < KHALF; ++k) {
            int lo = clamp(convert_int_sat_rte(ROW_AT(x, b, c0 + k) * inv), -7, 7) + 8;
            int hi = clamp(convert_int_sat_rte(ROW_AT(x, b, c0 + k + KHALF) * inv), -7, 7) + 8;
            d[(g * KHALF + k) * stride] = (uchar)(lo | (hi << 4));
        }
        s[g * sstride] = (float)(amax / 7.0f);
    }
}
#else
// Row @p x (@p b added) rounded to the cache's element type (to nearest even) at @p d, a
// stride of @p stride elements. A double goes to bfloat16 through a float rounded to odd
// (towards zero, the last bit set where that was inexact), which keeps the rounding single.
inline void store_row(global const REAL *x, global const REAL *b, global KST *d,
                      uint stride, global float *s, uint sstride) {
    for (uint c = 0; c < HD; ++c) {
        REAL v = ROW_AT(x, b, c);
#if KV_F16
        vstore_half_rte(v, c * stride, d);
#elif KV_BF16
#if REAL_F64
        float f = convert_float_rtz(v);
        uint u = as_uint(f) | (uint)((double)f != v && v == v);
#else
        uint u = as_uint(v);  // as cl/convert.cl's f32_to_bf16: a NaN stays a quiet NaN
#endif
        d[c * stride] = (u & 0x7fffffffu) > 0x7f800000u
                            ? (ushort)((u >> 16) | 0x40u)
                            : (ushort)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#else
        d[c * stride] = v;
#endif
    }
}
#endif

kernel void decode_append(global const REAL *proj, ulong k_at, ulong k_ld, ulong v_at,
                          ulong v_ld, global const REAL *bias, uint has_bias, ulong kb_at,
                          ulong vb_at, global KST *kc, global KST *vc, global float *kscale,
                          global float *vscale,
                          global const uint *lens, ulong pages_ld, uint pshift, ulong psize,
                          ulong num_pages, ulong n_batch, uint batch_first, ulong src_len,
                          ulong kv_heads, ulong rows) {
    ulong gid = get_global_id(0);
    if (gid >= rows) return;
    global const uint *pages = lens + 2 * n_batch;
    ulong t = gid % src_len, bkv = gid / src_len, n = bkv / kv_heads, kh = bkv % kv_heads;
    uint old = lens[2 * n], now = lens[2 * n + 1];
    if (t >= (ulong)(now - old)) return;
    ulong pos = old + t, row = token_row(n, t, n_batch, src_len, batch_first);
    ulong at = cache_at(pages, pages_ld, pshift, psize, num_pages, n, kh, pos);
    ulong b0 = at - pos % KB;  // the key block's first position
    global const REAL *ks = proj + k_at + row * k_ld + kh * HD;
    global const REAL *vs = proj + v_at + row * v_ld + kh * HD;
    global const REAL *kb = has_bias ? bias + kb_at + kh * HD : 0;
    global const REAL *vb = has_bias ? bias + vb_at + kh * HD : 0;
    // Keys: the block's scales lane by lane, group after group (kscale + b0*NG + g*KB + u, KB
    // floats per group); values: the row's NG scales together (vscale + at*NG).
    store_row(ks, kb, kc + b0 * KROW + pos % KB, KB, kscale + b0 * NG + pos % KB, KB);
    store_row(vs, vb, vc + at * KROW, 1, vscale + at * NG, 1);
}

// One work-item per (sequence n, KV head, query row i, part p), in that order, p fastest:
// the partial softmax of the G query heads of the group over part p of the keys that row i
// sees. Writes, per query head row ((n*H + h)*L + i) and part, the unnormalised weights*V sum
// (part_acc, HD elements) and the scores' max and sum of exp(score - max) (part_ms, 2);
// an empty part gives max -INFINITY, sum 0 and zeros. The keys row i sees are start ... end - 1
// (is_causal and the window, bottom-right aligned); the parts cut them from the key block that
// holds `start` (parts start on key blocks of BKEYS keys), and the first block's keys before
// `start` are masked.
kernel void decode_partial(global const REAL *proj, ulong q_at, ulong q_ld,
                           global const REAL *bias, uint has_bias, ulong n_batch,
                           uint batch_first, global const KST *kc, global const KST *vc,
                           global const float *kscale, global const float *vscale,
                           global const uint *lens, ulong pages_ld, uint pshift, ulong psize,
                           ulong num_pages, ulong tgt_len, ulong n_heads,
                           ulong kv_heads, uint parts, uint causal, long win_left,
                           long win_right, REAL scale, REAL softcap,
                           global const REAL *alibi_slopes, ulong alibi_off,
                           global const float *mod_p, ulong mod_off, global REAL *part_acc,
                           global REAL *part_ms, ulong items) {
    ulong gid = get_global_id(0);
    if (gid >= items) return;
    global const uint *pages = lens + 2 * n_batch;  // a paged cache's table
    uint p = (uint)(gid % parts);
    ulong r = gid / parts, i = r % tgt_len, bkv = r / tgt_len, n = bkv / kv_heads;
    ulong kvh = bkv - n * kv_heads;
    ulong old = lens[2 * n], now = lens[2 * n + 1], pos = old + i;  // the query's position
    ulong end = causal ? min(now, pos + 1) : now;
    if (win_right >= 0) end = min(end, pos + (ulong)win_right + 1);
    ulong start = win_left >= 0 && pos > (ulong)win_left ? pos - (ulong)win_left : 0;
    // The parts' first key: the block of `start`; none (end) when the row sees no key, so that
    // no part holds a block whose keys are all masked.
    ulong first = start < end ? start / BKEYS * BKEYS : end;
    ulong chunk = ((end - first + parts - 1) / parts + BKEYS - 1) / BKEYS * BKEYS;
    ulong j0 = min(end, first + p * chunk), j1 = min(end, j0 + chunk);

    // The group's scaled query rows, as scalars (each multiplies a block's dimension vector),
    // and its accumulators.
    REAL qs[G][HD];
    VT acc[G][HV];
    REAL m[G];
    REAL16 sv[G];
    ulong qrow = q_at + token_row(n, i, n_batch, tgt_len, batch_first) * q_ld;
    for (uint g = 0; g < G; ++g) {
        ulong h = kvh * G + g;
        global const REAL *qr = proj + qrow + h * HD, *qb = bias + h * HD;
        if (has_bias)
            for (uint c = 0; c < HD; ++c) qs[g][c] = (qr[c] + qb[c]) * scale;
        else
            for (uint c = 0; c < HD; ++c) qs[g][c] = qr[c] * scale;
        UNROLL
        for (uint c = 0; c < HV; ++c) acc[g][c] = (VT)(0.0f);
        m[g] = -INFINITY;
        sv[g] = (REAL16)(0.0f);
    }
#if KV_INT4
    // Each group's sum of the scaled query: a group's scores are sum q*(nibble - 8) =
    // sum q*nibble - 8*qsum, so the nibbles need no offset subtracted one by one.
    REAL qsum[G][NG];
    for (uint g = 0; g < G; ++g)
        for (uint k = 0; k < NG; ++k) {
            REAL t = 0.0f;
            for (uint c = 0; c < KGS; ++c) t += qs[g][k * KGS + c];
            qsum[g][k] = 8.0f * t;
        }
#endif
    for (ulong jb = j0; jb < j1; jb += BKEYS) {
        // The block's place in its page: its keys' vectors from kc + at*KROW, key jb + u's
        // value row at vc + (at + u)*KROW. Pages of 8: its second half's place is at2 (the
        // first half's where the sequence does not reach it: those lanes are masked, and its
        // page-table entry may be no page of the sequence's).
        ulong at = cache_at(pages, pages_ld, pshift, psize, num_pages, n, kvh, jb);
#if HALF_PAGES
        ulong at2 = jb + KB < now ? cache_at(pages, pages_ld, pshift, psize, num_pages, n, kvh,
                                             jb + KB)
                                  : at;
#else
        ulong at2 = at;
#endif
        // Lanes skip ... cnt - 1 of the block are keys the row sees (skip > 0 only in the
        // block of `start`, which part 0 begins with and holds a key of: skip < cnt).
        uint cnt = (uint)min((ulong)BKEYS, j1 - jb), skip = jb < start ? (uint)(start - jb) : 0;
        // The block's scores for the whole group: lane u is key jb + u; each dimension's
        // vector of the block's keys is read once for the G query heads. The dimensions go
        // round SPLIT sets of sums, so that G * SPLIT independent FMA chains hide the FMA's
        // latency (one chain per head made a head's 64 FMAs wait on each other).
        global const KST *kt = kc + at * KROW, *kt2 = kc + at2 * KROW;
        REAL16 sc[G];
#if KV_INT4
        // Group by group: the nibbles' dot products (a byte vector gives dimensions k and
        // k + KHALF of the group), less the offset, times the keys' scales of the group.
        _Pragma("unroll")
        for (uint g = 0; g < G; ++g) sc[g] = (REAL16)(0.0f);
        // The low and the high nibbles' products go to separate sums, and (SPLIT 4: G under 4)
        // even and odd bytes too: 2 or 4 independent FMA chains per head (one chain made each
        // product wait on the one before).
        for (uint gr = 0; gr < NG; ++gr) {
            REAL16 sp[KSETS][2][G];
            _Pragma("unroll")
            for (uint t = 0; t < KSETS; ++t) {
                _Pragma("unroll")
                for (uint g = 0; g < G; ++g) sp[t][0][g] = sp[t][1][g] = (REAL16)(0.0f);
            }
            uint c0 = gr * KGS;
            _Pragma("unroll 2")
            for (uint k = 0; k < KHALF; k += KSETS) {
                _Pragma("unroll")
                for (uint t = 0; t < KSETS; ++t) {
                    uchar16 by = KBYTES_AT(kt, kt2, gr * KHALF + k + t);
                    REAL16 lo = TO_REAL(16, by & (uchar16)(15));
                    REAL16 hi = TO_REAL(16, by >> 4);
                    _Pragma("unroll")
                    for (uint g = 0; g < G; ++g) {
                        sp[t][0][g] = fma((REAL16)(qs[g][c0 + k + t]), lo, sp[t][0][g]);
                        sp[t][1][g] = fma((REAL16)(qs[g][c0 + k + t + KHALF]), hi, sp[t][1][g]);
                    }
                }
            }
            REAL16 ksc =
                TO_REAL(16, KSCALES_AT(kscale + at * NG + gr * KB, kscale + at2 * NG + gr * KB));
            _Pragma("unroll")
            for (uint g = 0; g < G; ++g) {
                REAL16 x = sp[0][0][g] + sp[0][1][g];
                _Pragma("unroll")
                for (uint t = 1; t < KSETS; ++t) x += sp[t][0][g] + sp[t][1][g];
                sc[g] = fma(x - (REAL16)(qsum[g][gr]), ksc, sc[g]);
            }
        }
#else
        REAL16 sp[SPLIT][G];
        _Pragma("unroll")
        for (uint t = 0; t < SPLIT; ++t) {
            _Pragma("unroll")
            for (uint g = 0; g < G; ++g) sp[t][g] = (REAL16)(0.0f);
        }
        uint c = 0;
        _Pragma("unroll 2")
        for (; c + SPLIT <= HD; c += SPLIT) {
            _Pragma("unroll")
            for (uint t = 0; t < SPLIT; ++t) {
                REAL16 kv = KEYS_AT(kt, kt2, c + t);
                _Pragma("unroll")
                for (uint g = 0; g < G; ++g)
                    sp[t][g] = fma((REAL16)(qs[g][c + t]), kv, sp[t][g]);
            }
        }
        for (; c < HD; ++c) {
            REAL16 kv = KEYS_AT(kt, kt2, c);
            _Pragma("unroll")
            for (uint g = 0; g < G; ++g) sp[0][g] = fma((REAL16)(qs[g][c]), kv, sp[0][g]);
        }
        _Pragma("unroll")
        for (uint g = 0; g < G; ++g) {
            sc[g] = sp[0][g];
            _Pragma("unroll")
            for (uint t = 1; t < SPLIT; ++t) sc[g] += sp[t][g];
        }
#if KV_INT8
        {  // the block's keys' scales (lane u: key jb + u's), after the dot products
            REAL16 ksc = TO_REAL(16, KSCALES_AT(kscale + at, kscale + at2));
            _Pragma("unroll")
            for (uint g = 0; g < G; ++g) sc[g] *= ksc;
        }
#endif
#endif
#if SCORE_MODS
        // The score variants (cl/common.cl): soft-capping, then ALiBi's -slope*|pos - j| with
        // lane u at key jb + u (distances exact in float below 2^24).
        REAL16 dist = fabs((REAL16)((REAL)((long)pos - (long)jb)) -
                           (REAL16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        _Pragma("unroll")
        for (uint g = 0; g < G; ++g) {
#if SOFTCAP
            sc[g] = softcap * tanh(sc[g] / softcap);
#endif
#if ALIBI
            sc[g] -= ALIBI_SLOPE(kvh * G + g) * dist;
#endif
        }
#endif
#if USER_MODS
        // The user's functions (cl/common.cl) on the block's keys the row sees, lane by lane
        // (lane u is key jb + u); a block they forbid entirely is skipped.
        bool live = false;
        for (uint g = 0; g < G; ++g) {
            REAL *lane = (REAL *)&sc[g];
            for (uint u = skip; u < cnt; ++u) {
                ulong j = jb + u, h = kvh * G + g;
                REAL x = USER_SCORE_OF(lane[u], n, h, pos, j);
                lane[u] = USER_ALLOWS(n, h, pos, j) ? x : -INFINITY;
                live |= lane[u] != -INFINITY;
            }
        }
        if (!live) continue;
#endif
        // Per query head (unrolled: the heads' dependency chains interleave): the block's
        // probabilities exp(score - mb) (prs: lane u is key jb + u, read below through a REAL
        // pointer rather than extracted lane by lane), the new running maximum mb, and the
        // factor corr that rescales the head's accumulators and its lane-wise sums of
        // probabilities (sv, added across lanes once, after the last block). The running
        // maximum seldom grows after the first blocks: then corr is 1 and needs no exp.
        REAL16 prs[G];
        REAL corr[G];
        if (cnt < BKEYS || skip) {
            REAL16 lane = (REAL16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            RINT16 out = isgreaterequal(lane, (REAL16)((REAL)cnt)) |
                         isless(lane, (REAL16)((REAL)skip));
            _Pragma("unroll")
            for (uint g = 0; g < G; ++g) sc[g] = select(sc[g], (REAL16)(-INFINITY), out);
        }
        _Pragma("unroll")
        for (uint g = 0; g < G; ++g) {
            REAL mb = max_nan(m[g], block_max(sc[g]));
            corr[g] = mb > m[g] ? exp(m[g] - mb) : 1.0f;
#if USER_MASK
            // A head whose keys so far are all forbidden: exp(-inf - 0), not exp(-inf + inf).
            prs[g] = exp(sc[g] - (REAL16)(mb == -INFINITY ? (REAL)0.0f : mb));
#else
            prs[g] = exp(sc[g] - (REAL16)(mb));
#endif
            sv[g] = fma(sv[g], (REAL16)(corr[g]), prs[g]);
            m[g] = mb;
        }
        // The weights*V sums, GB query heads at a time, so that their accumulators stay in
        // registers while each value row is read once for all of them.
        for (uint g0 = 0; g0 < G; g0 += GB) {
            VT a[GB][HV];
            UNROLL
            for (uint gg = 0; gg < GB; ++gg) {
                UNROLL
                for (uint c = 0; c < HV; ++c) a[gg][c] = acc[g0 + gg][c] * corr[g0 + gg];
            }
            for (uint u = skip; u < cnt; ++u) {
                ulong vat = u < KB ? at + u : at2 + u - KB;  // the value row's place
                global const KST *vr = vc + vat * KROW;
#if KV_QUANT
                // The value row's scales (int4: one per group), folded into its weights.
                global const float *vsr = vscale + vat * NG;
#endif
                UNROLL
                for (uint c = 0; c < HV; ++c) {
#if KV_INT4
                    VT x = VAL_AT(vr, c) - (VT)(8.0f);
                    REAL vsu = vsr[c * VW / KGS];
#elif KV_INT8
                    VT x = VAL_AT(vr, c);
                    REAL vsu = vsr[0];
#else
                    VT x = VAL_AT(vr, c);
                    REAL vsu = 1.0f;
#endif
                    UNROLL
                    for (uint gg = 0; gg < GB; ++gg)
                        a[gg][c] = fma((VT)(((const REAL *)&prs[g0 + gg])[u] * vsu), x,
                                       a[gg][c]);
                }
            }
            UNROLL
            for (uint gg = 0; gg < GB; ++gg) {
                UNROLL
                for (uint c = 0; c < HV; ++c) acc[g0 + gg][c] = a[gg][c];
            }
        }
    }
    for (uint g = 0; g < G; ++g) {
        ulong row = ((n * n_heads + kvh * G + g) * tgt_len + i) * parts + p;
        global VT *out = (global VT *)(part_acc + row * HD);
        UNROLL
        for (uint c = 0; c < HV; ++c) out[c] = acc[g][c];
        part_ms[2 * row] = m[g];
        part_ms[2 * row + 1] = block_sum(sv[g]);
    }
}

// One work-item per query head row ((n*H + h)*L + i): merges its parts, and the key of
// add_bias_kv (bias_k, scored against the row's query; its value bias_v) and the zero key of
// add_zero_attn (score 0, value 0) when the layer has them, into the attention result, written
// as merged rows (rows, E) for the output projection (not into proj, whose queries other
// work-items still read); with has_b_out it also fills its part of the output rows y with
// out_proj.bias (the C operand of the output projection, beta 1). A row that sees no key at all
// gives zeros.
kernel void decode_combine(global const REAL *part_acc, global const REAL *part_ms,
                           uint parts, global const REAL *proj, ulong q_at, ulong q_ld,
                           global const REAL *bias, uint has_bias, global const REAL *bias_kv,
                           uint has_bias_kv, uint zero_attn, ulong n_heads, ulong kv_heads,
                           ulong tgt_len, REAL scale, REAL softcap,
                           global const REAL *sinks, ulong sinks_off, global REAL *merged,
                           ulong n_batch, uint batch_first, global REAL *y, ulong y_off,
                           global const REAL *b_out, uint has_b_out, ulong rows) {
    ulong row = get_global_id(0);
    if (row >= rows) return;
    ulong i = row % tgt_len, bh = row / tgt_len, n = bh / n_heads, h = bh % n_heads;
    ulong kvh = h / G;  // the row's key/value head
    // Its place in the merged rows and the output rows: query row n*L + i (batch_first) or
    // i*N + n, columns h*HD ... (the output's, out_proj.bias, for the output projection).
    ulong r = token_row(n, i, n_batch, tgt_len, batch_first);
    ulong at = (r * n_heads + h) * HD;
    if (has_b_out)
        for (uint c = 0; c < HD; ++c) y[y_off + at + c] = b_out[h * HD + c];
    REAL mx = -INFINITY, xb = -INFINITY;
    for (uint p = 0; p < parts; ++p) mx = max_nan(mx, part_ms[2 * (row * parts + p)]);
    // bias_k (kv_heads * HD elements), then bias_v: the row's key/value head's slice of each.
    global const VT *bk = (global const VT *)(bias_kv + kvh * HD);
    global const VT *bv = (global const VT *)(bias_kv + (kv_heads + kvh) * HD);
    if (has_bias_kv) {  // the row's query (in_proj_bias added) against bias_k
        global const VT *qr = (global const VT *)(proj + q_at + r * q_ld + h * HD);
        global const VT *qb = (global const VT *)(bias + h * HD);
        VT dot = (VT)(0.0f);
        if (has_bias)
            for (uint c = 0; c < HV; ++c) dot = fma(qr[c] + qb[c], bk[c], dot);
        else
            for (uint c = 0; c < HV; ++c) dot = fma(qr[c], bk[c], dot);
        xb = softcapped(hsum(dot) * scale, softcap);  // no ALiBi term: an appended key
        mx = max_nan(mx, xb);
    }
    if (zero_attn) mx = max_nan(mx, 0.0f);
#if SINKS
    REAL sink = SINK_OF(h);  // one more logit, with a zero value (cl/common.cl)
    mx = max_nan(mx, sink);
#endif
    global VT *o = (global VT *)(merged + at);
    if (mx == -INFINITY) {
        for (uint c = 0; c < HV; ++c) o[c] = (VT)(0.0f);
        return;
    }
    VT acc[HV];
    for (uint c = 0; c < HV; ++c) acc[c] = (VT)(0.0f);
    REAL total = 0.0f;
    for (uint p = 0; p < parts; ++p) {
        ulong at = row * parts + p;
        REAL mp = part_ms[2 * at];
        if (mp == -INFINITY) continue;
        REAL w = exp(mp - mx);
        total = fma(w, part_ms[2 * at + 1], total);
        global const VT *pa = (global const VT *)(part_acc + at * HD);
        for (uint c = 0; c < HV; ++c) acc[c] = fma((VT)(w), pa[c], acc[c]);
    }
    if (has_bias_kv) {
        REAL w = exp(xb - mx);
        total += w;
        for (uint c = 0; c < HV; ++c) acc[c] = fma((VT)(w), bv[c], acc[c]);
    }
    if (zero_attn) total += exp(-mx);
#if SINKS
    total += exp(sink - mx);
#endif
    for (uint c = 0; c < HV; ++c) o[c] = acc[c] / total;
}

// clmha_attention_merge(): merges partial attention results b into a, row by row: each row is
// a result (head_dim elements, normalised) and the log-sum-exp of its scores; the merge weighs
// the two by their sums of exp. A row with no keys in either (-INFINITY) stays zeros.
kernel void merge_partials(global REAL *oa, ulong oa_off, global REAL *la, ulong la_off,
                           global const REAL *ob, ulong ob_off, global const REAL *lb,
                           ulong lb_off, ulong head_dim, ulong rows) {
    ulong r = get_global_id(0);
    if (r >= rows) return;
    REAL a = la[la_off + r], b = lb[lb_off + r];
    REAL m = max_nan(a, b);
    global REAL *x = oa + oa_off + r * head_dim;
    global const REAL *y = ob + ob_off + r * head_dim;
    if (m == -INFINITY) {
        for (ulong c = 0; c < head_dim; ++c) x[c] = 0.0f;
        return;
    }
    REAL wa = a == -INFINITY ? (REAL)0.0f : exp(a - m);
    REAL wb = b == -INFINITY ? (REAL)0.0f : exp(b - m);
    REAL total = wa + wb;
    for (ulong c = 0; c < head_dim; ++c) x[c] = (wa * x[c] + wb * y[c]) / total;
    la[la_off + r] = m + log(total);
}
