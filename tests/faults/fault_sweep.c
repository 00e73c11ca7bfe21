// The fault sweep: each scenario (public entry points with their objects) runs in a child
// process with tests/faults/inject.c preloaded, once for every call of one kind the library
// makes in it (--kind cl, the default: OpenCL calls; alloc: malloc, calloc, realloc; io: file
// calls; blas: the GEMM libraries' calls), that call failing (CLMHA_FAULT_AT = 1, 2, ... up to
// the calls a run without faults makes, counted first). Each run must end in one of two
// outcomes:
//   refused:   an error status whose message names what failed: the OpenCL or CLBlast call
//              by name; a failed allocation as CLMHA_OUT_OF_MEMORY, its message saying
//              memory; a failed file call as CLMHA_IO_ERROR, its message naming the file (the
//              program: the file or stdout). A host call's output arrays keep what they held
//              (the header: written only once the whole pass has finished); a save leaves the
//              file it would replace as it was and no temporary file behind;
//   recovered: success with the right answer (a documented fallback took over);
// and then, with injection paused, the same call on the same objects (those that were made)
// must succeed with the right answer: nothing was left half-done. Then every object is
// released, and libclmha must hold no more OpenCL objects and allocations than after a run
// without faults (inject.c counts them): nothing leaked. Anything else is a failure: a wrong
// answer, a message that does not name what failed, a written output, an unusable object, a
// leak, a crash, an abort or a hang (180 s: a cold kernel cache builds every program first).
// Right answers are the double-precision reference's (clmha_reference_forward(),
// clmha_reference_attention()) within 1e-4. The tuning scenario's children run with
// CLMHA_FAULT_CLOCK (inject.c's made-up clock): its searches decide the same way every run.
//
//   fault_sweep PRELOAD [SCENARIO ...] [--kind cl|alloc|io|blas] [--stride K]
//               [--points FIRST-LAST]
//
// PRELOAD: the built inject library; --stride K runs every K-th injection point only (the
// CI's sample; the first and last always); --points the points FIRST to LAST only (a long
// sweep cut into parts that run side by side). --kind blas makes PRELOAD the host BLAS too
// (CLMHA_HOST_BLAS; its dnnl_sgemm forwards to oneDNN's); with CLMHA_GEMM=clblast in the
// environment the GEMMs are CLBlast's. Prints, per scenario, the injection points and the
// outcomes; exit status 0 when every run passed.
#define _GNU_SOURCE
#define CL_TARGET_OPENCL_VERSION 120
#include <clmha.h>

#include "sweep.h"

#include <dlfcn.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <dirent.h>
#include <unistd.h>

enum { E = 16, H = 2, N = 2, L = 5, S = 5 };
#define TOL 1e-4

// The outcome of one child run: its exit status.
static const char *const outcome_names[OUTCOMES] = {
    "refused", "recovered", "wrong answer", "unusable after", "message lacks the call",
    "setup failed", "output written", "leak", "program crashed or hung"};

enum { SENTINEL = 7 };  // what a host call's output arrays hold before it

// ---- the child: the objects, the calls, the checks ---------------------------------------------

typedef struct world {
    clmha_context *ctx;
    clmha_layer *layer;
    clmha_layer *loaded;  // the layer read back from the saved file
    bool train;           // dropout in training, and the averaged weights returned
    bool params_set;  // the layer's parameters were set (a failed set is retried)
    clmha_kv_cache *cache;
    clmha_saved *saved;
    float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E];
    float q[L * N * E], k[S * N * E], v[S * N * E];
    double want[L * N * E];
    float weights[N * L * S];
    float grads[L * N * E + 2 * S * N * E + 3 * E * E];  // query, key, value; in_proj_weight
    double want_weights[N * L * S];
    char dir[64], path[96];  // a folder of the child's own, and the layer file in it
} world;

static float value_at(unsigned i, unsigned salt) {
    return (float)sin(0.37 * (double)i + 0.11 * (double)salt) * 0.5f;
}

static void world_data(world *w) {
    float *arrays[] = {w->w_in, w->b_in, w->w_out, w->b_out, w->q, w->k, w->v};
    size_t counts[] = {3 * E * E, 3 * E, E * E, E, L * N * E, S * N * E, S * N * E};
    for (unsigned a = 0; a < 7; ++a)
        for (unsigned i = 0; i < counts[a]; ++i) arrays[a][i] = value_at(i, a + 1);
}

static clmha_layer_desc layer_desc(const world *w) {
    clmha_layer_desc d = CLMHA_STRUCT_INIT(clmha_layer_desc);
    d.embed_dim = E, d.num_heads = H, d.bias = true;
    d.dropout = w->train ? 0.25f : 0.0f;
    return d;
}

// The call's forward arguments: cross-attention on host arrays (L, N, E) and (S, N, E).
static clmha_forward_args forward_args(const world *w, bool causal) {
    clmha_forward_args a = CLMHA_STRUCT_INIT(clmha_forward_args);
    a.query = (clmha_tensor){.ndim = 3, .shape = {L, N, E}, .data = w->q};
    a.key = (clmha_tensor){.ndim = 3, .shape = {S, N, E}, .data = w->k};
    a.value = (clmha_tensor){.ndim = 3, .shape = {S, N, E}, .data = w->v};
    a.is_causal = causal;
    if (w->train) {
        a.training = a.need_weights = true;
        a.rng = (clmha_dropout_rng){.seed = 42, .offset = 3};
    }
    return a;
}

// The reference output of the forward call (once per child, before anything is injected).
static void reference(world *w, bool causal) {
    clmha_layer_desc d = layer_desc(w);
    clmha_reference_params p = {.struct_size = sizeof p, .in_proj_weight = w->w_in,
                                .in_proj_bias = w->b_in, .out_proj_weight = w->w_out,
                                .out_proj_bias = w->b_out};
    clmha_forward_args a = forward_args(w, causal);
    char msg[256];
    if (clmha_reference_forward(&d, &p, &a, w->want, L * N * E, w->want_weights,
                                w->train ? N * L * S : 0, msg, sizeof msg)) {
        fprintf(stderr, "fault_sweep: reference: %s\n", msg);
        exit(OUT_SETUP);
    }
}

// Makes the context and the layer where they are missing (a failed create leaves NULL).
static clmha_status make_objects(world *w) {
    clmha_status st;
    if (!w->ctx && (st = clmha_context_create_from_env(&w->ctx))) return st;
    clmha_layer_desc d = layer_desc(w);
    if (!w->layer && (st = clmha_layer_create(&w->layer, w->ctx, &d))) return st;
    if (!w->params_set &&
        ((st = clmha_layer_set_parameter(w->layer, "in_proj_weight", w->w_in, 3 * E * E)) ||
         (st = clmha_layer_set_parameter(w->layer, "in_proj_bias", w->b_in, 3 * E)) ||
         (st = clmha_layer_set_parameter(w->layer, "out_proj.weight", w->w_out, E * E)) ||
         (st = clmha_layer_set_parameter(w->layer, "out_proj.bias", w->b_out, E))))
        return st;
    w->params_set = true;
    return CLMHA_SUCCESS;
}

static double max_err(const float *got, const double *want, size_t n) {
    double e = 0;
    for (size_t i = 0; i < n; ++i) {
        double d = fabs((double)got[i] - want[i]);
        if (!(d <= e)) e = d;  // NaN wins
    }
    return e;
}

// One scenario step: the objects it needs made, its call run into @p out (L*N*E floats).
typedef clmha_status (*step_fn)(world *w, float *out);

static clmha_status step_forward(world *w, float *out, clmha_impl impl) {
    clmha_status st = make_objects(w);
    if (st) return st;
    clmha_forward_args a = forward_args(w, false);
    a.impl = impl;
    return clmha_layer_forward_host(w->layer, &a, out, L * N * E, w->weights,
                                    w->train ? N * L * S : 0);
}

static clmha_status step_fused(world *w, float *out) {
    return step_forward(w, out, CLMHA_IMPL_FUSED);
}

static clmha_status step_unfused(world *w, float *out) {
    return step_forward(w, out, CLMHA_IMPL_UNFUSED);
}

// The weights and dropout in training (the world's train set): the layer's choice of core.
static clmha_status step_auto(world *w, float *out) {
    return step_forward(w, out, CLMHA_IMPL_AUTO);
}

// The scratch made ahead for the call's shape, then the call.
static clmha_status step_bake(world *w, float *out) {
    clmha_status st = make_objects(w);
    if (st || (st = clmha_layer_bake(w->layer, N, L, S, false))) return st;
    return step_forward(w, out, CLMHA_IMPL_AUTO);
}

// The layer saved to a file, read back into a second layer, which then runs the call.
static clmha_status step_save_load(world *w, float *out) {
    clmha_status st = make_objects(w);
    if (st || (st = clmha_layer_save(w->layer, w->path))) return st;
    if (!w->loaded && (st = clmha_layer_load(&w->loaded, w->ctx, w->path))) return st;
    clmha_forward_args a = forward_args(w, false);
    return clmha_layer_forward_host(w->loaded, &a, out, L * N * E, NULL, 0);
}

// A forward call that saves, then its backward: checked through the forward's output (the
// backward's gradients are the backward suites' business; here: that it survives).
static clmha_status step_backward_with(world *w, float *out, clmha_impl impl) {
    clmha_status st = make_objects(w);
    if (st || (!w->saved && (st = clmha_saved_create(&w->saved, w->layer)))) return st;
    clmha_forward_args a = forward_args(w, false);
    a.save = w->saved;
    a.impl = impl;
    if ((st = clmha_layer_forward_host(w->layer, &a, out, L * N * E, NULL, 0))) return st;
    static float go[L * N * E];
    for (unsigned i = 0; i < L * N * E; ++i) go[i] = value_at(i, 9);
    clmha_backward_args b = {.struct_size = sizeof b, .saved = w->saved, .forward = &a};
    b.grad_output = (clmha_tensor){.ndim = 3, .shape = {L, N, E}, .data = go};
    b.query = (clmha_grad){.data = w->grads};
    b.key = (clmha_grad){.data = w->grads + L * N * E};
    b.in_proj_weight = (clmha_grad){.data = w->grads + L * N * E + 2 * S * N * E};
    return clmha_layer_backward_host(w->layer, &b);
}

static clmha_status step_backward(world *w, float *out) {
    return step_backward_with(w, out, CLMHA_IMPL_FUSED);
}

static clmha_status step_backward_unfused(world *w, float *out) {
    return step_backward_with(w, out, CLMHA_IMPL_UNFUSED);
}

// Causal self-attention through a KV cache, two calls (3 tokens, then 2): the one-shot causal
// output.
static clmha_status step_decode(world *w, float *out) {
    clmha_status st = make_objects(w);
    if (st) return st;
    if (!w->cache && (st = clmha_kv_cache_create(&w->cache, w->layer, N, L))) return st;
    if ((st = clmha_kv_cache_reset(w->cache))) return st;
    for (size_t t0 = 0; t0 < L; t0 += 3) {
        size_t len = t0 + 3 <= L ? 3 : L - t0;
        clmha_forward_args a = CLMHA_STRUCT_INIT(clmha_forward_args);
        a.query = (clmha_tensor){.ndim = 3, .shape = {len, N, E}, .data = w->q + t0 * N * E};
        a.is_causal = true;
        a.kv_cache = w->cache;
        if ((st = clmha_layer_forward_host(w->layer, &a, out + t0 * N * E, len * N * E, NULL,
                                           0)))
            return st;
    }
    return CLMHA_SUCCESS;
}

// The cache's two calls again, with a step back between: tokens [0, 3), then truncated to 2,
// then tokens [2, L): the same outputs.
static clmha_status step_truncate(world *w, float *out) {
    clmha_status st = make_objects(w);
    if (st) return st;
    if (!w->cache && (st = clmha_kv_cache_create(&w->cache, w->layer, N, L))) return st;
    if ((st = clmha_kv_cache_reset(w->cache))) return st;
    static const size_t from[2] = {0, 2}, to[2] = {3, L}, two[N] = {2, 2};
    for (int c = 0; c < 2; ++c) {
        size_t len = to[c] - from[c];
        clmha_forward_args a = CLMHA_STRUCT_INIT(clmha_forward_args);
        a.query = (clmha_tensor){.ndim = 3, .shape = {len, N, E}, .data = w->q + from[c] * N * E};
        a.is_causal = true;
        a.kv_cache = w->cache;
        if ((st = clmha_layer_forward_host(w->layer, &a, out + from[c] * N * E, len * N * E,
                                           NULL, 0)))
            return st;
        if (c == 0 && (st = clmha_kv_cache_truncate(w->cache, two, N))) return st;
    }
    return CLMHA_SUCCESS;
}

// The context tuned (the fused kernel's tiles and the decode split: the default and one
// candidate each, a budget never reached; the parent sets CLMHA_FAULT_CLOCK, so that the
// timings, and what they decide, are the same every run: the candidates win), the tuning
// stored in the world's folder (CLMHA_TUNING_DIR), then a forward through the fused core.
static clmha_status step_tune(world *w, float *out) {
    clmha_status st = make_objects(w);
    if (st) return st;
    clmha_tune_shape shape = {.batch = N, .tgt_len = L, .embed_dim = E, .num_heads = H};
    clmha_tune_options o = CLMHA_STRUCT_INIT(clmha_tune_options);
    o.budget_seconds = 3600;
    o.max_candidates = 1;
    o.shapes = &shape;
    o.num_shapes = 1;
    if ((st = clmha_context_tune(w->ctx, &o, NULL))) return st;
    return step_forward(w, out, CLMHA_IMPL_FUSED);
}

// The arrays of the attention function: query (N, H, L, D), key and value (N, H, S, D), the
// world's q, k, v read in that shape.
static clmha_attention_args function_args(const world *w) {
    clmha_attention_args a = CLMHA_STRUCT_INIT(clmha_attention_args);
    a.query = (clmha_tensor){.ndim = 4, .shape = {N, H, L, E / H}, .data = w->q};
    a.key = (clmha_tensor){.ndim = 4, .shape = {N, H, S, E / H}, .data = w->k};
    a.value = (clmha_tensor){.ndim = 4, .shape = {N, H, S, E / H}, .data = w->v};
    return a;
}

// Attention as a function: the forward and the backward on host arrays (the backward
// checked by surviving; its gradients are the sdpa suites' business).
static clmha_status step_function(world *w, float *out) {
    clmha_status st;
    if (!w->ctx && (st = clmha_context_create_from_env(&w->ctx))) return st;
    clmha_attention_args a = function_args(w);
    if ((st = clmha_attention_forward_host(w->ctx, &a, out, L * N * E, NULL, 0, NULL, 0)))
        return st;
    static float go[L * N * E];
    for (unsigned i = 0; i < L * N * E; ++i) go[i] = value_at(i, 9);
    float *g = w->grads;
    return clmha_attention_backward_host(w->ctx, &a, go, L * N * E, g, g + L * N * E,
                                         g + L * N * E + S * N * E, NULL);
}

// Partial attention on device buffers: the keys in two ranges ([0, 2) with the appended
// keys, [2, S)), merged, then the head merge and output projection.
static clmha_status step_partial(world *w, float *out) {
    clmha_status st = make_objects(w);
    if (st) return st;
    cl_context cl = clmha_context_cl_context(w->ctx);
    cl_command_queue q = clmha_context_cl_queue(w->ctx);
    enum { ROWS = N * H * L, CUT = 2 };
    const size_t bytes[9] = {sizeof w->q, CUT * N * E * 4, CUT * N * E * 4,
                             (S - CUT) * N * E * 4, (S - CUT) * N * E * 4, ROWS * E / H * 4,
                             ROWS * 4, ROWS * E / H * 4, ROWS * 4};
    const void *host[9] = {w->q, w->k, w->v, w->k + CUT * N * E, w->v + CUT * N * E};
    cl_mem b[10] = {NULL};
    cl_int err = CL_SUCCESS;
    for (int i = 0; i < 9 && !err; ++i)
        b[i] = clCreateBuffer(cl, CL_MEM_READ_WRITE | (host[i] ? CL_MEM_COPY_HOST_PTR : 0),
                              bytes[i], (void *)host[i], &err);
    if (!err) b[9] = clCreateBuffer(cl, CL_MEM_READ_WRITE, sizeof w->q, NULL, &err);
    clmha_forward_args a = forward_args(w, false);
    a.query = (clmha_tensor){.ndim = 3, .shape = {L, N, E}, .buffer = b[0]};
    for (int r = 0; r < 2 && !err && !st; ++r) {
        size_t len = r ? S - CUT : CUT;
        a.key = (clmha_tensor){.ndim = 3, .shape = {len, N, E}, .buffer = b[1 + 2 * r]};
        a.value = (clmha_tensor){.ndim = 3, .shape = {len, N, E}, .buffer = b[2 + 2 * r]};
        a.key_position = r ? CUT : 0;
        st = clmha_layer_attend(w->layer, &a, r == 0, b[5 + 2 * r], 0, b[6 + 2 * r], 0, 0, NULL,
                                NULL);
    }
    if (!err && !st)
        st = clmha_attention_merge(w->ctx, ROWS, E / H, b[5], 0, b[6], 0, b[7], 0, b[8], 0, 0,
                                   NULL, NULL);
    if (!err && !st)
        st = clmha_layer_project_heads(w->layer, N, L, b[5], 0, b[9], 0, 0, NULL, NULL);
    if (!err && !st)
        err = clEnqueueReadBuffer(q, b[9], CL_TRUE, 0, sizeof w->q, out, 0, NULL, NULL);
    clFinish(q);
    for (int i = 0; i < 10; ++i)
        if (b[i]) clReleaseMemObject(b[i]);
    if (err) {
        fprintf(stderr, "fault_sweep: the scenario's own OpenCL call failed (%d)\n", (int)err);
        exit(OUT_SETUP);
    }
    return st;
}

// The reference of the attention function's call (into w->want, (N, H, L, D)).
static void function_reference(world *w) {
    clmha_attention_args a = function_args(w);
    char msg[256];
    if (clmha_reference_attention(&a, w->want, L * N * E, NULL, 0, NULL, 0, msg, sizeof msg)) {
        fprintf(stderr, "fault_sweep: reference: %s\n", msg);
        exit(OUT_SETUP);
    }
}

typedef struct scenario {
    const char *name;
    step_fn step;
    bool self_causal;  // the reference is causal self-attention (query = key = value)
    bool function;     // the reference is attention as a function's (function_reference())
    bool train;        // dropout in training, weights returned (the world's train)
    bool one_output;   // only the last call writes the output: a failed run leaves it as it was
    bool grads;        // gradients into w->grads, by the last call: a failed run leaves them
} scenario;

static const scenario scenarios[] = {
    {"forward (fused core)", step_fused, false, false, false, true, false},
    {"forward (unfused core)", step_unfused, false, false, false, true, false},
    {"forward + backward (fused core)", step_backward, false, false, false, false, true},
    {"KV-cache decode", step_decode, true, false, false, false, false},
    {"partial attention + merge + project", step_partial, false, false, false, false, false},
    {"attention function, forward + backward", step_function, false, true, false, false, true},
    {"forward with weights, dropout in training", step_auto, false, false, true, true, false},
    {"forward + backward (unfused core)", step_backward_unfused, false, false, false, false,
     true},
    {"bake, then forward", step_bake, false, false, false, true, false},
    {"save, load, forward", step_save_load, false, false, false, true, false},
    {"KV-cache decode with truncate", step_truncate, true, false, false, false, false},
    {"the clmha run program: forward, backward, files", NULL, false, false, false, false,
     false},
    {"tune (fused tiles, decode split, stored), then forward", step_tune, false, false, false,
     true, false},
};
enum { SCENARIOS = sizeof scenarios / sizeof scenarios[0] };

// The layer file's state after a failed run: the bytes it held before (the save failed), or a
// whole layer file (the save succeeded, something after it failed). False (reported) otherwise.
static const char old_bytes[] = "the file a save must replace whole or leave as it was\n";

static bool file_whole(world *w) {
    char buf[sizeof old_bytes];
    FILE *f = fopen(w->path, "rb");
    size_t got = f ? fread(buf, 1, sizeof buf, f) : 0;
    if (f) fclose(f);
    bool kept = got == sizeof old_bytes - 1 && memcmp(buf, old_bytes, got) == 0;
    clmha_layer *check = NULL;
    if (!kept && w->ctx && clmha_layer_load(&check, w->ctx, w->path)) {
        fprintf(stderr, "  the layer file is neither the old one nor a layer file\n");
        return false;
    }
    clmha_layer_release(check);
    return true;
}

// Whether the world's folder holds no temporary file (a file write's, left behind).
static bool dir_clean(const world *w) {
    DIR *d = opendir(w->dir);
    struct dirent *e;
    bool clean = d != NULL;
    while (d && (e = readdir(d)))
        if (strncmp(e->d_name, ".clmha-", 7) == 0) {
            fprintf(stderr, "  a temporary file was left: %s\n", e->d_name);
            clean = false;
        }
    if (d) closedir(d);
    return clean;
}

// Removes the world's folder and the files in it.
static void dir_remove(const world *w) {
    DIR *d = opendir(w->dir);
    struct dirent *e;
    char path[sizeof w->dir + 260];
    while (d && (e = readdir(d)))
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) {
            snprintf(path, sizeof path, "%s/%s", w->dir, e->d_name);
            unlink(path);
        }
    if (d) closedir(d);
    rmdir(w->dir);
}

// The outcome of the run that failed call @p name: refused (with the message @p kind's rule
// asks for, the outputs as they were) or recovered (the right answer).
static int judge(world *w, const scenario *sc, clmha_status st, const float *out,
                 const char *kind, const char *name, long at) {
    if (!st) {
        bool right = max_err(out, w->want, L * N * E) <= TOL &&
                     (!w->train || max_err(w->weights, w->want_weights, N * L * S) <= TOL);
        if (!right) fprintf(stderr, "  %s, call %ld (%s): success with a wrong answer\n",
                            sc->name, at, name);
        return right ? OUT_RECOVERED : OUT_WRONG;
    }
    const char *msg = w->ctx ? clmha_context_last_error(w->ctx) : clmha_last_create_error();
    bool named = msg && (strcmp(kind, "alloc") == 0 ? st == CLMHA_OUT_OF_MEMORY &&
                                                          strstr(msg, "memory")
                         : strcmp(kind, "io") == 0 ? st == CLMHA_IO_ERROR && strchr(msg, '/')
                                                   : strstr(msg, name) != NULL);
    if (!named) {
        fprintf(stderr, "  %s, call %ld (%s): %s: \"%s\"\n", sc->name, at, name,
                clmha_status_string(st), msg ? msg : "");
        return OUT_MESSAGE;
    }
    bool kept = true;
    for (size_t i = 0; sc->one_output && i < L * N * E; ++i) kept = kept && out[i] == SENTINEL;
    for (size_t i = 0; sc->one_output && w->train && i < N * L * S; ++i)
        kept = kept && w->weights[i] == SENTINEL;
    for (size_t i = 0; sc->grads && i < sizeof w->grads / sizeof w->grads[0]; ++i)
        kept = kept && w->grads[i] == SENTINEL;
    if (!kept) fprintf(stderr, "  %s, call %ld (%s): refused, output written\n", sc->name, at,
                       name);
    bool files = (!w->path[0] || file_whole(w)) && (!w->dir[0] || dir_clean(w));
    return !kept || !files ? OUT_WRITTEN : OUT_REFUSED;
}

// Everything released, the OpenCL objects and allocations libclmha still holds in @p held.
static void release_all(world *w, long held[2]) {
    clmha_kv_cache_release(w->cache);
    clmha_saved_release(w->saved);
    clmha_layer_release(w->loaded);
    clmha_layer_release(w->layer);
    clmha_context_release(w->ctx);
    long (*count)(long *);
    *(void **)&count = dlsym(RTLD_DEFAULT, "clmha_fault_held");
    held[0] = count ? count(&held[1]) : 0;
    if (!count) held[1] = 0;
    if (w->dir[0]) dir_remove(w);
}

// The world of scenario @p sc: its data, its folder (save and tuning scenarios) and layer file
// (save), its reference.
static void child_setup(world *w, const scenario *sc) {
    world_data(w);
    w->train = sc->train;
    if (sc->self_causal) {  // query = key = value
        memcpy(w->k, w->q, sizeof w->q), memcpy(w->v, w->q, sizeof w->q);
    }
    if (sc->step == step_save_load || sc->step == step_tune) {
        snprintf(w->dir, sizeof w->dir, "/tmp/clmha-fault-XXXXXX");
        if (!mkdtemp(w->dir)) exit(OUT_SETUP);
    }
    if (sc->step == step_tune) setenv("CLMHA_TUNING_DIR", w->dir, 1);
    if (sc->step == step_save_load) {
        snprintf(w->path, sizeof w->path, "%s/layer.safetensors", w->dir);
        FILE *f = fopen(w->path, "wb");
        if (!f || fwrite(old_bytes, 1, sizeof old_bytes - 1, f) != sizeof old_bytes - 1)
            exit(OUT_SETUP);
        fclose(f);
    }
    if (sc->function) function_reference(w);
    else reference(w, sc->self_causal);
}

// The child of the program's scenario (sweep_cli.c): the program's own process is the one
// injected; what its library saw comes back in a report. The same exits as child()'s.
static void cli_child(long at) {
    const char *program = getenv("CLMHA_SWEEP_PROGRAM"), *cases = getenv("CLMHA_SWEEP_CASE");
    if (!program || !cases) exit(OUT_SETUP);
    cli_report r;
    int outcome = cli_sweep_run(program, cases, at, &r);
    if (at == 0) {
        const char *path = getenv("CLMHA_FAULT_COUNT_FILE");
        FILE *f = path ? fopen(path, "w") : NULL;
        if (!f || outcome != OUT_RECOVERED) exit(OUT_SETUP);
        fprintf(f, "%ld %ld %ld\n", r.calls, r.held, r.allocations);
        fclose(f);
        exit(OUT_DONE);
    }
    if (strcmp(r.failed, "-") == 0) exit(OUT_DONE);  // fewer calls than `at`
    long base_cl = 0, base_alloc = 0;
    const char *base = getenv("CLMHA_FAULT_BASE");
    if (outcome <= OUT_RECOVERED && base && sscanf(base, "%ld %ld", &base_cl, &base_alloc) == 2 &&
        (r.held > base_cl || r.allocations > base_alloc || r.allocations < 0)) {
        fprintf(stderr, "  clmha run, call %ld (%s): %ld OpenCL objects and %ld allocations "
                "left at exit (%ld and %ld without faults)\n", at, r.failed, r.held,
                r.allocations, base_cl, base_alloc);
        exit(OUT_LEAK);
    }
    exit(outcome);
}

// The child: scenario @p sc with call @p at failing. Exits with its outcome, or OUT_DONE when
// the run made fewer than @p at calls; with @p at 0 (nothing fails) it writes the number of
// calls the scenario makes and what libclmha holds after it to $CLMHA_FAULT_COUNT_FILE.
static void child(const scenario *sc, long at) {
    if (!sc->step) cli_child(at);
    long (*state)(const char **);
    void (*pause)(bool);
    *(void **)&state = dlsym(RTLD_DEFAULT, "clmha_fault_state");  // (ISO C's way to a
    *(void **)&pause = dlsym(RTLD_DEFAULT, "clmha_fault_pause");   // function pointer)
    if (!state || !pause) exit(OUT_SETUP);
    static world w;
    pause(true);  // the reference's own allocations are libclmha's too
    child_setup(&w, sc);
    static float out[L * N * E];
    for (size_t i = 0; i < L * N * E; ++i) out[i] = SENTINEL;
    for (size_t i = 0; i < N * L * S; ++i) w.weights[i] = SENTINEL;
    for (size_t i = 0; i < sizeof w.grads / sizeof w.grads[0]; ++i) w.grads[i] = SENTINEL;
    pause(false);
    clmha_status st = sc->step(&w, out);
    const char *name = NULL, *kind = getenv("CLMHA_FAULT_KIND");
    long calls = state(&name), held[2];
    pause(true);
    if (at == 0) {
        release_all(&w, held);
        const char *path = getenv("CLMHA_FAULT_COUNT_FILE");
        FILE *f = path ? fopen(path, "w") : NULL;
        if (!f || st) exit(OUT_SETUP);
        fprintf(f, "%ld %ld %ld\n", calls, held[0], held[1]);
        fclose(f);
        exit(OUT_DONE);
    }
    if (!name) exit(OUT_DONE);  // fewer calls than `at`
    int outcome = judge(&w, sc, st, out, kind ? kind : "cl", name, at);
    if (outcome > OUT_RECOVERED) exit(outcome);
    memset(out, 0, sizeof out);
    if ((st = sc->step(&w, out)) || max_err(out, w.want, L * N * E) > TOL) {
        fprintf(stderr, "  %s, call %ld (%s): the retry %s\n", sc->name, at, name,
                st ? clmha_status_string(st) : "gave a wrong answer");
        exit(OUT_RETRY);
    }
    release_all(&w, held);
    long base_cl = 0, base_alloc = 0;
    const char *base = getenv("CLMHA_FAULT_BASE");
    if (!base || sscanf(base, "%ld %ld", &base_cl, &base_alloc) != 2) exit(OUT_SETUP);
    if (held[0] > base_cl || held[1] > base_alloc || held[1] < 0) {
        fprintf(stderr, "  %s, call %ld (%s): %ld OpenCL objects and %ld allocations left "
                "(%ld and %ld without faults)\n", sc->name, at, name, held[0], held[1], base_cl,
                base_alloc);
        exit(OUT_LEAK);
    }
    exit(outcome);
}

// ---- the parent: the sweep ----------------------------------------------------------------------

// Runs scenario @p sc with call @p at failing, under @p preload; returns the child's outcome,
// or -1 for a crash, an abort or a hang (reported).
static int run_one(const char *self, const char *preload, int index, long at) {
    pid_t pid = fork();
    if (pid == 0) {
        char at_s[32], idx_s[16];
        snprintf(at_s, sizeof at_s, "%ld", at);
        snprintf(idx_s, sizeof idx_s, "%d", index);
        setenv("CLMHA_FAULT_AT", at_s, 1);
        setenv("LD_PRELOAD", preload, 1);
        if (scenarios[index].step == step_tune) setenv("CLMHA_FAULT_CLOCK", "1", 1);
        execl(self, self, "--child", idx_s, at_s, (char *)NULL);
        _exit(OUT_SETUP);
    }
    int status = 0;
    for (int waited = 0; waitpid(pid, &status, WNOHANG) == 0; ++waited) {
        if (waited > 1800) {  // 180 s
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            fprintf(stderr, "  %s, call %ld: hung (killed after 180 s)\n",
                    scenarios[index].name, at);
            return -1;
        }
        struct timespec ts = {0, 100000000};
        nanosleep(&ts, NULL);
    }
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    fprintf(stderr, "  %s, call %ld: killed by signal %d\n", scenarios[index].name, at,
            WTERMSIG(status));
    return -1;
}

// Sweeps scenario @p s: its run without faults (counting the calls and what libclmha holds
// after it), then one run per injection point; prints its table row; returns the failed runs.
static int sweep(const char *self, const char *preload, int s, long stride, const long range[2],
                 const char *count_file) {
    long counts[OUTCOMES] = {0}, failed = 0, runs = 0, total = 0, base[2];
    FILE *f = NULL;
    if (run_one(self, preload, s, 0) != OUT_DONE || !(f = fopen(count_file, "r")) ||
        fscanf(f, "%ld %ld %ld", &total, &base[0], &base[1]) != 3) {
        fprintf(stderr, "fault_sweep: %s: the run without faults failed\n", scenarios[s].name);
        if (f) fclose(f);
        return 1;
    }
    fclose(f);
    char base_s[64];  // what libclmha holds after a run without faults, for the leak check
    snprintf(base_s, sizeof base_s, "%ld %ld", base[0], base[1]);
    setenv("CLMHA_FAULT_BASE", base_s, 1);
    // Every point (the first and the last always, every stride-th between).
    long last = range[1] && range[1] < total ? range[1] : total;
    for (long at = range[0] > 1 ? range[0] : 1; at <= last; at = at == last ? last + 1
                                                         : at + stride > last ? last
                                                                              : at + stride) {
        int out = run_one(self, preload, s, at);
        if (out == OUT_DONE) break;  // a run that made fewer calls than the count
        ++runs;
        if (out == OUT_REFUSED || out == OUT_RECOVERED) {
            ++counts[out];
        } else {
            ++failed;
            if (out >= 0 && out < OUTCOMES) ++counts[out];
        }
    }
    printf("| %s | %ld | %ld | %ld | %ld | %ld |\n", scenarios[s].name, total, runs,
           counts[OUT_REFUSED], counts[OUT_RECOVERED], failed);
    for (int o = 2; o < OUTCOMES; ++o)
        if (counts[o]) printf("|   %s | | %ld | | | |\n", outcome_names[o], counts[o]);
    fflush(stdout);
    return (int)failed;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "--child") == 0) {
        int index = atoi(argv[2]);
        if (index < 0 || index >= SCENARIOS) return OUT_SETUP;
        child(&scenarios[index], atol(argv[3]));
    }
    if (argc < 2) {
        fprintf(stderr,
                "usage: %s PRELOAD [SCENARIO-NUMBER ...] [--kind cl|alloc|io|blas] "
                "[--stride K] [--points FIRST-LAST] [--program CLMHA --case DIR]\n",
                argv[0]);
        return 2;
    }
    long stride = 1, range[2] = {0, 0};
    bool chosen[SCENARIOS] = {false}, any = false;
    for (int i = 2; i < argc; ++i) {
        const char *env = strcmp(argv[i], "--kind") == 0      ? "CLMHA_FAULT_KIND"
                          : strcmp(argv[i], "--program") == 0 ? "CLMHA_SWEEP_PROGRAM"
                          : strcmp(argv[i], "--case") == 0    ? "CLMHA_SWEEP_CASE"
                                                              : NULL;
        if (env && i + 1 < argc) {
            setenv(env, argv[++i], 1);  // the children inherit it
        } else if (strcmp(argv[i], "--stride") == 0 && i + 1 < argc) {
            stride = atol(argv[++i]);
        } else if (strcmp(argv[i], "--points") == 0 && i + 1 < argc) {
            if (sscanf(argv[++i], "%ld-%ld", &range[0], &range[1]) != 2 || range[0] < 1 ||
                range[1] < range[0]) {
                fprintf(stderr, "fault_sweep: --points %s: expected FIRST-LAST, 1 <= FIRST <= "
                        "LAST\n", argv[i]);
                return 2;
            }
        } else {
            int k = atoi(argv[i]);
            if (k >= 1 && k <= SCENARIOS) chosen[k - 1] = any = true;
        }
    }
    if (stride < 1) stride = 1;
    char count_file[] = "/tmp/clmha-fault-count-XXXXXX";
    int fd = mkstemp(count_file);
    if (fd < 0) return 2;
    close(fd);
    setenv("CLMHA_FAULT_COUNT_FILE", count_file, 1);
    const char *kind = getenv("CLMHA_FAULT_KIND");
    kind = kind ? kind : "cl";
    if (strcmp(kind, "blas") == 0) setenv("CLMHA_HOST_BLAS", argv[1], 1);
    printf("| scenario (%s) | calls | runs | refused | recovered | failed |\n"
           "|---|---|---|---|---|---|\n",
           strcmp(kind, "alloc") == 0  ? "allocations"
           : strcmp(kind, "io") == 0   ? "file calls"
           : strcmp(kind, "blas") == 0 ? "GEMM calls"
                                       : "OpenCL calls");
    int failures = 0;
    for (int s = 0; s < SCENARIOS; ++s) {
        if (any && !chosen[s]) continue;
        if (!scenarios[s].step && !(getenv("CLMHA_SWEEP_PROGRAM") && getenv("CLMHA_SWEEP_CASE")))
            printf("| %s | skipped: no --program and --case | | | | |\n", scenarios[s].name);
        else failures += sweep(argv[0], argv[1], s, stride, range, count_file);
    }
    unlink(count_file);
    printf("fault_sweep: %d failed run%s\n", failures, failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}
