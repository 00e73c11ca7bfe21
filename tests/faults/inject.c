// Fault injection, preloaded (LD_PRELOAD) into a process that uses libclmha: the calls of one
// kind ($CLMHA_FAULT_KIND) that libclmha itself makes are counted, and the call numbered
// $CLMHA_FAULT_AT (1, 2, ...) fails without reaching the driver or the C library. A call is
// libclmha's when its return address lies in libclmha's loaded segments (found once with
// dl_iterate_phdr: the library named libclmha.so*); the calls of the driver, CLBlast, the C
// library and the process are never touched, unless $CLMHA_FAULT_PROGRAM is set: then the
// program's own calls are counted too (the `clmha` program's file writes, say). Used by
// tests/faults/fault_sweep.c; the process asks what happened through clmha_fault_state() and
// clmha_fault_held(), and pauses the injection with clmha_fault_pause() (found with dlsym: they
// are not part of the library under test).
//
// The kinds:
// - "cl" (the default): the OpenCL functions whose failure the library must survive: creating
//   contexts, buffers, programs, kernels and queues, building, setting arguments, every
//   enqueue, and the waits (an error code returned, or NULL and the code in errcode_ret).
//   Queries (clGet*Info) and releases are not failed.
// - "alloc": malloc, calloc and realloc (NULL returned; the real ones are glibc's
//   __libc_malloc, __libc_calloc and __libc_realloc, so that interposing needs no dlsym, which
//   allocates). An allocation made for libclmha by another C library function (strdup, fopen)
//   is not counted.
// - "io": the file calls of loading and saving: open, mkstemp, fchmod, fdopen, fread, fwrite,
//   fflush, fsync, fclose and rename (each fails as the C library reports a failure, with an
//   errno: a short read or write with the stream's error indicator set, -1, EOF or NULL; a
//   failed fclose still closes the stream).
// - "blas": the GEMM libraries' calls: CLBlast's four GEMMs (an error status), and oneDNN's
//   dnnl_sgemm when this library is also the host BLAS (CLMHA_HOST_BLAS names it: its
//   dnnl_sgemm forwards to libdnnl's, a dlsym'd function no preload can interpose).
//
// With $CLMHA_FAULT_CLOCK set, the clock and the profiling times libclmha reads are made up, so
// that a tuning run (searches until a deadline, the fastest candidate kept) makes the same calls
// every time (see the end of this file).
//
// Whatever the kind, what libclmha holds is counted too, for the leak check after a run:
// the OpenCL objects it created or retained less those it released (events an enqueue returned
// included), and the allocations it made that nothing has freed yet (clmha_fault_held()).
#define _GNU_SOURCE
#define CL_TARGET_OPENCL_VERSION 120
#define CL_USE_DEPRECATED_OPENCL_1_2_APIS
#include <CL/cl.h>
#include <clblast_c.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum kind { KIND_CL, KIND_ALLOC, KIND_IO, KIND_BLAS };

static long fail_at = -1;  // $CLMHA_FAULT_AT; -1: read it on the first call; 0: never
static int fail_kind;      // $CLMHA_FAULT_KIND, an enum kind
static long counted;       // the library's calls of the kind so far
static const char *failed; // the name of the call made to fail, or NULL
static bool paused;        // clmha_fault_pause(): no call counted or failed

// libclmha's loaded segments (and the program's, with $CLMHA_FAULT_PROGRAM set), found on the
// first call after libclmha is loaded.
enum { MAX_SEGMENTS = 16 };
static uintptr_t seg_lo[MAX_SEGMENTS], seg_hi[MAX_SEGMENTS];
static int segments = -1;  // -1: not looked for yet (or libclmha not loaded yet)

// The calls the process makes (by dlsym).
long clmha_fault_state(const char **name);
void clmha_fault_pause(bool pause);
long clmha_fault_held(long *allocations);

// What the process asks: the calls counted, and the one failed (NULL: none yet).
__attribute__((visibility("default"))) long clmha_fault_state(const char **name) {
    if (name) *name = failed;
    return counted;
}

// Stops (true) or resumes counting and failing: the process's own calls after the injected
// failure (the retry that checks the object is still usable) run untouched.
__attribute__((visibility("default"))) void clmha_fault_pause(bool pause) { paused = pause; }

// dl_iterate_phdr's callback: the segments of libclmha (and of the program: the first object,
// unnamed, when *data is true); counts libclmha's in segments only when it is there.
static int find_segments(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    static int n, found;
    bool program = *(bool *)data && info->dlpi_name && !info->dlpi_name[0] && n == 0;
    const char *base = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    base = base ? base + 1 : info->dlpi_name;
    bool lib = base && strncmp(base, "libclmha.so", 11) == 0;
    if (!program && !lib) return 0;
    for (int i = 0; i < info->dlpi_phnum && n < MAX_SEGMENTS; ++i) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD) continue;
        seg_lo[n] = info->dlpi_addr + ph->p_vaddr;
        seg_hi[n] = seg_lo[n] + ph->p_memsz;
        ++n;
    }
    if (lib) found = 1;
    if (found) segments = n;
    return 0;
}

// Whether the call made from @p ret (a return address) is libclmha's.
static bool from_clmha(void *ret) {
    if (segments <= 0) {
        bool program = getenv("CLMHA_FAULT_PROGRAM") != NULL;
        dl_iterate_phdr(find_segments, &program);
    }
    uintptr_t a = (uintptr_t)ret;
    for (int i = 0; i < segments; ++i)
        if (a >= seg_lo[i] && a < seg_hi[i]) return true;
    return false;
}

// Whether this call of @p name (of kind @p kind), made from @p ret, is the one to fail.
static bool hit(const char *name, int kind, void *ret) {
    if (fail_at < 0) {  // (getenv allocates nothing)
        const char *at = getenv("CLMHA_FAULT_KIND");
        fail_kind = !at                          ? KIND_CL
                    : strcmp(at, "alloc") == 0 ? KIND_ALLOC
                    : strcmp(at, "io") == 0    ? KIND_IO
                    : strcmp(at, "blas") == 0  ? KIND_BLAS
                                               : KIND_CL;
        at = getenv("CLMHA_FAULT_AT");
        fail_at = at ? atol(at) : 0;
    }
    if (paused || kind != fail_kind || !from_clmha(ret)) return false;
    if (__atomic_add_fetch(&counted, 1, __ATOMIC_SEQ_CST) != fail_at) return false;
    failed = name;  // (native kernels' calls come from the driver's threads)
    return true;
}

// ---- what libclmha holds -----------------------------------------------------------------------

// OpenCL objects libclmha created or retained, less those it released.
static long cl_held;

// The allocations libclmha made that are not freed yet: an open-addressed set of addresses
// (static: the set must not allocate), TOMB marking a removed one.
enum { SLOTS = 1 << 18 };
#define TOMB ((uintptr_t)1)
static uintptr_t slot[SLOTS];
static long live;
static bool overflow;  // the set filled up: the count is not known
static char lock_flag;

static void lock(void) {
    while (__atomic_test_and_set(&lock_flag, __ATOMIC_ACQUIRE)) {
    }
}

static void unlock(void) { __atomic_clear(&lock_flag, __ATOMIC_RELEASE); }

static size_t slot_of(uintptr_t p) { return (size_t)((p >> 4) * 0x9E3779B97F4A7C15ull >> 46); }

static void remember(void *p) {
    if (!p) return;
    lock();
    size_t i = slot_of((uintptr_t)p), n = 0;
    while (slot[i] > TOMB && n < SLOTS) i = (i + 1) % SLOTS, ++n;
    if (n == SLOTS) overflow = true;
    else slot[i] = (uintptr_t)p, ++live;
    unlock();
}

static void forget(void *p) {
    if (!p) return;
    lock();
    size_t i = slot_of((uintptr_t)p);
    for (size_t n = 0; slot[i] && n < SLOTS; i = (i + 1) % SLOTS, ++n)
        if (slot[i] == (uintptr_t)p) {
            slot[i] = TOMB, --live;
            break;
        }
    unlock();
}

// The OpenCL objects libclmha holds; *allocations: its allocations not freed (-1: not known).
__attribute__((visibility("default"))) long clmha_fault_held(long *allocations) {
    if (allocations) *allocations = overflow ? -1 : live;
    return cl_held;
}

// With $CLMHA_FAULT_REPORT set (a program run by the sweep), what this process saw, written
// when it exits: its calls of the kind, the OpenCL objects and allocations libclmha still
// holds, and the call failed ("-": none).
__attribute__((destructor)) static void report(void) {
    const char *path = getenv("CLMHA_FAULT_REPORT");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (!f) return;
    fprintf(f, "%ld %ld %ld %s\n", counted, cl_held, overflow ? -1 : live,
            failed ? failed : "-");
    fclose(f);
}

static void held(void *ret, long delta) {
    if (from_clmha(ret)) __atomic_add_fetch(&cl_held, delta, __ATOMIC_SEQ_CST);
}

// ---- allocations --------------------------------------------------------------------------------

extern void *__libc_malloc(size_t size);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t size);
extern void __libc_free(void *p);

void *malloc(size_t size) {
    void *ret = __builtin_return_address(0);
    if (hit("malloc", KIND_ALLOC, ret)) return NULL;
    void *p = __libc_malloc(size);
    if (from_clmha(ret)) remember(p);
    return p;
}

void *calloc(size_t n, size_t size) {
    void *ret = __builtin_return_address(0);
    if (hit("calloc", KIND_ALLOC, ret)) return NULL;
    void *p = __libc_calloc(n, size);
    if (from_clmha(ret)) remember(p);
    return p;
}

void *realloc(void *p, size_t size) {
    void *ret = __builtin_return_address(0);
    if (hit("realloc", KIND_ALLOC, ret)) return NULL;
    void *q = __libc_realloc(p, size);
    if (q || !size) forget(p);  // (a failed realloc leaves p as it was)
    if (q && from_clmha(ret)) remember(q);
    return q;
}

void free(void *p) {
    forget(p);
    __libc_free(p);
}

// ---- the real functions -------------------------------------------------------------------------

// The next library's function @p name (the driver's, CLBlast's, the C library's).
static void *real(const char *name) {
    void *f = dlsym(RTLD_NEXT, name);
    if (!f) abort();
    return f;
}

#define REAL(type, name, params)                                                               \
    static type(*f) params;                                                                    \
    if (!f) *(void **)&f = real(#name)

// ---- OpenCL -------------------------------------------------------------------------------------

// A function returning cl_int: fails with @p code; an event it returns (at @p event, NULL for
// none) is counted as held.
#define CL_INT_CALL(name, code, event, params, args)                                           \
    cl_int name params {                                                                       \
        void *ret = __builtin_return_address(0);                                               \
        if (hit(#name, KIND_CL, ret)) return code;                                             \
        REAL(cl_int, name, params);                                                            \
        cl_int rc_ = f args;                                                                   \
        cl_event *ev_ = (event);                                                               \
        if (rc_ == CL_SUCCESS && ev_ && *ev_) held(ret, 1);                                    \
        return rc_;                                                                            \
    }

// A function returning an object and an error through errcode_ret: NULL and @p code.
#define CL_OBJ_CALL(type, name, code, params, args)                                            \
    type name params {                                                                         \
        void *ret = __builtin_return_address(0);                                               \
        if (hit(#name, KIND_CL, ret)) {                                                        \
            if (errcode_ret) *errcode_ret = code;                                              \
            return NULL;                                                                       \
        }                                                                                      \
        REAL(type, name, params);                                                              \
        type obj = f args;                                                                     \
        if (obj) held(ret, 1);                                                                 \
        return obj;                                                                            \
    }

// A release (@p delta -1) or a retain (+1) of an object: never failed, counted.
#define CL_HOLD_CALL(name, type, delta)                                                        \
    cl_int name(type o) {                                                                      \
        void *ret = __builtin_return_address(0);                                               \
        REAL(cl_int, name, (type));                                                            \
        cl_int r = f(o);                                                                       \
        if (r == CL_SUCCESS) held(ret, delta);                                                 \
        return r;                                                                              \
    }

typedef void(CL_CALLBACK *context_notify)(const char *, const void *, size_t, void *);

CL_OBJ_CALL(cl_context, clCreateContext, CL_OUT_OF_HOST_MEMORY,
            (const cl_context_properties *pr, cl_uint n, const cl_device_id *d, context_notify cb,
             void *ud, cl_int *errcode_ret),
            (pr, n, d, cb, ud, errcode_ret))
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
CL_INT_CALL(clBuildProgram, CL_OUT_OF_RESOURCES, NULL,
            (cl_program p, cl_uint n, const cl_device_id *d, const char *opt,
             void(CL_CALLBACK *cb)(cl_program, void *), void *ud),
            (p, n, d, opt, cb, ud))
CL_INT_CALL(clSetKernelArg, CL_OUT_OF_RESOURCES, NULL,
            (cl_kernel k, cl_uint i, size_t size, const void *value), (k, i, size, value))
CL_INT_CALL(clEnqueueNDRangeKernel, CL_OUT_OF_RESOURCES, e,
            (cl_command_queue q, cl_kernel k, cl_uint dim, const size_t *off, const size_t *gws,
             const size_t *lws, cl_uint nw, const cl_event *w, cl_event *e),
            (q, k, dim, off, gws, lws, nw, w, e))
CL_INT_CALL(clEnqueueNativeKernel, CL_OUT_OF_RESOURCES, e,
            (cl_command_queue q, void(CL_CALLBACK *fn)(void *), void *a, size_t cb,
             cl_uint nmem, const cl_mem *mem, const void **loc, cl_uint nw, const cl_event *w,
             cl_event *e),
            (q, fn, a, cb, nmem, mem, loc, nw, w, e))
CL_INT_CALL(clEnqueueCopyBuffer, CL_OUT_OF_RESOURCES, e,
            (cl_command_queue q, cl_mem s, cl_mem d, size_t so, size_t dof, size_t cb, cl_uint nw,
             const cl_event *w, cl_event *e),
            (q, s, d, so, dof, cb, nw, w, e))
CL_INT_CALL(clEnqueueCopyBufferRect, CL_OUT_OF_RESOURCES, e,
            (cl_command_queue q, cl_mem s, cl_mem d, const size_t *so, const size_t *dof,
             const size_t *r, size_t srp, size_t ssp, size_t drp, size_t dsp, cl_uint nw,
             const cl_event *w, cl_event *e),
            (q, s, d, so, dof, r, srp, ssp, drp, dsp, nw, w, e))
CL_INT_CALL(clEnqueueReadBuffer, CL_OUT_OF_RESOURCES, e,
            (cl_command_queue q, cl_mem b, cl_bool bl, size_t off, size_t cb, void *p, cl_uint nw,
             const cl_event *w, cl_event *e),
            (q, b, bl, off, cb, p, nw, w, e))
CL_INT_CALL(clEnqueueWriteBuffer, CL_OUT_OF_RESOURCES, e,
            (cl_command_queue q, cl_mem b, cl_bool bl, size_t off, size_t cb, const void *p,
             cl_uint nw, const cl_event *w, cl_event *e),
            (q, b, bl, off, cb, p, nw, w, e))
CL_INT_CALL(clEnqueueFillBuffer, CL_OUT_OF_RESOURCES, e,
            (cl_command_queue q, cl_mem b, const void *pat, size_t ps, size_t off, size_t cb,
             cl_uint nw, const cl_event *w, cl_event *e),
            (q, b, pat, ps, off, cb, nw, w, e))
CL_INT_CALL(clEnqueueMarkerWithWaitList, CL_OUT_OF_RESOURCES, e,
            (cl_command_queue q, cl_uint nw, const cl_event *w, cl_event *e), (q, nw, w, e))
CL_INT_CALL(clEnqueueBarrierWithWaitList, CL_OUT_OF_RESOURCES, e,
            (cl_command_queue q, cl_uint nw, const cl_event *w, cl_event *e), (q, nw, w, e))
CL_INT_CALL(clWaitForEvents, CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST, NULL,
            (cl_uint n, const cl_event *e), (n, e))
CL_INT_CALL(clFinish, CL_OUT_OF_RESOURCES, NULL, (cl_command_queue q), (q))

CL_HOLD_CALL(clReleaseMemObject, cl_mem, -1)
CL_HOLD_CALL(clReleaseKernel, cl_kernel, -1)
CL_HOLD_CALL(clReleaseProgram, cl_program, -1)
CL_HOLD_CALL(clReleaseCommandQueue, cl_command_queue, -1)
CL_HOLD_CALL(clReleaseContext, cl_context, -1)
CL_HOLD_CALL(clReleaseEvent, cl_event, -1)
CL_HOLD_CALL(clRetainCommandQueue, cl_command_queue, 1)
CL_HOLD_CALL(clRetainContext, cl_context, 1)

// ---- files --------------------------------------------------------------------------------------

// Fails the call (errno @p err, the value @p fail returned) when it is the one; else runs it.
#define IO_CALL(type, name, fail, err, params, args)                                           \
    type name params {                                                                         \
        if (hit(#name, KIND_IO, __builtin_return_address(0))) {                                \
            errno = err;                                                                       \
            return fail;                                                                       \
        }                                                                                      \
        REAL(type, name, params);                                                              \
        return f args;                                                                         \
    }

IO_CALL(int, mkstemp, -1, ENOSPC, (char *t), (t))
IO_CALL(int, fchmod, -1, EPERM, (int fd, mode_t m), (fd, m))
IO_CALL(FILE *, fdopen, NULL, EMFILE, (int fd, const char *m), (fd, m))

// A failed stream call: errno and the stream's error indicator set (glibc's flag: ferror()
// sees it, as after a real failure).
#define STREAM_CALL(type, name, fail, err, params, args)                                       \
    type name params {                                                                         \
        if (hit(#name, KIND_IO, __builtin_return_address(0))) {                                \
            errno = err;                                                                       \
            fl->_flags |= _IO_ERR_SEEN;                                                        \
            return fail;                                                                       \
        }                                                                                      \
        REAL(type, name, params);                                                              \
        return f args;                                                                         \
    }

STREAM_CALL(size_t, fread, 0, EIO, (void *p, size_t s, size_t n, FILE *fl), (p, s, n, fl))
STREAM_CALL(size_t, fwrite, 0, ENOSPC, (const void *p, size_t s, size_t n, FILE *fl),
            (p, s, n, fl))
STREAM_CALL(int, fflush, EOF, ENOSPC, (FILE * fl), (fl))
IO_CALL(int, fsync, -1, EIO, (int fd), (fd))
IO_CALL(int, rename, -1, EIO, (const char *a, const char *b), (a, b))

int open(const char *path, int flags, ...) {
    mode_t mode = 0;
    if (flags & (O_CREAT | __O_TMPFILE)) {
        va_list ap;
        va_start(ap, flags);
        mode = (mode_t)va_arg(ap, unsigned);
        va_end(ap);
    }
    if (hit("open", KIND_IO, __builtin_return_address(0))) {
        errno = EIO;
        return -1;
    }
    REAL(int, open, (const char *, int, ...));
    return f(path, flags, mode);
}

// A failed fclose still closes the stream (as the C library's does).
int fclose(FILE *fl) {
    bool fail = hit("fclose", KIND_IO, __builtin_return_address(0));
    REAL(int, fclose, (FILE *));
    int r = f(fl);
    if (!fail) return r;
    errno = EIO;
    return EOF;
}

// ---- GEMM libraries -----------------------------------------------------------------------------

#define BLAS_CALL(name, params, args)                                                          \
    CLBlastStatusCode name params {                                                            \
        void *ret = __builtin_return_address(0);                                               \
        if (hit(#name, KIND_BLAS, ret)) return CLBlastOpenCLOutOfResources;                    \
        REAL(CLBlastStatusCode, name, params);                                                 \
        CLBlastStatusCode r = f args;                                                          \
        if (r == CLBlastSuccess && event && *event) held(ret, 1);                              \
        return r;                                                                              \
    }

BLAS_CALL(CLBlastSgemm,
          (CLBlastLayout l, CLBlastTranspose ta, CLBlastTranspose tb, size_t m, size_t n,
           size_t k, float al, cl_mem a, size_t ao, size_t lda, cl_mem b, size_t bo, size_t ldb,
           float be, cl_mem c, size_t co, size_t ldc, cl_command_queue *q, cl_event *event),
          (l, ta, tb, m, n, k, al, a, ao, lda, b, bo, ldb, be, c, co, ldc, q, event))
BLAS_CALL(CLBlastDgemm,
          (CLBlastLayout l, CLBlastTranspose ta, CLBlastTranspose tb, size_t m, size_t n,
           size_t k, double al, cl_mem a, size_t ao, size_t lda, cl_mem b, size_t bo, size_t ldb,
           double be, cl_mem c, size_t co, size_t ldc, cl_command_queue *q, cl_event *event),
          (l, ta, tb, m, n, k, al, a, ao, lda, b, bo, ldb, be, c, co, ldc, q, event))
BLAS_CALL(CLBlastSgemmStridedBatched,
          (CLBlastLayout l, CLBlastTranspose ta, CLBlastTranspose tb, size_t m, size_t n,
           size_t k, float al, cl_mem a, size_t ao, size_t lda, size_t as, cl_mem b, size_t bo,
           size_t ldb, size_t bs, float be, cl_mem c, size_t co, size_t ldc, size_t cs,
           size_t batch, cl_command_queue *q, cl_event *event),
          (l, ta, tb, m, n, k, al, a, ao, lda, as, b, bo, ldb, bs, be, c, co, ldc, cs, batch, q,
           event))
BLAS_CALL(CLBlastDgemmStridedBatched,
          (CLBlastLayout l, CLBlastTranspose ta, CLBlastTranspose tb, size_t m, size_t n,
           size_t k, double al, cl_mem a, size_t ao, size_t lda, size_t as, cl_mem b, size_t bo,
           size_t ldb, size_t bs, double be, cl_mem c, size_t co, size_t ldc, size_t cs,
           size_t batch, cl_command_queue *q, cl_event *event),
          (l, ta, tb, m, n, k, al, a, ao, lda, as, b, bo, ldb, bs, be, c, co, ldc, cs, batch, q,
           event))

// oneDNN's GEMM, for CLMHA_HOST_BLAS naming this library: fails with dnnl_out_of_memory (1),
// else runs libdnnl's (dnnl_runtime_error, 5, when there is none).
typedef int (*dnnl_sgemm_fn)(char, char, int64_t, int64_t, int64_t, float, const float *,
                             int64_t, const float *, int64_t, float, float *, int64_t);
int dnnl_sgemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float al, const float *a,
               int64_t lda, const float *b, int64_t ldb, float be, float *c, int64_t ldc);

__attribute__((visibility("default"))) int dnnl_sgemm(char ta, char tb, int64_t m, int64_t n,
                                                      int64_t k, float al, const float *a,
                                                      int64_t lda, const float *b, int64_t ldb,
                                                      float be, float *c, int64_t ldc) {
    if (hit("dnnl_sgemm", KIND_BLAS, __builtin_return_address(0))) return 1;
    static dnnl_sgemm_fn f;
    if (!f) {
        void *h = dlopen("libdnnl.so.3", RTLD_NOW | RTLD_LOCAL);
        if (!h) h = dlopen("libdnnl.so.2", RTLD_NOW | RTLD_LOCAL);
        if (h) *(void **)&f = dlsym(h, "dnnl_sgemm");
        if (!f) return 5;
    }
    return f(ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
}

// ---- a clock that makes the tuner's run the same every time ------------------------------------

// With $CLMHA_FAULT_CLOCK set, the times libclmha reads are made up, so that clmha_context_tune()
// (whose searches run until a wall-clock deadline and keep the fastest candidate) makes the
// same calls in every run: its clock (clock_gettime) reads 1000 s plus one second per read, and
// every profiling time it reads (clGetEventProfilingInfo) is 1 ms further on than the one before
// less 1 µs per read so far, so that each command timed looks a little faster than the one before
// it (the later candidates win, and what they found is stored). Nobody else's clock changes.
static bool fake_clock(void *ret) {
    static int on = -1;
    if (on < 0) on = getenv("CLMHA_FAULT_CLOCK") != NULL;
    return on && from_clmha(ret);
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    REAL(int, clock_gettime, (clockid_t, struct timespec *));
    if (!fake_clock(__builtin_return_address(0))) return f(id, ts);
    static long reads;
    ts->tv_sec = 1000 + __atomic_add_fetch(&reads, 1, __ATOMIC_SEQ_CST);
    ts->tv_nsec = 0;
    return 0;
}

cl_int clGetEventProfilingInfo(cl_event e, cl_profiling_info what, size_t size, void *value,
                               size_t *size_ret) {
    REAL(cl_int, clGetEventProfilingInfo, (cl_event, cl_profiling_info, size_t, void *, size_t *));
    cl_int rc = f(e, what, size, value, size_ret);
    if (rc != CL_SUCCESS || !value || size < sizeof(cl_ulong) ||
        !fake_clock(__builtin_return_address(0)))
        return rc;
    static cl_ulong now, reads;
    cl_ulong n = __atomic_add_fetch(&reads, 1, __ATOMIC_SEQ_CST);
    cl_ulong step = n < 999 ? 1000000 - 1000 * n : 1000;
    *(cl_ulong *)value = __atomic_add_fetch(&now, step, __ATOMIC_SEQ_CST);
    return rc;
}
