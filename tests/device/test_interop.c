#define _POSIX_C_SOURCE 200809L
// Embedding: the caller's own cl_context, queue, buffers and event wait lists; reference counts;
// a user-supplied attention core. Links libclmha.a for clmha's counts of the OpenCL objects it
// holds (tests/support/support.h).
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/half.h"
#include "support_internal.h"

enum { E = 16, H = 4, D = E / H, L = 5, N = 3, S = L };

typedef struct app {
    cl_context context;
    cl_device_id device;
    cl_command_queue queue;
} app;

// The application's own OpenCL objects, on the device CLMHA_DEVICE names.
static bool app_open(app *a) {
    clmha_device_info info = {.struct_size = sizeof info};
    char msg[512];
    if (clmha_device_select(getenv("CLMHA_DEVICE"), &info, msg, sizeof msg) != CLMHA_SUCCESS)
        return false;
    cl_int err;
    a->device = info.device;
    a->context = clCreateContext(NULL, 1, &info.device, NULL, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    a->queue = clCreateCommandQueue(a->context, info.device, 0, &err);
    cr_assert_eq(err, CL_SUCCESS);
    return true;
}

static void app_close(app *a) {
    clReleaseCommandQueue(a->queue);
    clReleaseContext(a->context);
}

static float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E], x[L * N * E];

static void make_params(void) {
    uint64_t s = 7;
    for (size_t i = 0; i < 3 * E * E; ++i) w_in[i] = 0.4f * frand(&s);
    for (size_t i = 0; i < 3 * E; ++i) b_in[i] = 0.1f * frand(&s);
    for (size_t i = 0; i < E * E; ++i) w_out[i] = 0.4f * frand(&s);
    for (size_t i = 0; i < E; ++i) b_out[i] = 0.1f * frand(&s);
    for (size_t i = 0; i < L * N * E; ++i) x[i] = frand(&s);
}

static clmha_layer *make_layer(clmha_context *ctx) {
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    make_params();
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.bias", b_out, E), 0);
    return layer;
}

// The reference result for the layer above on x.
static void reference(double *y, double *w) {
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    clmha_reference_params p = {.struct_size = sizeof p,
                                .in_proj_weight = w_in, .in_proj_bias = b_in,
                                .out_proj_weight = w_out, .out_proj_bias = b_out};
    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
                               .need_weights = true};
    char msg[256];
    cr_assert_eq(clmha_reference_forward(&desc, &p, &args, y, L * N * E, w, N * L * S, msg,
                                         sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

Test(interop, caller_objects_wait_list_event_and_refcounts) {
    app a;
    if (!app_open(&a)) cr_skip_test("no OpenCL device");
    // Reference counts: the driver's where they move (tests/support/support.h), clmha's own always.
    bool ctx_move = refs_move(REF_CONTEXT, a.context), queue_move = refs_move(REF_QUEUE, a.queue);
    if (ctx_move) context_refs_show_objects(a.context);  // notes when it does not
    cl_uint ctx_refs0 = refs_of(REF_CONTEXT, a.context), queue_refs0 = refs_of(REF_QUEUE, a.queue);
    assert_nothing_held("before the clmha context was created");

    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_cl(&ctx, a.context, a.device, a.queue), CLMHA_SUCCESS,
                 "%s", clmha_last_create_error());
    long held[CLMHA__HELD_KINDS];
    held_counts(held);
    cr_assert(held[CLMHA__HELD_CONTEXT] == 1 && held[CLMHA__HELD_QUEUE] == 1 &&
                  held[CLMHA__HELD_DEVICE] == 1,
              "clmha should hold one reference to each of the caller's context, queue and "
              "device: holds %ld, %ld, %ld",
              held[CLMHA__HELD_CONTEXT], held[CLMHA__HELD_QUEUE], held[CLMHA__HELD_DEVICE]);
    if (ctx_move)
        cr_assert_gt(refs_of(REF_CONTEXT, a.context), ctx_refs0, "clmha retained no reference");
    if (queue_move)
        cr_assert_gt(refs_of(REF_QUEUE, a.queue), queue_refs0, "clmha retained no reference");
    cr_assert_eq(clmha_context_cl_context(ctx), a.context);
    cr_assert_eq(clmha_context_cl_queue(ctx), a.queue);
    clmha_layer *layer = make_layer(ctx);
    cr_assert_eq(clmha_layer_bake(layer, N, L, S, true), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));

    // The application's buffers. The query starts as zeros; its real values are written on a
    // second queue once a user event opens, and the forward pass only waits for that write
    // through its wait list. Were the wait list ignored, the pass would read zeros.
    cl_int err;
    cl_mem q = clCreateBuffer(a.context, CL_MEM_READ_WRITE, sizeof x, NULL, &err);
    cl_mem out = clCreateBuffer(a.context, CL_MEM_READ_WRITE, sizeof(float) * L * N * E, NULL,
                                &err);
    cl_mem w = clCreateBuffer(a.context, CL_MEM_READ_WRITE, sizeof(float) * N * L * S, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    float zero = 0.0f;
    clEnqueueFillBuffer(a.queue, q, &zero, sizeof zero, 0, sizeof x, 0, NULL, NULL);
    clFinish(a.queue);
    cl_command_queue side = clCreateCommandQueue(a.context, a.device, 0, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_event gate = clCreateUserEvent(a.context, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_event written = NULL;
    cr_assert_eq(clEnqueueWriteBuffer(side, q, CL_FALSE, 0, sizeof x, x, 1, &gate, &written),
                 CL_SUCCESS);
    clFlush(side);

    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {L, N, E}, .buffer = q},
                               .need_weights = true};
    cl_event done = (cl_event)0x1;
    cr_assert_eq(clmha_layer_forward(layer, &args, out, 0, w, 0, 1, &written, &done),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_assert(done != NULL && done != (cl_event)0x1);
    clFlush(a.queue);
    sleep_ms(300);
    cl_int status = 0;
    clGetEventInfo(done, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, NULL);
    cr_assert_neq(status, CL_COMPLETE, "forward finished before its wait list was satisfied");

    clSetUserEventStatus(gate, CL_COMPLETE);
    cr_assert_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    cl_context ev_ctx = NULL;
    clGetEventInfo(done, CL_EVENT_CONTEXT, sizeof ev_ctx, &ev_ctx, NULL);
    cr_assert_eq(ev_ctx, a.context);
    if (refs_move(REF_EVENT, done)) {
        cl_uint ev_refs = refs_settled(REF_EVENT, done, 1);
        cr_assert_eq(ev_refs, 1, "the caller should hold the only reference to the event, not %u",
                     ev_refs);
    }

    static float y[L * N * E], wt[N * L * S];
    static double y_ref[L * N * E], w_ref[N * L * S];
    clEnqueueReadBuffer(a.queue, out, CL_TRUE, 0, sizeof y, y, 0, NULL, NULL);
    clEnqueueReadBuffer(a.queue, w, CL_TRUE, 0, sizeof wt, wt, 0, NULL, NULL);
    reference(y_ref, w_ref);
    double err_y = max_abs_err(y, y_ref, L * N * E), err_w = max_abs_err(wt, w_ref, N * L * S);
    cr_assert_leq(err_y, 1e-4, "output error %g", err_y);
    cr_assert_leq(err_w, 1e-4, "weights error %g", err_w);

    clReleaseEvent(done);
    clReleaseEvent(written);
    clReleaseEvent(gate);
    clReleaseCommandQueue(side);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    clReleaseMemObject(q);
    clReleaseMemObject(out);
    clReleaseMemObject(w);
    assert_nothing_held("after releasing the layer and the clmha context");
    assert_refs_back(REF_CONTEXT, a.context, ctx_move, ctx_refs0,
                     "after releasing the layer, the clmha context and the buffers");
    assert_refs_back(REF_QUEUE, a.queue, queue_move, queue_refs0,
                     "after releasing the clmha context");
    app_close(&a);
}

// Attention as a function on the caller's objects: its forward waits for a user event's wait
// list and returns the caller an event of its own; its backward runs; the context's bare layers
// (made on the first call) are freed with the context, and every reference clmha held on the
// caller's objects comes back.
Test(interop, attention_function_wait_list_and_refcounts) {
    app a;
    if (!app_open(&a)) cr_skip_test("no OpenCL device");
    bool ctx_move = refs_move(REF_CONTEXT, a.context), queue_move = refs_move(REF_QUEUE, a.queue);
    cl_uint ctx_refs0 = refs_of(REF_CONTEXT, a.context), queue_refs0 = refs_of(REF_QUEUE, a.queue);
    assert_nothing_held("before the clmha context was created");
    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_cl(&ctx, a.context, a.device, a.queue), CLMHA_SUCCESS,
                 "%s", clmha_last_create_error());
    make_params();  // x as (N, H, L, D) = (3, 4, 5, 4): query, key and value alike
    cl_int err;
    cl_mem q = clCreateBuffer(a.context, CL_MEM_READ_WRITE, sizeof x, NULL, &err);
    cl_mem out = clCreateBuffer(a.context, CL_MEM_READ_WRITE, sizeof x, NULL, &err);
    cl_mem g[3];
    for (int i = 0; i < 3; ++i)
        g[i] = clCreateBuffer(a.context, CL_MEM_READ_WRITE, sizeof x, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    float zero = 0.0f;
    clEnqueueFillBuffer(a.queue, q, &zero, sizeof zero, 0, sizeof x, 0, NULL, NULL);
    clFinish(a.queue);
    cl_command_queue side = clCreateCommandQueue(a.context, a.device, 0, &err);
    cl_event gate = clCreateUserEvent(a.context, &err);
    cl_event written = NULL;
    cr_assert_eq(clEnqueueWriteBuffer(side, q, CL_FALSE, 0, sizeof x, x, 1, &gate, &written),
                 CL_SUCCESS);
    clFlush(side);
    clmha_tensor t = {.ndim = 4, .shape = {N, H, L, D}, .buffer = q, .data = x};
    clmha_attention_args args = {.struct_size = sizeof args, .query = t, .key = t, .value = t,
                                 .is_causal = true};
    cl_event done = (cl_event)0x1;
    cr_assert_eq(clmha_attention_forward(ctx, &args, out, 0, NULL, 0, NULL, 0, 1, &written,
                                         &done),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_assert(done != NULL && done != (cl_event)0x1);
    clFlush(a.queue);
    sleep_ms(300);
    cl_int status = 0;
    clGetEventInfo(done, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, NULL);
    cr_assert_neq(status, CL_COMPLETE, "the call finished before its wait list was satisfied");
    clSetUserEventStatus(gate, CL_COMPLETE);
    cr_assert_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    static float y[L * N * E];
    static double y_ref[L * N * E];
    clEnqueueReadBuffer(a.queue, out, CL_TRUE, 0, sizeof y, y, 0, NULL, NULL);
    char msg[256];
    cr_assert_eq(clmha_reference_attention(&args, y_ref, L * N * E, NULL, 0, NULL, 0, msg,
                                           sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    double e = max_abs_err(y, y_ref, L * N * E);
    cr_assert_leq(e, 1e-4, "output error %g", e);
    clmha_attention_backward_args b = {.struct_size = sizeof b, .forward = &args, .output = out,
                                       .grad_output = out, .grad_query = g[0],
                                       .grad_key = g[1], .grad_value = g[2]};
    cr_assert_eq(clmha_attention_backward(ctx, &b, 0, NULL, NULL), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    clReleaseEvent(done);
    clReleaseEvent(written);
    clReleaseEvent(gate);
    clReleaseCommandQueue(side);
    clmha_context_release(ctx);  // frees its bare layers, which hold no reference to it
    clReleaseMemObject(q);
    clReleaseMemObject(out);
    for (int i = 0; i < 3; ++i) clReleaseMemObject(g[i]);
    assert_nothing_held("after releasing the clmha context that ran attention as a function");
    assert_refs_back(REF_CONTEXT, a.context, ctx_move, ctx_refs0,
                     "after releasing the clmha context and the buffers");
    assert_refs_back(REF_QUEUE, a.queue, queue_move, queue_refs0,
                     "after releasing the clmha context");
    app_close(&a);
}

// A user attention core that reads the head tiles to the host, computes plain softmax attention
// there, and writes the result back (with the weights when asked).
typedef struct core_log {
    int calls;
    size_t batch, heads, tgt, src, src_padded, head_dim;
} core_log;

static clmha_status host_core(const clmha_core_args *c, void *user) {
    core_log *log = user;
    log->calls++;
    log->batch = c->batch, log->heads = c->num_heads, log->tgt = c->tgt_len;
    log->src = c->src_len, log->src_padded = c->src_len_padded, log->head_dim = c->head_dim;
    size_t bh = c->batch * c->num_heads, d = c->head_dim, l = c->tgt_len, s = c->src_len_padded;
    float *q = malloc(bh * l * d * 4), *k = malloc(bh * s * d * 4), *v = malloc(bh * s * d * 4);
    float *o = malloc(bh * l * d * 4), *p = malloc(bh * l * s * 4);
    if (!q || !k || !v || !o || !p) return CLMHA_OUT_OF_MEMORY;
    clEnqueueReadBuffer(c->queue, c->q, CL_TRUE, 0, bh * l * d * 4, q, c->num_wait, c->wait_list,
                        NULL);
    clEnqueueReadBuffer(c->queue, c->k, CL_TRUE, 0, bh * s * d * 4, k, 0, NULL, NULL);
    clEnqueueReadBuffer(c->queue, c->v, CL_TRUE, 0, bh * s * d * 4, v, 0, NULL, NULL);
    for (size_t b = 0; b < bh; ++b)
        for (size_t i = 0; i < l; ++i) {
            float *row = p + (b * l + i) * s, m = -INFINITY, sum = 0;
            for (size_t j = 0; j < s; ++j) {
                float dot = 0;
                for (size_t t = 0; t < d; ++t) dot += q[(b * l + i) * d + t] * k[(b * s + j) * d + t];
                row[j] = dot * c->scale;
                m = fmaxf(m, row[j]);
            }
            for (size_t j = 0; j < s; ++j) sum += row[j] = expf(row[j] - m);
            for (size_t j = 0; j < s; ++j) row[j] /= sum;
            for (size_t t = 0; t < d; ++t) {
                float acc = 0;
                for (size_t j = 0; j < s; ++j) acc += row[j] * v[(b * s + j) * d + t];
                o[(b * l + i) * d + t] = acc;
            }
        }
    clEnqueueWriteBuffer(c->queue, c->out, CL_TRUE, 0, bh * l * d * 4, o, 0, NULL, NULL);
    if (c->weights)
        clEnqueueWriteBuffer(c->queue, c->weights, CL_TRUE, 0, bh * l * s * 4, p, 0, NULL, NULL);
    free(q), free(k), free(v), free(o), free(p);
    return clEnqueueMarkerWithWaitList(c->queue, 0, NULL, c->event) == CL_SUCCESS
               ? CLMHA_SUCCESS
               : CLMHA_OPENCL_ERROR;
}

static clmha_status failing_core(const clmha_core_args *c, void *user) {
    (void)c, (void)user;
    return CLMHA_UNSUPPORTED;
}

// A bfloat16 layer's user core sees its float32 pass (float32 tiles, as a float32 layer's):
// the output and weights within the dtype's contract of the reference on the rounded values.
Test(interop, user_attention_core_bfloat16) {
    clmha_context *ctx = context_or_skip();
    make_params();
    float *all[] = {w_in, b_in, w_out, b_out, x};
    size_t counts[] = {3 * E * E, 3 * E, E * E, E, L * N * E};
    for (size_t k = 0; k < 5; ++k)
        for (size_t i = 0; i < counts[k]; ++i)
            all[k][i] = clmha__dtype_round(CLMHA_DTYPE_BF16, all[k][i]);
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = H,
                             .bias = true, .dtype = CLMHA_DTYPE_BF16};
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS);
    const char *names[] = {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"};
    for (size_t k = 0; k < 4; ++k)
        cr_assert_eq(clmha_layer_set_parameter(layer, names[k], all[k], counts[k]), 0);
    core_log log = {0};
    cr_assert_eq(clmha_layer_set_attention(layer, host_core, &log), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
                               .need_weights = true};
    static float y[L * N * E], w[N * L * S];
    static double y_ref[L * N * E], w_ref[N * L * S];
    cr_assert_eq(clmha_layer_forward_host(layer, &args, y, L * N * E, w, N * L * S),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_assert_eq(log.calls, 1);
    reference(y_ref, w_ref);
    const float *got[] = {y, w};
    const double *want[] = {y_ref, w_ref};
    size_t count[] = {L * N * E, N * L * S};
    for (int m = 0; m < 2; ++m) {
        double big = 0.0, worst = 0.0;
        for (size_t i = 0; i < count[m]; ++i) big = fmax(big, fabs(want[m][i]));
        double t = 1e-5 * (1 + big);
        for (size_t i = 0; i < count[m]; ++i)
            worst = fmax(worst, fabs(got[m][i] - want[m][i]) /
                                    (0x1p-8 * (fabs(want[m][i]) + t) + t));
        cr_expect_leq(worst, 1.0, "%s: %.2f times the contract", m ? "weights" : "output",
                      worst);
    }
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

Test(interop, user_attention_core) {
    clmha_context *ctx = context_or_skip();
    clmha_layer *layer = make_layer(ctx);
    core_log log = {0};
    cr_assert_eq(clmha_layer_set_attention(layer, host_core, &log), CLMHA_SUCCESS);
    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
                               .need_weights = true};
    static float y[L * N * E], w[N * L * S];
    static double y_ref[L * N * E], w_ref[N * L * S];
    cr_assert_eq(clmha_layer_forward_host(layer, &args, y, L * N * E, w, N * L * S),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_assert_eq(log.calls, 1);
    cr_assert(log.batch == N && log.heads == H && log.tgt == L && log.src == S &&
              log.src_padded == S && log.head_dim == D);
    reference(y_ref, w_ref);
    double err_y = max_abs_err(y, y_ref, L * N * E), err_w = max_abs_err(w, w_ref, N * L * S);
    cr_assert_leq(err_y, 1e-4, "output error %g through the user core", err_y);
    cr_assert_leq(err_w, 1e-4, "weights error %g through the user core", err_w);

    // A failing core aborts the pass with CLMHA_CALLBACK_FAILED and leaves the output alone.
    cr_assert_eq(clmha_layer_set_attention(layer, failing_core, NULL), CLMHA_SUCCESS);
    for (size_t i = 0; i < L * N * E; ++i) y[i] = 12345.0f;
    cr_assert_eq(clmha_layer_forward_host(layer, &args, y, L * N * E, w, N * L * S),
                 CLMHA_CALLBACK_FAILED);
    for (size_t i = 0; i < L * N * E; ++i) cr_assert_eq(y[i], 12345.0f);
    cr_assert(strstr(clmha_context_last_error(ctx), "attention core") != NULL);

    // NULL restores the built-in core.
    cr_assert_eq(clmha_layer_set_attention(layer, NULL, NULL), CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_forward_host(layer, &args, y, L * N * E, w, N * L * S),
                 CLMHA_SUCCESS);
    err_y = max_abs_err(y, y_ref, L * N * E);
    cr_assert_leq(err_y, 1e-4);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

Test(interop, queue_of_another_context_is_refused) {
    app a, b;
    if (!app_open(&a)) cr_skip_test("no OpenCL device");
    app_open(&b);
    bool ctx_move = refs_move(REF_CONTEXT, a.context), queue_move = refs_move(REF_QUEUE, b.queue);
    cl_uint refs_a = refs_of(REF_CONTEXT, a.context), refs_q = refs_of(REF_QUEUE, b.queue);
    clmha_context *ctx = (clmha_context *)0x1;
    cr_assert_eq(clmha_context_create_from_cl(&ctx, a.context, a.device, b.queue),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert_null(ctx);
    cr_assert(strstr(clmha_last_create_error(), "another cl_context") != NULL, "%s",
              clmha_last_create_error());
    assert_nothing_held("after the refused call");
    assert_refs_back(REF_CONTEXT, a.context, ctx_move, refs_a, "after the refused call");
    assert_refs_back(REF_QUEUE, b.queue, queue_move, refs_q, "after the refused call");
    app_close(&a);
    app_close(&b);
}

// Releasing one clmha context, or failing to create one, leaves CLBlast's process-wide program
// cache alone while another context lives: its GEMM programs hold references to the caller's
// cl_context, so that context's reference count shows whether the cache was cleared.
Test(interop, other_contexts_keep_clblast_programs) {
    app a;
    if (!app_open(&a)) cr_skip_test("no OpenCL device");
    bool ctx_move = refs_move(REF_CONTEXT, a.context);
    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_cl(&ctx, a.context, a.device, a.queue), CLMHA_SUCCESS,
                 "%s", clmha_last_create_error());
    clmha_layer *layer = make_layer(ctx);
    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {L, N, E}, .data = x},
                               .need_weights = true};
    static float y[L * N * E], w[N * L * S];
    static double y_ref[L * N * E], w_ref[N * L * S];
    cr_assert_eq(clmha_layer_forward_host(layer, &args, y, L * N * E, w, N * L * S),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cl_uint refs = refs_steady(REF_CONTEXT, a.context);  // with CLBlast's GEMM programs

    clmha_context *other = NULL;
    cr_assert_eq(clmha_context_create_from_env(&other), CLMHA_SUCCESS, "%s",
                 clmha_last_create_error());
    clmha_context_release(other);
    clmha_context *bad = (clmha_context *)0x1;
    cr_assert_neq(clmha_context_create(&bad, "no-such-device-spec"), CLMHA_SUCCESS);
    cr_assert_null(bad);
    cl_uint after = ctx_move ? refs_steady(REF_CONTEXT, a.context) : refs;
    if (ctx_move)
        cr_expect_eq(after, refs,
                     "releasing another clmha context cleared CLBlast's program cache: the "
                     "caller's cl_context went from %u to %u references", refs, after);
    else
        cr_log_warn("the driver's reference counts do not move: the cache is not observed");

    // The first context still works.
    cr_assert_eq(clmha_layer_forward_host(layer, &args, y, L * N * E, w, N * L * S),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    reference(y_ref, w_ref);
    cr_expect_leq(max_abs_err(y, y_ref, L * N * E), 1e-4);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    app_close(&a);
}

// Waits up to @p ms for @p ev to leave CL_QUEUED/CL_SUBMITTED/CL_RUNNING; returns its status
// then (still positive when it did not).
static cl_int status_within(cl_event ev, long ms) {
    cl_int status = CL_QUEUED;
    for (long t = 0; t <= ms; t += 20) {
        clGetEventInfo(ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, NULL);
        if (status <= CL_COMPLETE) break;
        sleep_ms(20);
    }
    return status;
}

// A wait list holding an event that has already failed is refused, nothing is enqueued, and the
// queue keeps working: a command waiting for a failed event never runs on PoCL, so the pass (and
// every later command on the in-order queue) would never complete.
Test(interop, failed_event_in_wait_list_is_refused, .timeout = 120) {
    app a;
    if (!app_open(&a)) cr_skip_test("no OpenCL device");
    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_cl(&ctx, a.context, a.device, a.queue), CLMHA_SUCCESS,
                 "%s", clmha_last_create_error());
    clmha_layer *layer = make_layer(ctx);
    cl_int err;
    cl_mem q = clCreateBuffer(a.context, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof x, x,
                              &err);
    cl_mem out = clCreateBuffer(a.context, CL_MEM_READ_WRITE, sizeof(float) * L * N * E, NULL,
                                &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_event failed = clCreateUserEvent(a.context, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cr_assert_eq(clSetUserEventStatus(failed, -1), CL_SUCCESS);
    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {L, N, E}, .buffer = q}};
    cl_event done = (cl_event)0x1;
    cl_event wait[2] = {NULL, failed};
    cr_assert_eq(clEnqueueMarkerWithWaitList(a.queue, 0, NULL, &wait[0]), CL_SUCCESS);
    clmha_status st = clmha_layer_forward(layer, &args, out, 0, NULL, 0, 2, wait, &done);
    cr_expect_eq(st, CLMHA_OPENCL_ERROR, "a failed event in the wait list: %s",
                 clmha_status_string(st));
    cr_expect_null(done);
    cr_expect(strstr(clmha_context_last_error(ctx), "wait_list[1] has failed") != NULL, "%s",
              clmha_context_last_error(ctx));
    if (st == CLMHA_SUCCESS && done) clReleaseEvent(done);
    // The queue still works: a later call completes.
    cl_event later = NULL;
    cr_assert_eq(clmha_layer_forward(layer, &args, out, 0, NULL, 0, 0, NULL, &later),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    clFlush(a.queue);
    cl_int later_status = status_within(later, 10000);
    cr_assert_eq(later_status, CL_COMPLETE,
                 "the call after the refused one did not complete within 10 s (status %d): the "
                 "queue is stuck behind the failed event", later_status);
    clReleaseEvent(later);
    clReleaseEvent(wait[0]);
    clReleaseEvent(failed);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    clReleaseMemObject(q);
    clReleaseMemObject(out);
    app_close(&a);
}

