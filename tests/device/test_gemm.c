// The GEMMs of a context (src/context/gemm.c) through both paths, CLBlast and the host BLAS in
// native kernels, against a double-precision product computed here: every transpose, alpha and
// beta, offsets, leading dimensions wider than the rows, batches with strides (0 included),
// operands in sub-buffers and two operands in one buffer (the root-and-origin and capture
// handling of the host path, tools/driver-bugs/pocl-native-kernel-buffers). Also the public
// calls that choose and describe the path, and one forward pass through both paths.
//
// Links libclmha.a: clmha__gemm is internal. The host cases are skipped (with a message) on a
// device without the host path.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context/gemm.h"
#include "support.h"

// One product to check: row-major C = alpha·op(A)·op(B) + beta·C, batch items.
typedef struct gcase {
    bool ta, tb;
    size_t m, n, k, batch;
    float alpha, beta;
    size_t pad;          // extra columns in every leading dimension
    size_t a_off, b_off, c_off;
    bool b_shared;       // B stored in A's buffer, after A's items
    bool b_stride_zero;  // every item uses the same B
} gcase;

static size_t rows_of(bool t, size_t r, size_t c) { return t ? c : r; }
static size_t cols_of(bool t, size_t r, size_t c) { return t ? r : c; }

// Runs @p g on @p ctx with A, B, C in sub-buffers of parents made with @p slack floats before
// them when @p sub (else plain buffers), and returns the largest |C − reference| relative to
// the largest |reference| (1 when the call fails).
static double run_case(clmha_context *ctx, const gcase *g, bool sub, unsigned seed) {
    size_t ar = rows_of(g->ta, g->m, g->k), ac = cols_of(g->ta, g->m, g->k);
    size_t br = rows_of(g->tb, g->k, g->n), bc = cols_of(g->tb, g->k, g->n);
    size_t lda = ac + g->pad, ldb = bc + g->pad, ldc = g->n + g->pad;
    size_t a_item = ar * lda, b_item = br * ldb, c_item = g->m * ldc;
    size_t b_items = g->b_stride_zero ? 1 : g->batch;
    size_t a_len = g->a_off + a_item * g->batch, b_len = g->b_off + b_item * b_items;
    size_t c_len = g->c_off + c_item * g->batch;
    if (g->b_shared) a_len += b_len;  // B after A in one buffer
    float *a = calloc(a_len, sizeof *a), *b = calloc(b_len, sizeof *b);
    float *c = calloc(c_len, sizeof *c), *got = calloc(c_len, sizeof *got);
    double *want = calloc(c_len, sizeof *want);
    cr_assert(a && b && c && got && want);
    prng r = {seed};
    for (size_t i = 0; i < a_len; ++i) a[i] = (float)(2 * prng_uniform(&r) - 1);
    for (size_t i = 0; i < b_len; ++i) b[i] = (float)(2 * prng_uniform(&r) - 1);
    for (size_t i = 0; i < c_len; ++i) c[i] = (float)(2 * prng_uniform(&r) - 1);
    size_t b_base = g->b_shared ? a_len - b_len : 0;  // where B starts in its buffer
    if (g->b_shared) memcpy(a + b_base, b, b_len * sizeof *b);
    double big = 0;
    for (size_t i = 0; i < c_len; ++i) want[i] = c[i];
    for (size_t t = 0; t < g->batch; ++t) {
        const float *ai = a + g->a_off + t * a_item;
        const float *bi = b + g->b_off + (g->b_stride_zero ? 0 : t * b_item);
        for (size_t i = 0; i < g->m; ++i)
            for (size_t j = 0; j < g->n; ++j) {
                double s = 0;
                for (size_t p = 0; p < g->k; ++p)
                    s += (double)(g->ta ? ai[p * lda + i] : ai[i * lda + p]) *
                         (g->tb ? bi[j * ldb + p] : bi[p * ldb + j]);
                double *w = &want[g->c_off + t * c_item + i * ldc + j];
                *w = g->alpha * s + g->beta * *w;
                if (fabs(*w) > big) big = fabs(*w);
            }
    }
    // Device buffers: each in a parent with a 256-byte-aligned head when sub.
    size_t head = sub ? 256 / sizeof(float) * 4 : 0;  // 1024 bytes: any base alignment here
    cl_context cl = clmha_context_cl_context(ctx);
    cl_command_queue q = clmha_context_cl_queue(ctx);
    cl_int err;
    const float *host[3] = {a, g->b_shared ? a : b, c};
    size_t len[3] = {a_len, b_len, c_len};
    cl_mem parent[3] = {NULL, NULL, NULL}, use[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3; ++i) {
        if (i == 1 && g->b_shared) {
            use[1] = use[0];
            continue;
        }
        parent[i] = clCreateBuffer(cl, CL_MEM_READ_WRITE, (head + len[i]) * sizeof(float), NULL,
                                   &err);
        cr_assert_eq(err, CL_SUCCESS);
        cr_assert_eq(clEnqueueWriteBuffer(q, parent[i], CL_TRUE, head * sizeof(float),
                                          len[i] * sizeof(float), host[i], 0, NULL, NULL),
                     CL_SUCCESS);
        use[i] = parent[i];
        if (sub) {
            cl_buffer_region reg = {head * sizeof(float), len[i] * sizeof(float)};
            use[i] = clCreateSubBuffer(parent[i], CL_MEM_READ_WRITE,
                                       CL_BUFFER_CREATE_TYPE_REGION, &reg, &err);
            cr_assert_eq(err, CL_SUCCESS, "clCreateSubBuffer: %d", err);
        }
    }
    clmha__gemm_op op = {.ta = g->ta, .tb = g->tb, .m = g->m, .n = g->n, .k = g->k,
                         .alpha = g->alpha, .beta = g->beta,
                         .a = use[0], .a_off = g->a_off, .lda = lda, .a_stride = a_item,
                         .b = use[1], .b_off = b_base + g->b_off, .ldb = ldb,
                         .b_stride = g->b_stride_zero ? 0 : b_item,
                         .c = use[2], .c_off = g->c_off, .ldc = ldc, .c_stride = c_item,
                         .batch = g->batch};
    clmha_status st = clmha__gemm(ctx, "test product", &op);
    cr_expect_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    double worst = 1;
    if (st == CLMHA_SUCCESS &&
        clEnqueueReadBuffer(q, use[2], CL_TRUE, 0, c_len * sizeof(float), got, 0, NULL, NULL) ==
            CL_SUCCESS) {
        worst = 0;
        for (size_t i = 0; i < c_len; ++i) {
            double e = fabs(got[i] - want[i]) / (big > 0 ? big : 1);
            if (e > worst) worst = e;
        }
    }
    for (int i = 0; i < 3; ++i) {
        if (use[i] && use[i] != parent[i] && !(i == 1 && g->b_shared)) clReleaseMemObject(use[i]);
        if (parent[i]) clReleaseMemObject(parent[i]);
    }
    free(a), free(b), free(c), free(got), free(want);
    return worst;
}

static const gcase cases[] = {
    {false, true, 37, 53, 29, 1, 1.0f, 0.0f, 0, 0, 0, 0, false, false},     // a projection
    {false, false, 31, 17, 45, 1, 0.7f, 1.3f, 3, 5, 7, 11, false, false},  // beta, offsets
    {true, false, 19, 23, 41, 1, -1.5f, 0.5f, 1, 0, 3, 0, false, false},   // Aᵀ
    {true, true, 13, 29, 7, 1, 1.0f, 1.0f, 2, 1, 2, 3, false, false},      // both transposed
    {false, true, 16, 24, 8, 5, 0.125f, 0.0f, 0, 0, 0, 0, false, false},   // batched, QKᵀ-like
    {false, false, 9, 8, 21, 4, 1.0f, 0.0f, 1, 2, 4, 6, false, true},      // batch, B stride 0
    {true, false, 11, 12, 10, 3, 1.0f, 1.0f, 0, 8, 0, 5, true, false},     // B in A's buffer
    {false, true, 1, 64, 64, 1, 1.0f, 0.0f, 0, 0, 0, 0, true, false},      // one row
};

// Runs every case on @p ctx, plain and in sub-buffers; the worst relative error.
static double run_all(clmha_context *ctx, const char *path) {
    double worst = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i)
        for (int sub = 0; sub < 2; ++sub) {
            double e = run_case(ctx, &cases[i], sub, 100 + (unsigned)i);
            cr_expect_leq(e, 1e-5, "%s: case %zu%s: relative error %.3g", path, i,
                          sub ? " (sub-buffers)" : "", e);
            if (e > worst) worst = e;
        }
    printf("gemm: %s: %zu cases x plain/sub-buffers, worst relative error %.2e\n", path,
           sizeof cases / sizeof cases[0], worst);
    return worst;
}

Test(gemm, clblast_path) {
    clmha_context *ctx = context_or_skip();
    cr_assert_eq(clmha_context_set_gemm(ctx, CLMHA_GEMM_CLBLAST), CLMHA_SUCCESS);
    cr_expect_eq(clmha_context_gemm(ctx), CLMHA_GEMM_CLBLAST);
    run_all(ctx, "CLBlast");
    clmha_context_release(ctx);
}

Test(gemm, host_path) {
    clmha_context *ctx = context_or_skip();
    clmha_status st = clmha_context_set_gemm(ctx, CLMHA_GEMM_HOST);
    if (st == CLMHA_UNSUPPORTED) {
        printf("gemm: no host path here: %s\n", clmha_context_last_error(ctx));
        cr_expect_eq(clmha_context_gemm(ctx), CLMHA_GEMM_CLBLAST);
        clmha_context_release(ctx);
        cr_skip_test("no host BLAS path on this device");
    }
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect_eq(clmha_context_gemm(ctx), CLMHA_GEMM_HOST);
    char note[640];
    cr_assert_eq(clmha_context_gemm_note(ctx, note, sizeof note), CLMHA_SUCCESS);
    printf("gemm: %s\n", note);
    cr_expect(strstr(note, "host BLAS") != NULL, "%s", note);
    run_all(ctx, "host BLAS");
    clmha_context_release(ctx);
}

Test(gemm, choosing_and_notes) {
    cr_expect_eq(clmha_context_set_gemm(NULL, CLMHA_GEMM_AUTO), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_context_gemm(NULL), CLMHA_GEMM_CLBLAST);
    char note[64];
    cr_expect_eq(clmha_context_gemm_note(NULL, note, sizeof note), CLMHA_INVALID_ARGUMENT);
    clmha_context *ctx = context_or_skip();
    cr_expect_eq(clmha_context_set_gemm(ctx, (clmha_gemm)7), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "not a clmha_gemm") != NULL);
    cr_expect_eq(clmha_context_gemm_note(ctx, NULL, 8), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_context_gemm_note(ctx, note, 0), CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha_context_set_gemm(ctx, CLMHA_GEMM_CLBLAST), CLMHA_SUCCESS);
    cr_assert_eq(clmha_context_gemm_note(ctx, note, sizeof note), CLMHA_SUCCESS);
    cr_expect_str_eq(note, "CLBlast (asked for)");
    char tiny[8];  // truncated, terminated
    cr_assert_eq(clmha_context_gemm_note(ctx, tiny, sizeof tiny), CLMHA_SUCCESS);
    cr_expect_eq(strlen(tiny), sizeof tiny - 1);
    // AUTO takes the host path exactly when HOST is possible.
    cr_assert_eq(clmha_context_set_gemm(ctx, CLMHA_GEMM_AUTO), CLMHA_SUCCESS);
    clmha_gemm automatic = clmha_context_gemm(ctx);
    clmha_status host = clmha_context_set_gemm(ctx, CLMHA_GEMM_HOST);
    cr_expect_eq(automatic == CLMHA_GEMM_HOST, host == CLMHA_SUCCESS);
    if (host == CLMHA_UNSUPPORTED)  // the message says why, the context kept CLBlast
        cr_expect(strstr(clmha_context_last_error(ctx), "no host GEMMs") != NULL);
    clmha_context_release(ctx);
}

// One forward pass of a random layer through both paths: the outputs agree to float rounding.
Test(gemm, forward_through_both_paths) {
    clmha_context *ctx = context_or_skip();
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = 64, .num_heads = 4,
                             .bias = true, .batch_first = true};
    size_t n = 3, l = 37, e = 64;
    clmha_layer *layer;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS);
    prng r = {7};
    size_t np = 4 * e * e + 4 * e;
    float *params = malloc(np * sizeof *params), *x = malloc(n * l * e * sizeof *x);
    float *out[2] = {malloc(n * l * e * sizeof(float)), malloc(n * l * e * sizeof(float))};
    cr_assert(params && x && out[0] && out[1]);
    for (size_t i = 0; i < np; ++i) params[i] = (float)(0.25 * (2 * prng_uniform(&r) - 1));
    for (size_t i = 0; i < n * l * e; ++i) x[i] = (float)(2 * prng_uniform(&r) - 1);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", params, 3 * e * e),
                 CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_bias", params + 3 * e * e, 3 * e),
                 CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", params + 3 * e * e + 3 * e,
                                       e * e),
                 CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.bias", params + 4 * e * e + 3 * e, e),
                 CLMHA_SUCCESS);
    const clmha_gemm paths[2] = {CLMHA_GEMM_CLBLAST, CLMHA_GEMM_HOST};
    int ran = 0;
    for (int p = 0; p < 2; ++p) {
        if (clmha_context_set_gemm(ctx, paths[p]) != CLMHA_SUCCESS) continue;
        clmha_forward_args a = {.struct_size = sizeof a};
        a.query = (clmha_tensor){.ndim = 3, .shape = {n, l, e}, .data = x};
        cr_assert_eq(clmha_layer_forward_host(layer, &a, out[p], n * l * e, NULL, 0),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        ++ran;
    }
    if (ran == 2) {
        double worst = 0;
        for (size_t i = 0; i < n * l * e; ++i) {
            double d = fabs((double)out[0][i] - out[1][i]);
            if (d > worst) worst = d;
        }
        printf("gemm: forward N %zu L %zu E %zu, CLBlast vs host BLAS: max |diff| %.2e\n", n, l,
               e, worst);
        cr_expect_leq(worst, 1e-5);
    }
    free(params), free(x), free(out[0]), free(out[1]);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}
