// The dispatch of attention cores (src/cores/core.c): the forward and backward passes walk the
// table and read each core's answer (runs, passes, falls back, refuses). These cases check the
// answers that decide a call: a core asked for by impl that returns no weights refuses the
// call and says which impl does; a partial call asks only the cores that write log-sum-exp
// rows, with its own impl, and, when none can run it, the message gives each core's reason; a
// forward call that fell back (a driver's loop limit, here the test hook's) lets its backward
// fall back too, while one that ran the unfused core by choice does not.
#include <criterion/criterion.h>

#include <clmha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cores/fused.h"
#include "forward/saved.h"
#include "layer/layer.h"
#include "support.h"

enum { E = 16, H = 2, N = 2, L = 5 };

static clmha_context *ctx;
static clmha_layer *layer;
static float x[L * N * E], y[L * N * E], w[N * L * L], gy[L * N * E], dx[L * N * E];

static void setup(void) {
    ctx = context_or_skip();
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = H,
                             .bias = true};
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    prng r = {7};
    float *w_in = uniform_floats(&r, 3 * E * E, 0.3), *w_out = uniform_floats(&r, E * E, 0.3);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E), 0);
    free(w_in), free(w_out);
    for (size_t i = 0; i < L * N * E; ++i) x[i] = (float)(i % 11) * 0.1f - 0.5f;
    for (size_t i = 0; i < L * N * E; ++i) gy[i] = (float)(i % 7) * 0.1f - 0.3f;
}

static void teardown(void) {
    clmha__test_set_loop_limit(0);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

TestSuite(core_dispatch, .init = setup, .fini = teardown);

static clmha_forward_args self_call(void) {
    return (clmha_forward_args){.struct_size = sizeof(clmha_forward_args),
                                .query = {.ndim = 3, .shape = {L, N, E}, .data = x}};
}

static void expect_message(const char *needle) {
    const char *msg = clmha_context_last_error(ctx);
    cr_expect(strstr(msg, needle) != NULL, "message \"%s\" lacks \"%s\"", msg, needle);
}

// Weights asked of the fused core by impl: refused by the dispatch (the core returns none),
// naming the impl of the core that does; with CLMHA_IMPL_AUTO the unfused core returns them.
Test(core_dispatch, weights_asked_of_a_core_without_them) {
    clmha_forward_args a = self_call();
    a.need_weights = true;
    a.impl = CLMHA_IMPL_FUSED;
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, L * N * E, w, N * L * L),
                 CLMHA_INVALID_ARGUMENT);
    expect_message("the fused core (impl fused) does not return weights");
    expect_message("CLMHA_IMPL_UNFUSED");
    cr_assert_eq(clmha_layer_set_impl(layer, CLMHA_IMPL_FUSED), CLMHA_SUCCESS);
    a.impl = CLMHA_IMPL_AUTO;
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, L * N * E, w, N * L * L),
                 CLMHA_INVALID_ARGUMENT);
    expect_message("the layer's choice");
    cr_assert_eq(clmha_layer_set_impl(layer, CLMHA_IMPL_AUTO), CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, L * N * E, w, N * L * L), CLMHA_SUCCESS,
                 "%s", clmha_context_last_error(ctx));
    cr_assert(!clmha__fused_ran(layer), "weights came from a core that returns none");
}

// A partial call runs a core that writes the log-sum-exp rows, whatever the layer's impl: the
// fused core, or past its loop limit the unfused one, which writes the same rows.
Test(core_dispatch, partial_calls_need_log_sum_exp_rows) {
    cl_context cl = clmha_context_cl_context(ctx);
    cl_int err;
    cl_mem q = clCreateBuffer(cl, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof x, x, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_mem heads = clCreateBuffer(cl, CL_MEM_READ_WRITE, sizeof x, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_mem lse = clCreateBuffer(cl, CL_MEM_READ_WRITE, N * H * L * sizeof(float), NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    clmha_forward_args a = self_call();
    a.query.data = NULL;
    a.query.buffer = q;
    cr_assert_eq(clmha_layer_set_impl(layer, CLMHA_IMPL_UNFUSED), CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_attend(layer, &a, true, heads, 0, lse, 0, 0, NULL, NULL),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_assert(clmha__fused_ran(layer), "the partial call took the layer's impl");
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    static float fused_heads[sizeof x / sizeof x[0]], fused_lse[N * H * L];
    static float other_heads[sizeof x / sizeof x[0]], other_lse[N * H * L];
    clEnqueueReadBuffer(queue, heads, CL_TRUE, 0, sizeof x, fused_heads, 0, NULL, NULL);
    clEnqueueReadBuffer(queue, lse, CL_TRUE, 0, sizeof fused_lse, fused_lse, 0, NULL, NULL);
    clmha__test_set_loop_limit(2);
    cr_assert_eq(clmha_layer_attend(layer, &a, true, heads, 0, lse, 0, 0, NULL, NULL),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect(!clmha__fused_ran(layer), "past the loop limit the fused core ran");
    clmha__test_set_loop_limit(0);
    clEnqueueReadBuffer(queue, heads, CL_TRUE, 0, sizeof x, other_heads, 0, NULL, NULL);
    clEnqueueReadBuffer(queue, lse, CL_TRUE, 0, sizeof other_lse, other_lse, 0, NULL, NULL);
    double eh = max_abs_diff(fused_heads, other_heads, sizeof x / sizeof x[0]);
    double el = max_abs_diff(fused_lse, other_lse, N * H * L);
    cr_expect(eh <= 1e-5 && el <= 1e-5,
              "the unfused core's heads and log-sum-exp rows differ from the fused core's by "
              "%.3g and %.3g",
              eh, el);
    clFinish(queue);
    clReleaseMemObject(q), clReleaseMemObject(heads), clReleaseMemObject(lse);
}

// Runs a saving forward call with @p impl (and weights when @p weights), then its backward with
// @p backward_impl; returns the backward's status.
static clmha_status forward_then_backward(clmha_impl impl, bool weights, bool *fell_back,
                                          clmha_impl backward_impl) {
    clmha_saved *saved = NULL;
    cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
    clmha_forward_args a = self_call();
    a.impl = impl;
    a.need_weights = weights;
    a.save = saved;
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, L * N * E, weights ? w : NULL,
                                          weights ? N * L * L : 0),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    *fell_back = saved->fell_back;
    clmha_backward_args b = {.struct_size = sizeof b, .forward = &a, .saved = saved,
                             .grad_output = {.ndim = 3, .shape = {L, N, E}, .data = gy},
                             .query = {.data = dx}, .impl = backward_impl};
    clmha_status st = clmha_layer_backward_host(layer, &b);
    clmha_saved_release(saved);
    return st;
}

static clmha_status forward_then_fused_backward(clmha_impl impl, bool weights, bool *fell_back) {
    return forward_then_backward(impl, weights, fell_back, CLMHA_IMPL_FUSED);
}

// A forward call that asked for the fused core and fell back (the loop limit) records it, and
// its fused backward falls back to the unfused one; a forward call that ran the unfused core
// because it asked for weights did not fall back, and its fused backward is refused.
Test(core_dispatch, fused_backward_falls_back_with_its_forward) {
    bool fell_back = false;
    clmha__test_set_loop_limit(2);
    clmha_status st = forward_then_fused_backward(CLMHA_IMPL_FUSED, false, &fell_back);
    cr_assert(fell_back, "the forward call past the loop limit fell back");
    cr_assert(!clmha__fused_ran(layer));
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    clmha__test_set_loop_limit(0);
    st = forward_then_fused_backward(CLMHA_IMPL_AUTO, true, &fell_back);
    cr_assert(!fell_back);
    cr_assert_eq(st, CLMHA_UNSUPPORTED);
    expect_message("the fused backward core cannot run this call: the forward call did not run "
                   "the fused core");
    st = forward_then_fused_backward(CLMHA_IMPL_FUSED, false, &fell_back);
    cr_assert(!fell_back && clmha__fused_ran(layer));
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
}

// The layer's choice of the fused core (clmha_layer_set_impl()) is what a call with
// CLMHA_IMPL_AUTO prefers, not a demand: a backward call with CLMHA_IMPL_AUTO whose forward
// call ran the unfused core (its own impl said so) runs the unfused backward, as
// clmha_layer_backward() documents and as CLMHA_IMPL_UNFUSED would, bit for bit. It was
// refused (CLMHA_UNSUPPORTED, "the forward call did not run the fused core"): found by the
// soak (tests/soak/soak.c).
Test(core_dispatch, auto_backward_of_an_unfused_forward_on_a_fused_layer) {
    static float want[L * N * E];
    bool fell_back = false;
    cr_assert_eq(clmha_layer_set_impl(layer, CLMHA_IMPL_FUSED), CLMHA_SUCCESS);
    clmha_status st = forward_then_backward(CLMHA_IMPL_UNFUSED, false, &fell_back,
                                            CLMHA_IMPL_UNFUSED);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    memcpy(want, dx, sizeof want);
    memset(dx, 0, sizeof dx);
    st = forward_then_backward(CLMHA_IMPL_UNFUSED, false, &fell_back, CLMHA_IMPL_AUTO);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect(memcmp(dx, want, sizeof want) == 0, "the unfused backward's gradient differs");
    // An explicit CLMHA_IMPL_FUSED is still refused there.
    st = forward_then_backward(CLMHA_IMPL_UNFUSED, false, &fell_back, CLMHA_IMPL_FUSED);
    cr_expect_eq(st, CLMHA_UNSUPPORTED);
}
