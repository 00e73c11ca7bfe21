// The GEMMs of a context (context/gemm.h): CLBlast or the host BLAS through native kernels, and
// the public calls that choose and describe the path.
#include "context/gemm.h"
#include "context/native.h"

#include "context/context.h"
#include "device/blas.h"
#include "device/host_blas.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <clblast_c.h>

// ---- CLBlast ---------------------------------------------------------------------------------

// The row-major product in CLBlast's column-major terms, Cᵀ (n, m) = op(B)ᵀ·op(A)ᵀ: a
// row-major matrix is its transpose in column-major order, so the operands swap and keep their
// transpose flags. (For the projections, A·Wᵀ, CLBlast then transposes one operand instead of
// three: ~5% faster at 1024³ with a PoCL tuning.)
static clmha_status gemm_clblast(clmha_context *ctx, const char *what, const clmha__gemm_op *o) {
    cl_command_queue q = ctx->queue;
    CLBlastTranspose ta = o->ta ? CLBlastTransposeYes : CLBlastTransposeNo;
    CLBlastTranspose tb = o->tb ? CLBlastTransposeYes : CLBlastTransposeNo;
    if (o->batch > 1 && (o->a_off || o->b_off || o->c_off)) {
        // CLBlast 1.5.3's GemmStridedBatched ignores buffer offsets on one of its paths: one
        // plain GEMM per item instead.
        clmha__gemm_op one = *o;
        one.batch = 1;
        for (size_t i = 0; i < o->batch; ++i) {
            one.a_off = o->a_off + i * o->a_stride;
            one.b_off = o->b_off + i * o->b_stride;
            one.c_off = o->c_off + i * o->c_stride;
            clmha_status st = gemm_clblast(ctx, what, &one);
            if (st) return st;
        }
        return CLMHA_SUCCESS;
    }
    int s;
    float alpha = (float)o->alpha, beta = (float)o->beta;
    if (o->f64 && o->batch <= 1)
        CLMHA__BLAS(s, CLBlastDgemm(CLBlastLayoutColMajor, tb, ta, o->n, o->m, o->k, o->alpha,
                                    o->b, o->b_off, o->ldb, o->a, o->a_off, o->lda, o->beta,
                                    o->c, o->c_off, o->ldc, &q, NULL));
    else if (o->f64)
        CLMHA__BLAS(s, CLBlastDgemmStridedBatched(
                           CLBlastLayoutColMajor, tb, ta, o->n, o->m, o->k, o->alpha, o->b,
                           o->b_off, o->ldb, o->b_stride, o->a, o->a_off, o->lda, o->a_stride,
                           o->beta, o->c, o->c_off, o->ldc, o->c_stride, o->batch, &q, NULL));
    else if (o->batch <= 1)
        CLMHA__BLAS(s, CLBlastSgemm(CLBlastLayoutColMajor, tb, ta, o->n, o->m, o->k, alpha,
                                    o->b, o->b_off, o->ldb, o->a, o->a_off, o->lda, beta,
                                    o->c, o->c_off, o->ldc, &q, NULL));
    else
        CLMHA__BLAS(s, CLBlastSgemmStridedBatched(
                           CLBlastLayoutColMajor, tb, ta, o->n, o->m, o->k, alpha, o->b,
                           o->b_off, o->ldb, o->b_stride, o->a, o->a_off, o->lda, o->a_stride,
                           beta, o->c, o->c_off, o->ldc, o->c_stride, o->batch, &q, NULL));
    if (!s) return CLMHA_SUCCESS;
    char call[200];
    snprintf(call, sizeof call, "CLBlast%cgemm%s(%s)", o->f64 ? 'D' : 'S',
             o->batch > 1 ? "StridedBatched" : "", what);
    return clmha__blas_fail(ctx, s, call);
}

// ---- the host BLAS -----------------------------------------------------------------------------
//
// A product on the host path is a native kernel in the queue (clmha__native_run(),
// context/native.c: each operand's root buffer captured by a native kernel of its own, around
// PoCL 3.1's native-kernel bug, tools/driver-bugs/pocl-native-kernel-buffers; the product's
// kernel lists every operand, so the driver orders it after the commands that write them and
// keeps them alive until it has run). The roots' memory does not move between those commands
// on a CPU device (one device; its buffers are host memory).

// The operands of a product on the host path: A, B, C and the optional bias row.
#define OPERANDS 4

// The arguments of one product's native function.
typedef struct host_call {
    const clmha__host_blas *blas;
    const clmha__host_dgemm *dgemm;  // for a float64 product (op.f64)
    size_t b_origin;                 // B's origin in its root buffer, in elements
    clmha__gemm_op op;               // its cl_mem fields are not used here
} host_call;

// @p mem: A, B, C and the bias row (when there is one), each at its buffer's first element.
static void run_host(void *args, void *const *mem) {
    const host_call *h = args;
    const clmha__gemm_op *o = &h->op;
    size_t batch = o->batch ? o->batch : 1;
    if (o->f64) {
        const double *a = (const double *)mem[0] + o->a_off;
        const double *b = (const double *)mem[1] + o->b_off;
        double *c = (double *)mem[2] + o->c_off;
        for (size_t i = 0; i < batch; ++i)
            h->dgemm->dgemm(h->dgemm->impl, o->ta, o->tb, o->m, o->n, o->k, o->alpha,
                           a + i * o->a_stride, o->lda, b + i * o->b_stride, o->ldb, o->beta,
                           c + i * o->c_stride, o->ldc);
        if (o->bias) {  // (batch 1)
            const double *bias = (const double *)mem[3] + o->bias_off;
            for (size_t r = 0; r < o->m; ++r)
                for (size_t j = 0; j < o->n; ++j) c[r * o->ldc + j] += bias[j];
        }
        return;
    }
    clmha__host_batch call = {
        .ta = o->ta, .tb = o->tb, .m = o->m, .n = o->n, .k = o->k, .batch = batch,
        .alpha = (float)o->alpha, .beta = (float)o->beta, .a = (const float *)mem[0] + o->a_off,
        .b = (const float *)mem[1] + o->b_off, .c = (float *)mem[2] + o->c_off,
        .lda = o->lda, .ldb = o->ldb, .ldc = o->ldc, .a_stride = o->a_stride,
        .b_stride = o->b_stride, .c_stride = o->c_stride,
        .bias = o->bias ? (const float *)mem[3] + o->bias_off : NULL};
    // The panels of B's buffer from its row (first) of o->k elements, where B starts at one.
    size_t at = h->b_origin + o->b_off;
    if (!(o->b_packed && o->k && at % o->k == 0 &&
          clmha__host_blas_sgemm_packed(h->blas, &call, o->b_packed, at / o->k)))
        clmha__host_blas_sgemm_batch(h->blas, &call);
}

// The root buffer of @p m and the origin of @p m in it, in elements of @p elem bytes; false
// when the origin is not a whole number of elements (or the driver does not say).
static bool root_of(cl_mem m, size_t elem, cl_mem *root, size_t *origin) {
    size_t bytes;
    if (!clmha__native_root(m, root, &bytes)) return false;
    *origin = bytes / elem;
    return bytes % elem == 0;
}

// Enqueues @p o, whose B starts @p b_origin elements into its root buffer, as a native function.
static clmha_status gemm_host(clmha_context *ctx, const char *what, const clmha__gemm_op *o,
                              const clmha__host_dgemm *dgemm, size_t b_origin) {
    host_call h = {.blas = ctx->host_blas, .dgemm = dgemm, .b_origin = b_origin, .op = *o};
    const cl_mem buffers[OPERANDS] = {o->a, o->b, o->c, o->bias};
    char call[200];
    snprintf(call, sizeof call, "%s, host BLAS", what);
    return clmha__native_run(ctx, call, run_host, &h, sizeof h, buffers, o->bias ? 4 : 3);
}

// The host library that runs @p o (*@p hd: the dgemm of a float64 product; *@p b_origin: where
// its B starts in its root buffer, in elements), or NULL where @p o takes CLBlast's path: no host
// BLAS, a float64 product without a dgemm, sizes past the library's interface, or an operand at
// a sub-buffer origin that is not a whole number of elements.
static const clmha__host_blas *host_path(const clmha_context *ctx, const clmha__gemm_op *o,
                                         const clmha__host_dgemm **hd, size_t *b_origin) {
    const clmha__host_blas *hb = ctx->host_blas;
    // A float64 product takes the host path where the process has a dgemm too.
    *hd = hb && o->f64 ? clmha__host_dgemm_get() : NULL;
    if (!hb || (o->f64 && !*hd) || o->m > hb->max_dim || o->n > hb->max_dim ||
        o->k > hb->max_dim || o->lda > hb->max_dim || o->ldb > hb->max_dim ||
        o->ldc > hb->max_dim)
        return NULL;
    cl_mem mem[OPERANDS] = {o->a, o->b, o->c, o->bias};
    *b_origin = 0;
    for (int i = 0; i < OPERANDS && mem[i]; ++i) {
        cl_mem root;
        size_t origin;
        if (!root_of(mem[i], o->f64 ? sizeof(double) : sizeof(float), &root, &origin))
            return NULL;
        if (i == 1) *b_origin = origin;
    }
    return hb;
}

bool clmha__gemm_adds_bias(const clmha_context *ctx, const clmha__gemm_op *o) {
    const clmha__host_dgemm *hd;
    size_t b_origin;
    return o->batch <= 1 && o->beta == 0.0 && host_path(ctx, o, &hd, &b_origin) != NULL;
}

clmha_status clmha__gemm(clmha_context *ctx, const char *what, const clmha__gemm_op *o) {
    const clmha__host_dgemm *hd;
    size_t b_origin;
    if (host_path(ctx, o, &hd, &b_origin)) return gemm_host(ctx, what, o, hd, b_origin);
    // (A bias the caller was told the host path adds, clmha__gemm_adds_bias(), that it could not
    // take after all: a driver's answer about an operand changed.)
    if (o->bias)
        return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                           "%s: its bias row needs the host BLAS path, which cannot take it",
                           what);
    return gemm_clblast(ctx, what, o);
}

// ---- choosing the path -------------------------------------------------------------------------

// Why the device cannot take the host path, or NULL when it can.
static const char *host_unfit(const clmha_context *ctx) {
    // Oclgrind reports every type at once (and its native kernels crash in clReleaseMemObject
    // when their command is released): a CPU device is one that is nothing else.
    if (!(ctx->info.type & CL_DEVICE_TYPE_CPU) ||
        (ctx->info.type & (CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR)))
        return "not a CPU device";
    cl_device_exec_capabilities caps = 0;
    if (clGetDeviceInfo(ctx->device, CL_DEVICE_EXECUTION_CAPABILITIES, sizeof caps, &caps,
                        NULL) != CL_SUCCESS ||
        !(caps & CL_EXEC_NATIVE_KERNEL))
        return "the driver runs no native kernels";
    return NULL;
}

// Sets the path for @p want and writes the note; CLMHA_UNSUPPORTED (CLBlast kept) when the host
// path was asked for and is impossible.
static clmha_status choose(clmha_context *ctx, clmha_gemm want) {
    const char *why = NULL;
    const clmha__host_blas *hb = NULL;
    if (want != CLMHA_GEMM_CLBLAST) {
        why = host_unfit(ctx);
        if (!why) hb = clmha__host_blas_get(&why);
    }
    ctx->gemm_asked = want;
    ctx->host_blas = hb;
    if (hb)
        snprintf(ctx->gemm_note, sizeof ctx->gemm_note,
                 "host BLAS %s%s%.100s (%s) through native kernels%s%.240s", hb->name,
                 hb->detail[0] ? " " : "", hb->detail, hb->file, hb->warning[0] ? "; " : "",
                 hb->warning);
    else if (want == CLMHA_GEMM_CLBLAST)
        snprintf(ctx->gemm_note, sizeof ctx->gemm_note, "CLBlast (asked for)");
    else
        snprintf(ctx->gemm_note, sizeof ctx->gemm_note, "CLBlast (no host BLAS: %s)", why);
    return want == CLMHA_GEMM_HOST && !hb ? CLMHA_UNSUPPORTED : CLMHA_SUCCESS;
}

void clmha__gemm_init(clmha_context *ctx) {
    const char *env = getenv("CLMHA_GEMM");
    clmha_gemm want = CLMHA_GEMM_AUTO;
    if (env && strcmp(env, "clblast") == 0) want = CLMHA_GEMM_CLBLAST;
    if (env && strcmp(env, "host") == 0) want = CLMHA_GEMM_HOST;
    choose(ctx, want);
}

clmha_status clmha_context_set_gemm(clmha_context *ctx, clmha_gemm gemm) {
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    if (gemm != CLMHA_GEMM_AUTO && gemm != CLMHA_GEMM_CLBLAST && gemm != CLMHA_GEMM_HOST)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "gemm %d is not a clmha_gemm", (int)gemm);
    if (choose(ctx, gemm))
        return clmha__fail(ctx, CLMHA_UNSUPPORTED, "no host GEMMs on this device: %s",
                           ctx->gemm_note);
    return CLMHA_SUCCESS;
}

clmha_gemm clmha_context_gemm(const clmha_context *ctx) {
    return ctx && ctx->host_blas ? CLMHA_GEMM_HOST : CLMHA_GEMM_CLBLAST;
}

clmha_status clmha_context_gemm_note(const clmha_context *ctx, char *text, size_t size) {
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    if (!text || !size)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "text is NULL or size is 0");
    snprintf(text, size, "%s", ctx->gemm_note);
    return CLMHA_SUCCESS;
}
