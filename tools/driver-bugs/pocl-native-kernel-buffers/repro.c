// Standalone reproducer (no clmha): PoCL 3.1 hands a native kernel (clEnqueueNativeKernel) the
// wrong buffer memory when it lists more than one buffer, and the wrong address for a
// sub-buffer.
//
// Test 1: two buffers A (created first) and B, each starting with its own mark, listed as
// {B, A} with args_mem_loc at places 0 and 1. The native function reads the first int at each
// place: a correct driver gives B's mark at place 0 and A's at place 1. PoCL sorts the list by
// its internal object ids (creation order) before it fills the places, so the two come swapped.
// Test 2: a sub-buffer at origin 128 bytes of a buffer holding 0, 1, 2, ...: a correct driver
// passes the sub-buffer's memory, whose first int is 32. PoCL passes the parent's (first int 0).
//
// Build: cc -std=c11 -O2 repro.c -o repro -lOpenCL
// Run:   ./repro                (first platform, first device; it must run native kernels)
// Exit status: 0 when both are right, 1 when either is wrong, 2 on an OpenCL error.
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include <stdio.h>

typedef struct two {
    void *mem[2];
    int *seen;  // host memory: the first int at each place
} two;

static void CL_CALLBACK read_two(void *p) {
    const two *t = p;
    t->seen[0] = *(const int *)t->mem[0];
    t->seen[1] = *(const int *)t->mem[1];
}

typedef struct one {
    void *mem;
    int *seen;
} one;

static void CL_CALLBACK read_one(void *p) {
    const one *o = p;
    o->seen[0] = *(const int *)o->mem;
}

int main(void) {
    cl_platform_id platform;
    cl_device_id device;
    cl_int err;
    if (clGetPlatformIDs(1, &platform, NULL) != CL_SUCCESS ||
        clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &device, NULL) != CL_SUCCESS)
        return 2;
    cl_device_exec_capabilities caps = 0;
    clGetDeviceInfo(device, CL_DEVICE_EXECUTION_CAPABILITIES, sizeof caps, &caps, NULL);
    if (!(caps & CL_EXEC_NATIVE_KERNEL)) {
        puts("the device runs no native kernels");
        return 2;
    }
    cl_context ctx = clCreateContext(NULL, 1, &device, NULL, NULL, &err);
    cl_command_queue q = clCreateCommandQueue(ctx, device, 0, &err);
    int a_mark = 111, b_mark = 222, seq[64];
    for (int i = 0; i < 64; ++i) seq[i] = i;
    cl_mem a = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof a_mark,
                              &a_mark, &err);
    cl_mem b = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof b_mark,
                              &b_mark, &err);
    cl_mem whole = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof seq, seq,
                                  &err);
    cl_buffer_region region = {128, 128};  // origins must be aligned (PoCL: 128 bytes)
    cl_mem sub = clCreateSubBuffer(whole, CL_MEM_READ_WRITE, CL_BUFFER_CREATE_TYPE_REGION,
                                   &region, &err);
    if (!a || !b || !sub) return 2;

    int seen2[2] = {0, 0}, seen1 = -1;
    two t = {{b, a}, seen2};
    const void *where2[2] = {&t.mem[0], &t.mem[1]};
    one o = {sub, &seen1};
    const void *where1 = &o.mem;
    if (clEnqueueNativeKernel(q, read_two, &t, sizeof t, 2, (const cl_mem *)t.mem, where2, 0,
                              NULL, NULL) != CL_SUCCESS ||
        clEnqueueNativeKernel(q, read_one, &o, sizeof o, 1, (const cl_mem *)&o.mem, &where1, 0,
                              NULL, NULL) != CL_SUCCESS ||
        clFinish(q) != CL_SUCCESS)
        return 2;
    int ok1 = seen2[0] == b_mark && seen2[1] == a_mark, ok2 = seen1 == 32;
    printf("two buffers {B, A}: place 0 saw %d (B is %d), place 1 saw %d (A is %d): %s\n",
           seen2[0], b_mark, seen2[1], a_mark, ok1 ? "right" : "WRONG");
    printf("sub-buffer at 128 bytes: first int %d (expected 32): %s\n", seen1,
           ok2 ? "right" : "WRONG");
    return ok1 && ok2 ? 0 : 1;
}
