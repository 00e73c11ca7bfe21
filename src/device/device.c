// Device enumeration and selection by spec string.
#include "device/device.h"

#include "base/message.h"
#include "base/struct_in.h"
#include "errors/errors.h"

#include <ctype.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PLATFORMS 32
#define MAX_DEVICES 64
// Returned by the ICD loader when no platform is installed (cl_khr_icd).
#ifndef CL_PLATFORM_NOT_FOUND_KHR
#define CL_PLATFORM_NOT_FOUND_KHR -1001
#endif

static const char *no_device_hint =
    "no OpenCL device found: install an OpenCL driver (on Debian/Ubuntu for the CPU: "
    "apt-get install pocl-opencl-icd ocl-icd-libopencl1) and check it with `clinfo -l`";

void clmha__device_describe(cl_platform_id platform, cl_device_id device,
                            unsigned platform_index, unsigned device_index,
                            clmha_device_info *info) {
    memset(info, 0, sizeof *info);
    info->struct_size = sizeof *info;
    info->platform_index = platform_index;
    info->device_index = device_index;
    info->platform = platform;
    info->device = device;
    clGetPlatformInfo(platform, CL_PLATFORM_NAME, sizeof info->platform_name - 1,
                      info->platform_name, NULL);
    clGetDeviceInfo(device, CL_DEVICE_NAME, sizeof info->device_name - 1, info->device_name,
                    NULL);
    clGetDeviceInfo(device, CL_DRIVER_VERSION, sizeof info->driver_version - 1,
                    info->driver_version, NULL);
    clGetDeviceInfo(device, CL_DEVICE_TYPE, sizeof info->type, &info->type, NULL);
    clGetDeviceInfo(device, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof info->compute_units,
                    &info->compute_units, NULL);
    clGetDeviceInfo(device, CL_DEVICE_GLOBAL_MEM_SIZE, sizeof info->global_mem_bytes,
                    &info->global_mem_bytes, NULL);
    clGetDeviceInfo(device, CL_DEVICE_LOCAL_MEM_SIZE, sizeof info->local_mem_bytes,
                    &info->local_mem_bytes, NULL);
    clGetDeviceInfo(device, CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof info->max_alloc_bytes,
                    &info->max_alloc_bytes, NULL);
    size_t ext_size = 0;
    if (clGetDeviceInfo(device, CL_DEVICE_EXTENSIONS, 0, NULL, &ext_size) == CL_SUCCESS &&
        ext_size > 0) {
        char *ext = malloc(ext_size + 1);
        if (ext && clGetDeviceInfo(device, CL_DEVICE_EXTENSIONS, ext_size, ext, NULL) ==
                       CL_SUCCESS) {
            ext[ext_size] = 0;
            info->fp16 = strstr(ext, "cl_khr_fp16") != NULL;
            info->fp64 = strstr(ext, "cl_khr_fp64") != NULL;
        }
        free(ext);
    }
    cl_device_fp_config fp64 = 0;
    if (clGetDeviceInfo(device, CL_DEVICE_DOUBLE_FP_CONFIG, sizeof fp64, &fp64, NULL) ==
            CL_SUCCESS &&
        fp64)
        info->fp64 = true;
    snprintf(info->spec, sizeof info->spec, "%u:%u", platform_index, device_index);
}

// Counts every device of every platform into *count and describes devices first to
// first + capacity - 1 into @p infos.
static clmha_status devices_list_unlocked(clmha_device_info *infos, size_t first,
                                          size_t capacity, size_t *count) {
    *count = 0;
    cl_platform_id platforms[MAX_PLATFORMS];
    cl_uint np = 0;
    cl_int err = clGetPlatformIDs(MAX_PLATFORMS, platforms, &np);
    if (err == CL_PLATFORM_NOT_FOUND_KHR || np == 0) return CLMHA_SUCCESS;
    if (err != CL_SUCCESS) return CLMHA_OPENCL_ERROR;
    if (np > MAX_PLATFORMS) np = MAX_PLATFORMS;
    for (cl_uint p = 0; p < np; ++p) {
        cl_device_id devices[MAX_DEVICES];
        cl_uint nd = 0;
        if (clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, MAX_DEVICES, devices, &nd) !=
            CL_SUCCESS)
            continue;  // a platform without devices
        if (nd > MAX_DEVICES) nd = MAX_DEVICES;
        for (cl_uint d = 0; d < nd; ++d) {
            if (*count >= first && *count - first < capacity)
                clmha__device_describe(platforms[p], devices[d], p, d, &infos[*count - first]);
            ++*count;
        }
    }
    return CLMHA_SUCCESS;
}

// devices_list_unlocked() one thread at a time, process-wide. A driver initialises its platform
// and devices on the process's first clGetPlatformIDs, and PoCL 3.1 does not make other threads'
// calls wait for that: a thread calling clGetPlatformIDs meanwhile finds no platform, one
// querying a device meanwhile crashes (clGetDeviceInfo, SEGV in 1 of 2 processes whose threads
// created their first contexts at once: tests/device/test_concurrency.c, first_calls_*).
static clmha_status devices_list(clmha_device_info *infos, size_t first, size_t capacity,
                                 size_t *count) {
    static pthread_mutex_t enumeration = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&enumeration);
    clmha_status st = devices_list_unlocked(infos, first, capacity, count);
    pthread_mutex_unlock(&enumeration);
    return st;
}

clmha_status clmha_device_count(size_t *count) {
    if (!count) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "count is NULL");
    clmha_status st = devices_list(NULL, 0, 0, count);
    return st ? clmha__fail(NULL, st, "clGetPlatformIDs failed") : CLMHA_SUCCESS;
}

clmha_status clmha_device_describe(size_t index, clmha_device_info *info) {
    char msg[256];
    clmha_status st = CLMHA__STRUCT_OUT_CHECK(clmha_device_info, info, "info", msg, sizeof msg);
    if (st) return clmha__fail(NULL, st, "%s", msg);
    clmha_device_info found;  // this library's layout; the caller gets struct_size bytes of it
    size_t count = 0;
    if ((st = devices_list(&found, index, 1, &count)))
        return clmha__fail(NULL, st, "clGetPlatformIDs failed");
    if (index >= count)
        return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT,
                           "index %zu: there are %zu devices (clmha_device_count())", index, count);
    clmha__struct_out(info, &found, sizeof found);
    return CLMHA_SUCCESS;
}

// Case-insensitive substring test.
static bool contains_nocase(const char *hay, const char *needle) {
    size_t n = strlen(needle);
    for (; *hay; ++hay) {
        size_t i = 0;
        while (i < n && hay[i] &&
               tolower((unsigned char)hay[i]) == tolower((unsigned char)needle[i]))
            ++i;
        if (i == n) return true;
    }
    return n == 0;
}

static bool equals_nocase(const char *a, const char *b) {
    while (*a && *b && tolower((unsigned char)*a) == tolower((unsigned char)*b)) ++a, ++b;
    return *a == 0 && *b == 0;
}

// Whether @p spec is meant as "P:D": a colon, and only digits, signs or spaces before it (no
// device or platform name looks like that, while "-1:0" or " 0:0" are index pairs mistyped).
static bool looks_like_index_pair(const char *spec) {
    const char *colon = strchr(spec, ':');
    if (!colon) return false;
    for (const char *p = spec; p < colon; ++p)
        if (!isdigit((unsigned char)*p) && *p != '-' && *p != '+' && !isspace((unsigned char)*p))
            return false;
    return true;
}

// Reads one index of "P:D" from @p s up to @p end: decimal digits only (no sign, no space),
// at most UINT_MAX. On failure writes why to @p why.
static bool parse_index(const char *s, const char *end, const char *what, unsigned *out,
                        char *why, size_t why_size) {
    if (s == end) {
        snprintf(why, why_size, "its %s index is empty", what);
        return false;
    }
    unsigned long long v = 0;
    bool big = false;
    for (const char *p = s; p < end; ++p) {
        if (*p < '0' || *p > '9') {
            snprintf(why, why_size, "its %s index is not a decimal number (\"%.*s\")", what,
                     (int)(end - s > 32 ? 32 : end - s), s);
            return false;
        }
        if (v > UINT_MAX) big = true;  // keep scanning for stray characters
        else v = v * 10 + (unsigned)(*p - '0');
    }
    if (big || v > UINT_MAX) {
        snprintf(why, why_size, "its %s index %.*s is larger than %u", what,
                 (int)(end - s > 32 ? 32 : end - s), s, UINT_MAX);
        return false;
    }
    *out = (unsigned)v;
    return true;
}

clmha_status clmha_device_select(const char *spec, clmha_device_info *out, char *message,
                                 size_t message_size) {
    clmha_status st = CLMHA__STRUCT_OUT_CHECK(clmha_device_info, out, "out", message,
                                              message_size);
    if (st) return st;
    // An index pair is checked before any device is looked at: a malformed one is an error
    // of the caller's, whatever the devices.
    bool by_index = spec && looks_like_index_pair(spec);
    unsigned pi = 0, di = 0;
    if (by_index) {
        const char *colon = strchr(spec, ':');
        char why[128];
        if (!parse_index(spec, colon, "platform", &pi, why, sizeof why) ||
            !parse_index(colon + 1, colon + 1 + strlen(colon + 1), "device", &di, why,
                         sizeof why))
            return clmha__msg(message, message_size, CLMHA_INVALID_ARGUMENT,
                              "device spec \"%.64s\": %s; expected \"P:D\", a platform and a "
                              "device index as decimal numbers (see clmha devices)",
                              spec, why);
    }
    size_t count = 0;
    st = devices_list(NULL, 0, 0, &count);
    if (st) return clmha__msg(message, message_size, st, "clGetPlatformIDs failed");
    if (count == 0) return clmha__msg(message, message_size, CLMHA_DEVICE_NOT_FOUND, "%s",
                                      no_device_hint);
    clmha_device_info *all = calloc(count, sizeof *all);
    if (!all) return clmha__msg(message, message_size, CLMHA_OUT_OF_MEMORY, "out of memory");
    size_t got = 0;
    devices_list(all, 0, count, &got);
    if (got < count) count = got;

    long pick = -1;
    if (!spec || !*spec) {
        for (size_t i = 0; i < count && pick < 0; ++i)
            if (all[i].type & CL_DEVICE_TYPE_GPU) pick = (long)i;
        if (pick < 0 && count > 0) pick = 0;
    } else if (by_index) {
        for (size_t i = 0; i < count && pick < 0; ++i)
            if (all[i].platform_index == pi && all[i].device_index == di) pick = (long)i;
    } else if (equals_nocase(spec, "gpu") || equals_nocase(spec, "cpu") ||
               equals_nocase(spec, "accelerator")) {
        cl_device_type want = equals_nocase(spec, "gpu")   ? CL_DEVICE_TYPE_GPU
                              : equals_nocase(spec, "cpu") ? CL_DEVICE_TYPE_CPU
                                                           : CL_DEVICE_TYPE_ACCELERATOR;
        for (size_t i = 0; i < count && pick < 0; ++i)
            if (all[i].type & want) pick = (long)i;
    } else {
        for (size_t i = 0; i < count && pick < 0; ++i)
            if (contains_nocase(all[i].platform_name, spec) ||
                contains_nocase(all[i].device_name, spec))
                pick = (long)i;
    }
    if (pick < 0) {
        int used = snprintf(message, message ? message_size : 0,
                            "no OpenCL device matches \"%s\"; devices:", spec ? spec : "");
        for (size_t i = 0; i < count && message && used >= 0 && (size_t)used < message_size;
             ++i)
            used += snprintf(message + used, message_size - (size_t)used, "%s [%s] %s / %s",
                             i ? "," : "", all[i].spec, all[i].platform_name,
                             all[i].device_name);
        free(all);
        return CLMHA_DEVICE_NOT_FOUND;
    }
    clmha__struct_out(out, &all[pick], sizeof all[pick]);  // no byte past out->struct_size
    free(all);
    return CLMHA_SUCCESS;
}

clmha__quirks clmha__device_quirks(const clmha_device_info *info) {
    clmha__quirks q = {0};
    // Mesa's llvmpipe, under rusticl or clover: gallivm shares one limiter of 65535 iterations
    // between every loop of a shader invocation (LP_MAX_TGSI_LOOP_ITERATIONS), seen on 22.3.6.
    if (strncmp(info->device_name, "llvmpipe", 8) == 0) q.loop_limit = 65535;
    if (strcmp(info->platform_name, "Clover") == 0) q.no_vload = true;
    // PoCL (seen on 3.1): native kernels get their buffers sorted by object id and a
    // sub-buffer's parent. The host GEMMs avoid it on every driver (context/gemm.c); this
    // is what clmha_device_note() says, with the lost lane updates of a private array between
    // vstoreN and vloadN (float2/float4) that fused_backward_block avoids on every driver
    // (tools/driver-bugs/pocl-private-vector-reload/).
    if (strcmp(info->platform_name, "Portable Computing Language") == 0 &&
        (info->type & CL_DEVICE_TYPE_CPU))
        q.native_buffers = true;
    return q;
}

const char *clmha_device_note(const clmha_device_info *info) {
    clmha_device_info in;  // the caller's info in this library's layout (docs/abi.md)
    if (CLMHA__STRUCT_IN(clmha_device_info, &in, info, "info", NULL, 0)) return "";
    clmha__quirks q = clmha__device_quirks(&in);
    if (q.loop_limit && q.no_vload)
        return "driver bugs: loops end after 65535 iterations (fused core only on short key "
               "ranges, else unfused), vloadN aborts (fused core without vectors)";
    if (q.loop_limit)
        return "driver bug: loops end after 65535 iterations (fused core only on short key "
               "ranges, else unfused)";
    if (q.no_vload) return "driver bug: vloadN aborts (fused core without vectors)";
    if (q.native_buffers)
        return "driver bugs: native kernels get several buffers in the wrong places and a "
               "sub-buffer's parent (the host-BLAS GEMMs take each buffer's memory alone); "
               "lane updates of a private array between vstoreN and vloadN are lost (the "
               "fused backward's block kernel never updates a stored vector's lanes)";
    return "";
}
