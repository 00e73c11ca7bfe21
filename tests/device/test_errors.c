// Wrong calls: every public entry point is given bad arguments and must refuse them with the
// documented status, a message that names the culprit, and no side effect (outputs untouched,
// *event and *out set to NULL, parameters unchanged).
//
// The table `rows` lists the wrong calls. A row is one of:
//  - a forward row (.wrong): a valid self-attention call (E 8, 2 heads, L 3, N 2,
//    sequence-first) that .wrong breaks, made through the host forward, the device forward
//    and/or the CPU reference, as .paths says;
//  - a descriptor row (.wrong_desc): a valid descriptor that .wrong_desc breaks, given to
//    clmha_layer_create and/or clmha_reference_forward;
//  - a parameter row (.paths SET and/or GET): clmha_layer_set_parameter / get_parameter with
//    .name, .count and .null_data;
//  - any other call (.misc).
// Each (row, path) pair is one wrong call. The paths that need no device (the CPU reference,
// NULL out pointers, device selection) run even where no OpenCL device exists; the test is then
// reported as skipped once they have passed.
//
// Messages: before every call the context's message and the thread's creation message are set
// to a known marker, so a call that fails without writing a message is seen as having none
// (and not credited with an older message). CLMHA_TEST_VERBOSE=1 prints every call's status
// and message.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SENTINEL 12345.0f
#define CAP 512  // floats in every host array, more than any valid tensor used here holds
#define MSG_SIZE 4096
#define MARKER "#stale-marker#"
#define BAD_PTR(type) ((type *)(uintptr_t)1)  // a pointer the library must overwrite with NULL

// The valid call every forward row starts from.
enum { E = 8, H = 2, L = 3, N = 2, S = 3, S_CROSS = 4 };

// Host data: inputs and masks (zeros), parameters (zeros), output fill (SENTINEL).
static float q_data[CAP], k_data[CAP], v_data[CAP], mask_data[CAP];  // zeros
static const float zeros[CAP];
static float sentinels[CAP];

// ---- layers ------------------------------------------------------------------------------------

typedef enum which_layer {
    L_DEFAULT,    // E 8, 2 heads, bias
    L_NO_BIAS,    // bias = false
    L_KDIM,       // kdim = vdim = 4
    L_KDIM_VDIM,  // kdim 4, vdim 6
    L_COUNT
} which_layer;

static const clmha_layer_desc layer_descs[L_COUNT] = {
#define DESC_SIZE .struct_size = sizeof(clmha_layer_desc)
    [L_DEFAULT] = {DESC_SIZE, .embed_dim = E, .num_heads = H, .bias = true},
    [L_NO_BIAS] = {DESC_SIZE, .embed_dim = E, .num_heads = H, .bias = false},
    [L_KDIM] = {DESC_SIZE, .embed_dim = E, .num_heads = H, .kdim = 4, .vdim = 4, .bias = true},
    [L_KDIM_VDIM] = {DESC_SIZE, .embed_dim = E, .num_heads = H, .kdim = 4, .vdim = 6,
                     .bias = true},
#undef DESC_SIZE
};

// ---- one test's state --------------------------------------------------------------------------

typedef struct env {
    clmha_context *ctx;    // NULL where no device exists
    clmha_context *other;  // a second context on the same device, made on first use
    clmha_layer *layers[L_COUNT];
    char create_marker[MSG_SIZE];  // clmha_last_create_error() right after marking
    int failures;                  // failed expectations so far
} env;

#define EXPECT(e, cond, ...)                  \
    do {                                      \
        bool ok_ = (cond);                    \
        if (!ok_) ++(e)->failures;            \
        cr_expect(ok_, __VA_ARGS__);          \
    } while (0)

static clmha_layer *layer(env *e, which_layer w) {
    if (!e->layers[w]) {
        clmha_status st = clmha_layer_create(&e->layers[w], e->ctx, &layer_descs[w]);
        cr_assert_eq(st, CLMHA_SUCCESS, "layer %d: %s", (int)w, clmha_context_last_error(e->ctx));
    }
    return e->layers[w];
}

static clmha_context *other_context(env *e) {
    if (!e->other) {
        clmha_status st = clmha_context_create(&e->other, getenv("CLMHA_DEVICE"));
        cr_assert_eq(st, CLMHA_SUCCESS, "second context: %s", clmha_last_create_error());
        cr_assert_eq(clmha_context_cl_device(e->other), clmha_context_cl_device(e->ctx),
                     "the second context is on another device");
    }
    return e->other;
}

// ---- what one call gave -------------------------------------------------------------------------

typedef struct outcome {
    const char *what, *path;
    clmha_status status;
    char msg[MSG_SIZE];  // "" when the call wrote no message
} outcome;

// Sets both message channels to a marker before a call.
static void mark(env *e) {
    if (e->ctx) clmha_layer_set_parameter(layer(e, L_DEFAULT), MARKER, zeros, 1);
    clmha_context *c = NULL;
    clmha_context_create(&c, MARKER);
    clmha_context_release(c);
    snprintf(e->create_marker, sizeof e->create_marker, "%s", clmha_last_create_error());
}

static void ctx_message(env *e, outcome *o) {
    const char *m = clmha_context_last_error(e->ctx);
    snprintf(o->msg, sizeof o->msg, "%s", strstr(m, MARKER) ? "" : m);
}

static void create_message(env *e, outcome *o) {
    const char *m = clmha_last_create_error();
    snprintf(o->msg, sizeof o->msg, "%s", strcmp(m, e->create_marker) == 0 ? "" : m);
}

// ---- forward calls ------------------------------------------------------------------------------

// One forward call under construction.
typedef struct call {
    clmha_forward_args args;
    bool null_layer, null_args, null_output, null_weights;
    size_t output_count, weights_count;  // host/reference counts; device output buffer sizes
    // Device forward only: buffer sizes in bytes (0: CAP floats), foreign buffers, events.
    size_t query_bytes, kpm_bytes, attn_bytes;
    bool query_other_ctx, output_other_ctx;
    size_t output_offset;
    cl_uint num_wait;
    bool wait_list;
} call;

static clmha_tensor tensor(size_t ndim, size_t a, size_t b, size_t c, const void *data) {
    clmha_tensor t = {.ndim = ndim, .shape = {a, b, c}, .data = data};
    return t;
}

static call valid_call(void) {
    call c = {.args = {.struct_size = sizeof c.args}, .output_count = L * N * E};
    c.args.query = tensor(3, L, N, E, q_data);
    return c;
}

static void expect_untouched(env *e, const outcome *o, const char *name, const void *data,
                             bool is_double, size_t count) {
    for (size_t i = 0; i < count; ++i) {
        double x = is_double ? ((const double *)data)[i] : (double)((const float *)data)[i];
        if (x != (double)SENTINEL) {
            EXPECT(e, false, "%s [%s]: %s[%zu] was written (%g)", o->what, o->path, name, i, x);
            return;
        }
    }
}

static void expect_buffer_untouched(env *e, const outcome *o, const char *name,
                                    cl_command_queue q, cl_mem buf, size_t count) {
    if (!buf || !count) return;
    float back[CAP];
    cl_int err = clEnqueueReadBuffer(q, buf, CL_TRUE, 0, count * sizeof(float), back, 0, NULL,
                                     NULL);
    cr_assert_eq(err, CL_SUCCESS, "clEnqueueReadBuffer: %d", err);
    expect_untouched(e, o, name, back, false, count);
}

static void run_host(env *e, which_layer w, const call *c, outcome *o) {
    static float out[CAP], weights[CAP];
    memcpy(out, sentinels, sizeof out);
    memcpy(weights, sentinels, sizeof weights);
    o->status = clmha_layer_forward_host(c->null_layer ? NULL : layer(e, w),
                                         c->null_args ? NULL : &c->args,
                                         c->null_output ? NULL : out, c->output_count,
                                         c->null_weights ? NULL : weights, c->weights_count);
    ctx_message(e, o);
    expect_untouched(e, o, "output", out, false, CAP);
    expect_untouched(e, o, "weights", weights, false, CAP);
}

static cl_mem make_buffer(cl_context cl, const void *data, size_t bytes) {
    if (!data || !bytes) return NULL;
    cl_int err;
    cl_mem m = clCreateBuffer(cl, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, bytes, (void *)data,
                              &err);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer(%zu bytes): %d", bytes, err);
    return m;
}

static void run_device(env *e, which_layer w, const call *c, outcome *o) {
    clmha_layer *l = c->null_layer ? NULL : layer(e, w);
    clmha_context *other = c->query_other_ctx || c->output_other_ctx ? other_context(e) : NULL;
    cl_context cl = clmha_context_cl_context(e->ctx);
    clmha_forward_args a = c->args;
    const size_t full = CAP * sizeof(float);
    a.query.buffer = make_buffer(c->query_other_ctx ? clmha_context_cl_context(other) : cl,
                                 a.query.data, c->query_bytes ? c->query_bytes : full);
    a.key.buffer = make_buffer(cl, a.key.data, full);
    a.value.buffer = make_buffer(cl, a.value.data, full);
    a.key_padding_mask.tensor.buffer =
        make_buffer(cl, a.key_padding_mask.tensor.data, c->kpm_bytes ? c->kpm_bytes : full);
    a.attn_mask.tensor.buffer =
        make_buffer(cl, a.attn_mask.tensor.data, c->attn_bytes ? c->attn_bytes : full);
    clmha_context *out_ctx = c->output_other_ctx ? other : e->ctx;
    cl_mem out = c->null_output ? NULL
                                : make_buffer(clmha_context_cl_context(out_ctx), sentinels,
                                              c->output_count * sizeof(float));
    cl_mem weights = a.need_weights && !c->null_weights
                         ? make_buffer(cl, sentinels, c->weights_count * sizeof(float))
                         : NULL;
    cl_event none = NULL;
    cl_event ev = BAD_PTR(struct _cl_event);
    o->status = clmha_layer_forward(l, c->null_args ? NULL : &a, out, c->output_offset, weights,
                                    0, c->num_wait, c->wait_list ? &none : NULL, &ev);
    ctx_message(e, o);
    EXPECT(e, ev == NULL, "%s [%s]: *event is %p, not NULL", o->what, o->path, (void *)ev);
    if (ev && ev != BAD_PTR(struct _cl_event)) clReleaseEvent(ev);
    clFinish(clmha_context_cl_queue(e->ctx));
    expect_buffer_untouched(e, o, "output", clmha_context_cl_queue(out_ctx), out,
                            c->output_count);
    expect_buffer_untouched(e, o, "weights", clmha_context_cl_queue(e->ctx), weights,
                            c->weights_count);
    cl_mem all[] = {a.query.buffer, a.key.buffer, a.value.buffer,
                    a.key_padding_mask.tensor.buffer, a.attn_mask.tensor.buffer, out, weights};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i)
        if (all[i]) clReleaseMemObject(all[i]);
}

static void run_reference(env *e, const clmha_layer_desc *desc, const call *c, outcome *o) {
    static double out[CAP], weights[CAP];
    for (size_t i = 0; i < CAP; ++i) out[i] = weights[i] = SENTINEL;
    // Every parameter given: only the descriptor and the arguments can be wrong.
    clmha_reference_params p = {.struct_size = sizeof p, zeros, zeros, zeros, zeros, zeros,
                                zeros, zeros, zeros, zeros};
    snprintf(o->msg, sizeof o->msg, "%s", MARKER);
    o->status = clmha_reference_forward(desc, &p, c->null_args ? NULL : &c->args,
                                        c->null_output ? NULL : out, c->output_count,
                                        c->null_weights ? NULL : weights, c->weights_count,
                                        o->msg, sizeof o->msg);
    if (strstr(o->msg, MARKER)) o->msg[0] = '\0';
    expect_untouched(e, o, "output", out, true, CAP);
    expect_untouched(e, o, "weights", weights, true, CAP);
}

// ---- what .wrong does to the valid call ---------------------------------------------------------

static void cross(call *c) {  // key and value of S_CROSS positions
    c->args.key = tensor(3, S_CROSS, N, E, k_data);
    c->args.value = tensor(3, S_CROSS, N, E, v_data);
}
static void unbatched(call *c) {
    c->args.query = tensor(2, L, E, 0, q_data);
    c->output_count = L * E;
}
static void set_kpm(call *c, clmha_mask_kind kind, size_t ndim, size_t a, size_t b) {
    c->args.key_padding_mask =
        (clmha_mask){.kind = kind, .tensor = tensor(ndim, a, b, 0, mask_data)};
}
static void set_attn(call *c, clmha_mask_kind kind, size_t ndim, size_t a, size_t b, size_t d) {
    c->args.attn_mask = (clmha_mask){.kind = kind, .tensor = tensor(ndim, a, b, d, mask_data)};
}
static void want_weights(call *c, bool per_head) {
    c->args.need_weights = true;
    c->args.per_head_weights = per_head;
    c->weights_count = (per_head ? H : 1) * N * L * S;
}

static void null_layer(call *c) { c->null_layer = true; }
static void null_args(call *c) { c->null_args = true; }
static void null_output(call *c) { c->null_output = true; }
static void query_0d(call *c) { c->args.query.ndim = 0; }
static void query_1d(call *c) { c->args.query = tensor(1, E, 0, 0, q_data); }
static void query_4d(call *c) {
    c->args.query = tensor(4, 1, L, N, q_data);
    c->args.query.shape[3] = E;
}
static void query_5d(call *c) { c->args.query.ndim = 5; }  // more than clmha_tensor holds
static void query_features(call *c) { c->args.query.shape[2] = E - 1; }
static void query_zero_len(call *c) { c->args.query.shape[0] = 0; }
static void query_zero_batch(call *c) { c->args.query.shape[1] = 0; }
static void unbatched_zero_len(call *c) { c->args.query = tensor(2, 0, E, 0, q_data); }
static void key_zero_len(call *c) {
    cross(c);
    c->args.key.shape[0] = c->args.value.shape[0] = 0;
}
static void key_batch(call *c) {
    cross(c);
    c->args.key.shape[1] = c->args.value.shape[1] = N + 1;
}
static void value_batch(call *c) {
    cross(c);
    c->args.value.shape[1] = N + 1;
}
static void value_len(call *c) {
    cross(c);
    c->args.value.shape[0] = S_CROSS + 1;
}
static void key_features(call *c) {
    cross(c);
    c->args.key.shape[2] = E - 2;
}
static void key_2d(call *c) {
    c->args.key = tensor(2, S_CROSS, E, 0, k_data);
    c->args.value = tensor(2, S_CROSS, E, 0, v_data);
}
static void value_without_key(call *c) { c->args.value = tensor(3, L, N, E, v_data); }
static void self_attention(call *c) { (void)c; }  // the valid call, on a kdim != E layer
static void kdim_key_features(call *c) {  // layer kdim = vdim = 4, key has E features
    c->args.key = tensor(3, S_CROSS, N, E, k_data);
    c->args.value = tensor(3, S_CROSS, N, 4, v_data);
}
static void kdim_value_features(call *c) {
    c->args.key = tensor(3, S_CROSS, N, 4, k_data);
    c->args.value = tensor(3, S_CROSS, N, E, v_data);
}
static void value_defaults_to_key(call *c) {  // layer kdim 4, vdim 6
    c->args.key = tensor(3, S_CROSS, N, 4, k_data);
}

static void kpm_shape(call *c) { set_kpm(c, CLMHA_MASK_BOOL_IGNORE, 2, N, S + 1); }
static void kpm_transposed(call *c) { set_kpm(c, CLMHA_MASK_BOOL_IGNORE, 2, S, N); }
static void kpm_1d_batched(call *c) { set_kpm(c, CLMHA_MASK_BOOL_IGNORE, 1, S, 0); }
static void kpm_kind_none(call *c) { set_kpm(c, CLMHA_MASK_NONE, 2, N, S); }
static void kpm_kind_42(call *c) { set_kpm(c, (clmha_mask_kind)42, 2, N, S); }
static void kpm_per_batch(call *c) {
    set_kpm(c, CLMHA_MASK_BOOL_IGNORE, 2, N, S);
    c->args.key_padding_mask.per_batch = true;
}
static void kpm_null_data(call *c) {
    set_kpm(c, CLMHA_MASK_BOOL_IGNORE, 2, N, S);
    c->args.key_padding_mask.tensor.data = NULL;
}
static void kpm_float_in_bool_buffer(call *c) {  // N*S bytes: enough for bool, not for float
    set_kpm(c, CLMHA_MASK_FLOAT, 2, N, S);
    c->kpm_bytes = N * S;
}
static void attn_kind_minus_1(call *c) { set_attn(c, (clmha_mask_kind)-1, 2, L, S, 0); }
static void attn_shape(call *c) { set_attn(c, CLMHA_MASK_BOOL_IGNORE, 2, L, S + 1, 0); }
static void attn_3d_batch_not_heads(call *c) { set_attn(c, CLMHA_MASK_FLOAT, 3, N, L, S); }
static void attn_unbatched_3d(call *c) {  // unbatched 3-D masks are (H, L, S)
    unbatched(c);
    set_attn(c, CLMHA_MASK_FLOAT, 3, 1, L, S);
}
static void per_batch_unbatched(call *c) {
    unbatched(c);
    set_attn(c, CLMHA_MASK_BOOL_IGNORE, 3, 1, L, S);
    c->args.attn_mask.per_batch = true;
}
static void per_batch_heads_shape(call *c) {
    set_attn(c, CLMHA_MASK_BOOL_IGNORE, 3, N * H, L, S);
    c->args.attn_mask.per_batch = true;
}
static void attn_none_per_batch(call *c) { c->args.attn_mask.per_batch = true; }
static void attn_null_data(call *c) {
    set_attn(c, CLMHA_MASK_FLOAT, 2, L, S, 0);
    c->args.attn_mask.tensor.data = NULL;
}
static void attn_buffer_short(call *c) {
    set_attn(c, CLMHA_MASK_FLOAT, 2, L, S, 0);
    c->attn_bytes = (L * S - 1) * sizeof(float);
}

static void weights_null(call *c) {
    want_weights(c, false);
    c->null_weights = true;
}
static void output_count_short(call *c) { c->output_count -= 1; }
static void weights_count_short(call *c) {
    want_weights(c, false);
    c->weights_count -= 1;
}
static void per_head_count_averaged(call *c) {
    want_weights(c, true);
    c->weights_count = N * L * S;
}
static void weights_count_without_need(call *c) { c->weights_count = 5; }
static void query_null_data(call *c) { c->args.query.data = NULL; }
static void impl_7(call *c) { c->args.impl = (clmha_impl)7; }
static void fused_with_weights(call *c) {
    want_weights(c, false);
    c->args.impl = CLMHA_IMPL_FUSED;
}
static void key_null_data(call *c) {
    cross(c);
    c->args.key.data = NULL;
}

// Query (SIZE_MAX/2, 4, E): every shape check passes (E features, no zero size, key and value
// default to the query), so the first check to fail is the element count of the query, which
// overflows size_t: CLMHA_SIZE_OVERFLOW, not CLMHA_SHAPE_MISMATCH.
static void query_overflow(call *c) { c->args.query = tensor(3, SIZE_MAX / 2, 4, E, q_data); }
// Inputs whose element counts fit (key: SIZE_MAX/64 * E floats) but whose score matrix
// N*H*L*S (2 * 8 * SIZE_MAX/64) does not fit in SIZE_MAX / sizeof(double) elements.
static void scores_overflow(call *c) {
    c->args.query = tensor(3, 8, 1, E, q_data);
    c->args.key = tensor(3, SIZE_MAX / 64, 1, E, k_data);
}
// L = S = 2^(bits/2): the inputs fit, the (L, S) attn_mask has 2^bits elements.
static void attn_overflow(call *c) {
    size_t big = (size_t)1 << (sizeof(size_t) * 4);
    c->args.query = tensor(3, big, 1, E, q_data);
    c->args.key = tensor(3, big, 1, E, k_data);
    set_attn(c, CLMHA_MASK_FLOAT, 2, big, big, 0);
}

static void query_buffer_short(call *c) { c->query_bytes = (L * N * E - 1) * sizeof(float); }
static void query_other_context(call *c) { c->query_other_ctx = true; }
static void output_other_context(call *c) { c->output_other_ctx = true; }
static void wait_count_without_list(call *c) { c->num_wait = 1; }
static void wait_list_without_count(call *c) { c->wait_list = true; }
static void query_offset_huge(call *c) { c->args.query.offset = SIZE_MAX; }
static void output_offset_past_end(call *c) { c->output_offset = 1; }

// ---- what .wrong_desc does to a valid descriptor -----------------------------------------------

static const clmha_layer_desc *desc_null(clmha_layer_desc *d) {
    (void)d;
    return NULL;
}
static const clmha_layer_desc *embed_dim_0(clmha_layer_desc *d) {
    d->embed_dim = 0;
    return d;
}
static const clmha_layer_desc *num_heads_0(clmha_layer_desc *d) {
    d->num_heads = 0;
    return d;
}
static const clmha_layer_desc *not_divisible(clmha_layer_desc *d) {
    d->embed_dim = 10;
    d->num_heads = 4;
    return d;
}
static const clmha_layer_desc *dropout_negative(clmha_layer_desc *d) {
    d->dropout = -0.1f;
    return d;
}
static const clmha_layer_desc *dropout_one(clmha_layer_desc *d) {
    d->dropout = 1.0f;
    return d;
}
static const clmha_layer_desc *dropout_nan(clmha_layer_desc *d) {
    d->dropout = NAN;
    return d;
}
static const clmha_layer_desc *embed_dim_overflow(clmha_layer_desc *d) {
    d->embed_dim = SIZE_MAX / 4;  // (3E, E) floats overflow
    d->num_heads = 1;
    return d;
}
static const clmha_layer_desc *kdim_too_large(clmha_layer_desc *d) {
    d->kdim = (size_t)1 << 40;  // fits size_t; (E, kdim) floats = 32 TiB, more than any device
    return d;
}
static const clmha_layer_desc *kdim_overflow(clmha_layer_desc *d) {
    d->kdim = SIZE_MAX / 2;  // (E, kdim) floats overflow
    return d;
}

// ---- other calls --------------------------------------------------------------------------------

static bool create_null_out(env *e, outcome *o) {
    o->status = clmha_context_create(NULL, NULL);
    create_message(e, o);
    return true;
}

static bool create_spec(env *e, outcome *o, const char *spec) {
    clmha_context *c = BAD_PTR(clmha_context);
    o->status = clmha_context_create(&c, spec);
    create_message(e, o);
    EXPECT(e, c == NULL, "%s: *out is %p, not NULL", o->what, (void *)c);
    if (c && c != BAD_PTR(clmha_context)) clmha_context_release(c);
    return true;
}
static bool create_unknown_name(env *e, outcome *o) {
    return create_spec(e, o, "no-such-device-xyz");
}
static bool create_unknown_index(env *e, outcome *o) { return create_spec(e, o, "99:0"); }
// Index pairs that sscanf("%u:%u") used to wrap to 0:0.
static bool create_wrapped_index(env *e, outcome *o) {
    return create_spec(e, o, "4294967296:0");
}
static bool create_negative_index(env *e, outcome *o) {
    return create_spec(e, o, "-4294967296:0");
}

static bool from_cl_null_out(env *e, outcome *o) {
    o->status = clmha_context_create_from_cl(NULL, NULL, NULL, NULL);
    create_message(e, o);
    return true;
}

// clmha_context_create_from_cl(&c, context, device, queue) must refuse, leave c NULL, and keep
// no reference to the caller's objects.
static void from_cl(env *e, outcome *o, cl_context context, cl_device_id device,
                    cl_command_queue queue) {
    cl_uint ctx_refs = 0, queue_refs = 0, after = 0;
    if (context)
        clGetContextInfo(context, CL_CONTEXT_REFERENCE_COUNT, sizeof ctx_refs, &ctx_refs, NULL);
    if (queue)
        clGetCommandQueueInfo(queue, CL_QUEUE_REFERENCE_COUNT, sizeof queue_refs, &queue_refs,
                              NULL);
    clmha_context *c = BAD_PTR(clmha_context);
    o->status = clmha_context_create_from_cl(&c, context, device, queue);
    create_message(e, o);
    EXPECT(e, c == NULL, "%s: *out is %p, not NULL", o->what, (void *)c);
    if (c && c != BAD_PTR(clmha_context)) clmha_context_release(c);
    if (context) {
        clGetContextInfo(context, CL_CONTEXT_REFERENCE_COUNT, sizeof after, &after, NULL);
        EXPECT(e, after == ctx_refs, "%s: context references %u -> %u", o->what, ctx_refs, after);
    }
    if (queue) {
        clGetCommandQueueInfo(queue, CL_QUEUE_REFERENCE_COUNT, sizeof after, &after, NULL);
        EXPECT(e, after == queue_refs, "%s: queue references %u -> %u", o->what, queue_refs, after);
    }
}
static bool from_cl_nulls(env *e, outcome *o) {
    from_cl(e, o, NULL, NULL, NULL);
    return true;
}
static bool from_cl_null_queue(env *e, outcome *o) {
    from_cl(e, o, clmha_context_cl_context(e->ctx), clmha_context_cl_device(e->ctx), NULL);
    return true;
}
static bool from_cl_foreign_queue(env *e, outcome *o) {
    from_cl(e, o, clmha_context_cl_context(e->ctx), clmha_context_cl_device(e->ctx),
            clmha_context_cl_queue(other_context(e)));
    return true;
}
static bool from_cl_out_of_order(env *e, outcome *o) {
    cl_int err;
    cl_command_queue q = clCreateCommandQueue(clmha_context_cl_context(e->ctx),
                                              clmha_context_cl_device(e->ctx),
                                              CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE, &err);
    if (err != CL_SUCCESS) return false;  // the device has no out-of-order queues
    from_cl(e, o, clmha_context_cl_context(e->ctx), clmha_context_cl_device(e->ctx), q);
    clReleaseCommandQueue(q);
    return true;
}

static bool select_null_out(env *e, outcome *o) {
    (void)e;
    o->status = clmha_device_select(NULL, NULL, o->msg, sizeof o->msg);
    return true;
}
static bool count_null_count(env *e, outcome *o) {
    (void)e;
    o->status = clmha_device_count(NULL);
    return true;
}
static bool describe_null_info(env *e, outcome *o) {
    (void)e;
    o->status = clmha_device_describe(0, NULL);
    return true;
}

static bool layer_null_out(env *e, outcome *o) {
    o->status = clmha_layer_create(NULL, e->ctx, &layer_descs[L_DEFAULT]);
    ctx_message(e, o);
    return true;
}
static bool layer_null_ctx(env *e, outcome *o) {
    clmha_layer *l = BAD_PTR(clmha_layer);
    o->status = clmha_layer_create(&l, NULL, &layer_descs[L_DEFAULT]);
    EXPECT(e, l == NULL, "%s: *out is %p, not NULL", o->what, (void *)l);
    return true;
}
static bool set_impl_null(env *e, outcome *o) {
    (void)e;
    o->status = clmha_layer_set_impl(NULL, CLMHA_IMPL_FUSED);
    return true;
}
static bool set_impl_bad(env *e, outcome *o) {
    o->status = clmha_layer_set_impl(layer(e, L_DEFAULT), (clmha_impl)-1);
    ctx_message(e, o);
    return true;
}
// A layer set to the fused core, called with need_weights: refused, nothing written.
static bool weights_on_fused_layer(env *e, outcome *o) {
    clmha_layer *l = layer(e, L_DEFAULT);
    EXPECT(e, clmha_layer_set_impl(l, CLMHA_IMPL_FUSED) == CLMHA_SUCCESS, "set_impl fused");
    call c = valid_call();
    want_weights(&c, false);
    mark(e);
    run_host(e, L_DEFAULT, &c, o);
    clmha_layer_set_impl(l, CLMHA_IMPL_AUTO);
    return true;
}
static bool bake_zero(env *e, outcome *o) {
    o->status = clmha_layer_bake(layer(e, L_DEFAULT), 0, L, S, false);
    ctx_message(e, o);
    return true;
}
static bool bake_overflow(env *e, outcome *o) {
    o->status = clmha_layer_bake(layer(e, L_DEFAULT), SIZE_MAX / 2, 1, 1, false);
    ctx_message(e, o);
    return true;
}
static bool bake_too_large(env *e, outcome *o) {  // fits size_t, not the device
    o->status = clmha_layer_bake(layer(e, L_DEFAULT), (size_t)1 << 40, 1, 1, false);
    ctx_message(e, o);
    return true;
}
static bool output_counts_null_args(env *e, outcome *o) {
    size_t out = 7, weights = 7;
    o->status = clmha_layer_output_counts(layer(e, L_DEFAULT), NULL, &out, &weights);
    ctx_message(e, o);
    EXPECT(e, out == 7 && weights == 7, "%s: counts written (%zu, %zu)", o->what, out, weights);
    return true;
}
static bool output_counts_query_1d(env *e, outcome *o) {
    call c = valid_call();
    query_1d(&c);
    o->status = clmha_layer_output_counts(layer(e, L_DEFAULT), &c.args, NULL, NULL);
    ctx_message(e, o);
    return true;
}
static bool get_desc_null(env *e, outcome *o) {
    (void)e;
    clmha_layer_desc d = {.struct_size = sizeof d};
    o->status = clmha_layer_get_desc(NULL, &d);
    return true;
}
static bool set_attention_null(env *e, outcome *o) {
    (void)e;
    o->status = clmha_layer_set_attention(NULL, NULL, NULL);
    return true;
}

// ---- the table ----------------------------------------------------------------------------------

enum path {
    HOST = 1 << 0,    // clmha_layer_forward_host
    DEVICE = 1 << 1,  // clmha_layer_forward
    REF = 1 << 2,     // clmha_reference_forward
    CREATE = 1 << 3,  // clmha_layer_create
    SET = 1 << 4,     // clmha_layer_set_parameter
    GET = 1 << 5,     // clmha_layer_get_parameter
    MISC = 1 << 6,    // the row's .misc, which needs a device
    MISC_NO_DEVICE = 1 << 7,  // the row's .misc, which needs none
};
#define ALL (HOST | DEVICE | REF)
#define PATH_COUNT 8
static const char *const path_names[PATH_COUNT] = {
    "host", "device", "reference", "layer_create", "set_parameter", "get_parameter", "call", "call"};
static const unsigned needs_device = HOST | DEVICE | CREATE | SET | GET | MISC;

typedef struct row {
    const char *what;
    unsigned paths;
    clmha_status want;
    const char *msg_has;  // NULL: the call has nowhere to put a message
    which_layer layer;
    void (*wrong)(call *c);
    const clmha_layer_desc *(*wrong_desc)(clmha_layer_desc *d);
    const char *name;  // parameter rows
    size_t count;
    bool null_data;
    bool (*misc)(env *e, outcome *o);  // false: the row does not apply here (skipped)
} row;

#define INV CLMHA_INVALID_ARGUMENT
#define SHAPE CLMHA_SHAPE_MISMATCH
#define MASK CLMHA_INVALID_MASK
#define OVERFLOW CLMHA_SIZE_OVERFLOW

static const row rows[] = {
    // Contexts and devices.
    {"context_create: NULL out", MISC_NO_DEVICE, INV, "out", .misc = create_null_out},
    {"context_create: spec matching no device", MISC, CLMHA_DEVICE_NOT_FOUND,
     "no-such-device-xyz", .misc = create_unknown_name},
    {"context_create: spec 99:0", MISC, CLMHA_DEVICE_NOT_FOUND, "99:0",
     .misc = create_unknown_index},
    {"context_create: spec 4294967296:0", MISC_NO_DEVICE, INV, "\"4294967296:0\"",
     .misc = create_wrapped_index},
    {"context_create: spec -4294967296:0", MISC_NO_DEVICE, INV, "\"-4294967296:0\"",
     .misc = create_negative_index},
    {"context_create_from_cl: NULL out", MISC_NO_DEVICE, INV, "out", .misc = from_cl_null_out},
    {"context_create_from_cl: NULL context, device, queue", MISC_NO_DEVICE, INV, "context",
     .misc = from_cl_nulls},
    {"context_create_from_cl: NULL queue", MISC, INV, "queue", .misc = from_cl_null_queue},
    {"context_create_from_cl: queue of another context", MISC, INV, "another cl_context",
     .misc = from_cl_foreign_queue},
    {"context_create_from_cl: out-of-order queue", MISC, INV, "out-of-order",
     .misc = from_cl_out_of_order},
    {"device_select: NULL out", MISC_NO_DEVICE, INV, "out", .misc = select_null_out},
    {"device_count: NULL count", MISC_NO_DEVICE, INV, NULL, .misc = count_null_count},
    {"device_describe: NULL info", MISC_NO_DEVICE, INV, NULL, .misc = describe_null_info},

    // Layer creation (and the same descriptors given to the CPU reference).
    {"layer_create: NULL out", MISC, INV, "out", .misc = layer_null_out},
    {"layer_create: NULL ctx", MISC_NO_DEVICE, INV, NULL, .misc = layer_null_ctx},
    {"desc: NULL", CREATE | REF, INV, "desc", .wrong_desc = desc_null},
    {"desc: embed_dim 0", CREATE | REF, INV, "embed_dim", .wrong_desc = embed_dim_0},
    {"desc: num_heads 0", CREATE | REF, INV, "num_heads", .wrong_desc = num_heads_0},
    {"desc: embed_dim 10, num_heads 4", CREATE | REF, INV, "divisible by num_heads",
     .wrong_desc = not_divisible},
    {"desc: dropout -0.1", CREATE | REF, INV, "dropout", .wrong_desc = dropout_negative},
    {"desc: dropout 1.0", CREATE | REF, INV, "dropout", .wrong_desc = dropout_one},
    {"desc: dropout NaN", CREATE | REF, INV, "dropout", .wrong_desc = dropout_nan},
    {"desc: embed_dim SIZE_MAX/4", CREATE | REF, OVERFLOW, "embed_dim",
     .wrong_desc = embed_dim_overflow},
    {"desc: kdim SIZE_MAX/2", CREATE | REF, OVERFLOW, "kdim", .wrong_desc = kdim_overflow},
    {"desc: kdim 2^40 (parameters larger than the device)", CREATE, CLMHA_OUT_OF_MEMORY,
     "kdim", .wrong_desc = kdim_too_large},

    // Parameters.
    {"parameter: NULL name", SET | GET, INV, "name", .name = NULL, .count = 3 * E * E},
    {"parameter: NULL data", SET | GET, INV, "data", .name = "in_proj_weight",
     .count = 3 * E * E, .null_data = true},
    {"parameter: unknown name", SET | GET, INV, "in_proj_weights", .name = "in_proj_weights",
     .count = 3 * E * E},
    {"parameter: in_proj_weight count 3E*E - 1", SET | GET, SHAPE, "in_proj_weight",
     .name = "in_proj_weight", .count = 3 * E * E - 1},
    {"parameter: in_proj_bias of a bias=false layer", SET | GET, INV, "in_proj_bias",
     .layer = L_NO_BIAS, .name = "in_proj_bias", .count = 3 * E},
    {"parameter: out_proj.bias of a bias=false layer", SET | GET, INV, "out_proj.bias",
     .layer = L_NO_BIAS, .name = "out_proj.bias", .count = E},
    {"parameter: bias_k without add_bias_kv", SET | GET, INV, "bias_k", .name = "bias_k",
     .count = E},
    {"parameter: in_proj_weight of a kdim != E layer", SET | GET, INV, "in_proj_weight",
     .layer = L_KDIM, .name = "in_proj_weight", .count = 3 * E * E},
    {"parameter: k_proj_weight count E*E on a kdim 4 layer", SET | GET, SHAPE, "k_proj_weight",
     .layer = L_KDIM, .name = "k_proj_weight", .count = E * E},

    // Forward: handles and outputs.
    {"forward: NULL layer", HOST | DEVICE, INV, NULL, .wrong = null_layer},
    {"forward: NULL args", ALL, INV, "args", .wrong = null_args},
    {"forward: NULL output", ALL, INV, "output", .wrong = null_output},
    {"forward: need_weights with NULL weights", ALL, INV, "weights", .wrong = weights_null},
    {"forward: output_count 47 (48 needed)", HOST | REF, SHAPE, "output",
     .wrong = output_count_short},
    {"forward: output buffer of 47 floats (48 needed)", DEVICE, INV, "output",
     .wrong = output_count_short},
    {"forward: weights_count 17 (18 needed)", HOST | REF, SHAPE, "weights",
     .wrong = weights_count_short},
    {"forward: weights buffer of 17 floats (18 needed)", DEVICE, INV, "weights",
     .wrong = weights_count_short},
    {"forward: per-head weights_count of the averaged weights", HOST | REF, SHAPE, "weights",
     .wrong = per_head_count_averaged},
    {"forward: weights_count 5 without need_weights", REF, SHAPE, "weights_count",
     .wrong = weights_count_without_need},
    {"forward: impl 7", HOST | DEVICE, INV, "impl 7", .wrong = impl_7},
    {"forward: impl fused with need_weights", HOST | DEVICE, INV, "fused",
     .wrong = fused_with_weights},

    // Forward: query, key and value shapes.
    {"forward: query 0-D", ALL, SHAPE, "query", .wrong = query_0d},
    {"forward: query 1-D", ALL, SHAPE, "query", .wrong = query_1d},
    {"forward: query 4-D", ALL, SHAPE, "query", .wrong = query_4d},
    {"forward: query ndim 5", ALL, SHAPE, "query", .wrong = query_5d},
    {"forward: query with E - 1 features", ALL, SHAPE, "query", .wrong = query_features},
    {"forward: query L = 0", ALL, SHAPE, "query", .wrong = query_zero_len},
    {"forward: query N = 0", ALL, SHAPE, "query", .wrong = query_zero_batch},
    {"forward: unbatched query L = 0", ALL, SHAPE, "query", .wrong = unbatched_zero_len},
    {"forward: key S = 0", ALL, SHAPE, "key", .wrong = key_zero_len},
    {"forward: key batch != query batch", ALL, SHAPE, "key (4, 3, 8)", .wrong = key_batch},
    {"forward: value batch != query batch", ALL, SHAPE, "value", .wrong = value_batch},
    {"forward: key and value source lengths differ", ALL, SHAPE, "value (5, 2, 8)",
     .wrong = value_len},
    {"forward: key features != kdim", ALL, SHAPE, "key", .wrong = key_features},
    {"forward: key 2-D with a 3-D query", ALL, SHAPE, "key", .wrong = key_2d},
    {"forward: value without key", ALL, INV, "key", .wrong = value_without_key},
    {"forward: self-attention on a kdim != E layer", ALL, SHAPE, "kdim", .layer = L_KDIM,
     .wrong = self_attention},
    {"forward: key with E features on a kdim 4 layer", ALL, SHAPE, "key", .layer = L_KDIM,
     .wrong = kdim_key_features},
    {"forward: value with E features on a vdim 4 layer", ALL, SHAPE, "value", .layer = L_KDIM,
     .wrong = kdim_value_features},
    {"forward: value defaults to key but kdim != vdim", ALL, SHAPE, "vdim",
     .layer = L_KDIM_VDIM, .wrong = value_defaults_to_key},
    {"forward: query data NULL", ALL, INV, "query", .wrong = query_null_data},
    {"forward: key data NULL", ALL, INV, "key", .wrong = key_null_data},

    // Forward: masks.
    {"forward: key_padding_mask (N, S+1)", ALL, MASK, "key_padding_mask", .wrong = kpm_shape},
    {"forward: key_padding_mask (S, N)", ALL, MASK, "key_padding_mask", .wrong = kpm_transposed},
    {"forward: key_padding_mask 1-D on batched input", ALL, MASK, "key_padding_mask",
     .wrong = kpm_1d_batched},
    {"forward: key_padding_mask with kind NONE", ALL, MASK, "key_padding_mask",
     .wrong = kpm_kind_none},
    {"forward: key_padding_mask kind 42", ALL, MASK, "key_padding_mask", .wrong = kpm_kind_42},
    {"forward: key_padding_mask per_batch", ALL, MASK, "per_batch", .wrong = kpm_per_batch},
    {"forward: attn_mask kind -1", ALL, MASK, "attn_mask", .wrong = attn_kind_minus_1},
    {"forward: attn_mask (L, S+1)", ALL, MASK, "attn_mask", .wrong = attn_shape},
    {"forward: attn_mask (N, L, S) without per_batch", ALL, MASK, "attn_mask",
     .wrong = attn_3d_batch_not_heads},
    {"forward: unbatched attn_mask (1, L, S) with 2 heads", ALL, MASK, "attn_mask",
     .wrong = attn_unbatched_3d},
    {"forward: attn_mask per_batch on unbatched input", ALL, MASK, "per_batch",
     .wrong = per_batch_unbatched},
    {"forward: attn_mask per_batch with (N*H, L, S)", ALL, MASK, "per_batch",
     .wrong = per_batch_heads_shape},
    {"forward: attn_mask per_batch with kind NONE", ALL, MASK, "attn_mask",
     .wrong = attn_none_per_batch},
    // A NULL mask pointer is an invalid argument on every path, and the message names the mask.
    {"forward: key_padding_mask data NULL", ALL, INV, "key_padding_mask",
     .wrong = kpm_null_data},
    {"forward: attn_mask data NULL", ALL, INV, "attn_mask", .wrong = attn_null_data},

    // Forward: sizes that overflow size_t.
    {"forward: query (SIZE_MAX/2, 4, E)", ALL, OVERFLOW, "query (", .wrong = query_overflow},
    {"forward: N*H*L*S overflows", ALL, OVERFLOW, "overflow", .wrong = scores_overflow},
    {"forward: attn_mask L*S overflows", ALL, OVERFLOW, "attn_mask", .wrong = attn_overflow},

    // Forward on device buffers.
    {"forward: query buffer of 47 floats", DEVICE, INV, "query", .wrong = query_buffer_short},
    {"forward: query offset SIZE_MAX", DEVICE, INV, "query", .wrong = query_offset_huge},
    {"forward: query buffer of another cl_context", DEVICE, INV, "query",
     .wrong = query_other_context},
    {"forward: output buffer of another cl_context", DEVICE, INV, "output",
     .wrong = output_other_context},
    {"forward: output offset 1 in an exact buffer", DEVICE, INV, "output",
     .wrong = output_offset_past_end},
    {"forward: float key_padding_mask in N*S bytes", DEVICE, INV, "key_padding_mask",
     .wrong = kpm_float_in_bool_buffer},
    {"forward: attn_mask buffer one float short", DEVICE, INV, "attn_mask",
     .wrong = attn_buffer_short},
    {"forward: num_wait 1 with NULL wait_list", DEVICE, INV, "wait_list",
     .wrong = wait_count_without_list},
    {"forward: num_wait 0 with a wait_list", DEVICE, INV, "wait_list",
     .wrong = wait_list_without_count},

    // Other layer calls.
    {"layer_set_impl: NULL layer", MISC_NO_DEVICE, INV, NULL, .misc = set_impl_null},
    {"layer_set_impl: impl -1", MISC, INV, "impl -1", .misc = set_impl_bad},
    {"forward: need_weights on a layer set to the fused core", MISC, INV, "fused",
     .misc = weights_on_fused_layer},
    {"bake: batch 0", MISC, INV, "batch", .misc = bake_zero},
    {"bake: batch SIZE_MAX/2", MISC, OVERFLOW, "query (", .misc = bake_overflow},
    {"bake: batch 2^40 (more than the device holds)", MISC, CLMHA_OUT_OF_MEMORY,
     "largest allocation",
     .misc = bake_too_large},
    {"output_counts: NULL args", MISC, INV, "args", .misc = output_counts_null_args},
    {"output_counts: query 1-D", MISC, SHAPE, "query", .misc = output_counts_query_1d},
    {"get_desc: NULL layer", MISC_NO_DEVICE, INV, NULL, .misc = get_desc_null},
    {"set_attention: NULL layer", MISC_NO_DEVICE, INV, NULL, .misc = set_attention_null},
};

// ---- running one row on one path ----------------------------------------------------------------

static void run_parameter(env *e, const row *r, unsigned path, outcome *o) {
    static float data[CAP];
    memcpy(data, sentinels, sizeof data);
    clmha_layer *l = layer(e, r->layer);
    float *p = r->null_data ? NULL : data;
    o->status = path == SET ? clmha_layer_set_parameter(l, r->name, p, r->count)
                            : clmha_layer_get_parameter(l, r->name, p, r->count);
    ctx_message(e, o);
    if (path == GET) expect_untouched(e, o, "data", data, false, CAP);
    // A refused set leaves the parameter as it was: zero (nothing here ever sets one).
    size_t count = r->name ? clmha_layer_parameter_count(l, r->name) : 0;
    if (path == SET && count > 0 && count <= CAP) {
        float back[CAP];
        cr_assert_eq(clmha_layer_get_parameter(l, r->name, back, count), CLMHA_SUCCESS);
        EXPECT(e, memcmp(back, zeros, count * sizeof(float)) == 0,
               "%s [%s]: the parameter was written", o->what, o->path);
    }
}

static void run_row(env *e, const row *r, unsigned path, outcome *o) {
    if (r->misc) return;  // run by the caller
    if (r->wrong_desc) {
        clmha_layer_desc d = layer_descs[r->layer];
        const clmha_layer_desc *desc = r->wrong_desc(&d);
        if (path == REF) {
            call c = valid_call();
            run_reference(e, desc, &c, o);
        } else {
            clmha_layer *l = BAD_PTR(clmha_layer);
            o->status = clmha_layer_create(&l, e->ctx, desc);
            ctx_message(e, o);
            EXPECT(e, l == NULL, "%s [%s]: *out is %p, not NULL", o->what, o->path, (void *)l);
            if (l && l != BAD_PTR(clmha_layer)) clmha_layer_release(l);
        }
        return;
    }
    if (!r->wrong) {
        run_parameter(e, r, path, o);
        return;
    }
    call c = valid_call();
    r->wrong(&c);
    if (path == HOST) run_host(e, r->layer, &c, o);
    if (path == DEVICE) run_device(e, r->layer, &c, o);
    if (path == REF) run_reference(e, &layer_descs[r->layer], &c, o);
}

// Runs every row on every path it names that can run here; returns the number of calls made.
static int run_rows(env *e) {
    bool verbose = getenv("CLMHA_TEST_VERBOSE") && *getenv("CLMHA_TEST_VERBOSE") == '1';
    int calls = 0;
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; ++i) {
        const row *r = &rows[i];
        for (unsigned p = 0; p < PATH_COUNT; ++p) {
            unsigned path = 1u << p;
            if (!(r->paths & path) || (!e->ctx && (path & needs_device))) continue;
            outcome o = {.what = r->what, .path = path_names[p]};
            mark(e);
            if (r->misc) {
                if (!r->misc(e, &o)) continue;  // does not apply on this device
            } else {
                run_row(e, r, path, &o);
            }
            ++calls;
            if (verbose) {
                const char *name = clmha_status_string(o.status);
                fprintf(stderr, "%-54s %-13s %-22.*s %s\n", r->what, o.path,
                        (int)strcspn(name, ":"), name, o.msg);
            }
            EXPECT(e, o.status == r->want, "%s [%s]: returned %s, expected %s (message: \"%s\")",
                   r->what, o.path, clmha_status_string(o.status), clmha_status_string(r->want),
                   o.msg);
            if (r->msg_has)
                EXPECT(e, strstr(o.msg, r->msg_has) != NULL,
                       "%s [%s]: message \"%s\" does not contain \"%s\"", r->what, o.path, o.msg,
                       r->msg_has);
        }
    }
    return calls;
}

Test(errors, wrong_calls, .timeout = 600) {
    for (size_t i = 0; i < CAP; ++i) sentinels[i] = SENTINEL;
    env e = {0};
    clmha_status st = clmha_context_create_from_env(&e.ctx);
    bool no_device = st == CLMHA_DEVICE_NOT_FOUND;
    if (!no_device)
        cr_assert_eq(st, CLMHA_SUCCESS, "clmha_context_create_from_env: %s",
                     clmha_last_create_error());
    int calls = run_rows(&e);
    fprintf(stderr, "errors: %d wrong calls checked (%zu rows)%s\n", calls,
            sizeof rows / sizeof rows[0],
            no_device ? ", no OpenCL device: device rows skipped" : "");
    for (int w = 0; w < L_COUNT; ++w) clmha_layer_release(e.layers[w]);
    clmha_context_release(e.other);
    clmha_context_release(e.ctx);
    if (no_device && e.failures == 0)
        cr_skip_test("no OpenCL device (%s): only the device-free rows ran",
                     clmha_last_create_error());
}

// ---- status strings and NULL handles ------------------------------------------------------------

Test(errors, status_strings) {
#define STATUS_VALUE(name, value, text) CLMHA_##name,
#define STATUS_TEXT(name, value, text) text,
    static const clmha_status all[] = {CLMHA_STATUS_MAP(STATUS_VALUE)};
    static const char *const texts[] = {CLMHA_STATUS_MAP(STATUS_TEXT)};
#undef STATUS_VALUE
#undef STATUS_TEXT
    size_t n = sizeof all / sizeof all[0];
    for (size_t i = 0; i < n; ++i) {
        const char *s = clmha_status_string(all[i]);
        cr_assert(s != NULL && *s, "status %d has no string", (int)all[i]);
        cr_expect_str_neq(s, "unknown status", "status %d", (int)all[i]);
        cr_expect(strstr(s, texts[i]) != NULL, "\"%s\" lacks \"%s\"", s, texts[i]);
        for (size_t j = 0; j < i; ++j)
            cr_expect_str_neq(s, clmha_status_string(all[j]), "statuses %d and %d share \"%s\"",
                              (int)all[i], (int)all[j], s);
    }
    cr_expect_str_eq(clmha_status_string((clmha_status)42), "unknown status");
    cr_expect_str_eq(clmha_status_string((clmha_status)1), "unknown status");
    cr_expect_str_eq(clmha_status_string((clmha_status)-1000), "unknown status");
}

// CLMHA_NOT_READY is what clmha_context_tuning_export() returns with no tuning applied: its text
// must not speak of layer parameters (issue 12).
Test(errors, not_ready_text_is_general) {
    const char *s = clmha_status_string(CLMHA_NOT_READY);
    cr_expect(strstr(s, "nothing to return yet") != NULL, "\"%s\"", s);
    cr_expect(strstr(s, "layer parameter") == NULL, "\"%s\"", s);
}

Test(errors, null_handles) {
    clmha_layer_release(NULL);
    clmha_context_release(NULL);
    clmha_context_retain(NULL);
    cr_expect(clmha_context_last_error(NULL) != NULL);
    cr_expect(clmha_last_create_error() != NULL);
    cr_expect_null(clmha_context_cl_context(NULL));
    cr_expect_null(clmha_context_cl_device(NULL));
    cr_expect_null(clmha_context_cl_queue(NULL));
    cr_expect(clmha_context_device_name(NULL) != NULL);
    cr_expect_null(clmha_layer_context(NULL));
    cr_expect_eq(clmha_layer_scratch_bytes(NULL), 0);
    cr_expect_eq(clmha_layer_parameter_count(NULL, "in_proj_weight"), 0);
}

// ---- buffers the device forward pass must refuse --------------------------------------------

// A context, a layer (E 8, 2 heads, bias, parameters all zero but out_proj.weight) and buffers
// for a valid self-attention call (L 3, N 2) with weights.
typedef struct dev_call {
    clmha_context *ctx;
    clmha_layer *layer;
    cl_context cl;
    cl_mem q, out, wts;
    clmha_forward_args args;
} dev_call;

static bool dev_call_open(dev_call *c) {
    memset(c, 0, sizeof *c);
    if (clmha_context_create_from_env(&c->ctx) != CLMHA_SUCCESS) return false;
    c->cl = clmha_context_cl_context(c->ctx);
    cr_assert_eq(clmha_layer_create(&c->layer, c->ctx, &layer_descs[L_DEFAULT]), CLMHA_SUCCESS);
    cl_int err;
    static const float query[L * N * E];  // zeros: the calls that run read defined values
    c->q = make_buffer(c->cl, query, sizeof query);
    c->out = clCreateBuffer(c->cl, CL_MEM_READ_WRITE, L * N * E * 4, NULL, &err);
    c->wts = clCreateBuffer(c->cl, CL_MEM_READ_WRITE, N * L * S * 4, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    c->args = (clmha_forward_args){.struct_size = sizeof c->args,
                                   .query = {.ndim = 3, .shape = {L, N, E}, .buffer = c->q},
                                   .need_weights = true};
    return true;
}

static void dev_call_close(dev_call *c) {
    clmha_layer_release(c->layer);
    clmha_context_release(c->ctx);
    clReleaseMemObject(c->q);
    clReleaseMemObject(c->out);
    clReleaseMemObject(c->wts);
}

// Calls the device forward pass, expects @p want and a message containing @p msg_has.
static void expect_forward(dev_call *c, const char *what, cl_mem out, size_t out_off, cl_mem wts,
                           size_t wts_off, clmha_status want, const char *msg_has) {
    cl_event ev = BAD_PTR(struct _cl_event);
    clmha_status st = clmha_layer_forward(c->layer, &c->args, out, out_off, wts, wts_off, 0, NULL,
                                          &ev);
    cr_expect_eq(st, want, "%s: returned %s, expected %s (%s)", what, clmha_status_string(st),
                 clmha_status_string(want), clmha_context_last_error(c->ctx));
    if (want) {
        cr_expect_null(ev, "%s: *event not NULL", what);
        cr_expect(strstr(clmha_context_last_error(c->ctx), msg_has) != NULL,
                  "%s: message \"%s\" does not contain \"%s\"", what,
                  clmha_context_last_error(c->ctx), msg_has);
    } else if (ev) {
        clWaitForEvents(1, &ev);
        clReleaseEvent(ev);
    }
}

Test(errors, image_as_query_is_refused) {
    dev_call c;
    if (!dev_call_open(&c)) cr_skip_test("no OpenCL device");
    cl_bool images = CL_FALSE;
    clGetDeviceInfo(clmha_context_cl_device(c.ctx), CL_DEVICE_IMAGE_SUPPORT, sizeof images,
                    &images, NULL);
    if (!images) {
        dev_call_close(&c);
        cr_skip_test("the device has no image support");
    }
    cl_image_format format = {CL_RGBA, CL_FLOAT};
    cl_int err;
    // 16 x 4 RGBA float texels: 1 KiB, more than the query's 192 bytes.
    cl_image_desc desc = {.image_type = CL_MEM_OBJECT_IMAGE2D, .image_width = 16,
                          .image_height = 4};
    cl_mem image = clCreateImage(c.cl, CL_MEM_READ_WRITE, &format, &desc, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    c.args.query.buffer = image;
    expect_forward(&c, "image query", c.out, 0, c.wts, 0, CLMHA_INVALID_ARGUMENT,
                   "query is not a buffer");
    c.args.query.buffer = c.q;
    expect_forward(&c, "image output", image, 0, c.wts, 0, CLMHA_INVALID_ARGUMENT,
                   "output is not a buffer");
    clReleaseMemObject(image);
    dev_call_close(&c);
}

Test(errors, read_only_outputs_are_refused) {
    dev_call c;
    if (!dev_call_open(&c)) cr_skip_test("no OpenCL device");
    cl_int err;
    cl_mem ro = clCreateBuffer(c.cl, CL_MEM_READ_ONLY, 4096, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    expect_forward(&c, "read-only output", ro, 0, c.wts, 0, CLMHA_INVALID_ARGUMENT,
                   "output buffer is CL_MEM_READ_ONLY");
    expect_forward(&c, "read-only weights", c.out, 0, ro, 0, CLMHA_INVALID_ARGUMENT,
                   "weights buffer is CL_MEM_READ_ONLY");
    expect_forward(&c, "read-write outputs", c.out, 0, c.wts, 0, CLMHA_SUCCESS, "");
    clReleaseMemObject(ro);
    dev_call_close(&c);
}

Test(errors, overlapping_outputs_and_inputs_are_refused) {
    dev_call c;
    if (!dev_call_open(&c)) cr_skip_test("no OpenCL device");
    enum { OUTN = L * N * E, WN = N * L * S };  // 48 and 18 floats
    cl_int err;
    cl_mem one = clCreateBuffer(c.cl, CL_MEM_READ_WRITE, 4 * 256, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    expect_forward(&c, "weights inside the output", one, 0, one, 10, CLMHA_INVALID_ARGUMENT,
                   "output (bytes 0 to 192) overlaps weights");
    expect_forward(&c, "output overlapping the end of the weights", one, WN - 1, one, 0,
                   CLMHA_INVALID_ARGUMENT, "overlaps weights");
    expect_forward(&c, "output and weights side by side", one, 0, one, OUTN, CLMHA_SUCCESS, "");
    expect_forward(&c, "output over the query", c.q, 0, c.wts, 0, CLMHA_INVALID_ARGUMENT,
                   "output (bytes 0 to 192) overlaps query");
    expect_forward(&c, "weights over the query", c.out, 0, c.q, 30, CLMHA_INVALID_ARGUMENT,
                   "weights (bytes 120 to 192) overlaps query");
    // A sub-buffer aliases its parent.
    cl_buffer_region region = {0, 4 * 128};
    cl_mem sub = clCreateSubBuffer(one, CL_MEM_READ_WRITE, CL_BUFFER_CREATE_TYPE_REGION, &region,
                                   &err);
    cr_assert_eq(err, CL_SUCCESS);
    expect_forward(&c, "output in a sub-buffer over the weights", sub, 0, one, 20,
                   CLMHA_INVALID_ARGUMENT, "overlaps weights");
    clReleaseMemObject(sub);
    clReleaseMemObject(one);
    dev_call_close(&c);
}

Test(errors, stage_times_after_a_failed_profiled_call) {
    dev_call c;
    if (!dev_call_open(&c)) cr_skip_test("no OpenCL device");
    cr_assert_eq(clmha_layer_set_profiling(c.layer, true), CLMHA_SUCCESS);
    double ms[CLMHA_STAGE_COUNT];
    // The first profiled call fails: no times, and the message says why.
    expect_forward(&c, "first profiled call, no output", NULL, 0, c.wts, 0,
                   CLMHA_INVALID_ARGUMENT, "output buffer is NULL");
    cr_expect_eq(clmha_layer_stage_times(c.layer, ms), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(c.ctx), "the last forward call failed") != NULL,
              "%s", clmha_context_last_error(c.ctx));
    // A call that succeeds has times; a failed call after it drops them.
    expect_forward(&c, "profiled call", c.out, 0, c.wts, 0, CLMHA_SUCCESS, "");
    cr_expect_eq(clmha_layer_stage_times(c.layer, ms), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(c.ctx));
    expect_forward(&c, "failed call after it", NULL, 0, c.wts, 0, CLMHA_INVALID_ARGUMENT,
                   "output buffer is NULL");
    cr_expect_eq(clmha_layer_stage_times(c.layer, ms), CLMHA_INVALID_ARGUMENT,
                 "stage times of an earlier call after a failed one");
    cr_expect(strstr(clmha_context_last_error(c.ctx), "the last forward call failed") != NULL,
              "%s", clmha_context_last_error(c.ctx));
    // Profiling off: the message says so.
    cr_assert_eq(clmha_layer_set_profiling(c.layer, false), CLMHA_SUCCESS);
    cr_expect_eq(clmha_layer_stage_times(c.layer, ms), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(c.ctx), "profiling is off") != NULL, "%s",
              clmha_context_last_error(c.ctx));
    dev_call_close(&c);
}

// ---- what is not an error ----------------------------------------------------------------------

// NaN and infinity are data (clmha.h, "NaN and infinity"): they pass through to the outputs
// they reach and the call succeeds; -inf in a float mask forbids a key, +inf or NaN there makes
// the row NaN.
Test(errors, non_finite_values_are_data_not_errors) {
    clmha_context *ctx = NULL;
    if (clmha_context_create_from_env(&ctx) != CLMHA_SUCCESS) cr_skip_test("no OpenCL device");
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &layer_descs[L_DEFAULT]), CLMHA_SUCCESS);
    static float w_in[3 * E * E], w_out[E * E], q[L * N * E], out[L * N * E], mask[N * S];
    for (size_t i = 0; i < 3 * E * E; ++i) w_in[i] = 0.01f * (float)(i % 7);
    for (size_t i = 0; i < E * E; ++i) w_out[i] = 0.02f * (float)(i % 5);
    for (size_t i = 0; i < L * N * E; ++i) q[i] = 0.1f * (float)(i % 3);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E), 0);
    clmha_forward_args args = {
        .struct_size = sizeof args,
        .query = {.ndim = 3, .shape = {L, N, E}, .data = q},
        .key_padding_mask = {.kind = CLMHA_MASK_FLOAT,
                             .tensor = {.ndim = 2, .shape = {N, S}, .data = mask}}};
    struct {
        const char *what;
        float mask_value;  // of key 1 of every item
        bool nan_query;
        size_t want_nans;
    } cases[] = {{"-inf in a float mask", -INFINITY, false, 0},
                 {"+inf in a float mask", INFINITY, false, L * N * E},
                 {"NaN in a float mask", NAN, false, L * N * E},
                 // Self-attention: query element 0 is item 0's key too; item 1 stays finite.
                 {"NaN in the query", 0.0f, true, L * E}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
        for (size_t i = 0; i < N * S; ++i) mask[i] = i % S == 1 ? cases[c].mask_value : 0.0f;
        q[0] = cases[c].nan_query ? NAN : 0.0f;
        clmha_status st = clmha_layer_forward_host(layer, &args, out, L * N * E, NULL, 0);
        cr_expect_eq(st, CLMHA_SUCCESS, "%s: %s", cases[c].what, clmha_context_last_error(ctx));
        size_t nans = 0;
        for (size_t i = 0; i < L * N * E; ++i) nans += isnan(out[i]) != 0;
        cr_expect_eq(nans, cases[c].want_nans, "%s: %zu NaN outputs, expected %zu",
                     cases[c].what, nans, cases[c].want_nans);
    }
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}
