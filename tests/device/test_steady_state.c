#define _POSIX_C_SOURCE 200809L
// The steady state of the device-buffer forward pass: once a layer is baked for (N, L, S), a
// forward call at that shape or any smaller one builds no program and allocates no buffer in
// clmha, and it never waits on the host.
//
// Links libclmha.a (target clmha_static) for the internal counters of src/context/context.h:
// clmha__context_counters() counts clmha's own clBuildProgram and clCreateBuffer /
// clCreateSubBuffer calls on a context. What it does not see: CLBlast may compile kernels and
// allocate temporary buffers inside its own GEMM calls (e.g. padded copies of the matrices on
// its indirect GEMM path), and the OpenCL driver may allocate internally; neither goes through
// clmha, so neither is counted here. (clmha_layer_bake runs the GEMMs once at the baked shape,
// so CLBlast's kernels for them are compiled by then.)
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "context/context.h"
#include "support.h"

enum { E = 32, H = 4, KD = 24, VD = 40 };
enum { N_BAKE = 3, L_BAKE = 12, S_BAKE = 12 };  // the baked shape
enum { N_BIG = 3, L_BIG = 24, S_BIG = 24 };     // larger: the scratch has to grow
enum { MAX_FLOATS = N_BIG * H * L_BIG * S_BIG };  // the largest buffer: per-head weights

// A layer with random parameters: packed in_proj_weight (kdim = vdim = E), or separate
// q/k/v_proj_weight with kdim KD and vdim VD; with user functions @p mod_source (NULL: none).
static clmha_layer *make_layer_with(clmha_context *ctx, bool separate, const char *mod_source) {
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true,
                             .kdim = separate ? KD : 0, .vdim = separate ? VD : 0,
                             .mod_source = mod_source,
                             .mod_params = mod_source ? user_test_params : NULL,
                             .mod_params_count = mod_source ? USER_TEST_PARAMS : 0};
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    static float p[3 * E * VD + E * E];
    uint64_t rng = 11;
    for (size_t i = 0; i < sizeof p / sizeof p[0]; ++i) p[i] = 0.3f * frand(&rng);
    const char *names[] = {"in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                           "in_proj_bias", "out_proj.weight", "out_proj.bias"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i) {
        size_t count = clmha_layer_parameter_count(layer, names[i]);
        if (!count) continue;
        cr_assert_eq(clmha_layer_set_parameter(layer, names[i], p, count), CLMHA_SUCCESS, "%s: %s",
                     names[i], clmha_context_last_error(ctx));
    }
    return layer;
}

static clmha_layer *make_layer(clmha_context *ctx, bool separate) {
    return make_layer_with(ctx, separate, NULL);
}

// Device buffers big enough for every call below, filled with random values (made before the
// counters are read; they are the test's own, not clmha's).
typedef struct buffers {
    cl_mem q, k, v, out, w, kpm;
} buffers;

static cl_mem random_buffer(clmha_context *ctx, size_t count, uint64_t *rng) {
    static float host[MAX_FLOATS];
    cr_assert_leq(count, (size_t)MAX_FLOATS);
    for (size_t i = 0; i < count; ++i) host[i] = frand(rng);
    cl_int err;
    cl_mem m = clCreateBuffer(clmha_context_cl_context(ctx),
                              CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, count * sizeof(float),
                              host, &err);
    cr_assert_eq(err, CL_SUCCESS);
    return m;
}

static buffers make_buffers(clmha_context *ctx) {
    uint64_t rng = 5;
    buffers b;
    b.q = random_buffer(ctx, N_BIG * L_BIG * E, &rng);
    b.k = random_buffer(ctx, N_BIG * S_BIG * VD, &rng);
    b.v = random_buffer(ctx, N_BIG * S_BIG * VD, &rng);
    b.out = random_buffer(ctx, N_BIG * L_BIG * E, &rng);
    b.w = random_buffer(ctx, N_BIG * H * L_BIG * S_BIG, &rng);
    static unsigned char pad[N_BIG * S_BIG];
    for (size_t i = 0; i < sizeof pad; ++i) pad[i] = i % 5 == 4;  // every fifth key is padding
    cl_int err;
    b.kpm = clCreateBuffer(clmha_context_cl_context(ctx),
                           CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof pad, pad, &err);
    cr_assert_eq(err, CL_SUCCESS);
    return b;
}

static void release_buffers(buffers *b) {
    cl_mem all[] = {b->q, b->k, b->v, b->out, b->w, b->kpm};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) clReleaseMemObject(all[i]);
}

// One call: shape, attention kind and options.
typedef struct call {
    size_t n, l, s;
    int kind;  // 0 self-attention, 1 cross with key = value, 2 cross with separate key and value
    bool need_weights, per_head, kpm, causal;
} call;

static clmha_forward_args args_of(const call *c, const buffers *b, size_t kdim, size_t vdim) {
    clmha_forward_args a = {.struct_size = sizeof a,
                            .query = {.ndim = 3, .shape = {c->l, c->n, E}, .buffer = b->q},
                            .need_weights = c->need_weights || c->per_head,
                            .per_head_weights = c->per_head, .is_causal = c->causal};
    if (c->kind >= 1)
        a.key = (clmha_tensor){.ndim = 3, .shape = {c->s, c->n, kdim}, .buffer = b->k};
    if (c->kind == 2)
        a.value = (clmha_tensor){.ndim = 3, .shape = {c->s, c->n, vdim}, .buffer = b->v};
    if (c->kpm)
        a.key_padding_mask = (clmha_mask){
            .kind = CLMHA_MASK_BOOL_IGNORE,
            .tensor = {.ndim = 2, .shape = {c->n, c->s}, .buffer = b->kpm}};
    return a;
}

static void forward(clmha_layer *layer, const call *c, const buffers *b, size_t kdim,
                    size_t vdim) {
    clmha_context *ctx = clmha_layer_context(layer);
    clmha_forward_args a = args_of(c, b, kdim, vdim);
    cl_event done = NULL;
    cr_assert_eq(clmha_layer_forward(layer, &a, b->out, 0, b->w, 0, 0, NULL, &done),
                 CLMHA_SUCCESS, "N %zu L %zu S %zu kind %d: %s", c->n, c->l, c->s, c->kind,
                 clmha_context_last_error(ctx));
    cr_assert_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
}

static void counters(clmha_context *ctx, size_t *builds, size_t *allocs) {
    *builds = *allocs = (size_t)-1;
    clmha__context_counters(ctx, builds, allocs);
}

// Runs each of the @p n calls @p rounds times, then expects the context's counters still at
// @p builds0 programs built and @p allocs0 buffers allocated.
static void run_steady(clmha_layer *layer, const call *calls, size_t n, int rounds,
                       const buffers *b, size_t builds0, size_t allocs0) {
    for (size_t i = 0; i < n; ++i)
        for (int r = 0; r < rounds; ++r) forward(layer, &calls[i], b, E, E);
    size_t builds, allocs;
    counters(clmha_layer_context(layer), &builds, &allocs);
    cr_expect_eq(builds, builds0, "steady-state forward calls built %zu programs",
                 builds - builds0);
    cr_expect_eq(allocs, allocs0, "steady-state forward calls allocated %zu buffers",
                 allocs - allocs0);
}

Test(steady_state, no_allocation_or_build_at_or_below_the_baked_shape, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    size_t builds0, allocs0, builds, allocs;
    counters(ctx, &builds0, &allocs0);
    clmha_layer *layer = make_layer(ctx, false);
    counters(ctx, &builds, &allocs);
    cr_assert_gt(allocs, allocs0, "creating a layer allocates its parameters: counter broken?");
    buffers b = make_buffers(ctx);
    cr_assert_eq(clmha_layer_bake(layer, N_BAKE, L_BAKE, S_BAKE, true), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    size_t baked_scratch = clmha_layer_scratch_bytes(layer);
    counters(ctx, &builds0, &allocs0);

    const call calls[] = {
        {N_BAKE, L_BAKE, S_BAKE, 0, true, false, false, false},   // the baked shape
        {N_BAKE, L_BAKE, S_BAKE, 0, false, false, false, false},  // without weights
        {N_BAKE, L_BAKE, S_BAKE, 0, false, true, true, true},     // per-head weights, masks
        {N_BAKE, L_BAKE, S_BAKE, 1, true, false, true, false},    // cross, key = value
        {N_BAKE, L_BAKE, S_BAKE, 2, true, false, false, true},    // cross, separate value
        {2, 8, 8, 0, true, false, false, false},                  // smaller
        {1, L_BAKE, 5, 1, true, false, true, false},              // S < L
        {N_BAKE, 4, S_BAKE, 2, false, true, false, true},         // L < S
        {1, 1, 1, 0, true, false, false, false},                  // the smallest
    };
    run_steady(layer, calls, sizeof calls / sizeof calls[0], 3, &b, builds0, allocs0);
    cr_expect_eq(clmha_layer_scratch_bytes(layer), baked_scratch);

    // A larger shape must grow the scratch: the counter sees those allocations.
    const call big = {N_BIG, L_BIG, S_BIG, 0, true, false, false, false};
    forward(layer, &big, &b, E, E);
    counters(ctx, &builds, &allocs);
    cr_expect_gt(allocs, allocs0, "a larger shape grew the scratch without the counter moving");
    cr_expect_gt(clmha_layer_scratch_bytes(layer), baked_scratch);
    cr_expect_eq(builds, builds0, "a larger shape needs no new program");
    // ... and once grown, that shape is steady too.
    counters(ctx, &builds0, &allocs0);
    for (int r = 0; r < 3; ++r) forward(layer, &big, &b, E, E);
    counters(ctx, &builds, &allocs);
    cr_expect_eq(allocs, allocs0);
    cr_expect_eq(builds, builds0);

    release_buffers(&b);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// A layer with a user mask function baked with weights: its calls without weights (the fused
// core, with the function's block mask) allocate and build nothing either.
Test(steady_state, user_mask_function_baked_with_weights, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    clmha_layer *layer = make_layer_with(ctx, false, user_test_source);
    buffers b = make_buffers(ctx);
    cr_assert_eq(clmha_layer_bake(layer, N_BAKE, L_BAKE, S_BAKE, true), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    size_t builds0, allocs0;
    counters(ctx, &builds0, &allocs0);
    const call calls[] = {
        {N_BAKE, L_BAKE, S_BAKE, 0, false, false, false, false},  // without weights
        {N_BAKE, L_BAKE, S_BAKE, 0, true, false, false, true},    // with weights, causal
        {2, 8, 8, 0, false, false, true, true},                   // smaller, masks
        {N_BAKE, 4, S_BAKE, 2, false, false, false, false},       // L < S
    };
    run_steady(layer, calls, sizeof calls / sizeof calls[0], 2, &b, builds0, allocs0);
    release_buffers(&b);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// The same with separate q/k/v projection weights (kdim, vdim != E): cross-attention only.
Test(steady_state, separate_projections, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    clmha_layer *layer = make_layer(ctx, true);
    buffers b = make_buffers(ctx);
    cr_assert_eq(clmha_layer_bake(layer, N_BAKE, L_BAKE, S_BAKE, true), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    size_t builds0, allocs0, builds, allocs;
    counters(ctx, &builds0, &allocs0);
    const call calls[] = {
        {N_BAKE, L_BAKE, S_BAKE, 2, false, false, false, false},
        {N_BAKE, L_BAKE, S_BAKE, 2, true, false, true, true},  // weights: the scores scratch
        {2, 3, 7, 2, false, false, true, false},
    };
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; ++i)
        for (int r = 0; r < 3; ++r) forward(layer, &calls[i], &b, KD, VD);
    counters(ctx, &builds, &allocs);
    cr_expect_eq(builds, builds0);
    cr_expect_eq(allocs, allocs0, "%zu buffers allocated", allocs - allocs0);
    release_buffers(&b);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// ---- host-array calls ------------------------------------------------------------------------

// clmha_layer_forward_host() copies through staging buffers the layer keeps: its first call
// allocates them, later calls at that shape or a smaller one allocate nothing, and the results
// match the device-buffer call's bit for bit. (A call refused after its upload lets them go:
// test_faults.c, forward_scratch_beyond_max_alloc_is_out_of_memory.)
Test(steady_state, host_calls_reuse_their_staging_buffers, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    clmha_layer *layer = make_layer(ctx, false);
    buffers b = make_buffers(ctx);
    cr_assert_eq(clmha_layer_bake(layer, N_BAKE, L_BAKE, S_BAKE, true), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    size_t baked_scratch = clmha_layer_scratch_bytes(layer);
    enum { Q = N_BAKE * L_BAKE * E };
    static float x[Q], y[Q], y_dev[Q], w[N_BAKE * L_BAKE * S_BAKE];
    uint64_t rng = 5;
    for (size_t i = 0; i < Q; ++i) x[i] = frand(&rng);
    cr_assert_eq(clEnqueueWriteBuffer(clmha_context_cl_queue(ctx), b.q, CL_TRUE, 0, sizeof x, x, 0,
                                      NULL, NULL),
                 CL_SUCCESS);
    const call c = {N_BAKE, L_BAKE, S_BAKE, 0, true, false, false, false};
    forward(layer, &c, &b, E, E);
    cr_assert_eq(clEnqueueReadBuffer(clmha_context_cl_queue(ctx), b.out, CL_TRUE, 0, sizeof y_dev,
                                     y_dev, 0, NULL, NULL),
                 CL_SUCCESS);

    clmha_forward_args a = {.struct_size = sizeof a,
                            .query = {.ndim = 3, .shape = {L_BAKE, N_BAKE, E}, .data = x},
                            .need_weights = true};
    size_t builds0, allocs0, builds, allocs;
    counters(ctx, &builds0, &allocs0);
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, Q, w, sizeof w / sizeof w[0]),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    counters(ctx, &builds, &allocs);
    cr_expect_gt(allocs, allocs0, "the first host call stages its tensors: counter broken?");
    cr_expect_gt(clmha_layer_scratch_bytes(layer), baked_scratch, "staging counts as scratch");
    size_t staged_scratch = clmha_layer_scratch_bytes(layer);
    for (size_t i = 0; i < Q; ++i)
        cr_assert_eq(y[i], y_dev[i], "output %zu: host %.9g, device %.9g", i, (double)y[i],
                     (double)y_dev[i]);

    counters(ctx, &builds0, &allocs0);
    for (int r = 0; r < 3; ++r) {
        memset(y, 0, sizeof y);
        cr_assert_eq(clmha_layer_forward_host(layer, &a, y, Q, w, sizeof w / sizeof w[0]),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        for (size_t i = 0; i < Q; ++i)
            cr_assert_eq(y[i], y_dev[i], "call %d, output %zu", r + 2, i);
    }
    a.query.shape[0] = L_BAKE / 2;  // smaller: fits the staging buffers
    a.need_weights = false;
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, Q / 2, NULL, 0), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    counters(ctx, &builds, &allocs);
    cr_expect_eq(allocs, allocs0, "repeated host calls allocated %zu buffers", allocs - allocs0);
    cr_expect_eq(builds, builds0);
    cr_expect_eq(clmha_layer_scratch_bytes(layer), staged_scratch);

    release_buffers(&b);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// ---- no host synchronisation ---------------------------------------------------------------

// Opens the gate after a few seconds if the test has not done so: were the forward call to wait
// on the host for its wait list (clFinish, clWaitForEvents, a blocking read), it would block
// until then instead of deadlocking the test.
typedef struct watchdog {
    cl_event gate;
    atomic_bool stop;
    atomic_bool fired;
} watchdog;

static void *watchdog_main(void *arg) {
    watchdog *w = arg;
    double t0 = (1e3 * now_seconds());
    while (!atomic_load(&w->stop)) {
        if ((1e3 * now_seconds()) - t0 > 5000.0) {
            atomic_store(&w->fired, true);
            clSetUserEventStatus(w->gate, CL_COMPLETE);
            return NULL;
        }
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static cl_int event_status(cl_event e) {
    cl_int status = -1;
    clGetEventInfo(e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, NULL);
    return status;
}

Test(steady_state, forward_enqueues_without_waiting_on_the_host, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    clmha_layer *layer = make_layer(ctx, false);
    buffers b = make_buffers(ctx);
    cr_assert_eq(clmha_layer_bake(layer, N_BAKE, L_BAKE, S_BAKE, true), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    const call c = {N_BAKE, L_BAKE, S_BAKE, 0, true, false, true, false};
    cl_command_queue queue = clmha_context_cl_queue(ctx);

    // The result without a gate, for comparison.
    enum { OUT = N_BAKE * L_BAKE * E, W = N_BAKE * L_BAKE * S_BAKE };
    static float y0[OUT], w0[W], y1[OUT], w1[W];
    forward(layer, &c, &b, E, E);
    clEnqueueReadBuffer(queue, b.out, CL_TRUE, 0, sizeof y0, y0, 0, NULL, NULL);
    clEnqueueReadBuffer(queue, b.w, CL_TRUE, 0, sizeof w0, w0, 0, NULL, NULL);
    float zero = 0.0f;  // so that a pass that never ran cannot look right
    clEnqueueFillBuffer(queue, b.out, &zero, sizeof zero, 0, sizeof y0, 0, NULL, NULL);
    clEnqueueFillBuffer(queue, b.w, &zero, sizeof zero, 0, sizeof w0, 0, NULL, NULL);
    clFinish(queue);

    size_t builds0, allocs0, builds, allocs;
    counters(ctx, &builds0, &allocs0);
    cl_int err;
    watchdog wd = {.gate = clCreateUserEvent(clmha_context_cl_context(ctx), &err)};
    cr_assert_eq(err, CL_SUCCESS);
    atomic_init(&wd.stop, false);
    atomic_init(&wd.fired, false);
    pthread_t thread;
    cr_assert_eq(pthread_create(&thread, NULL, watchdog_main, &wd), 0);

    clmha_forward_args a = args_of(&c, &b, E, E);
    cl_event done = NULL;
    double t0 = (1e3 * now_seconds());
    clmha_status st = clmha_layer_forward(layer, &a, b.out, 0, b.w, 0, 1, &wd.gate, &done);
    double call_ms = (1e3 * now_seconds()) - t0;
    clFlush(queue);
    cl_int done_status = done ? event_status(done) : -1;
    cl_int gate_status = event_status(wd.gate);
    atomic_store(&wd.stop, true);
    pthread_join(thread, NULL);
    bool fired = atomic_load(&wd.fired);
    if (!fired) clSetUserEventStatus(wd.gate, CL_COMPLETE);

    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_assert(!fired, "the forward call blocked until the watchdog opened its wait list "
              "(%.0f ms): it waits on the host", call_ms);
    cr_expect_lt(call_ms, 1000.0, "enqueuing the forward pass took %.0f ms", call_ms);
    cr_expect_neq(gate_status, CL_COMPLETE);
    cr_expect_neq(done_status, CL_COMPLETE,
                  "the forward pass completed before its wait list was satisfied");

    // Once the gate opens the pass runs, with the same result as without the gate.
    cr_assert_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clEnqueueReadBuffer(queue, b.out, CL_TRUE, 0, sizeof y1, y1, 0, NULL, NULL);
    clEnqueueReadBuffer(queue, b.w, CL_TRUE, 0, sizeof w1, w1, 0, NULL, NULL);
    double dy = max_abs_diff(y1, y0, OUT), dw = max_abs_diff(w1, w0, W);
    cr_expect_leq(dy, 1e-6, "output differs by %g after the gate", dy);
    cr_expect_leq(dw, 1e-6, "weights differ by %g after the gate", dw);
    counters(ctx, &builds, &allocs);
    cr_expect_eq(builds, builds0);
    cr_expect_eq(allocs, allocs0);

    clReleaseEvent(done);
    clReleaseEvent(wd.gate);
    release_buffers(&b);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}
