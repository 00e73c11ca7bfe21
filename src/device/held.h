// The OpenCL objects clmha holds, counted process-wide, and the helpers that release them.
#ifndef CLMHA_DEVICE_HELD_H
#define CLMHA_DEVICE_HELD_H

#include "clmha.h"

#include "base/defs.h"

// What clmha holds a reference to, counted process-wide: every cl_context, command queue and
// device clmha created or retained, and every cl_mem, cl_program and cl_kernel it created and has
// not released (CLBlast's own objects are not counted). Tests compare these with zero after
// releasing everything, which also works on drivers whose CL_*_REFERENCE_COUNT does not move.
typedef enum clmha__held_kind {
    CLMHA__HELD_CONTEXT,
    CLMHA__HELD_QUEUE,
    CLMHA__HELD_DEVICE,
    CLMHA__HELD_MEM,
    CLMHA__HELD_PROGRAM,
    CLMHA__HELD_KERNEL,
    CLMHA__HELD_KINDS
} clmha__held_kind;

// Adds @p delta to the count of @p kind (thread-safe).
CLMHA__HIDDEN void clmha__held_add(clmha__held_kind kind, long delta);

// Test hook (reachable only by linking libclmha.a): the counts above, indexed by kind.
CLMHA__HIDDEN void clmha__test_held(long counts[CLMHA__HELD_KINDS]);

// Counts an object clmha just created (NULL, a failed creation, is not counted).
static inline void clmha__held_new(clmha__held_kind kind, const void *object) {
    if (object) clmha__held_add(kind, 1);
}

// Releases what clmha created, and counts it (NULL is ignored).
static inline void clmha__release_mem(cl_mem m) {
    if (!m) return;
    clReleaseMemObject(m);
    clmha__held_add(CLMHA__HELD_MEM, -1);
}
static inline void clmha__release_kernel(cl_kernel k) {
    if (!k) return;
    clReleaseKernel(k);
    clmha__held_add(CLMHA__HELD_KERNEL, -1);
}
static inline void clmha__release_program(cl_program p) {
    if (!p) return;
    clReleaseProgram(p);
    clmha__held_add(CLMHA__HELD_PROGRAM, -1);
}

#endif
