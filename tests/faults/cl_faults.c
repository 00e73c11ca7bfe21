// Fault injection for OpenCL calls, preloaded (LD_PRELOAD) into a process that uses libclmha:
// every OpenCL function below that libclmha itself calls (not the driver, not CLBlast: the
// caller's return address must lie in a library whose name holds "libclmha") is counted, and
// the call numbered $CLMHA_FAULT_AT (1, 2, ...) fails without reaching the driver: its error
// code is returned, or written to errcode_ret with NULL returned. The calls of no other
// library are touched. Used by tests/faults/fault_sweep.c; the process asks what happened
// through clmha_fault_state() (found with dlsym: it is not part of the library under test).
//
// The interposed functions are those whose failure the library must survive: creating buffers,
// programs, kernels, contexts and queues, building, setting arguments, every enqueue, and the
// waits. Queries (clGet*Info) and releases are not failed.
#define _GNU_SOURCE
#define CL_TARGET_OPENCL_VERSION 120
#define CL_USE_DEPRECATED_OPENCL_1_2_APIS
#include <CL/cl.h>
#include <dlfcn.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

static long fail_at = -1;  // $CLMHA_FAULT_AT; -1: read it on the first call; 0: never
static long counted;       // the library's calls so far
static const char *failed; // the name of the call made to fail, or NULL
static bool paused;        // clmha_fault_pause(): no call counted or failed

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

// Whether the call made from @p ret (a return address) is libclmha's.
static bool from_clmha(void *ret) {
    Dl_info info;
    return dladdr(ret, &info) && info.dli_fname && strstr(info.dli_fname, "libclmha");
}

// Whether this call of @p name, made from @p ret, is the one to fail.
static bool hit(const char *name, void *ret) {
    if (fail_at < 0) {
        const char *at = getenv("CLMHA_FAULT_AT");
        fail_at = at ? atol(at) : 0;
    }
    if (paused || !from_clmha(ret)) return false;
    if (++counted != fail_at) return false;
    failed = name;
    return true;
}

// The driver's function @p name.
static void *real(const char *name) {
    void *f = dlsym(RTLD_NEXT, name);
    if (!f) abort();
    return f;
}

// A function returning cl_int: fails with @p code.
#define CL_INT_CALL(name, code, params, args)                                                  \
    cl_int name params {                                                                       \
        if (hit(#name, __builtin_return_address(0))) return code;                              \
        static cl_int(*f) params;                                                              \
        if (!f) *(void **)&f = real(#name);                                                    \
        return f args;                                                                         \
    }

// A function returning an object and an error through errcode_ret: NULL and @p code.
#define CL_OBJ_CALL(type, name, code, params, args)                                            \
    type name params {                                                                         \
        if (hit(#name, __builtin_return_address(0))) {                                         \
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
