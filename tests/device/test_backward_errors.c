// Bad backward calls (clmha_layer_backward(), clmha_layer_backward_host(), clmha_saved_*): each
// is refused with its status and a message, enqueues nothing and leaves every gradient
// destination as it was.
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "support.h"

#define E 8
#define H 2
#define L 3
#define N 2
#define CANARY 12345.0f

static clmha_context *ctx;
static clmha_layer *layer;
static clmha_saved *saved;
static float x[L * N * E], gy[L * N * E];
static float dx[L * N * E], dw_in[3 * E * E], db_in[3 * E], dw_out[E * E];

static void fill(float *a, size_t n, float v) {
    for (size_t i = 0; i < n; ++i) a[i] = v;
}

static bool untouched(const float *a, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (a[i] != CANARY) return false;
    return true;
}

static clmha_forward_args fwd_args(void) {
    clmha_forward_args a = {.struct_size = sizeof a,
                            .query = {.ndim = 3, .shape = {L, N, E}, .data = x}};
    return a;
}

static void setup(void) {
    ctx = context_or_skip();
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = H,
                             .bias = true};
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    uint64_t seed = 7;
    float w_in[3 * E * E], w_out[E * E], b_in[3 * E];
    for (size_t i = 0; i < 3 * E * E; ++i) w_in[i] = frand(&seed) * 0.3f;
    for (size_t i = 0; i < E * E; ++i) w_out[i] = frand(&seed) * 0.3f;
    for (size_t i = 0; i < 3 * E; ++i) b_in[i] = frand(&seed) * 0.1f;
    for (size_t i = 0; i < L * N * E; ++i) x[i] = frand(&seed), gy[i] = frand(&seed);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * E), 0);
    cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
    cr_assert_eq(clmha_saved_bytes(saved), 0, "an empty saved object holds nothing");
    float y[L * N * E];
    clmha_forward_args a = fwd_args();
    a.save = saved;
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, L * N * E, NULL, 0), CLMHA_SUCCESS,
                 "%s", clmha_context_last_error(ctx));
    cr_assert_gt(clmha_saved_bytes(saved), 0);
    fill(dx, L * N * E, CANARY);
    fill(dw_in, 3 * E * E, CANARY);
    fill(db_in, 3 * E, CANARY);
    fill(dw_out, E * E, CANARY);
}

static void teardown(void) {
    clmha_saved_release(saved);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

TestSuite(backward_errors, .init = setup, .fini = teardown);

// A valid host call's arguments, for the tests to break one thing at a time.
static clmha_backward_args good(const clmha_forward_args *f) {
    clmha_backward_args b = {.struct_size = sizeof b, .forward = f, .saved = saved,
                             .grad_output = {.ndim = 3, .shape = {L, N, E}, .data = gy},
                             .query = {.data = dx}, .in_proj_weight = {.data = dw_in},
                             .in_proj_bias = {.data = db_in}, .out_proj_weight = {.data = dw_out}};
    return b;
}

static void expect(const clmha_backward_args *b, clmha_status want, const char *needle) {
    clmha_status st = clmha_layer_backward_host(layer, b);
    const char *msg = clmha_context_last_error(ctx);
    cr_assert_eq(st, want, "status %s, want %s (%s)", clmha_status_string(st),
                 clmha_status_string(want), msg);
    cr_assert(strstr(msg, needle), "message \"%s\" lacks \"%s\"", msg, needle);
    cr_assert(untouched(dx, L * N * E) && untouched(dw_in, 3 * E * E) &&
                  untouched(db_in, 3 * E) && untouched(dw_out, E * E),
              "a refused call wrote a gradient");
}

Test(backward_errors, nulls_and_sizes) {
    clmha_forward_args f = fwd_args();
    clmha_backward_args b = good(&f);
    cr_assert_eq(clmha_layer_backward_host(NULL, &b), CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha_layer_backward(NULL, &b, 0, NULL, NULL), CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha_layer_backward_host(layer, NULL), CLMHA_INVALID_ARGUMENT);
    b.struct_size = 0;
    expect(&b, CLMHA_INVALID_ARGUMENT, "struct_size");
    b = good(NULL);
    expect(&b, CLMHA_INVALID_ARGUMENT, "args->forward is NULL");
    b = good(&f);
    b.saved = NULL;
    expect(&b, CLMHA_INVALID_ARGUMENT, "args->saved is NULL");
    b = good(&f);
    b.grad_output.data = NULL;
    expect(&b, CLMHA_INVALID_ARGUMENT, "grad_output.data");
    cr_assert_eq(clmha_saved_create(NULL, layer), CLMHA_INVALID_ARGUMENT);
    clmha_saved *s = (clmha_saved *)1;
    cr_assert_eq(clmha_saved_create(&s, NULL), CLMHA_INVALID_ARGUMENT);
    cr_assert_null(s);
    clmha_saved_release(NULL);
    cr_assert_eq(clmha_saved_bytes(NULL), 0);
}

Test(backward_errors, saved_state_must_match) {
    clmha_forward_args f = fwd_args();
    clmha_backward_args b = good(&f);
    clmha_saved *empty;
    cr_assert_eq(clmha_saved_create(&empty, layer), CLMHA_SUCCESS);
    b.saved = empty;
    expect(&b, CLMHA_INVALID_ARGUMENT, "holds no forward call");
    clmha_saved_release(empty);

    clmha_layer *other;
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = H};
    cr_assert_eq(clmha_layer_create(&other, ctx, &desc), CLMHA_SUCCESS);
    clmha_saved *foreign;
    cr_assert_eq(clmha_saved_create(&foreign, other), CLMHA_SUCCESS);
    b = good(&f);
    b.saved = foreign;
    expect(&b, CLMHA_INVALID_ARGUMENT, "another layer");
    // ... and a forward call of this layer refuses to fill it.
    float y[L * N * E];
    clmha_forward_args a = fwd_args();
    a.save = foreign;
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, L * N * E, NULL, 0),
                 CLMHA_INVALID_ARGUMENT);
    clmha_saved_release(foreign);
    clmha_layer_release(other);

    f.is_causal = true;  // not what was saved
    b = good(&f);
    expect(&b, CLMHA_INVALID_ARGUMENT, "is_causal");
    f = fwd_args();
    f.query.shape[0] = 2;  // another L
    b = good(&f);
    b.grad_output.shape[0] = 2;
    expect(&b, CLMHA_SHAPE_MISMATCH, "not the call");
}

Test(backward_errors, failed_forward_leaves_saved_empty) {
    float y[L * N * E];
    clmha_forward_args a = fwd_args();
    a.save = saved;
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, L * N * E - 1, NULL, 0),
                 CLMHA_SHAPE_MISMATCH);
    // Validation failed before the saved object was touched: it still holds the first call.
    cr_assert_gt(clmha_saved_bytes(saved), 0);
    a.key_padding_mask.kind = CLMHA_MASK_BOOL_IGNORE;  // no tensor: refused by validation
    cr_assert_neq(clmha_layer_forward_host(layer, &a, y, L * N * E, NULL, 0), CLMHA_SUCCESS);
}

Test(backward_errors, gradients_the_call_has_not) {
    clmha_forward_args f = fwd_args();
    float dk[L * N * E];
    clmha_backward_args b = good(&f);
    b.key.data = dk;  // self-attention: key was not given
    expect(&b, CLMHA_INVALID_ARGUMENT, "key was not given");
    b = good(&f);
    float dq_w[E * E];
    b.q_proj_weight.data = dq_w;  // with in_proj_weight
    expect(&b, CLMHA_INVALID_ARGUMENT, "both asked for");
    b = good(&f);
    float dbk[E];
    b.bias_k.data = dbk;
    expect(&b, CLMHA_INVALID_ARGUMENT, "add_bias_kv");
    b = good(&f);
    float dmask[L * L];
    b.attn_mask.data = dmask;  // no attn_mask in the call
    expect(&b, CLMHA_INVALID_ARGUMENT, "attn_mask");
    b = good(&f);
    float gw[N * L * L];
    b.grad_weights = (clmha_tensor){.ndim = 3, .shape = {N, L, L}, .data = gw};
    expect(&b, CLMHA_INVALID_ARGUMENT, "need_weights");
    b = good(&f);
    b.grad_output.shape[2] = E + 1;
    expect(&b, CLMHA_SHAPE_MISMATCH, "grad_output");
    b = good(&f);
    b.impl = (clmha_impl)7;
    expect(&b, CLMHA_INVALID_ARGUMENT, "impl 7");
}

Test(backward_errors, boolean_mask_has_no_gradient) {
    uint8_t m[L * L] = {0};
    m[1] = 1;
    float y[L * N * E];
    clmha_forward_args f = fwd_args();
    f.attn_mask = (clmha_mask){.kind = CLMHA_MASK_BOOL_IGNORE,
                               .tensor = {.ndim = 2, .shape = {L, L}, .data = m}};
    f.save = saved;
    cr_assert_eq(clmha_layer_forward_host(layer, &f, y, L * N * E, NULL, 0), CLMHA_SUCCESS);
    clmha_backward_args b = good(&f);
    float dm[L * L];
    b.attn_mask.data = dm;
    expect(&b, CLMHA_INVALID_ARGUMENT, "boolean mask has no gradient");
}

static clmha_status user_core(const struct clmha_core_args *a, void *u) {
    (void)a, (void)u;
    return CLMHA_SUCCESS;
}

Test(backward_errors, user_core_has_no_backward) {
    cr_assert_eq(clmha_layer_set_attention(layer, user_core, NULL), CLMHA_SUCCESS);
    clmha_forward_args f = fwd_args();
    clmha_backward_args b = good(&f);
    expect(&b, CLMHA_UNSUPPORTED, "user attention core");
    cr_assert_eq(clmha_layer_set_attention(layer, NULL, NULL), CLMHA_SUCCESS);
}

// ---- device buffers ------------------------------------------------------------------------------

static cl_mem buffer(cl_mem_flags flags, size_t floats, const float *init) {
    cl_int err;
    cl_mem m = clCreateBuffer(clmha_context_cl_context(ctx),
                              flags | (init ? CL_MEM_COPY_HOST_PTR : 0), floats * sizeof(float),
                              (void *)init, &err);
    cr_assert_eq(err, CL_SUCCESS);
    return m;
}

Test(backward_errors, device_buffers) {
    cl_mem xq = buffer(CL_MEM_READ_WRITE, L * N * E, x);
    cl_mem g = buffer(CL_MEM_READ_WRITE, L * N * E, gy);
    float canary[3 * E * E];
    fill(canary, 3 * E * E, CANARY);
    cl_mem out = buffer(CL_MEM_READ_WRITE, 3 * E * E, canary);
    cl_mem ro = buffer(CL_MEM_READ_ONLY, 3 * E * E, canary);
    cl_mem wo = buffer(CL_MEM_WRITE_ONLY, 3 * E * E, NULL);
    clmha_forward_args f = fwd_args();
    f.query.buffer = xq;
    clmha_backward_args b = {.struct_size = sizeof b, .forward = &f, .saved = saved,
                             .grad_output = {.ndim = 3, .shape = {L, N, E}, .buffer = g}};
    cl_event ev = (cl_event)1;
    // Two gradients in overlapping bytes of one buffer.
    b.in_proj_weight = (clmha_grad){.buffer = out};
    b.out_proj_weight = (clmha_grad){.buffer = out, .offset = E};
    cr_assert_eq(clmha_layer_backward(layer, &b, 0, NULL, &ev), CLMHA_INVALID_ARGUMENT);
    cr_assert_null(ev);
    cr_assert(strstr(clmha_context_last_error(ctx), "overlaps"), "%s",
              clmha_context_last_error(ctx));
    // A gradient over an input.
    b.out_proj_weight = (clmha_grad){0};
    b.in_proj_weight = (clmha_grad){.buffer = g};
    cr_assert_eq(clmha_layer_backward(layer, &b, 0, NULL, NULL), CLMHA_INVALID_ARGUMENT);
    // Read-only, and write-only with accumulate.
    b.in_proj_weight = (clmha_grad){.buffer = ro};
    cr_assert_eq(clmha_layer_backward(layer, &b, 0, NULL, NULL), CLMHA_INVALID_ARGUMENT);
    b.in_proj_weight = (clmha_grad){.buffer = wo, .accumulate = true};
    cr_assert_eq(clmha_layer_backward(layer, &b, 0, NULL, NULL), CLMHA_INVALID_ARGUMENT);
    cr_assert(strstr(clmha_context_last_error(ctx), "WRITE_ONLY"));
    // Too small.
    b.in_proj_weight = (clmha_grad){.buffer = out, .offset = 1};
    cr_assert_eq(clmha_layer_backward(layer, &b, 0, NULL, NULL), CLMHA_INVALID_ARGUMENT);
    // A failed event in the wait list.
    cl_int err;
    cl_event user = clCreateUserEvent(clmha_context_cl_context(ctx), &err);
    cr_assert_eq(err, CL_SUCCESS);
    clSetUserEventStatus(user, -5);
    b.in_proj_weight = (clmha_grad){.buffer = out};
    cr_assert_eq(clmha_layer_backward(layer, &b, 1, &user, NULL), CLMHA_OPENCL_ERROR);
    cr_assert_eq(clmha_layer_backward(layer, &b, 1, NULL, NULL), CLMHA_INVALID_ARGUMENT);
    clReleaseEvent(user);
    float back[3 * E * E];
    cr_assert_eq(clEnqueueReadBuffer(clmha_context_cl_queue(ctx), out, CL_TRUE, 0, sizeof back,
                                     back, 0, NULL, NULL),
                 CL_SUCCESS);
    cr_assert(untouched(back, 3 * E * E), "a refused call wrote its destination");
    clReleaseMemObject(xq), clReleaseMemObject(g), clReleaseMemObject(out);
    clReleaseMemObject(ro), clReleaseMemObject(wo);
}
