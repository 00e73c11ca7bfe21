// Status codes, their strings, the mapping of OpenCL and CLBlast failures, and the detailed
// messages, kept per thread and per context (errors.h).
#include "errors/errors.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

// ---- messages -----------------------------------------------------------------------------------

// The calling thread's messages: one for calls without a context, and one per context for the
// last few contexts that failed in this thread (a context that fails after RECORDS others have
// failed since takes the place of the one whose message is oldest).
enum { RECORDS = 8 };

typedef struct record {
    uint64_t id;    // the owner's clmha__error_slot id; 0: free
    uint64_t when;  // the thread's count of recorded messages when this one was recorded
    char message[CLMHA__ERROR_SIZE];
} record;

static _Thread_local char create_error[CLMHA__ERROR_SIZE];
static _Thread_local record records[RECORDS];
static _Thread_local uint64_t recorded;

static _Atomic uint64_t next_id = 1;

void clmha__error_slot_init(clmha__error_slot *slot) { slot->id = atomic_fetch_add(&next_id, 1); }

static record *find(uint64_t id) {
    if (!id) return NULL;  // not a slot's id: the id of free records
    for (int i = 0; i < RECORDS; ++i)
        if (records[i].id == id) return &records[i];
    return NULL;
}

void clmha__error_slot_forget(const clmha__error_slot *slot) {
    record *r = find(slot->id);
    if (r) r->id = 0;
}

const char *clmha__error_last(const clmha__error_slot *slot) {
    static _Thread_local char copy[CLMHA__ERROR_SIZE];
    const record *r = find(slot->id);
    snprintf(copy, sizeof copy, "%s", r ? r->message : "");
    return copy;
}

const char *clmha_last_create_error(void) { return create_error; }

// Records @p message as the calling thread's for owner @p id.
static void keep(uint64_t id, const char *message) {
    record *r = find(id);
    if (!r) {  // a free record, else the oldest
        r = &records[0];
        for (int i = 1; i < RECORDS && r->id; ++i)
            if (!records[i].id || records[i].when < r->when) r = &records[i];
        r->id = id;
    }
    r->when = ++recorded;
    snprintf(r->message, sizeof r->message, "%s", message);
}

clmha_status clmha__fail(const clmha_context *ctx, clmha_status status, const char *fmt, ...) {
    char buf[CLMHA__ERROR_SIZE];  // formatted first: an argument may be this thread's message
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (!ctx) {
        memcpy(create_error, buf, sizeof buf);
        return status;
    }
    // The context starts with its slot (src/context/context.h).
    keep(((const clmha__error_slot *)(const void *)ctx)->id, buf);
    return status;
}

void clmha__error_restore(const clmha__error_slot *slot, const char *message) {
    if (message[0]) keep(slot->id, message);
    else clmha__error_slot_forget(slot);
}

// ---- status codes -------------------------------------------------------------------------------

const char *clmha_status_string(clmha_status status) {
    switch (status) {
#define CLMHA__STATUS_CASE(name, value, text) \
    case CLMHA_##name:                        \
        return "CLMHA_" #name ": " text;
        CLMHA_STATUS_MAP(CLMHA__STATUS_CASE)
#undef CLMHA__STATUS_CASE
    }
    return "unknown status";
}

const char *clmha_version(void) { return CLMHA_VERSION_STRING; }

const char *clmha__cl_error_name(cl_int err) {
    switch (err) {
#define E(x) \
    case x:  \
        return #x;
        E(CL_SUCCESS) E(CL_DEVICE_NOT_FOUND) E(CL_DEVICE_NOT_AVAILABLE)
        E(CL_COMPILER_NOT_AVAILABLE) E(CL_MEM_OBJECT_ALLOCATION_FAILURE) E(CL_OUT_OF_RESOURCES)
        E(CL_OUT_OF_HOST_MEMORY) E(CL_PROFILING_INFO_NOT_AVAILABLE) E(CL_MEM_COPY_OVERLAP)
        E(CL_BUILD_PROGRAM_FAILURE) E(CL_MAP_FAILURE) E(CL_MISALIGNED_SUB_BUFFER_OFFSET)
        E(CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST) E(CL_INVALID_VALUE)
        E(CL_INVALID_DEVICE_TYPE) E(CL_INVALID_PLATFORM) E(CL_INVALID_DEVICE)
        E(CL_INVALID_CONTEXT) E(CL_INVALID_QUEUE_PROPERTIES) E(CL_INVALID_COMMAND_QUEUE)
        E(CL_INVALID_HOST_PTR) E(CL_INVALID_MEM_OBJECT) E(CL_INVALID_BINARY)
        E(CL_INVALID_BUILD_OPTIONS) E(CL_INVALID_PROGRAM) E(CL_INVALID_PROGRAM_EXECUTABLE)
        E(CL_INVALID_KERNEL_NAME) E(CL_INVALID_KERNEL_DEFINITION) E(CL_INVALID_KERNEL)
        E(CL_INVALID_ARG_INDEX) E(CL_INVALID_ARG_VALUE) E(CL_INVALID_ARG_SIZE)
        E(CL_INVALID_KERNEL_ARGS) E(CL_INVALID_WORK_DIMENSION) E(CL_INVALID_WORK_GROUP_SIZE)
        E(CL_INVALID_WORK_ITEM_SIZE) E(CL_INVALID_GLOBAL_OFFSET) E(CL_INVALID_EVENT_WAIT_LIST)
        E(CL_INVALID_EVENT) E(CL_INVALID_OPERATION) E(CL_INVALID_BUFFER_SIZE)
        E(CL_INVALID_GLOBAL_WORK_SIZE) E(CL_INVALID_PROPERTY)
#undef E
    }
    return "unknown OpenCL error";
}

static clmha_status cl_status(cl_int err) {
    switch (err) {
    case CL_MEM_OBJECT_ALLOCATION_FAILURE:
    case CL_OUT_OF_HOST_MEMORY:
    case CL_OUT_OF_RESOURCES:
    case CL_INVALID_BUFFER_SIZE:
        return CLMHA_OUT_OF_MEMORY;
    case CL_BUILD_PROGRAM_FAILURE:
        return CLMHA_BUILD_FAILED;
    case CL_DEVICE_NOT_FOUND:
        return CLMHA_DEVICE_NOT_FOUND;
    default:
        return CLMHA_OPENCL_ERROR;
    }
}

clmha_status clmha__cl_fail(const clmha_context *ctx, cl_int err, const char *call) {
    clmha_status st = cl_status(err);
    return clmha__fail(ctx, st, "%s failed: %s (%d)", call, clmha__cl_error_name(err), (int)err);
}

clmha_status clmha__cl_fail_on(const clmha_context *ctx, cl_int err, const char *fn,
                               const char *what) {
    clmha_status st = cl_status(err);
    return clmha__fail(ctx, st, "%s(%s) failed: %s (%d)", fn, what, clmha__cl_error_name(err),
                       (int)err);
}

// CLBlast's own statuses (CLBlastStatusCode in clblast_c.h, CLBlast 1.5), by name and meaning.
static const struct {
    int code;
    const char *name, *text;
} blas_statuses[] = {
    {-1024, "CLBlastNotImplemented", "not implemented"},
    {-1022, "CLBlastInvalidMatrixA", "matrix A is not a valid buffer"},
    {-1021, "CLBlastInvalidMatrixB", "matrix B is not a valid buffer"},
    {-1020, "CLBlastInvalidMatrixC", "matrix C is not a valid buffer"},
    {-1019, "CLBlastInvalidVectorX", "vector X is not a valid buffer"},
    {-1018, "CLBlastInvalidVectorY", "vector Y is not a valid buffer"},
    {-1017, "CLBlastInvalidDimension", "invalid dimension"},
    {-1016, "CLBlastInvalidLeadDimA", "leading dimension of A too small"},
    {-1015, "CLBlastInvalidLeadDimB", "leading dimension of B too small"},
    {-1014, "CLBlastInvalidLeadDimC", "leading dimension of C too small"},
    {-1013, "CLBlastInvalidIncrementX", "increment of X is zero"},
    {-1012, "CLBlastInvalidIncrementY", "increment of Y is zero"},
    {-1011, "CLBlastInsufficientMemoryA", "buffer of A too small"},
    {-1010, "CLBlastInsufficientMemoryB", "buffer of B too small"},
    {-1009, "CLBlastInsufficientMemoryC", "buffer of C too small"},
    {-1008, "CLBlastInsufficientMemoryX", "buffer of X too small"},
    {-1007, "CLBlastInsufficientMemoryY", "buffer of Y too small"},
    {-2050, "CLBlastInsufficientMemoryTemp", "temporary buffer too small"},
    {-2049, "CLBlastInvalidBatchCount", "batch count not positive"},
    {-2048, "CLBlastInvalidOverrideKernel", "invalid kernel name to override"},
    {-2047, "CLBlastMissingOverrideParameter", "missing override parameter"},
    {-2046, "CLBlastInvalidLocalMemUsage", "not enough local memory"},
    {-2045, "CLBlastNoHalfPrecision", "no half precision on the device"},
    {-2044, "CLBlastNoDoublePrecision", "no double precision on the device"},
    {-2043, "CLBlastInvalidVectorScalar", "scalar is not a valid buffer"},
    {-2042, "CLBlastInsufficientMemoryScalar", "buffer of the scalar too small"},
    {-2041, "CLBlastDatabaseError", "no tuning database entry"},
    {-2040, "CLBlastUnknownError", "unknown error"},
    {-2039, "CLBlastUnexpectedError", "unexpected error"},
};

const char *clmha__blas_status_name(int err, const char **text) {
    for (size_t i = 0; i < sizeof blas_statuses / sizeof blas_statuses[0]; ++i)
        if (blas_statuses[i].code == err) {
            if (text) *text = blas_statuses[i].text;
            return blas_statuses[i].name;
        }
    if (text) *text = "not a CLBlast status";
    return "CLBlast status ?";
}

clmha_status clmha__blas_fail(const clmha_context *ctx, int err, const char *call) {
    // CLBlast's codes above -1000 are OpenCL codes.
    if (err > -1000) {
        clmha_status st = cl_status(err);
        return clmha__fail(ctx, st == CLMHA_OPENCL_ERROR ? CLMHA_BLAS_ERROR : st,
                           "%s failed: CLBlast status %d (%s)", call, err,
                           clmha__cl_error_name(err));
    }
    const char *text;
    const char *name = clmha__blas_status_name(err, &text);
    return clmha__fail(ctx, CLMHA_BLAS_ERROR, "%s failed: CLBlast status %d (%s: %s)", call, err,
                       name, text);
}
