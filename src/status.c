// Status codes, their strings and the mapping of OpenCL and CLBlast failures.
#include "internal.h"

#include <stdio.h>

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

clmha_status clmha__blas_fail(const clmha_context *ctx, int err, const char *call) {
    // CLBlast's codes above -1000 are OpenCL codes.
    if (err > -1000) {
        clmha_status st = cl_status(err);
        return clmha__fail(ctx, st == CLMHA_OPENCL_ERROR ? CLMHA_BLAS_ERROR : st,
                           "%s failed: CLBlast status %d (%s)", call, err,
                           clmha__cl_error_name(err));
    }
    const char *what = err == -2050 ? "temporary buffer too small"
                     : err == -2046 ? "not enough local memory"
                     : err == -2041 ? "no tuning database entry"
                     : err <= -1007 && err >= -1011 ? "buffer too small"
                     : err == -1017 ? "invalid dimension"
                                    : "see clblast_c.h";
    return clmha__fail(ctx, CLMHA_BLAS_ERROR, "%s failed: CLBlast status %d (%s)", call, err,
                       what);
}
