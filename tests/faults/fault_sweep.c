// The fault sweep: each scenario (public entry points with their objects) runs in a child
// process with tests/faults/inject.c preloaded, once for every OpenCL call (--kind cl, the
// default) or allocation (--kind alloc) the library makes in it, that call failing
// (CLMHA_FAULT_AT = 1, 2, ... up to the calls a run without faults makes, counted first).
// Each run must end in one of two outcomes:
//   refused:   an error status whose message names the failed OpenCL call (a failed
//              allocation: CLMHA_OUT_OF_MEMORY, its message saying memory);
//   recovered: success with the right answer (a documented fallback took over);
// and then, with injection paused, the same call on the same objects (those that were made)
// must succeed with the right answer: nothing was left half-done. Anything else is a failure:
// a wrong answer, a message that does not name the failed call, an unusable object, a crash,
// an abort or a hang (180 s: a cold kernel cache builds every program first). Right answers
// are the double-precision reference's (clmha_reference_forward(),
// clmha_reference_attention()) within 1e-4.
//
//   fault_sweep PRELOAD [SCENARIO ...] [--kind cl|alloc] [--stride K]
//
// PRELOAD: the built inject library; --stride K runs every K-th injection point only (the
// CI's sample; the first and last always). Prints, per scenario, the injection points and the
// outcomes; exit status 0 when every run passed.
#define _GNU_SOURCE
#define CL_TARGET_OPENCL_VERSION 120
#include <clmha.h>
#include <dlfcn.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { E = 16, H = 2, N = 2, L = 5, S = 5 };
#define TOL 1e-4

// The outcome of one child run: its exit status.
enum { OUT_REFUSED = 0, OUT_RECOVERED = 1, OUT_WRONG = 2, OUT_RETRY = 3, OUT_MESSAGE = 4,
       OUT_SETUP = 5, OUT_DONE = 10 };

static const char *const outcome_names[] = {"refused", "recovered", "wrong answer",
                                             "unusable after", "message lacks the call",
                                             "setup failed"};

// ---- the child: the objects, the calls, the checks ---------------------------------------------

typedef struct world {
    clmha_context *ctx;
    clmha_layer *layer;
    bool params_set;  // the layer's parameters were set (a failed set is retried)
    clmha_kv_cache *cache;
    clmha_saved *saved;
    float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E];
    float q[L * N * E], k[S * N * E], v[S * N * E];
    double want[L * N * E];
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

static clmha_layer_desc layer_desc(void) {
    clmha_layer_desc d = CLMHA_STRUCT_INIT(clmha_layer_desc);
    d.embed_dim = E, d.num_heads = H, d.bias = true;
    return d;
}

// The call's forward arguments: cross-attention on host arrays (L, N, E) and (S, N, E).
static clmha_forward_args forward_args(const world *w, bool causal) {
    clmha_forward_args a = CLMHA_STRUCT_INIT(clmha_forward_args);
    a.query = (clmha_tensor){.ndim = 3, .shape = {L, N, E}, .data = w->q};
    a.key = (clmha_tensor){.ndim = 3, .shape = {S, N, E}, .data = w->k};
    a.value = (clmha_tensor){.ndim = 3, .shape = {S, N, E}, .data = w->v};
    a.is_causal = causal;
    return a;
}

// The reference output of the forward call (once per child, before anything is injected).
static void reference(world *w, bool causal) {
    clmha_layer_desc d = layer_desc();
    clmha_reference_params p = {.struct_size = sizeof p, .in_proj_weight = w->w_in,
                                .in_proj_bias = w->b_in, .out_proj_weight = w->w_out,
                                .out_proj_bias = w->b_out};
    clmha_forward_args a = forward_args(w, causal);
    char msg[256];
    if (clmha_reference_forward(&d, &p, &a, w->want, L * N * E, NULL, 0, msg, sizeof msg)) {
        fprintf(stderr, "fault_sweep: reference: %s\n", msg);
        exit(OUT_SETUP);
    }
}

// Makes the context and the layer where they are missing (a failed create leaves NULL).
static clmha_status make_objects(world *w) {
    clmha_status st;
    if (!w->ctx && (st = clmha_context_create_from_env(&w->ctx))) return st;
    clmha_layer_desc d = layer_desc();
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
    return clmha_layer_forward_host(w->layer, &a, out, L * N * E, NULL, 0);
}

static clmha_status step_fused(world *w, float *out) {
    return step_forward(w, out, CLMHA_IMPL_FUSED);
}

static clmha_status step_unfused(world *w, float *out) {
    return step_forward(w, out, CLMHA_IMPL_UNFUSED);
}

// A forward call that saves, then its backward: checked through the forward's output (the
// backward's gradients are the backward suites' business; here: that it survives).
static clmha_status step_backward(world *w, float *out) {
    clmha_status st = make_objects(w);
    if (st || (!w->saved && (st = clmha_saved_create(&w->saved, w->layer)))) return st;
    clmha_forward_args a = forward_args(w, false);
    a.save = w->saved;
    if ((st = clmha_layer_forward_host(w->layer, &a, out, L * N * E, NULL, 0))) return st;
    static float go[L * N * E], gq[L * N * E];
    for (unsigned i = 0; i < L * N * E; ++i) go[i] = value_at(i, 9);
    clmha_backward_args b = {.struct_size = sizeof b, .saved = w->saved, .forward = &a};
    b.grad_output = (clmha_tensor){.ndim = 3, .shape = {L, N, E}, .data = go};
    b.query = (clmha_grad){.data = gq};
    return clmha_layer_backward_host(w->layer, &b);
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
    static float go[L * N * E], gq[L * N * E], gk[S * N * E], gv[S * N * E];
    for (unsigned i = 0; i < L * N * E; ++i) go[i] = value_at(i, 9);
    return clmha_attention_backward_host(w->ctx, &a, go, L * N * E, gq, gk, gv, NULL);
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
} scenario;

static const scenario scenarios[] = {
    {"forward (fused core)", step_fused, false, false},
    {"forward (unfused core)", step_unfused, false, false},
    {"forward + backward", step_backward, false, false},
    {"KV-cache decode", step_decode, true, false},
    {"partial attention + merge + project", step_partial, false, false},
    {"attention function, forward + backward", step_function, false, true},
};
enum { SCENARIOS = sizeof scenarios / sizeof scenarios[0] };

// The child: scenario @p sc with call @p at failing. Exits with its outcome, or OUT_DONE when
// the run made fewer than @p at calls; with @p at 0 (nothing fails) it writes the number of
// calls the scenario makes to $CLMHA_FAULT_COUNT_FILE.
static void child(const scenario *sc, long at) {
    long (*state)(const char **);
    void (*pause)(bool);
    *(void **)&state = dlsym(RTLD_DEFAULT, "clmha_fault_state");  // (ISO C's way to a
    *(void **)&pause = dlsym(RTLD_DEFAULT, "clmha_fault_pause");   // function pointer)
    if (!state || !pause) exit(OUT_SETUP);
    static world w;
    world_data(&w);
    if (sc->self_causal) {  // query = key = value
        memcpy(w.k, w.q, sizeof w.q), memcpy(w.v, w.q, sizeof w.q);
    }
    pause(true);  // the reference's own allocations are libclmha's too
    if (sc->function) function_reference(&w);
    else reference(&w, sc->self_causal);
    pause(false);
    static float out[L * N * E];
    clmha_status st = sc->step(&w, out);
    const char *name = NULL;
    long calls = state(&name);
    const char *kind = getenv("CLMHA_FAULT_KIND");
    bool alloc = kind && strcmp(kind, "alloc") == 0;
    if (at == 0) {
        const char *path = getenv("CLMHA_FAULT_COUNT_FILE");
        FILE *f = path ? fopen(path, "w") : NULL;
        if (!f || st) exit(OUT_SETUP);
        fprintf(f, "%ld\n", calls);
        fclose(f);
        exit(OUT_DONE);
    }
    if (!name) exit(OUT_DONE);  // fewer calls than `at`
    int outcome = OUT_RECOVERED;
    if (st) {
        const char *msg = w.ctx ? clmha_context_last_error(w.ctx) : clmha_last_create_error();
        // A failed allocation is reported as memory that was not there; an OpenCL call by name.
        bool named = msg && (alloc ? st == CLMHA_OUT_OF_MEMORY && strstr(msg, "memory")
                                   : strstr(msg, name) != NULL);
        outcome = named ? OUT_REFUSED : OUT_MESSAGE;
        if (outcome == OUT_MESSAGE)
            fprintf(stderr, "  %s, call %ld (%s): %s: \"%s\"\n", sc->name, at, name,
                    clmha_status_string(st), msg ? msg : "");
    } else if (max_err(out, w.want, L * N * E) > TOL) {
        fprintf(stderr, "  %s, call %ld (%s): success with a wrong answer\n", sc->name, at, name);
        exit(OUT_WRONG);
    }
    pause(true);
    memset(out, 0, sizeof out);
    if ((st = sc->step(&w, out)) || max_err(out, w.want, L * N * E) > TOL) {
        fprintf(stderr, "  %s, call %ld (%s): the retry %s\n", sc->name, at, name,
                st ? clmha_status_string(st) : "gave a wrong answer");
        exit(OUT_RETRY);
    }
    clmha_kv_cache_release(w.cache);
    clmha_saved_release(w.saved);
    clmha_layer_release(w.layer);
    clmha_context_release(w.ctx);
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

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "--child") == 0) {
        int index = atoi(argv[2]);
        if (index < 0 || index >= SCENARIOS) return OUT_SETUP;
        child(&scenarios[index], atol(argv[3]));
    }
    if (argc < 2) {
        fprintf(stderr, "usage: %s PRELOAD [SCENARIO-NUMBER ...] [--kind cl|alloc] [--stride K]\n",
                argv[0]);
        return 2;
    }
    long stride = 1;
    bool chosen[SCENARIOS] = {false}, any = false;
    for (int i = 2; i < argc; ++i) {
        if (strcmp(argv[i], "--stride") == 0 && i + 1 < argc) {
            stride = atol(argv[++i]);
        } else if (strcmp(argv[i], "--kind") == 0 && i + 1 < argc) {
            setenv("CLMHA_FAULT_KIND", argv[++i], 1);  // the children inherit it
        } else {
            int k = atoi(argv[i]);
            if (k >= 1 && k <= SCENARIOS) chosen[k - 1] = any = true;
        }
    }
    if (stride < 1) stride = 1;
    int failures = 0;
    char count_file[] = "/tmp/clmha-fault-count-XXXXXX";
    int fd = mkstemp(count_file);
    if (fd < 0) return 2;
    close(fd);
    setenv("CLMHA_FAULT_COUNT_FILE", count_file, 1);
    const char *kind = getenv("CLMHA_FAULT_KIND");
    printf("| scenario (%s) | calls | runs | refused | recovered | failed |\n"
           "|---|---|---|---|---|---|\n",
           kind && strcmp(kind, "alloc") == 0 ? "allocations" : "OpenCL calls");
    for (int s = 0; s < SCENARIOS; ++s) {
        if (any && !chosen[s]) continue;
        long counts[6] = {0}, failed = 0, runs = 0, total = 0;
        FILE *f = NULL;
        if (run_one(argv[0], argv[1], s, 0) != OUT_DONE || !(f = fopen(count_file, "r")) ||
            fscanf(f, "%ld", &total) != 1) {
            fprintf(stderr, "fault_sweep: %s: the run without faults failed\n",
                    scenarios[s].name);
            if (f) fclose(f);
            ++failures;
            continue;
        }
        fclose(f);
        // Every point (the first and the last always, every stride-th between).
        for (long at = 1; at <= total; at = at == total ? total + 1
                                           : at + stride > total ? total
                                                                 : at + stride) {
            int out = run_one(argv[0], argv[1], s, at);
            if (out == OUT_DONE) break;  // a run that made fewer calls than the count
            ++runs;
            if (out == OUT_REFUSED || out == OUT_RECOVERED) {
                ++counts[out];
            } else {
                ++failed;
                if (out >= 0 && out < 6) ++counts[out];
            }
        }
        printf("| %s | %ld | %ld | %ld | %ld | %ld |\n", scenarios[s].name, total, runs,
               counts[OUT_REFUSED], counts[OUT_RECOVERED], failed);
        for (int o = 2; o < 6; ++o)
            if (counts[o]) printf("|   %s | | %ld | | | |\n", outcome_names[o], counts[o]);
        failures += (int)failed;
        fflush(stdout);
    }
    unlink(count_file);
    printf("fault_sweep: %d failed run%s\n", failures, failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}
