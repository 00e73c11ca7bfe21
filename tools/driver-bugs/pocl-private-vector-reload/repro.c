// Standalone reproducer (no clmha): PoCL 3.1 (Debian 12) loses the lane updates made to a private
// array between a vector store to it and a vector load of it.
//
// Kernel `reload` (one vector of VW floats per work-item, work-groups of 1):
//
//     float a[VW];
//     vstoreVW(vloadVW(0, x + j), 0, a);                       // vector store
//     for (uint u = 0; u < n; ++u)                             // n: a kernel argument, = VW
//         a[u] += mask[j + u] ? -INFINITY : 0.0f;              // lane updates
//     vstoreVW(vloadVW(0, a), 0, x + j);                       // vector reload, written back
//
// Every x[i] whose mask byte is set must become -inf. On PoCL 3.1 with VW 2 the reloaded vector
// is the one stored before the loop (x comes back unchanged), with VW 4 its first two lanes are;
// VW 8 and 16 are right. The other cases change one thing each: a constant -inf instead of the
// mask (still wrong), the trip count VW instead of n (right), a[u] = value without reading the
// old lane (right), and the lanes written to a second array b[u] = a[u] + value and b reloaded
// (right: the workaround). Intel's CPU runtime and the PoCL 3.0 from PyPI are right everywhere.
//
// Build: cc -std=c11 -O2 tools/driver-bugs/pocl-private-vector-reload/repro.c -o /tmp/repro -lOpenCL
// Run:   /tmp/repro              (first platform, first device)
// Prints ok or WRONG per case; exit status 0 when all are right, 1 when any is wrong, 2 on an
// OpenCL error.
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include <math.h>
#include <stdio.h>

static const char *source =
    "#define CAT_(a, b) a##b\n"
    "#define CAT(a, b) CAT_(a, b)\n"
    "#define VLOAD CAT(vload, VW)\n"
    "#define VSTORE CAT(vstore, VW)\n"
    "#if CONST_VALUE\n"
    "#define VALUE(m) (-INFINITY)\n"
    "#else\n"
    "#define VALUE(m) ((m) ? -INFINITY : 0.0f)\n"
    "#endif\n"
    "#if CONST_TRIP\n"
    "#define TRIP VW\n"
    "#else\n"
    "#define TRIP n\n"
    "#endif\n"
    "kernel void reload(global float *x, global const uchar *mask, uint n) {\n"
    "    size_t j = get_global_id(0) * VW;\n"
    "    float a[VW];\n"
    "    VSTORE(VLOAD(0, x + j), 0, a);\n"
    "#if SECOND_ARRAY\n"
    "    float b[VW];\n"
    "    for (uint u = 0; u < TRIP; ++u) b[u] = a[u] + VALUE(mask[j + u]);\n"
    "    VSTORE(VLOAD(0, b), 0, x + j);\n"
    "#else\n"
    "#if ASSIGN\n"
    "    for (uint u = 0; u < TRIP; ++u) a[u] = VALUE(mask[j + u]);\n"
    "#else\n"
    "    for (uint u = 0; u < TRIP; ++u) a[u] += VALUE(mask[j + u]);\n"
    "#endif\n"
    "    VSTORE(VLOAD(0, a), 0, x + j);\n"
    "#endif\n"
    "}\n";

typedef struct variant {
    const char *name;
    int vw, const_value, const_trip, assign, second_array;
} variant;

static const variant cases[] = {
    {"VW  2, a[u] += mask, trip count n ", 2, 0, 0, 0, 0},
    {"VW  4, a[u] += mask, trip count n ", 4, 0, 0, 0, 0},
    {"VW  8, a[u] += mask, trip count n ", 8, 0, 0, 0, 0},
    {"VW 16, a[u] += mask, trip count n ", 16, 0, 0, 0, 0},
    {"VW  2, a[u] += -inf, trip count n ", 2, 1, 0, 0, 0},
    {"VW  4, a[u] += -inf, trip count n ", 4, 1, 0, 0, 0},
    {"VW  2, a[u] += mask, trip count VW", 2, 0, 1, 0, 0},
    {"VW  2, a[u] = mask,  trip count n ", 2, 0, 0, 1, 0},
    {"VW  2, b[u] = a[u] + mask, b (n)  ", 2, 0, 0, 0, 1},
    {"VW  4, b[u] = a[u] + mask, b (n)  ", 4, 0, 0, 0, 1},
};

#define N 64  // floats, a multiple of every VW

int main(void) {
    cl_platform_id platform;
    cl_device_id device;
    cl_int err;
    if (clGetPlatformIDs(1, &platform, NULL) != CL_SUCCESS ||
        clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &device, NULL) != CL_SUCCESS)
        return 2;
    char pname[256] = "", dname[256] = "", dver[256] = "";
    clGetPlatformInfo(platform, CL_PLATFORM_NAME, sizeof pname, pname, NULL);
    clGetDeviceInfo(device, CL_DEVICE_NAME, sizeof dname, dname, NULL);
    clGetDeviceInfo(device, CL_DRIVER_VERSION, sizeof dver, dver, NULL);
    printf("device: %s / %s, driver %s\n", pname, dname, dver);
    cl_context ctx = clCreateContext(NULL, 1, &device, NULL, NULL, &err);
    if (!ctx) return 2;
    cl_command_queue q = clCreateCommandQueue(ctx, device, 0, &err);
    if (!q) return 2;

    float x[N], out[N];
    unsigned char mask[N];
    for (int i = 0; i < N; ++i) {
        x[i] = (float)i;
        mask[i] = i % 3 == 0;
    }
    int all_right = 1;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
        const variant *v = &cases[c];
        char options[128];
        snprintf(options, sizeof options,
                 "-DVW=%d -DCONST_VALUE=%d -DCONST_TRIP=%d -DASSIGN=%d -DSECOND_ARRAY=%d", v->vw,
                 v->const_value, v->const_trip, v->assign, v->second_array);
        cl_program prog = clCreateProgramWithSource(ctx, 1, &source, NULL, &err);
        if (!prog || clBuildProgram(prog, 1, &device, options, NULL, NULL) != CL_SUCCESS) {
            char log[4096] = "";
            if (prog)
                clGetProgramBuildInfo(prog, device, CL_PROGRAM_BUILD_LOG, sizeof log, log, NULL);
            printf("%s: build failed\n%s\n", v->name, log);
            return 2;
        }
        cl_kernel k = clCreateKernel(prog, "reload", &err);
        cl_mem bx = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof x, x,
                                   &err);
        cl_mem bm = clCreateBuffer(ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, sizeof mask,
                                   mask, &err);
        cl_uint n = (cl_uint)v->vw;
        size_t global = N / v->vw, local = 1;
        if (!k || !bx || !bm || clSetKernelArg(k, 0, sizeof bx, &bx) != CL_SUCCESS ||
            clSetKernelArg(k, 1, sizeof bm, &bm) != CL_SUCCESS ||
            clSetKernelArg(k, 2, sizeof n, &n) != CL_SUCCESS ||
            clEnqueueNDRangeKernel(q, k, 1, NULL, &global, &local, 0, NULL, NULL) != CL_SUCCESS ||
            clEnqueueReadBuffer(q, bx, CL_TRUE, 0, sizeof out, out, 0, NULL, NULL) != CL_SUCCESS)
            return 2;
        // lost: the lane should be -inf and still holds its value from before the loop
        int wrong = 0, lost = 0;
        for (int i = 0; i < N; ++i) {
            float want = v->const_value || mask[i] ? -INFINITY : v->assign ? 0.0f : x[i];
            if (out[i] != want) {
                ++wrong;
                lost += isinf(want) && out[i] == x[i];
            }
        }
        printf("%s: %2d of %d wrong (%2d updates lost), x[0..7]:", v->name, wrong, N, lost);
        for (int i = 0; i < 8; ++i) printf(" %g", out[i]);
        printf("  %s\n", wrong ? "WRONG" : "ok");
        all_right &= !wrong;
        clReleaseMemObject(bx);
        clReleaseMemObject(bm);
        clReleaseKernel(k);
        clReleaseProgram(prog);
    }
    puts(all_right ? "all results right"
                   : "WRONG RESULTS: lane updates between vstoreN and vloadN were lost");
    return all_right ? 0 : 1;
}
