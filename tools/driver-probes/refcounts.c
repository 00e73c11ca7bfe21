// What a driver's CL_CONTEXT_REFERENCE_COUNT reports as objects come and go: a standalone
// program, no clmha, built as build/tests/probe_refcounts (or: cc -std=c11 -o refcounts
// tools/driver-probes/refcounts.c -lOpenCL). Run it under each lane:
//   tools/ocl-driver.sh rusticl -- build/tests/probe_refcounts
// Measured (tools/ocl-driver.sh lanes, December 2026):
//   pocl, clover:  created 1, retained 2, +buffer 3, +queue 4, 1 right after the releases
//   rusticl 22.3:  the same, but 4 right after the releases, 1 from 250 ms on: the buffer's and
//                  the queue's references are dropped late by the queue's worker thread
//   intel 2026.2:  created 1, retained 2, +buffer 2, +queue 2: objects do not hold their context
// tests/support/support.c (refs_move, context_refs_show_objects) decides from the same observations
// which counts a test may compare.
#define CL_TARGET_OPENCL_VERSION 120
#define _POSIX_C_SOURCE 200809L
#include <CL/cl.h>
#include <stdio.h>
#include <time.h>

static cl_uint refs(cl_context c) {
    cl_uint n = 0;
    clGetContextInfo(c, CL_CONTEXT_REFERENCE_COUNT, sizeof n, &n, NULL);
    return n;
}

int main(void) {
    cl_platform_id platform;
    cl_device_id device;
    cl_int err;
    if (clGetPlatformIDs(1, &platform, NULL) != CL_SUCCESS ||
        clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &device, NULL) != CL_SUCCESS) {
        fprintf(stderr, "no OpenCL device\n");
        return 77;
    }
    cl_context c = clCreateContext(NULL, 1, &device, NULL, NULL, &err);
    if (err != CL_SUCCESS) return 1;
    printf("created:            %u\n", refs(c));
    clRetainContext(c);
    printf("retained:           %u\n", refs(c));
    cl_mem m = clCreateBuffer(c, CL_MEM_READ_WRITE, 4096, NULL, &err);
    printf("with a buffer:      %u\n", refs(c));
    cl_command_queue q = clCreateCommandQueue(c, device, 0, &err);
    printf("with a queue:       %u\n", refs(c));
    float x = 1.0f;
    clEnqueueFillBuffer(q, m, &x, sizeof x, 0, 4096, 0, NULL, NULL);
    clFinish(q);
    clReleaseMemObject(m);
    clReleaseCommandQueue(q);
    clReleaseContext(c);
    // The count right after the releases and while it settles.
    for (int ms = 0; ms <= 1000; ms += 250) {
        printf("released, %4d ms:  %u\n", ms, refs(c));
        struct timespec ts = {0, 250 * 1000000L};
        nanosleep(&ts, NULL);
    }
    clReleaseContext(c);
    return 0;
}
