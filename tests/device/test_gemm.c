// The GEMMs of a context (src/context/gemm.c) through both paths, CLBlast and the host BLAS in
// native kernels, against a double-precision product computed here: every transpose, alpha and
// beta, offsets, leading dimensions wider than the rows, batches with strides (0 included),
// products large enough for the host path to split by columns, rows or items,
// operands in sub-buffers and two operands in one buffer (the root-and-origin and capture
// handling of the host path, tools/driver-bugs/pocl-native-kernel-buffers). Also the public
// calls that choose and describe the path, and one forward pass through both paths. The host
// path's packed weights (src/device/packed_weight.h): their kernel alone at sizes with every
// tail, in products through clmha__gemm(), and a layer whose parameters change between
// forwards, one still queued when they do.
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
#include "device/packed_weight.h"
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
    // Over 2^22 multiply-adds: the host path shares them out among its threads.
    {false, true, 150, 200, 200, 1, 1.0f, 0.0f, 1, 0, 0, 0, false, false},  // by columns
    {false, false, 300, 40, 400, 1, 0.7f, 1.3f, 2, 3, 1, 5, false, false},  // by rows
    {true, false, 301, 40, 400, 1, 1.0f, 0.0f, 0, 0, 2, 0, false, false},   // by rows, Aᵀ
    {false, true, 64, 64, 64, 20, 1.0f, 0.0f, 0, 0, 0, 0, false, false},    // by items
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

// ---- packed weights ----------------------------------------------------------------------------

// C (m, n) = A·W[first .. first + n)ᵀ + bias (+ C0 when accumulate) in double.
static void packed_reference(size_t m, size_t n, size_t k, const float *a, size_t lda,
                             const float *w, size_t first, const float *bias, const float *c0,
                             size_t ldc, bool accumulate, double *want) {
    for (size_t i = 0; i < m; ++i)
        for (size_t j = 0; j < n; ++j) {
            double sum = (bias ? bias[j] : 0) + (accumulate ? c0[i * ldc + j] : 0);
            for (size_t p = 0; p < k; ++p)
                sum += (double)a[i * lda + p] * w[(first + j) * k + p];
            want[i * n + j] = sum;
        }
}

// The kernel alone against the double product: rows below, at and past its 6-row tile and its
// 192-row block, columns past a panel's 32, k past its 256-value block, a weight read from row
// 32 on, the columns in two calls (as two threads share them), with and without bias and
// accumulation. Columns of C past n must keep their values.
Test(gemm, packed_weight_kernel) {
    clmha__packed_weight *probe = clmha__packed_weight_new(1, 1);
    if (!probe) cr_skip_test("no packed-weight kernel on this CPU (AVX-512) or compiler");
    clmha__packed_weight_free(probe);
    static const size_t shapes[][4] = {  // m, n, k, first
        {1, 1, 1, 0}, {5, 31, 17, 0}, {6, 32, 256, 32}, {7, 33, 300, 0}, {13, 70, 64, 32},
        {200, 96, 513, 0}, {37, 64, 512, 64}};
    double worst = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; ++s)
        for (int mode = 0; mode < 4; ++mode) {  // bias: mode & 1; accumulate: mode & 2
            size_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2], first = shapes[s][3];
            size_t rows = first + n + 5, lda = k + 3, ldc = n + 7;
            bool with_bias = mode & 1, accumulate = mode & 2;
            float *w = malloc(rows * k * sizeof *w), *a = malloc(m * lda * sizeof *a);
            float *bias = malloc(n * sizeof *bias), *c = malloc(m * ldc * sizeof *c);
            float *c0 = malloc(m * ldc * sizeof *c0);
            double *want = malloc(m * n * sizeof *want);
            cr_assert(w && a && bias && c && c0 && want);
            prng r = {900 + (unsigned)(s * 4 + mode)};
            for (size_t i = 0; i < rows * k; ++i) w[i] = (float)(2 * prng_uniform(&r) - 1);
            for (size_t i = 0; i < m * lda; ++i) a[i] = (float)(2 * prng_uniform(&r) - 1);
            for (size_t i = 0; i < n; ++i) bias[i] = (float)(2 * prng_uniform(&r) - 1);
            for (size_t i = 0; i < m * ldc; ++i) c0[i] = c[i] = (float)(2 * prng_uniform(&r) - 1);
            clmha__packed_weight *pw = clmha__packed_weight_new(rows, k);
            cr_assert(pw);
            clmha__packed_weight_write(pw, 0, 3, w);  // in two writes, as parameters may come
            clmha__packed_weight_write(pw, 3, rows - 3, w + 3 * k);
            cr_assert(clmha__packed_weight_fits(pw, first, n, k));
            cr_expect(!clmha__packed_weight_fits(pw, first + 1, n, k));
            cr_expect(!clmha__packed_weight_fits(pw, first, rows - first + 1, k));
            cr_expect(!clmha__packed_weight_fits(pw, first, n, k + 1));
            size_t split = n > 32 ? 32 : n;
            const float *b = with_bias ? bias : NULL;
            clmha__packed_weight_gemm(pw, first, m, n, a, lda, c, ldc, b, accumulate, 0, split);
            clmha__packed_weight_gemm(pw, first, m, n, a, lda, c, ldc, b, accumulate, split, n);
            packed_reference(m, n, k, a, lda, w, first, b, c0, ldc, accumulate, want);
            double big = 0, err = 0;
            for (size_t i = 0; i < m * n; ++i) big = fmax(big, fabs(want[i]));
            size_t kept = 0;
            for (size_t i = 0; i < m; ++i) {
                for (size_t j = 0; j < n; ++j)
                    err = fmax(err, fabs(c[i * ldc + j] - want[i * n + j]) / big);
                for (size_t j = n; j < ldc; ++j) kept += c[i * ldc + j] == c0[i * ldc + j];
            }
            cr_expect_leq(err, 2e-6, "m %zu n %zu k %zu first %zu mode %d: relative error %.3g",
                          m, n, k, first, mode, err);
            cr_expect_eq(kept, m * (ldc - n), "m %zu n %zu: columns past n written", m, n);
            worst = fmax(worst, err);
            clmha__packed_weight_free(pw);
            free(w), free(a), free(bias), free(c), free(c0), free(want);
        }
    printf("gemm: packed-weight kernel, %zu shapes x 4 modes, worst relative error %.2e\n",
           sizeof shapes / sizeof shapes[0], worst);
}

// Sets @p p's float parameters on @p layer (E @p e, bias): in_proj_weight, or with @p q_only
// only its first E rows (q_proj_weight), then the rest.
static void set_params(clmha_layer *layer, const clmha_reference_params *p, size_t e,
                       bool q_only) {
    clmha_status st = q_only
                          ? clmha_layer_set_parameter(layer, "q_proj_weight", p->in_proj_weight,
                                                      e * e)
                          : clmha_layer_set_parameter(layer, "in_proj_weight", p->in_proj_weight,
                                                      3 * e * e);
    if (!st) st = clmha_layer_set_parameter(layer, "in_proj_bias", p->in_proj_bias, 3 * e);
    if (!st) st = clmha_layer_set_parameter(layer, "out_proj.weight", p->out_proj_weight, e * e);
    if (!st) st = clmha_layer_set_parameter(layer, "out_proj.bias", p->out_proj_bias, e);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(clmha_layer_context(layer)));
}

// The largest |y - reference of @p p| over the forward of @p args.
static double against_reference(const clmha_layer_desc *desc, const clmha_reference_params *p,
                                 const clmha_forward_args *args, const float *y, size_t count) {
    double *want = malloc(count * sizeof *want);
    cr_assert(want);
    char msg[256];
    cr_assert_eq(clmha_reference_forward(desc, p, args, want, count, NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    double worst = 0;
    for (size_t i = 0; i < count; ++i) worst = fmax(worst, fabs(y[i] - want[i]));
    free(want);
    return worst;
}

// A layer's packed weights follow its parameters: a forward queued before they change computes
// with the old ones, the next with the new ones (in_proj_weight's first rows rewritten through
// q_proj_weight, out_proj.weight whole), each against the double reference of its parameters.
Test(gemm, packed_weights_follow_parameters) {
    clmha_context *ctx = context_or_skip();
    if (clmha_context_gemm(ctx) != CLMHA_GEMM_HOST) {
        clmha_context_release(ctx);
        cr_skip_test("no host BLAS path on this device");
    }
    size_t e = 64, n = 2, l = 40, count = n * l * e;  // 80 rows: 13 tiles of 6 and 2
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = e, .num_heads = 4,
                             .bias = true, .batch_first = true};
    clmha_layer *layer;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS);
    size_t np = 4 * e * e + 4 * e;
    float *params[2] = {malloc(np * sizeof(float)), malloc(np * sizeof(float))};
    float *x = malloc(count * sizeof *x), *y[2] = {malloc(count * 4), malloc(count * 4)};
    cr_assert(params[0] && params[1] && x && y[0] && y[1]);
    prng r = {77};
    for (int v = 0; v < 2; ++v)
        for (size_t i = 0; i < np; ++i) params[v][i] = (float)(0.25 * (2 * prng_uniform(&r) - 1));
    memcpy(params[1] + e * e, params[0] + e * e, 2 * e * e * sizeof(float));  // K, V rows kept
    memcpy(params[1] + 3 * e * e, params[0] + 3 * e * e, 3 * e * sizeof(float));  // in bias
    for (size_t i = 0; i < count; ++i) x[i] = (float)(2 * prng_uniform(&r) - 1);
    clmha_reference_params ref[2];
    for (int v = 0; v < 2; ++v)
        ref[v] = (clmha_reference_params){
            .struct_size = sizeof ref[v], .in_proj_weight = params[v],
            .in_proj_bias = params[v] + 3 * e * e, .out_proj_weight = params[v] + 3 * e * e + 3 * e,
            .out_proj_bias = params[v] + 4 * e * e + 3 * e};
    set_params(layer, &ref[0], e, false);
    cl_context cl = clmha_context_cl_context(ctx);
    cl_command_queue q = clmha_context_cl_queue(ctx);
    cl_int err;
    cl_mem xb = clCreateBuffer(cl, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, count * 4, x, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_mem yb = clCreateBuffer(cl, CL_MEM_READ_WRITE, count * 4, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    clmha_forward_args a = {.struct_size = sizeof a};
    a.query = (clmha_tensor){.ndim = 3, .shape = {n, l, e}, .buffer = xb, .data = x};
    cl_event done = NULL;
    cr_assert_eq(clmha_layer_forward(layer, &a, yb, 0, NULL, 0, 0, NULL, &done), CLMHA_SUCCESS,
                 "%s", clmha_context_last_error(ctx));
    set_params(layer, &ref[1], e, true);  // while the forward may still be queued
    cr_assert_eq(clEnqueueReadBuffer(q, yb, CL_TRUE, 0, count * 4, y[0], 1, &done, NULL),
                 CL_SUCCESS);
    clReleaseEvent(done);
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y[1], count, NULL, 0), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    double before = against_reference(&desc, &ref[0], &a, y[0], count);
    double after = against_reference(&desc, &ref[1], &a, y[1], count);
    double stale = against_reference(&desc, &ref[0], &a, y[1], count);
    printf("gemm: parameters changed between forwards: max |error| %.2e before, %.2e after "
           "(%.2e against the old parameters)\n", before, after, stale);
    cr_expect_leq(before, 1e-5);
    cr_expect_leq(after, 1e-5);
    cr_expect_gt(stale, 1e-3);  // the second forward did see the new parameters
    clReleaseMemObject(xb), clReleaseMemObject(yb);
    free(params[0]), free(params[1]), free(x), free(y[0]), free(y[1]);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}
