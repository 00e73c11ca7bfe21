// The unfused core working through chunks of the scores (clmha__scores_chunks()): with the
// device's largest allocation lowered by the test hook clmha__test_set_max_alloc, small shapes
// run as groups of heads, single heads and rows of one head (chunks that do not divide L), and
// must match the double-precision reference and the same call without chunks, with every
// option that touches the scores: weights per head and averaged, every mask kind and layout,
// is_causal, add_bias_kv/add_zero_attn, dropout. The scratch stays within the lowered limit.
//
// Links libclmha.a (not libclmha.so): the hook and the planner are internal.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layer/layer.h"
#include "support.h"

#define TOLERANCE 1e-4
// Chunked against unchunked: the same kernels on the same numbers, only the GEMM calls (plain
// per plane or batched) and the order of the head sums differ.
#define SAME_TOLERANCE 1e-5

// ---- cases ------------------------------------------------------------------------------------

// What the lowered limit makes the planner do.
typedef enum kind {
    HEADS_DIV,    // groups of 2 of the 4 heads of a batch item
    HEADS_ITEMS,  // groups of 2 whole batch items (8 planes) of 3: chunks of 8 and 4 planes
    HEAD_ONE,     // one plane per chunk
    ROWS,         // rows of one plane: 23 + 17 rows of L = 40
    ROWS_MANY,    // rows of one plane: 7 + 7 + 7 + 7 + 2 rows of L = 30
    KIND_COUNT
} kind;

static const char *const kind_names[KIND_COUNT] = {"heads/2", "items/2", "head/1", "rows/23",
                                                   "rows/7"};

typedef enum layout { SHARED, PER_HEAD, PER_BATCH } layout;

typedef struct tcase {
    kind k;
    size_t e, h, n, l, s;  // n ignored when unbatched
    size_t target;         // planes (whole kinds) or rows (row kinds) per chunk
    bool bias_kv, zero_attn, batch_first, unbatched;
    clmha_mask_kind kpm, am;
    layout lay;
    bool causal, per_head, training;
    float dropout;
    uint64_t seed;
} tcase;

// Shapes: the projection (N*(L + 2S)*E floats) and the head tiles must fit in the lowered
// limit too, so the sequences are long next to N*E.
static tcase base_case(kind k) {
    tcase c = {.k = k, .e = 8, .h = 4, .n = 2, .l = 40, .s = 50};
    switch (k) {
    case HEADS_DIV: c.target = 2; break;
    case HEADS_ITEMS: c.n = 3, c.target = 8; break;
    case HEAD_ONE: c.target = 1; break;
    case ROWS: c.target = 23; break;
    case ROWS_MANY: c.e = 4, c.h = 2, c.n = 1, c.l = 30, c.target = 7; break;
    case KIND_COUNT: break;
    }
    return c;
}

// The options on top of a shape, one per case.
enum { VARIANT_COUNT = 14 };

static bool variant(tcase *c, int v) {
    switch (v) {
    case 0: break;
    case 1: c->per_head = true; break;
    case 2: c->kpm = CLMHA_MASK_BOOL_IGNORE, c->am = CLMHA_MASK_BOOL_IGNORE, c->lay = SHARED; break;
    case 3:
        c->kpm = CLMHA_MASK_BOOL_ATTEND, c->am = CLMHA_MASK_FLOAT, c->lay = PER_HEAD;
        c->per_head = true;
        break;
    case 4: c->kpm = CLMHA_MASK_FLOAT, c->am = CLMHA_MASK_BOOL_ATTEND, c->lay = PER_BATCH; break;
    case 5: c->causal = true, c->per_head = true; break;
    case 6: c->causal = true, c->am = CLMHA_MASK_FLOAT, c->lay = SHARED; break;
    case 7:
        c->bias_kv = c->zero_attn = true, c->per_head = true;
        c->kpm = CLMHA_MASK_BOOL_IGNORE;
        break;
    case 8: c->bias_kv = c->zero_attn = true, c->am = CLMHA_MASK_FLOAT, c->lay = PER_HEAD; break;
    case 9: c->training = true, c->dropout = 0.3f, c->per_head = true; break;
    case 10:
        c->training = true, c->dropout = 0.3f, c->causal = true, c->bias_kv = true;
        c->kpm = CLMHA_MASK_FLOAT;
        break;
    case 11:
        c->batch_first = true, c->per_head = true;
        c->am = CLMHA_MASK_BOOL_IGNORE, c->lay = PER_BATCH;
        break;
    case 12:
        // Unbatched: one batch item, fewer planes than the groups of whole items.
        if (c->k == HEADS_ITEMS) return false;
        c->unbatched = true, c->zero_attn = true, c->causal = true;
        break;
    case 13:
        c->unbatched = c->k != HEADS_ITEMS, c->training = true, c->dropout = 0.5f;
        c->am = CLMHA_MASK_BOOL_ATTEND, c->lay = c->unbatched ? SHARED : PER_HEAD;
        c->per_head = c->k != ROWS;
        break;
    default: return false;
    }
    c->seed = 1000 + 37 * (uint64_t)c->k + (uint64_t)v;
    return true;
}

static void describe(const tcase *c, char *buf, size_t size) {
    static const char *const kinds[] = {"none", "ignore", "attend", "float"};
    static const char *const layouts[] = {"L,S", "NH,L,S", "N,L,S"};
    int used = snprintf(buf, size, "%-7s E%zu H%zu N%zu L%zu S%zu", kind_names[c->k], c->e,
                        c->h, c->unbatched ? (size_t)1 : c->n, c->l, c->s);
#define APPEND(...)                                                                            \
    if (used >= 0 && (size_t)used < size)                                                      \
    used += snprintf(buf + used, size - (size_t)used, __VA_ARGS__)
    if (c->bias_kv) APPEND(" bias_kv");
    if (c->zero_attn) APPEND(" zero_attn");
    if (c->batch_first) APPEND(" batch_first");
    if (c->unbatched) APPEND(" unbatched");
    if (c->kpm) APPEND(" kpm=%s", kinds[c->kpm]);
    if (c->am) APPEND(" am=%s(%s)", kinds[c->am], layouts[c->lay]);
    if (c->causal) APPEND(" causal");
    if (c->training) APPEND(" p=%.2g", (double)c->dropout);
    APPEND(c->per_head ? " w=per_head" : " w=avg");
#undef APPEND
}

// A case made concrete: parameters, inputs, masks and the call's arguments.
typedef struct instance {
    tcase c;
    size_t n, sp, out_count, w_count;
    clmha_layer_desc desc;
    clmha_reference_params params;
    clmha_forward_args args;
    float *w_in, *b_in, *w_out, *b_out, *bk, *bv, *q, *k, *v;
    void *kpm, *am;
} instance;

static clmha_tensor tensor(const void *data, size_t ndim, size_t a, size_t b, size_t c) {
    return (clmha_tensor){.ndim = ndim, .shape = {a, b, c}, .data = data};
}

static clmha_tensor input(const instance *in, const float *data, size_t seq) {
    if (in->c.unbatched) return tensor(data, 2, seq, in->c.e, 0);
    if (in->c.batch_first) return tensor(data, 3, in->n, seq, in->c.e);
    return tensor(data, 3, seq, in->n, in->c.e);
}

// Boolean masks hold 0 or a non-zero byte with a fraction 0.2 forbidden; float masks N(0, 1)
// with a fraction 0.2 of -inf.
static void *mask(prng *s, clmha_mask_kind mk, size_t count) {
    if (mk == CLMHA_MASK_FLOAT) {
        float *m = alloc_floats(count);
        for (size_t i = 0; i < count; ++i)
            m[i] = prng_uniform(s) < 0.2 ? -INFINITY : (float)prng_normal(s);
        return m;
    }
    unsigned char *m = malloc(count);
    cr_assert_not_null(m);
    for (size_t i = 0; i < count; ++i) {
        bool forbidden = prng_uniform(s) < 0.2;
        m[i] = forbidden == (mk == CLMHA_MASK_BOOL_IGNORE) ? (unsigned char)(1 + prng_next(s) % 255)
                                                           : 0;
    }
    return m;
}

static void instance_make(instance *in, const tcase *c) {
    memset(in, 0, sizeof *in);
    in->c = *c;
    prng rs = {c->seed}, *s = &rs;
    size_t e = c->e, n = c->unbatched ? 1 : c->n, l = c->l, src = c->s;
    in->n = n;
    in->sp = src + c->bias_kv + c->zero_attn;
    in->desc = (clmha_layer_desc){.struct_size = sizeof(clmha_layer_desc),
                                  .embed_dim = e, .num_heads = c->h, .bias = true,
                                  .add_bias_kv = c->bias_kv, .add_zero_attn = c->zero_attn,
                                  .batch_first = c->batch_first, .dropout = c->dropout};
    double bound = 1.0 / sqrt((double)e);
    in->w_in = uniform_floats(s, 3 * e * e, bound);
    in->b_in = uniform_floats(s, 3 * e, bound);
    in->w_out = uniform_floats(s, e * e, bound);
    in->b_out = uniform_floats(s, e, bound);
    in->params = (clmha_reference_params){.struct_size = sizeof(clmha_reference_params),
                                          .in_proj_weight = in->w_in, .in_proj_bias = in->b_in,
                                          .out_proj_weight = in->w_out,
                                          .out_proj_bias = in->b_out};
    if (c->bias_kv) {
        in->bk = normal_floats(s, e);
        in->bv = normal_floats(s, e);
        in->params.bias_k = in->bk;
        in->params.bias_v = in->bv;
    }
    in->q = normal_floats(s, l * n * e);
    in->k = normal_floats(s, src * n * e);
    in->v = normal_floats(s, src * n * e);
    clmha_forward_args *a = &in->args;
    a->struct_size = sizeof *a;
    a->query = input(in, in->q, l);
    a->key = input(in, in->k, src);
    a->value = input(in, in->v, src);
    if (c->kpm) {
        in->kpm = mask(s, c->kpm, n * src);
        a->key_padding_mask = (clmha_mask){
            .kind = c->kpm,
            .tensor = c->unbatched ? tensor(in->kpm, 1, src, 0, 0) : tensor(in->kpm, 2, n, src, 0)};
    }
    if (c->am) {
        size_t planes = c->lay == PER_HEAD ? n * c->h : c->lay == PER_BATCH ? n : 1;
        in->am = mask(s, c->am, planes * l * src);
        a->attn_mask = (clmha_mask){.kind = c->am,
                                    .per_batch = c->lay == PER_BATCH,
                                    .tensor = c->lay == SHARED ? tensor(in->am, 2, l, src, 0)
                                                               : tensor(in->am, 3, planes, l, src)};
    }
    a->is_causal = c->causal;
    a->need_weights = true;
    a->per_head_weights = c->per_head;
    a->training = c->training;
    a->rng = (clmha_dropout_rng){.seed = 0x5EED0000ull + c->seed, .offset = 7 * c->seed};
    a->impl = CLMHA_IMPL_UNFUSED;
    in->out_count = n * l * e;
    in->w_count = n * (c->per_head ? c->h : 1) * l * in->sp;
}

static void instance_free(instance *in) {
    float *arrays[] = {in->w_in, in->b_in, in->w_out, in->b_out, in->bk,
                       in->bv,   in->q,    in->k,     in->v};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; ++i) free(arrays[i]);
    free(in->kpm);
    free(in->am);
}

// ---- running -----------------------------------------------------------------------------------

static void clear_hook(void) { clmha__test_set_max_alloc(0); }

static void set(clmha_layer *layer, const char *name, const float *data, size_t count) {
    if (!data) return;
    cr_assert_eq(clmha_layer_set_parameter(layer, name, data, count), CLMHA_SUCCESS, "%s: %s",
                 name, clmha_context_last_error(clmha_layer_context(layer)));
}

static clmha_layer *make_layer(clmha_context *ctx, const instance *in) {
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &in->desc), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    size_t e = in->c.e;
    set(layer, "in_proj_weight", in->w_in, 3 * e * e);
    set(layer, "in_proj_bias", in->b_in, 3 * e);
    set(layer, "out_proj.weight", in->w_out, e * e);
    set(layer, "out_proj.bias", in->b_out, e);
    set(layer, "bias_k", in->bk, e);
    set(layer, "bias_v", in->bv, e);
    return layer;
}

// The lowered limit (bytes) that makes the planner pick c.target planes or rows per chunk:
// chunks get half of it.
static size_t limit_for(const instance *in) {
    size_t per = in->c.k == ROWS || in->c.k == ROWS_MANY ? in->sp : in->c.l * in->sp;
    return 2 * sizeof(float) * in->c.target * per;
}

// Checks the plan against the kind of the case and that every scratch buffer fits the limit.
static void check_plan(clmha_layer *layer, const instance *in, size_t limit) {
    clmha__dims d;
    char msg[512];
    cr_assert_eq(clmha__dims_resolve(&in->desc, &in->args, &d, msg, sizeof msg), CLMHA_SUCCESS,
                 "%s", msg);
    size_t planes = in->n * in->c.h, l = in->c.l, sp = in->sp;
    cr_assert_leq((in->out_count + 2 * in->n * in->c.s * in->c.e) * sizeof(float), limit,
                  "the case is too small for its limit: the projection would not fit");
    clmha__chunks c;
    cr_assert(clmha__scores_chunks(layer, &d, &c));
    bool rows = in->c.k == ROWS || in->c.k == ROWS_MANY;
    cr_assert_eq(c.whole, !rows, "chunks of %s expected", rows ? "rows" : "whole planes");
    size_t t = in->c.target;
    cr_assert_eq(c.rows, rows ? t : t * l, "rows per chunk %zu", c.rows);
    size_t count = rows ? planes * ((l + t - 1) / t) : (planes + t - 1) / t;
    cr_assert_eq(c.count, count, "%zu chunks, expected %zu", c.count, count);
    cr_assert_gt(c.count, 1);
    if (rows) cr_assert_neq(l % t, 0, "the row chunks should not divide L");

    cr_assert_eq(layer->scores_cap, c.rows * sp, "scores scratch %zu floats, one chunk is %zu",
                 layer->scores_cap, c.rows * sp);
    cr_expect_leq(layer->scores_cap * sizeof(float), limit / 2);
    cr_expect_leq(layer->head_sums_cap * sizeof(float), limit / 2);
    if (!in->c.per_head && c.sums)
        cr_expect_eq(layer->head_sums_cap, c.sums, "head sums scratch %zu floats, expected %zu",
                     layer->head_sums_cap, c.sums);
    cr_expect_leq(layer->proj_cap * sizeof(float), limit);
    for (int i = 0; i < CLMHA__TILE_COUNT; ++i)
        cr_expect_leq(layer->tile_caps[i] * sizeof(float), limit, "tile %d", i);
}

typedef struct errors {
    double out, weights;
} errors;

static void forward(clmha_layer *layer, const instance *in, float *out, float *w) {
    for (size_t i = 0; i < in->out_count; ++i) out[i] = NAN;
    for (size_t i = 0; i < in->w_count; ++i) w[i] = NAN;
    clmha_status st = clmha_layer_forward_host(layer, &in->args, out, in->out_count, w,
                                               in->w_count);
    cr_assert_eq(st, CLMHA_SUCCESS, "forward: %s (%s)", clmha_status_string(st),
                 clmha_context_last_error(clmha_layer_context(layer)));
}

// Runs one case chunked (fresh layer, lowered limit), against the reference and against the
// same layer unchunked. Returns the errors against the reference.
static errors check_case(clmha_context *ctx, const tcase *c, double *worst_same) {
    instance in;
    instance_make(&in, c);
    char name[200];
    describe(c, name, sizeof name);
    clmha_layer *layer = make_layer(ctx, &in);
    size_t limit = limit_for(&in);
    float *out = alloc_floats(in.out_count), *w = alloc_floats(in.w_count);
    float *out_u = alloc_floats(in.out_count), *w_u = alloc_floats(in.w_count);
    double *ref_out = malloc(in.out_count * sizeof *ref_out);
    double *ref_w = malloc(in.w_count * sizeof *ref_w);
    cr_assert(ref_out && ref_w);

    clmha__test_set_max_alloc(limit);
    forward(layer, &in, out, w);
    check_plan(layer, &in, limit);
    clear_hook();
    forward(layer, &in, out_u, w_u);  // the same layer, now with room for all the scores

    char msg[256];
    cr_assert_eq(clmha_reference_forward(&in.desc, &in.params, &in.args, ref_out, in.out_count,
                                         ref_w, in.w_count, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    errors e = {max_abs_err(out, ref_out, in.out_count), max_abs_err(w, ref_w, in.w_count)};
    double same = fmax(max_abs_diff(out, out_u, in.out_count), max_abs_diff(w, w_u, in.w_count));
    fprintf(stderr, "chunking: %-72s out %.2e weights %.2e chunked-unchunked %.2e\n", name,
            e.out, e.weights, same);
    cr_expect_leq(e.out, TOLERANCE, "%s: output max abs error %g", name, e.out);
    cr_expect_leq(e.weights, TOLERANCE, "%s: weights max abs error %g", name, e.weights);
    cr_expect_leq(same, SAME_TOLERANCE, "%s: chunked and unchunked differ by %g", name, same);
    if (c->training && c->per_head) {  // dropout drops exactly the reference's weights
        size_t differ = 0;
        for (size_t i = 0; i < in.w_count; ++i) differ += (w[i] == 0.0f) != (ref_w[i] == 0.0);
        cr_expect_eq(differ, 0, "%s: %zu weights dropped on one side only", name, differ);
    }
    *worst_same = fmax(*worst_same, same);
    free(out), free(w), free(out_u), free(w_u), free(ref_out), free(ref_w);
    clmha_layer_release(layer);
    instance_free(&in);
    return e;
}

static void run_kind(kind k) {
    clmha_context *ctx = context_or_skip();
    errors worst = {0.0, 0.0};
    double same = 0.0;
    int cases = 0;
    for (int v = 0; v < VARIANT_COUNT; ++v) {
        tcase c = base_case(k);
        if (!variant(&c, v)) continue;
        errors e = check_case(ctx, &c, &same);
        worst.out = fmax(worst.out, e.out);
        worst.weights = fmax(worst.weights, e.weights);
        ++cases;
    }
    fprintf(stderr,
            "chunking: %s: %d cases, worst out %.2e, weights %.2e, chunked-unchunked %.2e\n",
            kind_names[k], cases, worst.out, worst.weights, same);
    clmha_context_release(ctx);
}

Test(chunking, groups_of_heads, .fini = clear_hook, .timeout = 600) { run_kind(HEADS_DIV); }
Test(chunking, groups_of_batch_items, .fini = clear_hook, .timeout = 600) {
    run_kind(HEADS_ITEMS);
}
Test(chunking, single_heads, .fini = clear_hook, .timeout = 600) { run_kind(HEAD_ONE); }
Test(chunking, rows_of_a_head, .fini = clear_hook, .timeout = 600) { run_kind(ROWS); }
Test(chunking, many_rows_chunks_of_a_head, .fini = clear_hook, .timeout = 600) {
    run_kind(ROWS_MANY);
}

// The planner on its own: planes per chunk drop to a divisor of H, or to a multiple of it; a
// row that does not fit is refused.
Test(chunking, planner_keeps_batch_items_whole, .fini = clear_hook, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = 6, .num_heads = 3};
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS);
    clmha__dims d = {.n = 4, .l = 10, .s = 20, .s_padded = 20, .e = 6, .h = 3, .d = 2};
    d.scores_count = d.n * 3 * d.l * d.s_padded;  // 12 planes of 200 floats
    size_t plane_bytes = 200 * sizeof(float);
    static const struct {
        size_t budget_planes, want_planes, want_count;
    } cases[] = {{2, 1, 12}, {3, 3, 4}, {5, 3, 4}, {7, 6, 2}, {11, 9, 2}, {12, 12, 1}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        clmha__test_set_max_alloc(2 * cases[i].budget_planes * plane_bytes);
        clmha__chunks c;
        cr_assert(clmha__scores_chunks(layer, &d, &c));
        cr_expect(c.whole);
        cr_expect_eq(c.rows, cases[i].want_planes * d.l, "budget %zu planes: %zu rows",
                     cases[i].budget_planes, c.rows);
        cr_expect_eq(c.count, cases[i].want_count, "budget %zu planes: %zu chunks",
                     cases[i].budget_planes, c.count);
    }
    clmha__test_set_max_alloc(2 * 3 * 20 * sizeof(float) + 4);  // 3 rows
    clmha__chunks c;
    cr_assert(clmha__scores_chunks(layer, &d, &c));
    cr_expect(!c.whole);
    cr_expect_eq(c.rows, 3);
    cr_expect_eq(c.count, 12 * 4);  // 3 + 3 + 3 + 1 rows per plane
    clmha__test_set_max_alloc(2 * 19 * sizeof(float));  // not even one row of 20
    cr_expect(!clmha__scores_chunks(layer, &d, &c));
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// The device path: the weights land at the caller's offset in a CL_MEM_WRITE_ONLY buffer (the
// chunked head average never reads it), nothing before or after the result is touched, and the
// event is returned.
Test(chunking, device_buffers_at_offsets, .fini = clear_hook, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    cl_context cl = clmha_context_cl_context(ctx);
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    for (int per_head = 0; per_head < 2; ++per_head) {
        tcase c = base_case(ROWS);
        c.per_head = per_head, c.causal = true, c.kpm = CLMHA_MASK_BOOL_IGNORE, c.seed = 77;
        instance in;
        instance_make(&in, &c);
        clmha_layer *layer = make_layer(ctx, &in);
        float *want = alloc_floats(in.out_count), *want_w = alloc_floats(in.w_count);
        forward(layer, &in, want, want_w);  // unchunked, host path

        clmha_layer_release(layer);
        layer = make_layer(ctx, &in);
        size_t limit = limit_for(&in);
        clmha__test_set_max_alloc(limit);
        enum { PAD = 5 };
        const float sentinel = 1234.5f;
        size_t counts[5] = {in.out_count + 2 * PAD, in.w_count + 2 * PAD, in.out_count,
                            in.n * c.s * c.e, in.n * c.s * c.e};
        const float *data[5] = {NULL, NULL, in.q, in.k, in.v};
        cl_mem bufs[5];
        for (int i = 0; i < 5; ++i) {
            cl_int err;
            cl_mem_flags flags = i == 1 ? CL_MEM_WRITE_ONLY : CL_MEM_READ_WRITE;
            bufs[i] = clCreateBuffer(cl, flags, counts[i] * sizeof(float), NULL, &err);
            cr_assert_eq(err, CL_SUCCESS);
            if (data[i])
                err = clEnqueueWriteBuffer(queue, bufs[i], CL_TRUE, 0, counts[i] * sizeof(float),
                                           data[i], 0, NULL, NULL);
            else
                err = clEnqueueFillBuffer(queue, bufs[i], &sentinel, sizeof sentinel, 0,
                                          counts[i] * sizeof(float), 0, NULL, NULL);
            cr_assert_eq(err, CL_SUCCESS);
        }
        cl_mem kpm;
        cl_int err;
        kpm = clCreateBuffer(cl, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, in.n * c.s, in.kpm,
                             &err);
        cr_assert_eq(err, CL_SUCCESS);
        clmha_forward_args a = in.args;
        a.query = (clmha_tensor){.ndim = 3, .shape = {c.l, in.n, c.e}, .buffer = bufs[2]};
        a.key = (clmha_tensor){.ndim = 3, .shape = {c.s, in.n, c.e}, .buffer = bufs[3]};
        a.value = (clmha_tensor){.ndim = 3, .shape = {c.s, in.n, c.e}, .buffer = bufs[4]};
        a.key_padding_mask.tensor = (clmha_tensor){.ndim = 2, .shape = {in.n, c.s}, .buffer = kpm};
        cl_event ev = NULL;
        clmha_status st = clmha_layer_forward(layer, &a, bufs[0], PAD, bufs[1], PAD, 0, NULL, &ev);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        cr_assert_not_null(ev);
        cr_assert_eq(clWaitForEvents(1, &ev), CL_SUCCESS);
        clReleaseEvent(ev);
        check_plan(layer, &in, limit);
        float *got = alloc_floats(counts[0]), *got_w = alloc_floats(counts[1]);
        cr_assert_eq(clEnqueueReadBuffer(queue, bufs[0], CL_TRUE, 0, counts[0] * sizeof(float),
                                         got, 0, NULL, NULL),
                     CL_SUCCESS);
        cr_assert_eq(clEnqueueReadBuffer(queue, bufs[1], CL_TRUE, 0, counts[1] * sizeof(float),
                                         got_w, 0, NULL, NULL),
                     CL_SUCCESS);
        for (size_t i = 0; i < PAD; ++i) {
            cr_expect_eq(got[i], sentinel);
            cr_expect_eq(got[PAD + in.out_count + i], sentinel);
            cr_expect_eq(got_w[i], sentinel, "weights[%zu] before the offset written", i);
            cr_expect_eq(got_w[PAD + in.w_count + i], sentinel, "weights after the end written");
        }
        double dout = max_abs_diff(got + PAD, want, in.out_count);
        double dw = max_abs_diff(got_w + PAD, want_w, in.w_count);
        fprintf(stderr, "chunking: device path (%s weights) vs host unchunked: out %.2e "
                "weights %.2e\n", per_head ? "per-head" : "averaged", dout, dw);
        cr_expect_leq(dout, SAME_TOLERANCE);
        cr_expect_leq(dw, SAME_TOLERANCE);
        clear_hook();
        for (int i = 0; i < 5; ++i) clReleaseMemObject(bufs[i]);
        clReleaseMemObject(kpm);
        free(got), free(got_w), free(want), free(want_w);
        clmha_layer_release(layer);
        instance_free(&in);
    }
    clmha_context_release(ctx);
}

// The backward pass when the scores do not fit in one buffer: the unfused backward has no
// chunks, so a call only it could run is refused with CLMHA_OUT_OF_MEMORY (nothing written);
// the fused backward, whose memory is linear, runs the same shapes and matches the reference.
Test(chunking, backward_beyond_the_scores_limit, .fini = clear_hook, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    enum { E = 8, H = 2, N = 1, L = 40 };
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = H,
                             .bias = true};
    clmha_layer *layer;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS);
    prng r = {77};
    float *w_in = uniform_floats(&r, 3 * E * E, 0.35), *w_out = uniform_floats(&r, E * E, 0.35);
    float *b_in = uniform_floats(&r, 3 * E, 0.35), *b_out = uniform_floats(&r, E, 0.35);
    float *x = normal_floats(&r, L * N * E), *gy = normal_floats(&r, L * N * E);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.bias", b_out, E), 0);
    // N*H*L*S = 3200 floats of scores; a limit of 4096 bytes holds one plane's rows at most.
    clmha__test_set_max_alloc(4096);
    clmha_saved *saved;
    cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
    float y[L * N * E], dx[L * N * E], dw[3 * E * E];
    clmha_forward_args f = {.struct_size = sizeof f,
                            .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
                            .is_causal = true, .impl = CLMHA_IMPL_UNFUSED, .save = saved};
    cr_assert_eq(clmha_layer_forward_host(layer, &f, y, L * N * E, NULL, 0), CLMHA_SUCCESS,
                 "%s", clmha_context_last_error(ctx));
    for (size_t i = 0; i < L * N * E; ++i) dx[i] = 7.0f;
    clmha_backward_args b = {.struct_size = sizeof b, .forward = &f, .saved = saved,
                             .grad_output = {.ndim = 3, .shape = {L, N, E}, .data = gy},
                             .query = {.data = dx}, .in_proj_weight = {.data = dw}};
    cr_assert_eq(clmha_layer_backward_host(layer, &b), CLMHA_OUT_OF_MEMORY, "%s",
                 clmha_context_last_error(ctx));
    cr_assert(strstr(clmha_context_last_error(ctx), "largest allocation"), "%s",
              clmha_context_last_error(ctx));
    cr_assert_eq(dx[0], 7.0f, "a refused backward wrote its destination");
    // The fused forward saves the log-sum-exp: the fused backward runs in linear memory.
    f.impl = CLMHA_IMPL_AUTO;
    cr_assert_eq(clmha_layer_forward_host(layer, &f, y, L * N * E, NULL, 0), CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_backward_host(layer, &b), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    double ref_dx[L * N * E], ref_dw[3 * E * E];
    clmha_reference_params p = {.struct_size = sizeof p, .in_proj_weight = w_in,
                                .in_proj_bias = b_in, .out_proj_weight = w_out,
                                .out_proj_bias = b_out};
    clmha_reference_grads rg = {.struct_size = sizeof rg, .query = ref_dx,
                                .in_proj_weight = ref_dw};
    char msg[256];
    cr_assert_eq(clmha_reference_backward(&desc, &p, &f, gy, NULL, &rg, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    cr_expect_leq(max_abs_err(dx, ref_dx, L * N * E), TOLERANCE);
    cr_expect_leq(max_abs_err(dw, ref_dw, 3 * E * E), TOLERANCE);
    clmha_saved_release(saved);
    clmha_layer_release(layer);
    free(w_in), free(w_out), free(b_in), free(b_out), free(x), free(gy);
    clmha_context_release(ctx);
}
