// Host functions in the context's queue: clmha__native_run() enqueues a C function as a native
// kernel (clEnqueueNativeKernel) that receives the host memory of the device buffers it names,
// in queue order (after the commands before it, before those after it), with no host wait.
// Used on contexts whose products take the host path (clmha_context::host_blas: a CPU device
// that runs native kernels) by those products (src/context/gemm.c) and by the cores that
// compute on the CPU itself (src/cores/host_fused.c).
//
// The buffers' memory is taken around PoCL 3.1's native-kernel bug
// (tools/driver-bugs/pocl-native-kernel-buffers): each root buffer's pointer by a native
// kernel of its own, then the function's kernel, which lists every buffer so that the driver
// orders it after their writers and keeps them alive.
#ifndef CLMHA_CONTEXT_NATIVE_H
#define CLMHA_CONTEXT_NATIVE_H

#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// The most buffers one native function receives.
#define CLMHA__NATIVE_BUFFERS 7

// A native function: @p args its copy of the arguments, mem[i] the host memory of buffer i
// (at the buffer's own first byte, sub-buffers included).
typedef void (*clmha__native_fn)(void *args, void *const *mem);

// Enqueues @p fn on @p ctx's queue with a copy of the @p size bytes at @p args and the memory
// of @p buffers (@p count of them, at most CLMHA__NATIVE_BUFFERS; repeats allowed). @p what
// names the call in a failure's message. On failure nothing of it runs.
CLMHA__HIDDEN clmha_status clmha__native_run(clmha_context *ctx, const char *what,
                                             clmha__native_fn fn, const void *args,
                                             size_t size, const cl_mem *buffers,
                                             unsigned count);

// The root buffer of @p m (itself, or the parent of a sub-buffer) and @p m's origin in it, in
// bytes; false when the driver does not say.
CLMHA__HIDDEN bool clmha__native_root(cl_mem m, cl_mem *root, size_t *origin);

#endif
