// Checks and enqueue helpers shared by the forward and backward passes (enqueue.h).
#include "forward/enqueue.h"

#include "context/gemm.h"
#include "device/held.h"

#include <stdint.h>


typedef clmha__arg arg;
#define ARG CLMHA__ARG

// Checks that @p buf is a buffer of this context holding @p count elements of @p elem bytes
// after @p offset elements.
clmha_status clmha__check_buffer(clmha_context *ctx, const char *name, cl_mem buf, size_t offset,
                                 size_t count, size_t elem) {
    if (!buf) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "%s buffer is NULL", name);
    size_t size = 0;
    cl_context owner = NULL;
    cl_int err = clGetMemObjectInfo(buf, CL_MEM_SIZE, sizeof size, &size, NULL);
    if (err == CL_SUCCESS)
        err = clGetMemObjectInfo(buf, CL_MEM_CONTEXT, sizeof owner, &owner, NULL);
    if (err != CL_SUCCESS)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "%s is not a valid cl_mem (%s)", name,
                           clmha__cl_error_name(err));
    if (owner != ctx->cl_ctx)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "%s buffer belongs to another cl_context", name);
    cl_mem_object_type type = CL_MEM_OBJECT_BUFFER;
    clGetMemObjectInfo(buf, CL_MEM_TYPE, sizeof type, &type, NULL);
    if (type != CL_MEM_OBJECT_BUFFER)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "%s is not a buffer (cl_mem_object_type 0x%x: an image or pipe)", name,
                           (unsigned)type);
    if (offset > SIZE_MAX / elem - count || (offset + count) * elem > size)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "%s buffer holds %zu bytes, the call needs %zu elements of %zu bytes "
                           "from element offset %zu",
                           name, size, count, elem, offset);
    return CLMHA_SUCCESS;
}


size_t clmha__mask_elem(clmha_mask_kind kind) { return kind == CLMHA_MASK_FLOAT ? 4 : 1; }


// Checks that output buffer @p buf may be written by kernels (not CL_MEM_READ_ONLY).
clmha_status clmha__check_writable(clmha_context *ctx, const char *name, cl_mem buf) {
    cl_mem_flags flags = 0;
    clGetMemObjectInfo(buf, CL_MEM_FLAGS, sizeof flags, &flags, NULL);
    if (flags & CL_MEM_READ_ONLY)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "%s buffer is CL_MEM_READ_ONLY: the forward pass writes it", name);
    return CLMHA_SUCCESS;
}


// The bytes [begin, end) of a tensor argument in the buffer that holds them (a sub-buffer's
// parent: its sub-buffers alias it).
clmha__span clmha__span_of(const char *name, cl_mem buf, size_t offset, size_t count, size_t elem) {
    cl_mem parent = NULL;
    size_t origin = 0;
    clGetMemObjectInfo(buf, CL_MEM_ASSOCIATED_MEMOBJECT, sizeof parent, &parent, NULL);
    if (parent) clGetMemObjectInfo(buf, CL_MEM_OFFSET, sizeof origin, &origin, NULL);
    return (clmha__span){name, parent ? parent : buf, origin + offset * elem,
                  origin + (offset + count) * elem};
}


// Checks that the wait list holds events of this context, none of which has failed: a command
// waiting for a failed event never runs (the driver aborts it or leaves it queued), so the pass
// would never complete and, on an in-order queue, nor would anything enqueued after it.
clmha_status clmha__check_wait_list(clmha_context *ctx, cl_uint num_wait,
                                    const cl_event *wait_list) {
    if ((num_wait > 0) != (wait_list != NULL))
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "num_wait (%u) and wait_list (%p) disagree", (unsigned)num_wait,
                           (const void *)wait_list);
    for (cl_uint i = 0; i < num_wait; ++i) {
        cl_context owner = NULL;
        cl_int status = CL_COMPLETE;
        cl_int err = wait_list[i] ? clGetEventInfo(wait_list[i], CL_EVENT_CONTEXT, sizeof owner,
                                                   &owner, NULL)
                                  : CL_INVALID_EVENT;
        if (err == CL_SUCCESS)
            err = clGetEventInfo(wait_list[i], CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status,
                                 &status, NULL);
        if (err != CL_SUCCESS)
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                               "wait_list[%u] is not a valid event (%s)", (unsigned)i,
                               clmha__cl_error_name(err));
        if (owner != ctx->cl_ctx)
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                               "wait_list[%u] belongs to another cl_context", (unsigned)i);
        if (status < 0)
            return clmha__fail(ctx, CLMHA_OPENCL_ERROR,
                               "wait_list[%u] has failed (execution status %d, %s): "
                               "CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST; nothing was "
                               "enqueued",
                               (unsigned)i, (int)status, clmha__cl_error_name(status));
    }
    return CLMHA_SUCCESS;
}


// Enqueues split_heads or merge_heads (@p k) over tiles of @p planes (batch·head) x @p seq rows
// of head_dim floats, in the mapping its program was built with (cl/heads.cl, chosen by the
// device class): 1-D, one work-item per row, in groups of @p wg; or coalesced, 3-D (d, t, bh),
// one work-item per float, in groups of up to 256 (within the kernels' CL_KERNEL_WORK_GROUP_SIZE)
// whose first dimension spans a row (head_dim rounded up to a power of two, at most the group)
// and second several rows.
clmha_status clmha__launch_heads(clmha_layer *l, cl_kernel k, const char *name, size_t planes,
                                 size_t seq, size_t wg, const arg *args, cl_uint nargs) {
    clmha_context *ctx = l->ctx;
    if (!ctx->cls->coalesced) return clmha__launch(ctx, k, name, planes * seq, wg, args, nargs);
    clmha_status st = clmha__set_args(ctx, k, name, args, nargs);
    if (st) return st;
    size_t group = 1;
    while (group * 2 <= 256 && group * 2 <= l->heads_limit) group *= 2;
    size_t l0 = 1;
    while (l0 < l->d && l0 * 2 <= group) l0 *= 2;
    size_t local[3] = {l0, group / l0, 1};
    size_t global[3] = {(l->d + l0 - 1) / l0 * l0, (seq + local[1] - 1) / local[1] * local[1],
                        planes};
    cl_int err = clEnqueueNDRangeKernel(ctx->queue, k, 3, NULL, global, local, 0, NULL, NULL);
    if (err != CL_SUCCESS) return clmha__cl_fail_on(ctx, err, "clEnqueueNDRangeKernel", name);
    return CLMHA_SUCCESS;
}


// Row-major C (m, n) = A (m, k) · W (n, k)ᵀ, the shape of every projection. Called as the
// same product in column-major terms, Cᵀ (n, m) = W · Aᵀ with W transposed: CLBlast then
// transposes one operand instead of three (~5% faster at 1024³ with a PoCL tuning).
clmha_status clmha__gemm_nt(clmha_layer *l, const char *what, size_t m, size_t n, size_t k,
                            cl_mem a, size_t a_off, size_t lda, cl_mem w, size_t w_off,
                            size_t ldw, double beta, cl_mem c, size_t c_off, size_t ldc) {
    clmha__gemm_op op = {.tb = true, .f64 = l->rs == 8, .m = m, .n = n, .k = k, .alpha = 1.0,
                         .beta = beta, .a = a, .a_off = a_off, .lda = lda, .b = w,
                         .b_off = w_off, .ldb = ldw, .c = c, .c_off = c_off, .ldc = ldc,
                         .b_packed = clmha__layer_packed(l, w)};
    return clmha__gemm(l->ctx, what, &op);
}

clmha_status clmha__gemm_nt_bias(clmha_layer *l, const char *what, size_t m, size_t n, size_t k,
                                 cl_mem a, size_t a_off, size_t lda, cl_mem w, size_t w_off,
                                 size_t ldw, cl_mem bias, cl_mem c, size_t c_off, size_t ldc) {
    clmha__gemm_op op = {.tb = true, .f64 = l->rs == 8, .m = m, .n = n, .k = k, .alpha = 1.0,
                         .a = a, .a_off = a_off, .lda = lda, .b = w, .b_off = w_off, .ldb = ldw,
                         .c = c, .c_off = c_off, .ldc = ldc, .bias = bias,
                         .b_packed = clmha__layer_packed(l, w)};
    if (clmha__gemm_adds_bias(l->ctx, &op)) return clmha__gemm(l->ctx, what, &op);
    // Else the bias rows first (kernel fill_rows), the product added to them.
    cl_ulong off = c_off, r = m, cols = n;
    cl_uint has_bias = 1;
    if (ldc != n)  // fill_rows writes whole rows, one after another
        return clmha__fail(l->ctx, CLMHA_UNSUPPORTED, "%s: bias rows %zu apart for %zu columns",
                           what, ldc, n);
    arg args[] = {ARG(c), ARG(off), ARG(bias), ARG(has_bias), ARG(r), ARG(cols)};
    clmha_status st = clmha__launch_rows(l->ctx, l->fill_rows, "fill_rows", m, n, l->heads_wg,
                                         args, sizeof args / sizeof args[0]);
    if (st) return st;
    op.bias = NULL;
    op.beta = 1.0;
    return clmha__gemm(l->ctx, what, &op);
}


clmha_status clmha__check_overlaps(clmha_context *ctx, const clmha__span *all, size_t n,
                                   size_t outputs) {
    for (size_t i = 0; i < outputs; ++i)
        for (size_t j = i + 1; j < n; ++j)
            if (all[i].root == all[j].root && all[i].begin < all[j].end &&
                all[j].begin < all[i].end)
                return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                                   "%s (bytes %zu to %zu) overlaps %s (bytes %zu to %zu) in the "
                                   "same buffer: an output must not alias another output or an "
                                   "input",
                                   all[i].name, all[i].begin, all[i].end, all[j].name,
                                   all[j].begin, all[j].end);
    return CLMHA_SUCCESS;
}

clmha_status clmha__enqueue_wait(clmha_context *ctx, cl_uint num_wait, const cl_event *wait_list) {
    cl_int err = num_wait ? clEnqueueBarrierWithWaitList(ctx->queue, num_wait, wait_list, NULL)
                          : CL_SUCCESS;
    return err ? clmha__cl_fail(ctx, err, "clEnqueueBarrierWithWaitList") : CLMHA_SUCCESS;
}

clmha_status clmha__enqueue_event(clmha_context *ctx, cl_event *event) {
    cl_int err = event ? clEnqueueMarkerWithWaitList(ctx->queue, 0, NULL, event) : CL_SUCCESS;
    return err ? clmha__cl_fail(ctx, err, "clEnqueueMarkerWithWaitList") : CLMHA_SUCCESS;
}
