// Standalone reproducer (no clmha): Mesa's clover (OpenCL 1.1 on llvmpipe, Mesa 22.3.6 with
// LLVM 15) aborts the whole host process inside clBuildProgram when a kernel calls vloadN or
// vstoreN, in any address space ("Assertion `NumContainedTys && "Attempting to get element type
// of opaque pointer"' failed" in LLVM's Type.h). Vector types alone are fine. This program builds
// one kernel per case in a child process, so that it can report the abort instead of dying.
//
// Build: cc -std=c11 -O2 repro.c -o repro -lOpenCL
// Run:   ./repro                       (first platform, first device)
//        OCL_ICD_VENDORS=<folder with clover's .icd> LP_CL=1 ./repro
// Exit status: 0 when every kernel builds, 1 when a build killed its process.
#define _POSIX_C_SOURCE 200809L
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include <stdbool.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *const cases[][2] = {
    {"float2 built from scalars",
     "kernel void f(global float *p) { float2 v = (float2)(p[0], p[1]); p[0] = v.x * v.y; }"},
    {"vload2/vstore2 on global memory",
     "kernel void f(global float *p) { float2 v = vload2(0, p); vstore2(v * 2.0f, 0, p); }"},
    {"vload2 on a private array",
     "kernel void f(global float *p) { float a[4]; for (int i = 0; i < 4; ++i) a[i] = p[i];\n"
     "  float2 v = vload2(0, a + 2); p[0] = v.x; }"},
    {"vstore2 on a private array",
     "kernel void f(global float *p) { float a[4]; for (int i = 0; i < 4; ++i) a[i] = p[i];\n"
     "  vstore2((float2)(a[1], a[2]), 0, a); p[0] = a[0] + a[3]; }"},
};

// Builds @p source on the first device; returns the clBuildProgram status.
static cl_int build(const char *source) {
    cl_platform_id platform;
    cl_device_id device;
    cl_int err = clGetPlatformIDs(1, &platform, NULL);
    if (err == CL_SUCCESS) err = clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &device, NULL);
    if (err != CL_SUCCESS) return err;
    cl_context ctx = clCreateContext(NULL, 1, &device, NULL, NULL, &err);
    if (err != CL_SUCCESS) return err;
    cl_program prog = clCreateProgramWithSource(ctx, 1, &source, NULL, &err);
    if (err == CL_SUCCESS) err = clBuildProgram(prog, 1, &device, "", NULL, NULL);
    return err;
}

int main(void) {
    cl_platform_id platform;
    char name[256] = "";
    if (clGetPlatformIDs(1, &platform, NULL) == CL_SUCCESS)
        clGetPlatformInfo(platform, CL_PLATFORM_NAME, sizeof name, name, NULL);
    printf("platform: %s\n", name);
    fflush(stdout);
    int aborted = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        pid_t pid = fork();
        if (pid == 0) {
            // The child's stderr would carry LLVM's assertion text: keep the report short.
            freopen("/dev/null", "w", stderr);
            _exit(build(cases[i][1]) == CL_SUCCESS ? 0 : 3);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        bool killed = WIFSIGNALED(status);
        aborted += killed;
        printf("%-34s %s\n", cases[i][0],
               killed ? "ABORTED the process"
               : WEXITSTATUS(status) == 0 ? "builds"
                                          : "build failed (an error, not an abort)");
    }
    printf("%s\n", aborted ? "this driver kills its host process on vloadN/vstoreN"
                           : "every kernel builds");
    return aborted ? 1 : 0;
}
