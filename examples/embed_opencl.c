// An application that owns its OpenCL objects and runs a clmha layer on them.
//
// The application creates the cl_context and in-order queue, allocates the input and output
// cl_mem buffers, and fills the query and key with an OpenCL kernel of its own. clmha works
// inside those objects: clmha_context_create_from_cl() wraps them, and clmha_layer_forward()
// reads the application's buffers, waits for the fill kernels' events on the device (not on the
// host) and returns an event for its completion. Inputs never travel through host memory.
//
// For the check only, the host computes the same input patterns and the double-precision CPU
// reference (clmha_reference_forward) and compares (tolerance 1e-4).
//
//   embed_opencl            device from $CLMHA_DEVICE, else the first GPU, else any device
// Exit status: 0 pass, 1 failure, 77 no OpenCL device.
#include <clmha.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

// Cross-attention: query (L, N, E), key = value (S, N, E); sequence-first like PyTorch's default.
enum { E = 16, H = 4, L = 6, S = 9, N = 2 };

// The application's own kernel: x[i] = amplitude * sin(i * step + phase).
static const char *fill_source =
    "kernel void fill_pattern(global float *x, uint n, float step, float phase,\n"
    "                         float amplitude) {\n"
    "    uint i = get_global_id(0);\n"
    "    if (i < n) x[i] = amplitude * sin((float)i * step + phase);\n"
    "}\n";

// The same pattern on the host, for the check.
static void fill_host(float *x, unsigned n, float step, float phase, float amplitude) {
    for (unsigned i = 0; i < n; ++i) x[i] = amplitude * sinf((float)i * step + phase);
}

static float next_value(unsigned *state) {  // deterministic parameters in [-0.5, 0.5)
    *state = *state * 1664525u + 1013904223u;
    return (float)(*state >> 8) / (float)(1u << 24) - 0.5f;
}

#define CL_CHECK(call)                                                                   \
    do {                                                                                 \
        cl_int err_ = (call);                                                            \
        if (err_ != CL_SUCCESS) {                                                        \
            fprintf(stderr, "%s:%d: %s failed (%d)\n", __FILE__, __LINE__, #call, err_); \
            goto done;                                                                   \
        }                                                                                \
    } while (0)

// Enqueues fill_pattern over @p n floats of @p buf and returns its event.
static cl_int enqueue_fill(cl_command_queue queue, cl_kernel kernel, cl_mem buf, cl_uint n,
                           float step, float phase, float amplitude, cl_event *event) {
    cl_int err = clSetKernelArg(kernel, 0, sizeof buf, &buf);
    if (!err) err = clSetKernelArg(kernel, 1, sizeof n, &n);
    if (!err) err = clSetKernelArg(kernel, 2, sizeof step, &step);
    if (!err) err = clSetKernelArg(kernel, 3, sizeof phase, &phase);
    if (!err) err = clSetKernelArg(kernel, 4, sizeof amplitude, &amplitude);
    size_t global = n;
    if (!err) err = clEnqueueNDRangeKernel(queue, kernel, 1, NULL, &global, NULL, 0, NULL, event);
    return err;
}

int main(void) {
    int result = 1;
    cl_context context = NULL;
    cl_command_queue queue = NULL;
    cl_program program = NULL;
    cl_kernel fill = NULL;
    cl_mem query = NULL, key = NULL, output = NULL, weights = NULL;
    cl_event ready[2] = {NULL, NULL}, done = NULL;
    clmha_context *mha_ctx = NULL;
    clmha_layer *layer = NULL;
    cl_int err;

    // ---- the application's OpenCL setup (clmha_device_select only honours $CLMHA_DEVICE) ----
    clmha_device_info dev = {.struct_size = sizeof dev};
    char message[512];
    clmha_status st = clmha_device_select(getenv("CLMHA_DEVICE"), &dev, message, sizeof message);
    if (st == CLMHA_DEVICE_NOT_FOUND) {
        printf("skipped: no OpenCL device (%s)\n", message);
        return 77;
    }
    if (st) {
        fprintf(stderr, "device selection: %s\n", message);
        return 1;
    }
    printf("device: %s / %s\n", dev.platform_name, dev.device_name);
    cl_context_properties props[] = {CL_CONTEXT_PLATFORM, (cl_context_properties)dev.platform,
                                     0};
    context = clCreateContext(props, 1, &dev.device, NULL, NULL, &err);
    CL_CHECK(err);
    queue = clCreateCommandQueue(context, dev.device, 0, &err);  // in-order
    CL_CHECK(err);
    program = clCreateProgramWithSource(context, 1, &fill_source, NULL, &err);
    CL_CHECK(err);
    CL_CHECK(clBuildProgram(program, 1, &dev.device, "", NULL, NULL));
    fill = clCreateKernel(program, "fill_pattern", &err);
    CL_CHECK(err);

    const size_t q_count = (size_t)L * N * E, kv_count = (size_t)S * N * E;
    const size_t out_count = q_count, w_count = (size_t)N * L * S;
    query = clCreateBuffer(context, CL_MEM_READ_WRITE, q_count * sizeof(float), NULL, &err);
    CL_CHECK(err);
    key = clCreateBuffer(context, CL_MEM_READ_WRITE, kv_count * sizeof(float), NULL, &err);
    CL_CHECK(err);
    output = clCreateBuffer(context, CL_MEM_READ_WRITE, out_count * sizeof(float), NULL, &err);
    CL_CHECK(err);
    weights = clCreateBuffer(context, CL_MEM_READ_WRITE, w_count * sizeof(float), NULL, &err);
    CL_CHECK(err);

    // ---- clmha inside the application's context and queue ----
    if ((st = clmha_context_create_from_cl(&mha_ctx, context, dev.device, queue))) {
        fprintf(stderr, "clmha_context_create_from_cl: %s\n", clmha_last_create_error());
        goto done;
    }
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    static float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E];
    unsigned seed = 7;
    for (size_t i = 0; i < 3 * E * E; ++i) w_in[i] = next_value(&seed);
    for (size_t i = 0; i < 3 * E; ++i) b_in[i] = 0.2f * next_value(&seed);
    for (size_t i = 0; i < E * E; ++i) w_out[i] = next_value(&seed);
    for (size_t i = 0; i < E; ++i) b_out[i] = 0.2f * next_value(&seed);
    st = clmha_layer_create(&layer, mha_ctx, &desc);
    if (!st) st = clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E);
    if (!st) st = clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * E);
    if (!st) st = clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E);
    if (!st) st = clmha_layer_set_parameter(layer, "out_proj.bias", b_out, E);
    if (st) {
        fprintf(stderr, "layer: %s\n", clmha_context_last_error(mha_ctx));
        goto done;
    }

    // The application's kernels write the inputs; their events are clmha's wait list.
    CL_CHECK(enqueue_fill(queue, fill, query, (cl_uint)q_count, 0.1f, 0.0f, 1.0f, &ready[0]));
    CL_CHECK(enqueue_fill(queue, fill, key, (cl_uint)kv_count, 0.037f, 0.5f, 1.5f, &ready[1]));

    clmha_forward_args args = {.struct_size = sizeof args,
        .query = {.ndim = 3, .shape = {L, N, E}, .buffer = query},
        .key = {.ndim = 3, .shape = {S, N, E}, .buffer = key},  // value: ndim 0, same as key
        .need_weights = true};
    st = clmha_layer_forward(layer, &args, output, 0, weights, 0, 2, ready, &done);
    if (st) {
        fprintf(stderr, "clmha_layer_forward: %s\n", clmha_context_last_error(mha_ctx));
        goto done;
    }
    // The result: read after clmha's event (the read waits on it explicitly).
    static float y[L * N * E], w[N * L * S];
    CL_CHECK(clEnqueueReadBuffer(queue, output, CL_FALSE, 0, sizeof y, y, 1, &done, NULL));
    CL_CHECK(clEnqueueReadBuffer(queue, weights, CL_FALSE, 0, sizeof w, w, 1, &done, NULL));
    CL_CHECK(clFinish(queue));

    // ---- the check: the same inputs made on the host, the CPU reference ----
    static float q_host[L * N * E], k_host[S * N * E];
    static double y_ref[L * N * E], w_ref[N * L * S];
    fill_host(q_host, (unsigned)q_count, 0.1f, 0.0f, 1.0f);
    fill_host(k_host, (unsigned)kv_count, 0.037f, 0.5f, 1.5f);
    clmha_forward_args host_args = args;
    host_args.query.data = q_host;
    host_args.key.data = k_host;
    clmha_reference_params params = {.struct_size = sizeof params,
                                     .in_proj_weight = w_in, .in_proj_bias = b_in,
                                     .out_proj_weight = w_out, .out_proj_bias = b_out};
    if ((st = clmha_reference_forward(&desc, &params, &host_args, y_ref, out_count, w_ref,
                                      w_count, message, sizeof message))) {
        fprintf(stderr, "reference: %s\n", message);
        goto done;
    }
    double err_y = 0.0, err_w = 0.0, checksum = 0.0;
    for (size_t i = 0; i < out_count; ++i) {
        err_y = fmax(err_y, fabs(y[i] - y_ref[i]));
        checksum += y[i];
    }
    for (size_t i = 0; i < w_count; ++i) err_w = fmax(err_w, fabs(w[i] - w_ref[i]));
    printf("query (L, N, E) = (%d, %d, %d), key = value (S, N, E) = (%d, %d, %d), %d heads\n", L,
           N, E, S, N, E, H);
    printf("output (%d, %d, %d), sum %.6f; weights (%d, %d, %d)\n", L, N, E, checksum, N, L, S);
    printf("max |device - reference|: output %.3g, weights %.3g (tolerance 1e-4)\n", err_y, err_w);
    result = err_y <= 1e-4 && err_w <= 1e-4 ? 0 : 1;
    printf("%s\n", result ? "FAIL" : "PASS");

done:
    // clmha first (it holds references to the application's objects), then the application's.
    if (done) clReleaseEvent(done);
    for (int i = 0; i < 2; ++i)
        if (ready[i]) clReleaseEvent(ready[i]);
    clmha_layer_release(layer);
    clmha_context_release(mha_ctx);
    if (query) clReleaseMemObject(query);
    if (key) clReleaseMemObject(key);
    if (output) clReleaseMemObject(output);
    if (weights) clReleaseMemObject(weights);
    if (fill) clReleaseKernel(fill);
    if (program) clReleaseProgram(program);
    if (queue) clReleaseCommandQueue(queue);
    if (context) clReleaseContext(context);
    return result;
}
