// Ring attention across processes: each MPI rank holds one slice of a long key/value sequence;
// the slices travel around the ring of ranks, and every rank attends its queries over each slice
// as it passes (clmha_layer_attend: the slice's per-head result and log-sum-exp), merges the
// partial results (clmha_attention_merge), and projects the merged heads at the end
// (clmha_layer_project_heads). No rank ever holds more than one slice on its device, yet each
// gets the attention over the whole sequence: the program checks it against the one-shot
// forward over the whole key/value (clmha_layer_forward_host) and prints the difference.
//
//   mpirun -np 2 ./ring_attention_mpi        (each rank opens its own context: $CLMHA_DEVICE,
//                                             else the default device)
//
// The layer has add_bias_kv and add_zero_attn: their keys belong to no slice, so they go with
// the slice of rank 0 (appended_keys). Exit status: 0 when every rank's result is within 1e-5
// of the one-shot forward, 1 when not or on an error, 77 when a rank has no OpenCL device.
#include <mpi.h>

#include <clmha.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { E = 32, H = 4, N = 2, L = 6, SLICE = 7 };

// The same numbers on every rank: splitmix64 from a seed, uniform in [-bound, bound).
static void fill(float *x, size_t count, uint64_t seed, float bound) {
    for (size_t i = 0; i < count; ++i) {
        uint64_t z = (seed += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        x[i] = bound * (float)((double)(z >> 11) * 0x1.0p-52 - 1.0);
    }
}

// Stops every rank when one fails: returns the worst status over the ranks (0 all fine, 77 no
// device somewhere, 1 an error somewhere).
static int agree(int mine) {
    int worst = 0;
    MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return worst;
}

static cl_mem buffer(clmha_context *ctx, size_t floats, const float *init) {
    cl_int err;
    cl_mem m = clCreateBuffer(clmha_context_cl_context(ctx),
                              CL_MEM_READ_WRITE | (init ? CL_MEM_COPY_HOST_PTR : 0),
                              floats * sizeof(float), (void *)init, &err);
    return err == CL_SUCCESS ? m : NULL;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, ranks = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    const size_t s_total = (size_t)SLICE * (size_t)ranks, d = E / H, rows = N * H * L;

    // Parameters, queries and the whole key/value, the same on every rank (each rank keeps only
    // its slice for the ring; the whole is for the check).
    static float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E], bias_k[E], bias_v[E];
    static float query[L * N * E], out[L * N * E], whole[L * N * E];
    float *key = malloc(s_total * N * E * sizeof *key);
    float *value = malloc(s_total * N * E * sizeof *value);
    float *k_slice = malloc(SLICE * N * E * sizeof *k_slice);
    float *v_slice = malloc(SLICE * N * E * sizeof *v_slice);
    if (agree(!key || !value || !k_slice || !v_slice)) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        MPI_Finalize();
        return 1;
    }
    fill(w_in, sizeof w_in / sizeof *w_in, 1, 0.3f);
    fill(b_in, E * 3, 2, 0.1f);
    fill(w_out, E * E, 3, 0.3f);
    fill(b_out, E, 4, 0.1f);
    fill(bias_k, E, 5, 0.5f);
    fill(bias_v, E, 9, 0.5f);
    fill(query, L * N * E, 6, 1.0f);
    fill(key, s_total * N * E, 7, 1.0f);
    fill(value, s_total * N * E, 8, 1.0f);
    // Sequence-first (S, N, E): a slice of keys is a contiguous block of rows.
    memcpy(k_slice, key + (size_t)rank * SLICE * N * E, SLICE * N * E * sizeof *k_slice);
    memcpy(v_slice, value + (size_t)rank * SLICE * N * E, SLICE * N * E * sizeof *v_slice);

    clmha_context *ctx = NULL;
    clmha_layer *layer = NULL;
    int rc = 0;
    if (clmha_context_create_from_env(&ctx) != CLMHA_SUCCESS) {
        fprintf(stderr, "rank %d: no OpenCL device: %s\n", rank, clmha_last_create_error());
        rc = 77;
    }
    if ((rc = agree(rc))) goto end;
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = H,
                             .bias = true, .add_bias_kv = true, .add_zero_attn = true};
    clmha_status st = clmha_layer_create(&layer, ctx, &desc);
    if (!st) st = clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * E * E);
    if (!st) st = clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * E);
    if (!st) st = clmha_layer_set_parameter(layer, "out_proj.weight", w_out, E * E);
    if (!st) st = clmha_layer_set_parameter(layer, "out_proj.bias", b_out, E);
    if (!st) st = clmha_layer_set_parameter(layer, "bias_k", bias_k, E);
    if (!st) st = clmha_layer_set_parameter(layer, "bias_v", bias_v, E);
    if (st) fprintf(stderr, "rank %d: layer: %s\n", rank, clmha_context_last_error(ctx));
    if ((rc = agree(st ? 1 : 0))) goto end;

    cl_command_queue queue = clmha_context_cl_queue(ctx);
    cl_mem q = buffer(ctx, L * N * E, query), k = buffer(ctx, SLICE * N * E, NULL),
           v = buffer(ctx, SLICE * N * E, NULL), acc = buffer(ctx, rows * d, NULL),
           acc_lse = buffer(ctx, rows, NULL), part = buffer(ctx, rows * d, NULL),
           part_lse = buffer(ctx, rows, NULL), o = buffer(ctx, L * N * E, NULL);
    cl_mem all[] = {q, k, v, acc, acc_lse, part, part_lse, o};
    for (size_t i = 0; i < sizeof all / sizeof *all; ++i)
        if (!all[i]) st = CLMHA_OUT_OF_MEMORY;
    int next = (rank + 1) % ranks, prev = (rank + ranks - 1) % ranks;
    // Step t: this rank holds the slice of rank (rank - t) mod ranks; attend over it, merge, then
    // pass it on to the next rank and take the previous rank's.
    for (int t = 0; t < ranks && !st; ++t) {
        int owner = (rank - t + ranks) % ranks;
        cl_int err = clEnqueueWriteBuffer(queue, k, CL_FALSE, 0, SLICE * N * E * sizeof(float),
                                          k_slice, 0, NULL, NULL);
        if (err == CL_SUCCESS)
            err = clEnqueueWriteBuffer(queue, v, CL_FALSE, 0, SLICE * N * E * sizeof(float),
                                       v_slice, 0, NULL, NULL);
        if (err != CL_SUCCESS) {
            st = CLMHA_OPENCL_ERROR;
            break;
        }
        clmha_forward_args a = {.struct_size = sizeof a};
        a.query = (clmha_tensor){.ndim = 3, .shape = {L, N, E}, .buffer = q};
        a.key = (clmha_tensor){.ndim = 3, .shape = {SLICE, N, E}, .buffer = k};
        a.value = (clmha_tensor){.ndim = 3, .shape = {SLICE, N, E}, .buffer = v};
        st = clmha_layer_attend(layer, &a, owner == 0, t ? part : acc, 0, t ? part_lse : acc_lse,
                                0, 0, NULL, NULL);
        if (!st && t)
            st = clmha_attention_merge(ctx, rows, d, acc, 0, acc_lse, 0, part, 0, part_lse, 0, 0,
                                       NULL, NULL);
        // The slices' host arrays are read by the writes above: wait before they are replaced.
        if (!st && clFinish(queue) != CL_SUCCESS) st = CLMHA_OPENCL_ERROR;
        if (st || ranks == 1) continue;
        MPI_Sendrecv_replace(k_slice, SLICE * N * E, MPI_FLOAT, next, 0, prev, 0, MPI_COMM_WORLD,
                             MPI_STATUS_IGNORE);
        MPI_Sendrecv_replace(v_slice, SLICE * N * E, MPI_FLOAT, next, 1, prev, 1, MPI_COMM_WORLD,
                             MPI_STATUS_IGNORE);
    }
    if (!st) st = clmha_layer_project_heads(layer, N, L, acc, 0, o, 0, 0, NULL, NULL);
    if (!st && clEnqueueReadBuffer(queue, o, CL_TRUE, 0, sizeof out, out, 0, NULL, NULL))
        st = CLMHA_OPENCL_ERROR;
    for (size_t i = 0; i < sizeof all / sizeof *all; ++i)
        if (all[i]) clReleaseMemObject(all[i]);
    if (st) fprintf(stderr, "rank %d: ring: %s: %s\n", rank, clmha_status_string(st),
                    clmha_context_last_error(ctx));
    if ((rc = agree(st ? 1 : 0))) goto end;

    // The one-shot forward over the whole key/value, on this rank's device.
    clmha_forward_args one = {.struct_size = sizeof one};
    one.query = (clmha_tensor){.ndim = 3, .shape = {L, N, E}, .data = query};
    one.key = (clmha_tensor){.ndim = 3, .shape = {s_total, N, E}, .data = key};
    one.value = (clmha_tensor){.ndim = 3, .shape = {s_total, N, E}, .data = value};
    st = clmha_layer_forward_host(layer, &one, whole, L * N * E, NULL, 0);
    if (st) fprintf(stderr, "rank %d: forward: %s\n", rank, clmha_context_last_error(ctx));
    if ((rc = agree(st ? 1 : 0))) goto end;
    double err = 0.0, worst = 0.0;
    for (size_t i = 0; i < L * N * E; ++i) {
        double x = fabs((double)out[i] - (double)whole[i]);
        if (!(x <= err)) err = x;  // NaN counts as the worst
    }
    if (isnan(err)) err = INFINITY;
    MPI_Reduce(&err, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0)
        printf("ring attention over %d ranks (%zu keys, %d per rank, N %d, L %d, E %d, H %d): "
               "max abs difference from the one-shot forward %.3g\n",
               ranks, s_total, SLICE, N, L, E, H, worst);
    rc = agree(err <= 1e-5 ? 0 : 1);
end:
    clmha_layer_release(layer);
    clmha_context_release(ctx);
    free(key);
    free(value);
    free(k_slice);
    free(v_slice);
    MPI_Finalize();
    return rc;
}
