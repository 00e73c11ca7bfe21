// The decode core (src/cores/decode.c): attention of a few new query rows over a KV cache,
// split-K. The cached keys of a (sequence, KV head) are cut into `parts` contiguous ranges;
// decode_partial gives, per query row and range, the weights*V sum and the (max, sum of exp)
// of its scores (a partial softmax); decode_combine merges the ranges of a row exactly (and
// the keys add_bias_kv and add_zero_attn append) into the attention result. So a step with
// one query row per head still spreads over parts x heads work-items.
//
// Layouts: q (N*H, L, HD) and the result (N*H, L, HD), as the other cores; new keys and values
// (N*KVH, S, HD); the cache kc, vc (N*KVH, CAP, HD); lens (N, 2) uint: each sequence's length
// before and after this call. Query head h reads KV head h / G (grouped-query attention: G
// query heads per KV head; G 1 is plain multi-head attention): each work-item of decode_partial
// holds the G query rows of a group and reads every key and value of its range once for all
// of them.
// is_causal is bottom-right aligned: new query i of a sequence that held `old` tokens sees
// cache positions j <= old + i.
// Needs cl/common.cl in front (max_nan); the row pointers are cast to VT (HD % VW == 0 and the
// buffers start at offset 0, so every row is aligned): no vloadN, which Mesa clover cannot
// compile.

#ifndef HD
#define HD 64
#endif
#ifndef G
#define G 1
#endif
#ifndef VW
#define VW 1
#endif
#define HV (HD / VW)
// Keys scored before their values are summed: one rescale of the accumulators per block.
#define BKEYS 16
// Where a row is a few vectors (CPU drivers: HD 64 in 16-float vectors) decode_partial's loops
// over a row's vectors and a block's keys are unrolled, so that the compiler keeps the row
// accumulators in registers and interleaves the 16 keys' products (without it PoCL kept them on
// the stack: a store and a reload per key; unrolled, the decode stage took 21% less at S 4096);
// long rows of scalars (GPUs) stay loops.
#if HV <= 8
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif

#if VW == 1
#define VT float
inline float hsum(float v) { return v; }
#else
#define VT_(n) float##n
#define VT__(n) VT_(n)
#define VT VT__(VW)
#if VW == 2
inline float hsum(float2 v) { return v.x + v.y; }
#elif VW == 4
inline float hsum(float4 v) { return (v.x + v.y) + (v.z + v.w); }
#elif VW == 8
inline float hsum(float8 v) {
    float4 a = v.lo + v.hi;
    return (a.x + a.y) + (a.z + a.w);
}
#elif VW == 16
inline float hsum(float16 v) {
    float8 b = v.lo + v.hi;
    float4 a = b.lo + b.hi;
    return (a.x + a.y) + (a.z + a.w);
}
#endif
#endif

// dot = the products of query row q (HV vectors, private) with key row kr (global), summed
// over the row's vectors (a vector: its lanes are summed later). A macro, not a function, so
// that q stays an array in registers (a pointer to it would not be).
#define ROW_PRODUCTS(dot, q, kr)                                                              \
    do {                                                                                      \
        dot = (q)[0] * (kr)[0];                                                               \
        UNROLL                                                                                \
        for (uint c_ = 1; c_ < HV; ++c_) dot = fma((q)[c_], (kr)[c_], dot);                   \
    } while (0)

// Copies the first new - old of each sequence's S new keys and values to positions old, old+1,
// ... of the cache. One work-item per new row (N*KVH*S of them).
kernel void decode_append(global const float *k_new, global const float *v_new,
                          global float *kc, global float *vc, global const uint *lens,
                          ulong src_len, ulong kv_heads, ulong cap, ulong rows) {
    ulong gid = get_global_id(0);
    if (gid >= rows) return;
    ulong t = gid % src_len, bkv = gid / src_len, n = bkv / kv_heads;
    uint old = lens[2 * n], now = lens[2 * n + 1];
    if (t >= (ulong)(now - old)) return;
    global const VT *ks = (global const VT *)(k_new + gid * HD);
    global const VT *vs = (global const VT *)(v_new + gid * HD);
    ulong at = (bkv * cap + old + t) * HD;
    global VT *kd = (global VT *)(kc + at), *vd = (global VT *)(vc + at);
    for (uint c = 0; c < HV; ++c) {
        kd[c] = ks[c];
        vd[c] = vs[c];
    }
}

// One work-item per (sequence n, KV head, query row i, part p), in that order, p fastest:
// the partial softmax of the G query heads of the group over part p of the keys that row i
// sees. Writes, per query head row ((n*H + h)*L + i) and part, the unnormalised weights*V sum
// (part_acc, HD floats) and the scores' max and sum of exp(score - max) (part_ms, 2 floats);
// an empty part gives max -INFINITY, sum 0 and zeros.
kernel void decode_partial(global const float *q, global const float *kc,
                           global const float *vc, global const uint *lens, ulong tgt_len,
                           ulong n_heads, ulong kv_heads, ulong cap, uint parts, uint causal,
                           float scale, global float *part_acc, global float *part_ms,
                           ulong items) {
    ulong gid = get_global_id(0);
    if (gid >= items) return;
    uint p = (uint)(gid % parts);
    ulong r = gid / parts, i = r % tgt_len, bkv = r / tgt_len, n = bkv / kv_heads;
    ulong kvh = bkv - n * kv_heads;
    ulong old = lens[2 * n], now = lens[2 * n + 1];
    ulong end = causal ? min(now, old + i + 1) : now;
    ulong chunk = (end + parts - 1) / parts;
    ulong j0 = min(end, p * chunk), j1 = min(end, j0 + chunk);

    VT qv[G][HV], acc[G][HV];
    float m[G], s[G];
    for (uint g = 0; g < G; ++g) {
        global const VT *qr =
            (global const VT *)(q + ((n * n_heads + kvh * G + g) * tgt_len + i) * HD);
        UNROLL
        for (uint c = 0; c < HV; ++c) {
            qv[g][c] = qr[c] * scale;
            acc[g][c] = (VT)(0.0f);
        }
        m[g] = -INFINITY;
        s[g] = 0.0f;
    }
    global const float *kb = kc + bkv * cap * HD, *vb = vc + bkv * cap * HD;
    for (ulong jb = j0; jb < j1; jb += BKEYS) {
        uint cnt = (uint)min((ulong)BKEYS, j1 - jb);
        // One query head of the group at a time, so that its row and accumulators stay in
        // registers; the block's keys and values are read from memory for the first and from
        // the cache for the others.
        for (uint g = 0; g < G; ++g) {
            // The block's probabilities exp(score - mb) (pr, keys jb .. jb + cnt - 1), their
            // sum, and the new running maximum mb.
            float mb = m[g], pr[BKEYS], bsum;
#if VW == 16
            // The 16 scores as one vector (lane u: key jb + u), so that their max and
            // exponentials are vector operations; the lane sums of the 16 keys' products at
            // once: each level adds neighbouring lanes of two vectors, halving the partial sums
            // per key and keeping the keys in order.
            float16 d[BKEYS];
            UNROLL
            for (uint u = 0; u < BKEYS; ++u) {
                global const VT *kr = (global const VT *)(kb + (jb + min(u, cnt - 1)) * HD);
                ROW_PRODUCTS(d[u], qv[g], kr);
            }
#define PAIR_SUMS(a, b) (float16)((a).even + (a).odd, (b).even + (b).odd)
            float16 e0 = PAIR_SUMS(d[0], d[1]), e1 = PAIR_SUMS(d[2], d[3]),
                    e2 = PAIR_SUMS(d[4], d[5]), e3 = PAIR_SUMS(d[6], d[7]),
                    e4 = PAIR_SUMS(d[8], d[9]), e5 = PAIR_SUMS(d[10], d[11]),
                    e6 = PAIR_SUMS(d[12], d[13]), e7 = PAIR_SUMS(d[14], d[15]);
            float16 f0 = PAIR_SUMS(e0, e1), f1 = PAIR_SUMS(e2, e3), f2 = PAIR_SUMS(e4, e5),
                    f3 = PAIR_SUMS(e6, e7);
            float16 scv = PAIR_SUMS(PAIR_SUMS(f0, f1), PAIR_SUMS(f2, f3));
#undef PAIR_SUMS
            float16 lane = (float16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            scv = select(scv, (float16)(-INFINITY), isgreaterequal(lane, (float16)((float)cnt)));
            {
                float8 m8 = fmax(scv.lo, scv.hi);
                float4 m4 = fmax(m8.lo, m8.hi);
                float2 m2 = fmax(m4.lo, m4.hi);
                mb = max_nan(mb, fmax(m2.x, m2.y));
            }
            float16 prv = exp(scv - (float16)(mb));
            {
                float8 s8 = prv.lo + prv.hi;
                float4 s4 = s8.lo + s8.hi;
                bsum = (s4.x + s4.y) + (s4.z + s4.w);
            }
            pr[0] = prv.s0, pr[1] = prv.s1, pr[2] = prv.s2, pr[3] = prv.s3;
            pr[4] = prv.s4, pr[5] = prv.s5, pr[6] = prv.s6, pr[7] = prv.s7;
            pr[8] = prv.s8, pr[9] = prv.s9, pr[10] = prv.sa, pr[11] = prv.sb;
            pr[12] = prv.sc, pr[13] = prv.sd, pr[14] = prv.se, pr[15] = prv.sf;
#else
            // Other widths (GPUs: scalar rows) score key by key.
            float sc[BKEYS];
            UNROLL
            for (uint u = 0; u < BKEYS; ++u) {
                global const VT *kr = (global const VT *)(kb + (jb + min(u, cnt - 1)) * HD);
                VT dot;
                ROW_PRODUCTS(dot, qv[g], kr);
                sc[u] = u < cnt ? hsum(dot) : -INFINITY;
                mb = max_nan(mb, sc[u]);
            }
            bsum = 0.0f;
            for (uint u = 0; u < cnt; ++u) {
                pr[u] = exp(sc[u] - mb);
                bsum += pr[u];
            }
#endif
            float corr = m[g] == -INFINITY ? 0.0f : exp(m[g] - mb);
            float sum = fma(s[g], corr, bsum);
            VT a[HV];
            UNROLL
            for (uint c = 0; c < HV; ++c) a[c] = acc[g][c] * corr;
            for (uint u = 0; u < cnt; ++u) {
                global const VT *vr = (global const VT *)(vb + (jb + u) * HD);
                UNROLL
                for (uint c = 0; c < HV; ++c) a[c] = fma((VT)(pr[u]), vr[c], a[c]);
            }
            UNROLL
            for (uint c = 0; c < HV; ++c) acc[g][c] = a[c];
            m[g] = mb;
            s[g] = sum;
        }
    }
    for (uint g = 0; g < G; ++g) {
        ulong row = ((n * n_heads + kvh * G + g) * tgt_len + i) * parts + p;
        global VT *out = (global VT *)(part_acc + row * HD);
        UNROLL
        for (uint c = 0; c < HV; ++c) out[c] = acc[g][c];
        part_ms[2 * row] = m[g];
        part_ms[2 * row + 1] = s[g];
    }
}

// One work-item per query head row ((n*H + h)*L + i): merges its parts, and the key of
// add_bias_kv (bias_k, scored against the row's query; its value bias_v) and the zero key of
// add_zero_attn (score 0, value 0) when the layer has them, into the attention result. A row
// that sees no key at all gives zeros.
kernel void decode_combine(global const float *part_acc, global const float *part_ms,
                           uint parts, global const float *q, global const float *bias_kv,
                           uint has_bias_kv, uint zero_attn, ulong n_heads, ulong kv_heads,
                           ulong tgt_len, float scale, global float *out, ulong rows) {
    ulong row = get_global_id(0);
    if (row >= rows) return;
    ulong kvh = row / tgt_len % n_heads / G;  // the row's key/value head
    float mx = -INFINITY, xb = -INFINITY;
    for (uint p = 0; p < parts; ++p) mx = max_nan(mx, part_ms[2 * (row * parts + p)]);
    // bias_k (kv_heads * HD floats), then bias_v: the row's key/value head's slice of each.
    global const VT *bk = (global const VT *)(bias_kv + kvh * HD);
    global const VT *bv = (global const VT *)(bias_kv + (kv_heads + kvh) * HD);
    if (has_bias_kv) {
        global const VT *qr = (global const VT *)(q + row * HD);
        VT dot = qr[0] * bk[0];
        for (uint c = 1; c < HV; ++c) dot = fma(qr[c], bk[c], dot);
        xb = hsum(dot) * scale;
        mx = max_nan(mx, xb);
    }
    if (zero_attn) mx = max_nan(mx, 0.0f);
    global VT *o = (global VT *)(out + row * HD);
    if (mx == -INFINITY) {
        for (uint c = 0; c < HV; ++c) o[c] = (VT)(0.0f);
        return;
    }
    VT acc[HV];
    for (uint c = 0; c < HV; ++c) acc[c] = (VT)(0.0f);
    float total = 0.0f;
    for (uint p = 0; p < parts; ++p) {
        ulong at = row * parts + p;
        float mp = part_ms[2 * at];
        if (mp == -INFINITY) continue;
        float w = exp(mp - mx);
        total = fma(w, part_ms[2 * at + 1], total);
        global const VT *pa = (global const VT *)(part_acc + at * HD);
        for (uint c = 0; c < HV; ++c) acc[c] = fma((VT)(w), pa[c], acc[c]);
    }
    if (has_bias_kv) {
        float w = exp(xb - mx);
        total += w;
        for (uint c = 0; c < HV; ++c) acc[c] = fma((VT)(w), bv[c], acc[c]);
    }
    if (zero_attn) total += exp(-mx);
    for (uint c = 0; c < HV; ++c) o[c] = acc[c] / total;
}

// clmha_attention_merge(): merges partial attention results b into a, row by row: each row is
// a result (head_dim floats, normalised) and the log-sum-exp of its scores; the merge weighs
// the two by their sums of exp. A row with no keys in either (-INFINITY) stays zeros.
kernel void merge_partials(global float *oa, ulong oa_off, global float *la, ulong la_off,
                           global const float *ob, ulong ob_off, global const float *lb,
                           ulong lb_off, ulong head_dim, ulong rows) {
    ulong r = get_global_id(0);
    if (r >= rows) return;
    float a = la[la_off + r], b = lb[lb_off + r];
    float m = max_nan(a, b);
    global float *x = oa + oa_off + r * head_dim;
    global const float *y = ob + ob_off + r * head_dim;
    if (m == -INFINITY) {
        for (ulong c = 0; c < head_dim; ++c) x[c] = 0.0f;
        return;
    }
    float wa = a == -INFINITY ? 0.0f : exp(a - m), wb = b == -INFINITY ? 0.0f : exp(b - m);
    float total = wa + wb;
    for (ulong c = 0; c < head_dim; ++c) x[c] = (wa * x[c] + wb * y[c]) / total;
    la[la_off + r] = m + log(total);
}
