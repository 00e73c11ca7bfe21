// Host functions in the context's queue (context/native.h).
#include "context/native.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context/context.h"

bool clmha__native_root(cl_mem m, cl_mem *root, size_t *origin) {
    cl_mem parent = NULL;
    size_t bytes = 0;
    if (clGetMemObjectInfo(m, CL_MEM_ASSOCIATED_MEMOBJECT, sizeof parent, &parent, NULL) !=
        CL_SUCCESS)
        return false;
    if (parent && clGetMemObjectInfo(m, CL_MEM_OFFSET, sizeof bytes, &bytes, NULL) != CL_SUCCESS)
        return false;
    *root = parent ? parent : m;
    *origin = bytes;
    return true;
}

// What the function's kernel reads: the roots' memory (written by the capture kernels), the
// buffers' origins in them, and the arguments after it. Freed by the function's kernel.
typedef struct native_block {
    clmha__native_fn fn;
    void *root_mem[CLMHA__NATIVE_BUFFERS];
    int from[CLMHA__NATIVE_BUFFERS];  // buffer i's root
    size_t origin[CLMHA__NATIVE_BUFFERS];
    unsigned count;
    _Alignas(max_align_t) unsigned char args[];
} native_block;

typedef struct capture_args {
    void *mem;   // the root (cl_mem) when enqueued, its memory when run
    void **dst;
} capture_args;

static void CL_CALLBACK run_capture(void *p) {
    const capture_args *c = p;
    *c->dst = c->mem;
}

// The function kernel's arguments: the block, and the roots' handles (replaced by their memory
// in the driver's copy, unused: the driver may permute them).
typedef struct function_args {
    native_block *block;
    void *roots[CLMHA__NATIVE_BUFFERS];
} function_args;

static void CL_CALLBACK run_function(void *p) {
    native_block *b = ((const function_args *)p)->block;
    void *mem[CLMHA__NATIVE_BUFFERS] = {0};
    for (unsigned i = 0; i < b->count; ++i)
        mem[i] = (unsigned char *)b->root_mem[b->from[i]] + b->origin[i];
    b->fn(b->args, mem);
    free(b);
}

static clmha_status native_fail(clmha_context *ctx, cl_int err, const char *what) {
    char call[200];
    snprintf(call, sizeof call, "clEnqueueNativeKernel(%s)", what);
    return clmha__cl_fail(ctx, err, call);
}

clmha_status clmha__native_run(clmha_context *ctx, const char *what, clmha__native_fn fn,
                               const void *args, size_t size, const cl_mem *buffers,
                               unsigned count) {
    if (count > CLMHA__NATIVE_BUFFERS)
        return clmha__fail(ctx, CLMHA_UNSUPPORTED, "%s: too many buffers", what);
    native_block *b = calloc(1, sizeof *b + size);
    if (!b) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    b->fn = fn;
    b->count = count;
    memcpy(b->args, args, size);
    function_args f = {.block = b};
    unsigned roots = 0;
    for (unsigned i = 0; i < count; ++i) {
        cl_mem root;
        if (!clmha__native_root(buffers[i], &root, &b->origin[i])) {
            free(b);
            return clmha__fail(ctx, CLMHA_OPENCL_ERROR,
                               "%s: clGetMemObjectInfo failed on one of its buffers", what);
        }
        unsigned j = 0;
        while (j < roots && (cl_mem)f.roots[j] != root) ++j;
        if (j == roots) f.roots[roots++] = root;
        b->from[i] = (int)j;
    }
    cl_int err = CL_SUCCESS;
    unsigned captured = 0;
    for (; captured < roots && err == CL_SUCCESS; ++captured) {
        capture_args c = {f.roots[captured], &b->root_mem[captured]};
        const void *where = &c.mem;
        err = clEnqueueNativeKernel(ctx->queue, run_capture, &c, sizeof c, 1,
                                    (const cl_mem *)&c.mem, &where, 0, NULL, NULL);
    }
    if (err == CL_SUCCESS) {
        const void *where[CLMHA__NATIVE_BUFFERS];
        for (unsigned i = 0; i < roots; ++i) where[i] = &f.roots[i];
        err = clEnqueueNativeKernel(ctx->queue, run_function, &f, sizeof f, roots,
                                    (const cl_mem *)f.roots, where, 0, NULL, NULL);
        if (err == CL_SUCCESS) return CLMHA_SUCCESS;  // run_function frees the block
    }
    // A capture kernel may be queued and write into the block: let it run before the free.
    if (captured) clFinish(ctx->queue);
    free(b);
    return native_fail(ctx, err, what);
}
