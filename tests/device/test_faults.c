#define _POSIX_C_SOURCE 200809L
// Faults: allocations beyond the device's largest allocation, a forced kernel build failure, a
// machine without any OpenCL platform, and NaN/Inf in the inputs and masks.
//
// Links libclmha.a (not libclmha.so): the build failure is forced through the internal test hook
// clmha__test_set_extra_build_options, and the largest allocation lowered through
// clmha__test_set_max_alloc (and the global memory through clmha__test_set_global_mem), which
// only the static library exposes.
#include <criterion/criterion.h>

#include <clmha.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <clblast_c.h>

#include "context/context.h"
#include "context/programs.h"
#include "support_internal.h"

extern char **environ;

// ---- helpers ---------------------------------------------------------------------------------

static cl_ulong max_alloc(clmha_context *ctx) {
    cl_ulong bytes = 0;
    cr_assert_eq(clGetDeviceInfo(clmha_context_cl_device(ctx), CL_DEVICE_MAX_MEM_ALLOC_SIZE,
                                 sizeof bytes, &bytes, NULL),
                 CL_SUCCESS);
    cr_assert_gt(bytes, 0);
    return bytes;
}

// A small layer (E 8, 2 heads, bias) with random parameters, and its reference parameters.
enum { E = 8, H = 2, L = 4, S = 5, N = 3 };

typedef struct small {
    clmha_layer_desc desc;
    float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E];
    clmha_reference_params ref;
} small;

static clmha_layer *small_layer(clmha_context *ctx, small *m, bool bias) {
    uint64_t s = 11;
    for (size_t i = 0; i < 3 * E * E; ++i) m->w_in[i] = 0.5f * frand(&s);
    for (size_t i = 0; i < 3 * E; ++i) m->b_in[i] = bias ? 0.1f * frand(&s) : 0.0f;
    for (size_t i = 0; i < E * E; ++i) m->w_out[i] = 0.5f * frand(&s);
    for (size_t i = 0; i < E; ++i) m->b_out[i] = bias ? 0.1f * frand(&s) : 0.0f;
    m->desc = (clmha_layer_desc){.struct_size = sizeof(clmha_layer_desc),
                                 .embed_dim = E, .num_heads = H, .bias = bias};
    m->ref = (clmha_reference_params){.struct_size = sizeof(clmha_reference_params),
                                      .in_proj_weight = m->w_in,
                                      .in_proj_bias = bias ? m->b_in : NULL,
                                      .out_proj_weight = m->w_out,
                                      .out_proj_bias = bias ? m->b_out : NULL};
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &m->desc), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", m->w_in, 3 * E * E), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", m->w_out, E * E), 0);
    if (bias) {
        cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_bias", m->b_in, 3 * E), 0);
        cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.bias", m->b_out, E), 0);
    }
    return layer;
}

// Cross-attention inputs: query (L, N, E), key (S, N, E) (value = key), random.
typedef struct inputs {
    float q[L * N * E], k[S * N * E];
    float attn[L * S];  // float attn_mask (L, S), used when the test sets it
} inputs;

static void make_inputs(inputs *in, uint64_t seed) {
    for (size_t i = 0; i < L * N * E; ++i) in->q[i] = frand(&seed);
    for (size_t i = 0; i < S * N * E; ++i) in->k[i] = frand(&seed);
    for (size_t i = 0; i < L * S; ++i) in->attn[i] = 0.0f;
}

static clmha_forward_args cross_args(const inputs *in, bool with_attn) {
    clmha_forward_args a = {.struct_size = sizeof a,
                            .query = {.ndim = 3, .shape = {L, N, E}, .data = in->q},
                            .key = {.ndim = 3, .shape = {S, N, E}, .data = in->k},
                            .need_weights = true};
    if (with_attn)
        a.attn_mask = (clmha_mask){.kind = CLMHA_MASK_FLOAT,
                                   .tensor = {.ndim = 2, .shape = {L, S}, .data = in->attn}};
    return a;
}

typedef struct result {
    float y[L * N * E], w[N * L * S];
    double y_ref[L * N * E], w_ref[N * L * S];
} result;

// Runs the device and the reference on @p args (the call must return).
static void run_both(clmha_layer *layer, const small *m, const clmha_forward_args *args,
                     result *r) {
    clmha_context *ctx = clmha_layer_context(layer);
    cr_assert_eq(clmha_layer_forward_host(layer, args, r->y, L * N * E, r->w, N * L * S),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    char msg[256];
    cr_assert_eq(clmha_reference_forward(&m->desc, &m->ref, args, r->y_ref, L * N * E, r->w_ref,
                                         N * L * S, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
}

static bool row_has_nan_f(const float *p, size_t count) {
    for (size_t i = 0; i < count; ++i)
        if (isnan(p[i])) return true;
    return false;
}

static bool row_has_nan_d(const double *p, size_t count) {
    for (size_t i = 0; i < count; ++i)
        if (isnan(p[i])) return true;
    return false;
}

// expect_nan(l, n): whether output row (l, n) must be NaN (PyTorch's result). Checks the device
// against that and against the reference: NaN rows all NaN, the others finite and close.
// The averaged weights row (n, l) follows the same rule.
static void check_rows(const result *r, bool (*expect_nan)(size_t l, size_t n), const char *what) {
    for (size_t l = 0; l < L; ++l)
        for (size_t n = 0; n < N; ++n) {
            const float *y = r->y + (l * N + n) * E;
            const double *yr = r->y_ref + (l * N + n) * E;
            const float *w = r->w + (n * L + l) * S;
            const double *wr = r->w_ref + (n * L + l) * S;
            bool want = expect_nan(l, n);
            cr_expect_eq(row_has_nan_f(y, E), want, "%s: device output row (l %zu, n %zu) %s",
                         what, l, n, want ? "should be NaN (as PyTorch)" : "has NaN");
            cr_expect_eq(row_has_nan_d(yr, E), want,
                         "%s: reference output row (l %zu, n %zu) %s", what, l, n,
                         want ? "should be NaN (as PyTorch)" : "has NaN");
            cr_expect_eq(row_has_nan_f(w, S), want, "%s: device weights row (n %zu, l %zu) %s",
                         what, n, l, want ? "should be NaN" : "has NaN");
            for (size_t c = 0; c < E; ++c) {
                if (want) {
                    cr_expect(isnan(y[c]), "%s: output (l %zu, n %zu, %zu) = %g, want NaN", what,
                              l, n, c, (double)y[c]);
                } else {
                    cr_expect(isfinite(y[c]), "%s: output (l %zu, n %zu, %zu) = %g", what, l, n,
                              c, (double)y[c]);
                    cr_expect_leq(fabs(y[c] - yr[c]), 1e-4, "%s: output (l %zu, n %zu, %zu) %g vs %g",
                                  what, l, n, c, (double)y[c], yr[c]);
                }
            }
            for (size_t j = 0; j < S && !want; ++j)
                cr_expect_leq(fabs(w[j] - wr[j]), 1e-4, "%s: weight (n %zu, l %zu, %zu) %g vs %g",
                              what, n, l, j, (double)w[j], wr[j]);
        }
}

// ---- (a) allocations beyond CL_DEVICE_MAX_MEM_ALLOC_SIZE --------------------------------------

// The application's own cl_context (so that its reference count shows any cl_mem, cl_program or
// cl_kernel clmha leaves behind, where the driver's counts move: tests/support/support.h) and a clmha
// context on it.
typedef struct wrapped {
    cl_context context;
    cl_command_queue queue;
    bool refs_move;  // the driver's context reference count moves when retained
    cl_uint refs0;
    clmha_context *ctx;
} wrapped;

static void wrapped_open(wrapped *w) {
    clmha_device_info info = {.struct_size = sizeof info};
    char msg[512];
    if (clmha_device_select(getenv("CLMHA_DEVICE"), &info, msg, sizeof msg) != CLMHA_SUCCESS)
        cr_skip_test("no OpenCL device: %s", msg);
    cl_int err;
    w->context = clCreateContext(NULL, 1, &info.device, NULL, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    w->queue = clCreateCommandQueue(w->context, info.device, 0, &err);
    cr_assert_eq(err, CL_SUCCESS);
    w->refs_move = refs_move(REF_CONTEXT, w->context);
    if (w->refs_move) context_refs_show_objects(w->context);  // notes when it does not
    w->refs0 = refs_of(REF_CONTEXT, w->context);
    assert_nothing_held("before the clmha context was created");
    cr_assert_eq(clmha_context_create_from_cl(&w->ctx, w->context, info.device, w->queue),
                 CLMHA_SUCCESS, "%s", clmha_last_create_error());
}

// Releases the clmha context and checks that clmha holds no OpenCL object any more and that the
// cl_context is back to its references (an OpenCL object leaked otherwise).
static void wrapped_close(wrapped *w) {
    long held[CLMHA__HELD_KINDS];
    held_counts(held);
    cr_assert(held[CLMHA__HELD_CONTEXT] == 1 && held[CLMHA__HELD_QUEUE] == 1 &&
                  held[CLMHA__HELD_MEM] >= 1,
              "clmha's counts of held objects before the release: %ld contexts, %ld queues, "
              "%ld buffers",
              held[CLMHA__HELD_CONTEXT], held[CLMHA__HELD_QUEUE], held[CLMHA__HELD_MEM]);
    clmha_context_release(w->ctx);
    assert_nothing_held("after releasing everything");
    assert_refs_back(REF_CONTEXT, w->context, w->refs_move, w->refs0,
                     "after releasing everything: an OpenCL object leaked");
    clReleaseCommandQueue(w->queue);
    clReleaseContext(w->context);
}

static void clear_max_alloc(void) { clmha__test_set_max_alloc(0); }

// Scores beyond the largest allocation no longer fail (the unfused core works in chunks), but
// the projection of the inputs cannot be chunked. The test hook lowers the limit so that a small
// shape shows both: self-attention over len positions (N = 1) projects into 3 * len * E floats,
// while its scores (H * len^2 floats) are far above the limit.
enum { LEN = 64 };
static const size_t proj_bytes = 3 * LEN * E * sizeof(float);

Test(faults, bake_beyond_max_alloc_is_out_of_memory, .fini = clear_max_alloc, .timeout = 600) {
    wrapped w;
    wrapped_open(&w);
    small m;
    clmha_layer *layer = small_layer(w.ctx, &m, true);
    cr_assert_gt((size_t)H * LEN * LEN * sizeof(float), 2 * proj_bytes);
    size_t before = clmha_layer_scratch_bytes(layer);
    clmha__test_set_max_alloc(proj_bytes - sizeof(float));
    clmha_status st = clmha_layer_bake(layer, 1, LEN, LEN, true);
    const char *msg = clmha_context_last_error(w.ctx);
    cr_assert_eq(st, CLMHA_OUT_OF_MEMORY, "bake L = S = %d: %s (%s)", LEN,
                 clmha_status_string(st), msg);
    cr_expect(strstr(msg, "projection") != NULL, "the message should name the projection: %s",
              msg);
    cr_expect(strstr(msg, "largest allocation") != NULL, "message: %s", msg);
    cr_expect_eq(clmha_layer_scratch_bytes(layer), before, "nothing should have been allocated");

    // With room for the projection, the scores alone do not stop the bake: they come in chunks
    // of at most half the limit.
    clmha__test_set_max_alloc(2 * proj_bytes);
    st = clmha_layer_bake(layer, 1, LEN, LEN, true);
    cr_assert_eq(st, CLMHA_SUCCESS, "bake with chunked scores: %s (%s)", clmha_status_string(st),
                 clmha_context_last_error(w.ctx));
    cr_expect_leq(clmha_layer_scratch_bytes(layer), 5 * proj_bytes,
                  "scratch %zu bytes: projection, 4 head tiles, one chunk of scores and its "
                  "head sums",
                  clmha_layer_scratch_bytes(layer));

    // The layer still works after the refusal, under the same limit.
    inputs in;
    make_inputs(&in, 5);
    clmha_forward_args args = cross_args(&in, false);
    result r;
    run_both(layer, &m, &args, &r);
    for (size_t i = 0; i < L * N * E; ++i)
        cr_assert_leq(fabs(r.y[i] - r.y_ref[i]), 1e-4, "output %zu: %g vs %g", i,
                      (double)r.y[i], r.y_ref[i]);
    clmha_layer_release(layer);
    wrapped_close(&w);
}

Test(faults, forward_scratch_beyond_max_alloc_is_out_of_memory, .fini = clear_max_alloc,
     .timeout = 600) {
    wrapped w;
    wrapped_open(&w);
    small m;
    clmha_layer *layer = small_layer(w.ctx, &m, true);
    size_t before = clmha_layer_scratch_bytes(layer);
    clmha__test_set_max_alloc(proj_bytes - sizeof(float));
    float *x = calloc(LEN * E, sizeof *x);
    float *y = malloc(LEN * E * sizeof *y);
    cr_assert(x && y);
    for (size_t i = 0; i < LEN * E; ++i) y[i] = 7.0f;
    // Host path, self-attention (L = S = LEN, N = 1).
    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {LEN, 1, E}, .data = x},
                               .impl = CLMHA_IMPL_UNFUSED};
    clmha_status st = clmha_layer_forward_host(layer, &args, y, LEN * E, NULL, 0);
    const char *msg = clmha_context_last_error(w.ctx);
    cr_assert_eq(st, CLMHA_OUT_OF_MEMORY, "forward_host L = %d: %s (%s)", LEN,
                 clmha_status_string(st), msg);
    cr_expect(strstr(msg, "projection") != NULL, "the message should name the projection: %s",
              msg);
    for (size_t i = 0; i < LEN * E; ++i) cr_assert_eq(y[i], 7.0f, "output %zu was written", i);

    // Device path: the caller's buffers, nothing enqueued or written, no event.
    cl_int err;
    cl_mem q = clCreateBuffer(w.context, CL_MEM_READ_WRITE, LEN * E * sizeof(float), NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_mem out = clCreateBuffer(w.context, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
                                LEN * E * sizeof(float), y, &err);
    cr_assert_eq(err, CL_SUCCESS);
    args.query = (clmha_tensor){.ndim = 3, .shape = {LEN, 1, E}, .buffer = q};
    cl_event ev = (cl_event)0x1;
    st = clmha_layer_forward(layer, &args, out, 0, NULL, 0, 0, NULL, &ev);
    msg = clmha_context_last_error(w.ctx);
    cr_assert_eq(st, CLMHA_OUT_OF_MEMORY, "forward L = %d: %s (%s)", LEN,
                 clmha_status_string(st), msg);
    cr_expect(strstr(msg, "projection") != NULL, "message: %s", msg);
    cr_expect(strstr(msg, "largest allocation") != NULL, "message: %s", msg);
    cr_expect_null(ev, "*event must be NULL on failure");
    cr_expect_eq(clmha_layer_scratch_bytes(layer), before, "nothing should have been allocated");
    cr_assert_eq(clEnqueueReadBuffer(w.queue, out, CL_TRUE, 0, LEN * E * sizeof(float), y, 0,
                                     NULL, NULL),
                 CL_SUCCESS);
    for (size_t i = 0; i < LEN * E; ++i) cr_assert_eq(y[i], 7.0f, "output %zu was written", i);
    clReleaseMemObject(q);
    clReleaseMemObject(out);
    free(x);
    free(y);

    // Still usable at a normal size, under the same limit.
    inputs in;
    make_inputs(&in, 6);
    clmha_forward_args small_args = cross_args(&in, false);
    result r;
    run_both(layer, &m, &small_args, &r);
    for (size_t i = 0; i < L * N * E; ++i)
        cr_assert_leq(fabs(r.y[i] - r.y_ref[i]), 1e-4);
    clmha_layer_release(layer);
    wrapped_close(&w);
}

static void clear_global_mem(void) { clmha__test_set_global_mem(0); }

static void clear_limits(void) {
    clmha__test_set_max_alloc(0);
    clmha__test_set_global_mem(0);
}

// A bake through core @p impl on a fresh layer under a global memory of @p limit bytes (0: the
// device's): its status, the layer's scratch after it in *scratch, its message in msg.
static clmha_status bake_under(wrapped *w, small *m, clmha_impl impl, size_t limit,
                               size_t *scratch, char *msg, size_t msg_size) {
    clmha_layer *layer = small_layer(w->ctx, m, true);
    cr_assert_eq(clmha_layer_set_impl(layer, impl), CLMHA_SUCCESS);
    clmha__test_set_global_mem(limit);
    clmha_status st = clmha_layer_bake(layer, 1, LEN, LEN, false);
    snprintf(msg, msg_size, "%s", clmha_context_last_error(w->ctx));
    *scratch = clmha_layer_scratch_bytes(layer);
    clmha__test_set_global_mem(0);
    clmha_layer_release(layer);
    return st;
}

// Scratch that just fits the device's global memory is made; a byte more is refused with
// CLMHA_OUT_OF_MEMORY saying which buffer and how much, before it is allocated (the driver
// would fail only when the work runs). Both cores, and a forward call under a small limit.
Test(faults, scratch_beyond_global_memory_is_out_of_memory, .fini = clear_global_mem,
     .timeout = 600) {
    wrapped w;
    wrapped_open(&w);
    small m;
    static const clmha_impl impls[2] = {CLMHA_IMPL_UNFUSED, CLMHA_IMPL_FUSED};
    char msg[1024];
    for (int c = 0; c < 2; ++c) {
        size_t need = 0, got = 0;
        cr_assert_eq(bake_under(&w, &m, impls[c], 0, &need, msg, sizeof msg), CLMHA_SUCCESS,
                     "%s", msg);
        cr_assert_gt(need, 0);
        clmha_status st = bake_under(&w, &m, impls[c], need, &got, msg, sizeof msg);
        cr_expect_eq(st, CLMHA_SUCCESS, "%s core, global memory %zu bytes, just enough: %s",
                     clmha_impl_name(impls[c]), need, msg);
        cr_expect_eq(got, need);
        st = bake_under(&w, &m, impls[c], need - 1, &got, msg, sizeof msg);
        cr_expect_eq(st, CLMHA_OUT_OF_MEMORY, "%s core, global memory %zu bytes: %s",
                     clmha_impl_name(impls[c]), need - 1, msg);
        cr_expect(strstr(msg, "global memory") && strstr(msg, "bytes"), "message: %s", msg);
        cr_expect_lt(got, need, "%s core: %zu bytes of scratch under a limit of %zu",
                     clmha_impl_name(impls[c]), got, need - 1);
    }
    // A forward call on host arrays: refused before its scratch, the output untouched.
    clmha_layer *layer = small_layer(w.ctx, &m, true);
    float *x = calloc(LEN * E, sizeof *x), *y = malloc(LEN * E * sizeof *y);
    cr_assert(x && y);
    for (size_t i = 0; i < LEN * E; ++i) y[i] = 7.0f;
    clmha__test_set_global_mem(proj_bytes);
    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {LEN, 1, E}, .data = x}};
    clmha_status st = clmha_layer_forward_host(layer, &args, y, LEN * E, NULL, 0);
    clmha__test_set_global_mem(0);
    cr_expect_eq(st, CLMHA_OUT_OF_MEMORY, "%s", clmha_context_last_error(w.ctx));
    cr_expect(strstr(clmha_context_last_error(w.ctx), "global memory"), "message: %s",
              clmha_context_last_error(w.ctx));
    for (size_t i = 0; i < LEN * E; ++i) cr_assert_eq(y[i], 7.0f, "output %zu was written", i);
    // And without the limit it works.
    cr_expect_eq(clmha_layer_forward_host(layer, &args, y, LEN * E, NULL, 0), CLMHA_SUCCESS,
                 "%s", clmha_context_last_error(w.ctx));
    free(x);
    free(y);
    clmha_layer_release(layer);
    wrapped_close(&w);
}

// A KV cache's key and value buffers (batch 1, 16 tokens: 16 E elements each) against the
// device's largest allocation and, both together, its global memory: just fitting is made, a
// byte less is refused with CLMHA_OUT_OF_MEMORY naming the limit, before anything is allocated
// (no cache returned). An int8 cache's buffers are a byte an element: it fits where float32's
// would not.
Test(faults, kv_cache_at_the_device_limits, .fini = clear_limits, .timeout = 600) {
    wrapped w;
    wrapped_open(&w);
    small m;
    clmha_layer *layer = small_layer(w.ctx, &m, true);
    const size_t bytes = 16 * E * sizeof(float);
    static const struct {
        size_t max_alloc, global;
        clmha_kv_dtype kv;
        bool fits;
        const char *names;
    } cases[] = {
        {bytes, 0, CLMHA_KV_FLOAT32, true, NULL},
        {bytes - 1, 0, CLMHA_KV_FLOAT32, false, "largest allocation"},
        {0, 2 * bytes, CLMHA_KV_FLOAT32, true, NULL},
        {0, 2 * bytes - 1, CLMHA_KV_FLOAT32, false, "global memory"},
        {bytes / 4, 2 * bytes / 4, CLMHA_KV_INT8, true, NULL},
        {bytes / 4 - 1, 0, CLMHA_KV_INT8, false, "largest allocation"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = 16,
                                    .kv_dtype = cases[i].kv};
        clmha__test_set_max_alloc(cases[i].max_alloc);
        clmha__test_set_global_mem(cases[i].global);
        clmha_kv_cache *cache = NULL;
        clmha_status st = clmha_kv_cache_create_with(&cache, layer, 1, &o);
        clear_limits();
        const char *msg = clmha_context_last_error(w.ctx);
        if (cases[i].fits) {
            cr_expect_eq(st, CLMHA_SUCCESS, "case %zu: %s", i, msg);
            cr_expect_not_null(cache);
        } else {
            cr_expect_eq(st, CLMHA_OUT_OF_MEMORY, "case %zu: %s", i, msg);
            cr_expect(strstr(msg, cases[i].names) && strstr(msg, "bytes"), "case %zu: %s", i,
                      msg);
            cr_expect_null(cache);
        }
        clmha_kv_cache_release(cache);
    }
    clmha_layer_release(layer);
    wrapped_close(&w);
}

Test(faults, parameters_beyond_max_alloc_are_out_of_memory, .timeout = 600) {
    wrapped w;
    wrapped_open(&w);
    cl_ulong limit = max_alloc(w.ctx);
    // in_proj_weight is (3E, E) floats.
    size_t e = (size_t)ceil(sqrt((double)limit / 12.0)) + 1;
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = e, .num_heads = 1, .bias = true};
    clmha_layer *layer = (clmha_layer *)0x1;
    clmha_status st = clmha_layer_create(&layer, w.ctx, &desc);
    const char *msg = clmha_context_last_error(w.ctx);
    cr_assert_eq(st, CLMHA_OUT_OF_MEMORY, "embed_dim %zu: %s (%s)", e, clmha_status_string(st),
                 msg);
    cr_expect_null(layer);
    cr_expect(strstr(msg, "proj_weight") != NULL, "the message should name the weights: %s",
              msg);
    wrapped_close(&w);
}

// ---- (b) a kernel build failure -----------------------------------------------------------------

static void clear_hook(void) { clmha__test_set_extra_build_options(NULL); }

Test(faults, build_failure_carries_the_build_log, .fini = clear_hook, .timeout = 600) {
    // A new context: its program cache is empty, so layer creation must build cl/heads.cl.
    clmha_context *ctx = context_or_skip();
    clmha__test_set_extra_build_options("-DCLMHA_FORCE_BUILD_ERROR");
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    clmha_layer *layer = (clmha_layer *)0x1;
    clmha_status st = clmha_layer_create(&layer, ctx, &desc);
    const char *msg = clmha_context_last_error(ctx);
    cr_assert_eq(st, CLMHA_BUILD_FAILED, "%s: %s", clmha_status_string(st), msg);
    cr_expect_null(layer);
    cr_expect(strstr(msg, "cl/heads.cl") != NULL, "the message should name the file: %s", msg);
    cr_expect(strstr(msg, "-DCLMHA_FORCE_BUILD_ERROR") != NULL,
              "the message should give the build options: %s", msg);
    cr_expect(strstr(msg, "forced by the test hook") != NULL,
              "the message should carry the build log: %s", msg);

    // Cleared, the same context builds the kernels (the failed build was not cached).
    clear_hook();
    layer = NULL;
    st = clmha_layer_create(&layer, ctx, &desc);
    cr_assert_eq(st, CLMHA_SUCCESS, "after clearing the hook: %s", clmha_context_last_error(ctx));
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// Options past any fixed buffer are passed whole (they were cut at 512 bytes, while the cache
// key held them whole): the failing define at their end must reach the compiler.
Test(faults, long_build_options_are_not_cut, .fini = clear_hook, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    static char extra[2048];
    size_t used = 0;
    for (int i = 0; used < 1200; ++i)
        used += (size_t)snprintf(extra + used, sizeof extra - used, "-DCLMHA_PAD_%03d=1 ", i);
    snprintf(extra + used, sizeof extra - used, "-DCLMHA_FORCE_BUILD_ERROR");
    clmha__test_set_extra_build_options(extra);
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    clmha_layer *layer = NULL;
    clmha_status st = clmha_layer_create(&layer, ctx, &desc);
    const char *msg = clmha_context_last_error(ctx);
    cr_expect_eq(st, CLMHA_BUILD_FAILED, "%zu bytes of options: %s: %s", strlen(extra),
                 clmha_status_string(st), msg);
    cr_expect(strstr(msg, "forced by the test hook") != NULL, "%s", msg);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// A device the tuning registry cannot take (as when it cannot grow) is said so in the note,
// and an import is refused rather than applied where export and the note cannot see it.
static void clear_registry_limit(void) { clmha__test_set_tuning_registry_limit(SIZE_MAX); }

Test(faults, tuning_registry_that_cannot_record_says_so, .fini = clear_registry_limit,
     .timeout = 600) {
    clmha__test_set_tuning_registry_limit(0);
    clmha_context *ctx = context_or_skip();
    char note[1024] = "";
    cr_assert_eq(clmha_context_tuning_note(ctx, note, sizeof note), CLMHA_SUCCESS);
    cr_expect(strstr(note, "could not record") != NULL, "note: %s", note);
    clmha_device_info info = {.struct_size = sizeof info};
    char msg[512];
    cr_assert_eq(clmha_device_select(getenv("CLMHA_DEVICE"), &info, msg, sizeof msg), 0);
    char json[4096];
    snprintf(json, sizeof json,
             "{\"format\": \"clmha-gemm-tuning\", \"version\": 1, \"platform\": \"%s\", "
             "\"device\": \"%s\", \"driver\": \"%s\", \"clblast\": \"%d.%d.%d\", "
             "\"precision\": \"float32\", "
             "\"kernels\": {\"GemmRoutine\": {\"XGEMM_MIN_INDIRECT_SIZE\": 448}}}",
             info.platform_name, info.device_name, info.driver_version, CLBLAST_VERSION_MAJOR,
             CLBLAST_VERSION_MINOR, CLBLAST_VERSION_PATCH);
    clmha_status st = clmha_context_tuning_import(ctx, json);
    cr_expect_eq(st, CLMHA_OUT_OF_MEMORY, "import: %s: %s", clmha_status_string(st),
                 clmha_context_last_error(ctx));
    size_t needed = 0;
    cr_expect_eq(clmha_context_tuning_export(ctx, NULL, 0, &needed), CLMHA_NOT_READY);
    clmha_context_release(ctx);
}

// CLBlast's statuses are named in messages, their number kept (no forced CLBlast failure is
// at hand, so the naming function itself is checked, and one message through it).
Test(faults, clblast_statuses_have_names) {
    const char *text = NULL;
    cr_expect_str_eq(clmha__blas_status_name(-2046, &text), "CLBlastInvalidLocalMemUsage");
    cr_expect_str_eq(text, "not enough local memory");
    cr_expect_str_eq(clmha__blas_status_name(-2041, NULL), "CLBlastDatabaseError");
    cr_expect_str_eq(clmha__blas_status_name(-1017, NULL), "CLBlastInvalidDimension");
    cr_expect_str_eq(clmha__blas_status_name(-1007, NULL), "CLBlastInsufficientMemoryY");
    cr_expect_str_eq(clmha__blas_status_name(-2039, NULL), "CLBlastUnexpectedError");
    cr_expect_str_eq(clmha__blas_status_name(-3000, &text), "CLBlast status ?");
    cr_expect_eq(clmha__blas_fail(NULL, -2050, "CLBlastSgemm"), CLMHA_BLAS_ERROR);
    const char *msg = clmha_last_create_error();
    cr_expect(strstr(msg, "-2050") != NULL && strstr(msg, "CLBlastInsufficientMemoryTemp"),
              "%s", msg);
}

// ---- (c) no OpenCL platform at all --------------------------------------------------------------

// A copy of the environment with OCL_ICD_VENDORS = @p vendors (an empty folder, so the ICD loader
// finds no platform), without OCL_ICD_FILENAMES, plus @p extra (may be NULL).
static char **child_env(const char *vendors, const char *extra) {
    size_t n = 0;
    while (environ[n]) ++n;
    char **env = calloc(n + 3, sizeof *env);
    cr_assert_not_null(env);
    size_t k = 0;
    for (size_t i = 0; i < n; ++i)
        if (strncmp(environ[i], "OCL_ICD_VENDORS=", 16) != 0 &&
            strncmp(environ[i], "OCL_ICD_FILENAMES=", 18) != 0)
            env[k++] = environ[i];
    static char vendor_var[4200];
    snprintf(vendor_var, sizeof vendor_var, "OCL_ICD_VENDORS=%s", vendors);
    env[k++] = vendor_var;
    if (extra) env[k++] = (char *)extra;
    env[k] = NULL;
    return env;
}

// Runs @p argv with @p env; returns the exit status (-1 if it did not exit normally) and the
// child's stdout and stderr together in @p out.
static int run_child(char *const argv[], char **env, char *out, size_t out_size) {
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        execve(argv[0], argv, env);
        _exit(127);
    }
    close(fds[1]);
    size_t used = 0;
    for (;;) {
        ssize_t got = read(fds[0], out + used, out_size - 1 - used);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        used += (size_t)got;
        if (used == out_size - 1) {  // drain the rest
            char sink[4096];
            while (read(fds[0], sink, sizeof sink) > 0) {
            }
            break;
        }
    }
    out[used] = 0;
    close(fds[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

Test(faults, no_platform_cli_says_install_pocl, .timeout = 600) {
    char dir[64];
    tmpdir_make(dir, sizeof dir, "clmha-no-vendors");
    char **env = child_env(dir, NULL);
    char *argv[] = {CLMHA_CLI_PATH, "demo", NULL};
    static char out[16384];
    int code = run_child(argv, env, out, sizeof out);
    free(env);
    tmpdir_remove(dir);
    cr_expect_eq(code, 1, "clmha demo without a platform exited with %d:\n%s", code, out);
    cr_expect(strstr(out, "pocl-opencl-icd") != NULL,
              "the message should name the package to install:\n%s", out);
}

// The library itself, in a fresh process (the ICD loader reads OCL_ICD_VENDORS once per
// process): this test binary re-executes itself with FAULTS_NO_PLATFORM_CHILD set, and the
// constructor below runs clmha_context_create there instead of the tests.
#define CHILD_VAR "CLMHA_FAULTS_NO_PLATFORM_CHILD"

__attribute__((constructor)) static void no_platform_child(void) {
    if (!getenv(CHILD_VAR)) return;
    clmha_context *ctx = (clmha_context *)0x1;
    clmha_status st = clmha_context_create(&ctx, NULL);
    size_t count = 99;
    clmha_status list = clmha_device_count(&count);
    printf("status %d (%s)\nmessage: %s\nctx %p\ndevice_count %d count %zu\n", (int)st,
           clmha_status_string(st), clmha_last_create_error(), (void *)ctx, (int)list, count);
    fflush(stdout);
    clmha_context_release(ctx == (clmha_context *)0x1 ? NULL : ctx);
    exit(st == CLMHA_DEVICE_NOT_FOUND && ctx == NULL &&
                 strstr(clmha_last_create_error(), "pocl-opencl-icd") != NULL &&
                 list == CLMHA_SUCCESS && count == 0
             ? 0
             : 3);
}

Test(faults, no_platform_context_create_is_device_not_found, .timeout = 600) {
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) cr_skip_test("no /proc/self/exe");
    self[len] = 0;
    char dir[64];
    tmpdir_make(dir, sizeof dir, "clmha-no-vendors");
    char **env = child_env(dir, CHILD_VAR "=1");
    char *argv[] = {self, NULL};
    static char out[16384];
    int code = run_child(argv, env, out, sizeof out);
    free(env);
    tmpdir_remove(dir);
    cr_expect_eq(code, 0, "clmha_context_create without a platform (exit %d):\n%s", code, out);
}

// ---- (d) NaN and Inf --------------------------------------------------------------------------------

static bool nan_row_l1_n0(size_t l, size_t n) { return l == 1 && n == 0; }
static bool nan_item_1(size_t l, size_t n) { return (void)l, n == 1; }
static bool nan_row_l1(size_t l, size_t n) { return (void)n, l == 1; }

Test(faults, nan_in_one_query_row_gives_that_row_nan, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    small m;
    clmha_layer *layer = small_layer(ctx, &m, true);
    inputs in;
    make_inputs(&in, 21);
    in.q[(1 * N + 0) * E + 3] = NAN;  // query (l 1, n 0), feature 3
    clmha_forward_args args = cross_args(&in, false);
    result r;
    run_both(layer, &m, &args, &r);
    check_rows(&r, nan_row_l1_n0, "NaN in query (1, 0)");
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

Test(faults, nan_in_a_key_gives_its_batch_item_nan, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    small m;
    clmha_layer *layer = small_layer(ctx, &m, true);
    inputs in;
    make_inputs(&in, 22);
    in.k[(2 * N + 1) * E + 0] = NAN;  // key (s 2, n 1), feature 0
    clmha_forward_args args = cross_args(&in, false);
    result r;
    run_both(layer, &m, &args, &r);
    check_rows(&r, nan_item_1, "NaN in key (2, 1)");
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// PyTorch 1.13 (nn.MultiheadAttention, float attn_mask): +inf or NaN at (1, 2) makes query
// row 1 NaN in every batch item (softmax of a row holding +inf is inf - inf = NaN); the other rows
// are unaffected.
Test(faults, inf_or_nan_in_float_attn_mask_gives_that_row_nan, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    small m;
    clmha_layer *layer = small_layer(ctx, &m, true);
    const float bad[2] = {INFINITY, NAN};
    for (int b = 0; b < 2; ++b) {
        inputs in;
        make_inputs(&in, 23);
        in.attn[1 * S + 2] = bad[b];
        clmha_forward_args args = cross_args(&in, true);
        result r;
        run_both(layer, &m, &args, &r);
        check_rows(&r, nan_row_l1, b == 0 ? "+inf in attn_mask (1, 2)" : "NaN in attn_mask (1, 2)");
    }
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// Every key forbidden (-inf everywhere): the documented difference from PyTorch (which gives
// NaN): zero weights, zero attention, so every output row is out_proj.bias.
Test(faults, minus_inf_everywhere_gives_the_documented_zeros, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    small m;
    clmha_layer *layer = small_layer(ctx, &m, true);
    inputs in;
    make_inputs(&in, 24);
    for (size_t i = 0; i < L * S; ++i) in.attn[i] = -INFINITY;
    clmha_forward_args args = cross_args(&in, true);
    result r;
    run_both(layer, &m, &args, &r);
    for (size_t row = 0; row < L * N; ++row)
        for (size_t c = 0; c < E; ++c) {
            cr_expect_eq(r.y[row * E + c], m.b_out[c], "output (%zu, %zu) = %g, want bias %g",
                         row, c, (double)r.y[row * E + c], (double)m.b_out[c]);
            cr_expect_eq(r.y_ref[row * E + c], (double)m.b_out[c]);
        }
    for (size_t i = 0; i < N * L * S; ++i) {
        cr_expect_eq(r.w[i], 0.0f, "weight %zu = %g", i, (double)r.w[i]);
        cr_expect_eq(r.w_ref[i], 0.0);
    }
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// NaN left in the scratch by one call, or in the caller's output buffer, must not reach the next
// result (a GEMM with beta = 0 must not read C: 0 * NaN is NaN).
Test(faults, nan_does_not_survive_into_later_calls, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    small m;
    clmha_layer *layer = small_layer(ctx, &m, false);  // no bias: the output GEMM has beta = 0
    inputs in;
    make_inputs(&in, 25);
    for (size_t i = 0; i < L * N * E; ++i) in.q[i] = NAN;
    for (size_t i = 0; i < S * N * E; ++i) in.k[i] = NAN;
    clmha_forward_args args = cross_args(&in, false);
    static result r;
    run_both(layer, &m, &args, &r);
    for (size_t i = 0; i < L * N * E; ++i) cr_expect(isnan(r.y[i]));

    // The same layer on clean inputs, into device buffers pre-filled with NaN.
    make_inputs(&in, 26);
    cl_context cl = clmha_context_cl_context(ctx);
    cl_command_queue queue = clmha_context_cl_queue(ctx);
    cl_int err;
    cl_mem q = clCreateBuffer(cl, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof in.q, in.q, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_mem k = clCreateBuffer(cl, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof in.k, in.k, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_mem out = clCreateBuffer(cl, CL_MEM_READ_WRITE, sizeof r.y, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_mem w = clCreateBuffer(cl, CL_MEM_READ_WRITE, sizeof r.w, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    float nan = NAN;
    clEnqueueFillBuffer(queue, out, &nan, sizeof nan, 0, sizeof r.y, 0, NULL, NULL);
    clEnqueueFillBuffer(queue, w, &nan, sizeof nan, 0, sizeof r.w, 0, NULL, NULL);
    clmha_forward_args dev = {.struct_size = sizeof dev,
                              .query = {.ndim = 3, .shape = {L, N, E}, .buffer = q},
                              .key = {.ndim = 3, .shape = {S, N, E}, .buffer = k},
                              .need_weights = true};
    cr_assert_eq(clmha_layer_forward(layer, &dev, out, 0, w, 0, 0, NULL, NULL), CLMHA_SUCCESS,
                 "%s", clmha_context_last_error(ctx));
    cr_assert_eq(clEnqueueReadBuffer(queue, out, CL_TRUE, 0, sizeof r.y, r.y, 0, NULL, NULL),
                 CL_SUCCESS);
    cr_assert_eq(clEnqueueReadBuffer(queue, w, CL_TRUE, 0, sizeof r.w, r.w, 0, NULL, NULL),
                 CL_SUCCESS);
    clmha_forward_args host = cross_args(&in, false);
    char msg[256];
    cr_assert_eq(clmha_reference_forward(&m.desc, &m.ref, &host, r.y_ref, L * N * E, r.w_ref,
                                         N * L * S, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    for (size_t i = 0; i < L * N * E; ++i)
        cr_expect_leq(fabs(r.y[i] - r.y_ref[i]), 1e-4, "output %zu: %g vs %g", i, (double)r.y[i],
                      r.y_ref[i]);
    for (size_t i = 0; i < N * L * S; ++i)
        cr_expect_leq(fabs(r.w[i] - r.w_ref[i]), 1e-4, "weight %zu: %g vs %g", i, (double)r.w[i],
                      r.w_ref[i]);
    clReleaseMemObject(q);
    clReleaseMemObject(k);
    clReleaseMemObject(out);
    clReleaseMemObject(w);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}
