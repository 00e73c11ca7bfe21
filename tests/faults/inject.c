// Fault injection, preloaded (LD_PRELOAD) into a process that uses libclmha: the calls of one
// kind ($CLMHA_FAULT_KIND: "cl", the default, or "alloc") that libclmha itself makes are
// counted, and the call numbered $CLMHA_FAULT_AT (1, 2, ...) fails without reaching the
// driver or the C library. A call is libclmha's when its return address lies in libclmha's
// loaded segments (found once with dl_iterate_phdr: the library named libclmha.so*);
// the calls of the driver, CLBlast, the C library and the process are never touched. Used by
// tests/faults/fault_sweep.c; the process asks what happened through clmha_fault_state() and
// pauses the injection with clmha_fault_pause() (found with dlsym: they are not part of the
// library under test).
//
// "cl": the OpenCL functions whose failure the library must survive: creating buffers,
// programs, kernels and queues, building, setting arguments, every enqueue, and the waits (an
// error code returned, or NULL and the code in errcode_ret). Queries (clGet*Info) and releases
// are not failed. "alloc": malloc, calloc and realloc (NULL returned; the real ones are glibc's
// __libc_malloc, __libc_calloc and __libc_realloc, so that interposing needs no dlsym, which
// allocates). An allocation made for libclmha by another C library function (strdup, fopen) is
// not counted.
#define _GNU_SOURCE
#define CL_TARGET_OPENCL_VERSION 120
#define CL_USE_DEPRECATED_OPENCL_1_2_APIS
#include <CL/cl.h>
#include <dlfcn.h>
#include <link.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static long fail_at = -1;  // $CLMHA_FAULT_AT; -1: read it on the first call; 0: never
static bool alloc_kind;    // $CLMHA_FAULT_KIND is "alloc" (else OpenCL calls are failed)
static long counted;       // the library's calls of the kind so far
static const char *failed; // the name of the call made to fail, or NULL
static bool paused;        // clmha_fault_pause(): no call counted or failed

// libclmha's loaded segments, found on the first call after it is loaded.
enum { MAX_SEGMENTS = 8 };
static uintptr_t seg_lo[MAX_SEGMENTS], seg_hi[MAX_SEGMENTS];
static int segments = -1;  // -1: not looked for yet (or libclmha not loaded yet)

// The two calls the process makes (by dlsym).
long clmha_fault_state(const char **name);
void clmha_fault_pause(bool pause);

// What the process asks: the calls counted, and the one failed (NULL: none yet).
__attribute__((visibility("default"))) long clmha_fault_state(const char **name) {
    if (name) *name = failed;
    return counted;
}

// Stops (true) or resumes counting and failing: the process's own calls after the injected
// failure (the retry that checks the object is still usable) run untouched.
__attribute__((visibility("default"))) void clmha_fault_pause(bool pause) { paused = pause; }

static int find_segments(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size, (void)data;
    const char *base = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    base = base ? base + 1 : info->dlpi_name;
    if (!base || strncmp(base, "libclmha.so", 11) != 0) return 0;  // (not this library)
    int n = 0;
    for (int i = 0; i < info->dlpi_phnum && n < MAX_SEGMENTS; ++i) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD) continue;
        seg_lo[n] = info->dlpi_addr + ph->p_vaddr;
        seg_hi[n] = seg_lo[n] + ph->p_memsz;
        ++n;
    }
    segments = n;
    return 1;
}

// Whether the call made from @p ret (a return address) is libclmha's.
static bool from_clmha(void *ret) {
    if (segments <= 0) dl_iterate_phdr(find_segments, NULL);
    uintptr_t a = (uintptr_t)ret;
    for (int i = 0; i < segments; ++i)
        if (a >= seg_lo[i] && a < seg_hi[i]) return true;
    return false;
}

// Whether this call of @p name (of the kind @p alloc), made from @p ret, is the one to fail.
static bool hit(const char *name, bool alloc, void *ret) {
    if (fail_at < 0) {  // (getenv allocates nothing)
        const char *at = getenv("CLMHA_FAULT_AT"), *kind = getenv("CLMHA_FAULT_KIND");
        alloc_kind = kind && strcmp(kind, "alloc") == 0;
        fail_at = at ? atol(at) : 0;
    }
    if (paused || alloc != alloc_kind || !from_clmha(ret)) return false;
    if (__atomic_add_fetch(&counted, 1, __ATOMIC_SEQ_CST) != fail_at) return false;
    failed = name;  // (native kernels' calls come from the driver's threads)
    return true;
}

// ---- allocations --------------------------------------------------------------------------------

extern void *__libc_malloc(size_t size);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t size);

void *malloc(size_t size) {
    return hit("malloc", true, __builtin_return_address(0)) ? NULL : __libc_malloc(size);
}

void *calloc(size_t n, size_t size) {
    return hit("calloc", true, __builtin_return_address(0)) ? NULL : __libc_calloc(n, size);
}

void *realloc(void *p, size_t size) {
    return hit("realloc", true, __builtin_return_address(0)) ? NULL : __libc_realloc(p, size);
}

// ---- OpenCL -------------------------------------------------------------------------------------

// The driver's function @p name.
static void *real(const char *name) {
    void *f = dlsym(RTLD_NEXT, name);
    if (!f) abort();
    return f;
}

// A function returning cl_int: fails with @p code.
#define CL_INT_CALL(name, code, params, args)                                                  \
    cl_int name params {                                                                       \
        if (hit(#name, false, __builtin_return_address(0))) return code;                           \
        static cl_int(*f) params;                                                              \
        if (!f) *(void **)&f = real(#name);                                                    \
        return f args;                                                                         \
    }

// A function returning an object and an error through errcode_ret: NULL and @p code.
#define CL_OBJ_CALL(type, name, code, params, args)                                            \
    type name params {                                                                         \
        if (hit(#name, false, __builtin_return_address(0))) {                                      \
            if (errcode_ret) *errcode_ret = code;                                              \
            return NULL;                                                                       \
        }                                                                                      \
        static type(*f) params;                                                                \
        if (!f) *(void **)&f = real(#name);                                                    \
        return f args;                                                                         \
    }

CL_OBJ_CALL(cl_mem, clCreateBuffer, CL_MEM_OBJECT_ALLOCATION_FAILURE,
            (cl_context c, cl_mem_flags fl, size_t size, void *host, cl_int *errcode_ret),
            (c, fl, size, host, errcode_ret))
CL_OBJ_CALL(cl_kernel, clCreateKernel, CL_OUT_OF_RESOURCES,
            (cl_program p, const char *kname, cl_int *errcode_ret), (p, kname, errcode_ret))
CL_OBJ_CALL(cl_program, clCreateProgramWithSource, CL_OUT_OF_HOST_MEMORY,
            (cl_context c, cl_uint n, const char **src, const size_t *len, cl_int *errcode_ret),
            (c, n, src, len, errcode_ret))
CL_OBJ_CALL(cl_command_queue, clCreateCommandQueue, CL_OUT_OF_RESOURCES,
            (cl_context c, cl_device_id d, cl_command_queue_properties pr, cl_int *errcode_ret),
            (c, d, pr, errcode_ret))
CL_INT_CALL(clBuildProgram, CL_OUT_OF_RESOURCES,
            (cl_program p, cl_uint n, const cl_device_id *d, const char *opt,
             void(CL_CALLBACK *cb)(cl_program, void *), void *ud),
            (p, n, d, opt, cb, ud))
CL_INT_CALL(clSetKernelArg, CL_OUT_OF_RESOURCES,
            (cl_kernel k, cl_uint i, size_t size, const void *value), (k, i, size, value))
CL_INT_CALL(clEnqueueNDRangeKernel, CL_OUT_OF_RESOURCES,
            (cl_command_queue q, cl_kernel k, cl_uint dim, const size_t *off, const size_t *gws,
             const size_t *lws, cl_uint nw, const cl_event *w, cl_event *e),
            (q, k, dim, off, gws, lws, nw, w, e))
CL_INT_CALL(clEnqueueNativeKernel, CL_OUT_OF_RESOURCES,
            (cl_command_queue q, void(CL_CALLBACK *fn)(void *), void *a, size_t cb,
             cl_uint nmem, const cl_mem *mem, const void **loc, cl_uint nw, const cl_event *w,
             cl_event *e),
            (q, fn, a, cb, nmem, mem, loc, nw, w, e))
CL_INT_CALL(clEnqueueCopyBuffer, CL_OUT_OF_RESOURCES,
            (cl_command_queue q, cl_mem s, cl_mem d, size_t so, size_t dof, size_t cb, cl_uint nw,
             const cl_event *w, cl_event *e),
            (q, s, d, so, dof, cb, nw, w, e))
CL_INT_CALL(clEnqueueCopyBufferRect, CL_OUT_OF_RESOURCES,
            (cl_command_queue q, cl_mem s, cl_mem d, const size_t *so, const size_t *dof,
             const size_t *r, size_t srp, size_t ssp, size_t drp, size_t dsp, cl_uint nw,
             const cl_event *w, cl_event *e),
            (q, s, d, so, dof, r, srp, ssp, drp, dsp, nw, w, e))
CL_INT_CALL(clEnqueueReadBuffer, CL_OUT_OF_RESOURCES,
            (cl_command_queue q, cl_mem b, cl_bool bl, size_t off, size_t cb, void *p, cl_uint nw,
             const cl_event *w, cl_event *e),
            (q, b, bl, off, cb, p, nw, w, e))
CL_INT_CALL(clEnqueueWriteBuffer, CL_OUT_OF_RESOURCES,
            (cl_command_queue q, cl_mem b, cl_bool bl, size_t off, size_t cb, const void *p,
             cl_uint nw, const cl_event *w, cl_event *e),
            (q, b, bl, off, cb, p, nw, w, e))
CL_INT_CALL(clEnqueueFillBuffer, CL_OUT_OF_RESOURCES,
            (cl_command_queue q, cl_mem b, const void *pat, size_t ps, size_t off, size_t cb,
             cl_uint nw, const cl_event *w, cl_event *e),
            (q, b, pat, ps, off, cb, nw, w, e))
CL_INT_CALL(clEnqueueMarkerWithWaitList, CL_OUT_OF_RESOURCES,
            (cl_command_queue q, cl_uint nw, const cl_event *w, cl_event *e), (q, nw, w, e))
CL_INT_CALL(clEnqueueBarrierWithWaitList, CL_OUT_OF_RESOURCES,
            (cl_command_queue q, cl_uint nw, const cl_event *w, cl_event *e), (q, nw, w, e))
CL_INT_CALL(clWaitForEvents, CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST,
            (cl_uint n, const cl_event *e), (n, e))
CL_INT_CALL(clFinish, CL_OUT_OF_RESOURCES, (cl_command_queue q), (q))
