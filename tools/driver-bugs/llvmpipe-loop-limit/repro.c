// Standalone reproducer (no clmha): Mesa's llvmpipe (gallivm) ends every loop of a kernel early
// once one work-item has run about 65535 loop iterations in total, over all its loops together.
// The kernel below, on one work-item, first sums n ones in a loop, then writes 16 values in a
// second, short loop. A correct driver prints sum = n and tail = 16 of 16 for every n; Mesa
// 22.3.6 (rusticl and clover on llvmpipe) prints a sum capped near 65535 for large n, and from
// then on the short loop runs once: tail 1 of 16. Nested loops count their inner iterations
// too: the second kernel runs `outer` times an inner loop of 64 iterations, each sum must be
// outer * 64.
//
// Build: cc -std=c11 -O2 repro.c -o repro -lOpenCL
// Run:   ./repro                       (first platform, first device)
//        OCL_ICD_VENDORS=<folder with the Mesa .icd> RUSTICL_ENABLE=llvmpipe ./repro
// Exit status: 0 when every result is right, 1 when any is wrong, 2 on an OpenCL error.
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

static const char *source =
    "kernel void flat(global const uint *ones, uint n, global uint *out) {\n"
    "    uint sum = 0;\n"
    "    for (uint i = 0; i < n; ++i) sum += ones[i];\n"
    "    out[0] = sum;\n"
    "    for (uint d = 0; d < 16; ++d) out[1 + d] = d + 1;\n"
    "}\n"
    "kernel void nested(global const uint *ones, uint outer, global uint *out) {\n"
    "    uint sum = 0;\n"
    "    for (uint o = 0; o < outer; ++o)\n"
    "        for (uint i = 0; i < 64; ++i) sum += ones[(o * 64 + i) & 1023];\n"
    "    out[0] = sum;\n"
    "    for (uint d = 0; d < 16; ++d) out[1 + d] = d + 1;\n"
    "}\n";

#define CHECK(call)                                                              \
    do {                                                                         \
        cl_int err_ = (call);                                                    \
        if (err_ != CL_SUCCESS) {                                                \
            fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #call, \
                    (int)err_);                                                  \
            exit(2);                                                             \
        }                                                                        \
    } while (0)

int main(void) {
    cl_platform_id platform;
    cl_device_id device;
    cl_int err;
    CHECK(clGetPlatformIDs(1, &platform, NULL));
    CHECK(clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &device, NULL));
    char pname[256] = "", dname[256] = "", dver[256] = "";
    clGetPlatformInfo(platform, CL_PLATFORM_NAME, sizeof pname, pname, NULL);
    clGetDeviceInfo(device, CL_DEVICE_NAME, sizeof dname, dname, NULL);
    clGetDeviceInfo(device, CL_DRIVER_VERSION, sizeof dver, dver, NULL);
    printf("device: %s / %s, driver %s\n", pname, dname, dver);

    cl_context ctx = clCreateContext(NULL, 1, &device, NULL, NULL, &err);
    CHECK(err);
    cl_command_queue queue = clCreateCommandQueue(ctx, device, 0, &err);
    CHECK(err);
    cl_program prog = clCreateProgramWithSource(ctx, 1, &source, NULL, &err);
    CHECK(err);
    CHECK(clBuildProgram(prog, 1, &device, "", NULL, NULL));

    enum { MAX_N = 200000 };
    cl_uint *ones = malloc(MAX_N * sizeof *ones);
    if (!ones) return 2;
    for (int i = 0; i < MAX_N; ++i) ones[i] = 1;
    cl_mem in = clCreateBuffer(ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, MAX_N * sizeof *ones,
                               ones, &err);
    CHECK(err);
    cl_mem out = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 17 * sizeof(cl_uint), NULL, &err);
    CHECK(err);

    int wrong = 0;
    const char *names[2] = {"flat", "nested"};
    const cl_uint counts[2][5] = {{1000, 65000, 65535, 65536, 200000},
                                  {100, 1000, 1023, 1024, 3000}};
    for (int kind = 0; kind < 2; ++kind) {
        cl_kernel k = clCreateKernel(prog, names[kind], &err);
        CHECK(err);
        for (int c = 0; c < 5; ++c) {
            cl_uint n = counts[kind][c], result[17], zero = 0;
            CHECK(clEnqueueFillBuffer(queue, out, &zero, sizeof zero, 0, sizeof result, 0, NULL,
                                      NULL));
            CHECK(clSetKernelArg(k, 0, sizeof in, &in));
            CHECK(clSetKernelArg(k, 1, sizeof n, &n));
            CHECK(clSetKernelArg(k, 2, sizeof out, &out));
            size_t one = 1;
            CHECK(clEnqueueNDRangeKernel(queue, k, 1, NULL, &one, &one, 0, NULL, NULL));
            CHECK(clEnqueueReadBuffer(queue, out, CL_TRUE, 0, sizeof result, result, 0, NULL,
                                      NULL));
            cl_uint want = kind ? n * 64 : n;
            int tail = 0;
            for (int d = 0; d < 16; ++d) tail += result[1 + d] == (cl_uint)d + 1;
            bool ok = result[0] == want && tail == 16;
            wrong += !ok;
            printf("%-6s %s = %6u: sum %6u (want %6u), tail %2d of 16 written  %s\n", names[kind],
                   kind ? "outer" : "n    ", n, result[0], want, tail, ok ? "ok" : "WRONG");
        }
        clReleaseKernel(k);
    }
    printf("%s\n", wrong ? "WRONG RESULTS: this driver ends loops early" : "all results right");
    clReleaseMemObject(in);
    clReleaseMemObject(out);
    clReleaseProgram(prog);
    clReleaseCommandQueue(queue);
    clReleaseContext(ctx);
    free(ones);
    return wrong ? 1 : 0;
}
