#define _POSIX_C_SOURCE 200809L
// Threads: several threads, each with its own layer, on one shared context; several contexts in
// parallel threads. Every result must be bit-identical to a serial run of the same inputs.
//
// Criterion cannot start under ThreadSanitizer (its sandbox maps a shared arena at fixed
// addresses that TSan reserves: Snaipe/Criterion#274). Compiled with -DCLMHA_TEST_STANDALONE,
// this file is a plain program instead: the few Criterion macros it uses become simple checks
// and main() runs the tests in order (exit status 0 pass, 1 fail, 77 skipped). The TSan build
// (-DCLMHA_SANITIZE=thread) registers that program as the test `concurrency_standalone`.
#ifdef CLMHA_TEST_STANDALONE
#include <stdio.h>
#include <stdlib.h>
static int standalone_failures;
#define SA_CHECK(fatal, cond, text)                                                            \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, text);           \
            ++standalone_failures;                                                             \
            if (fatal) exit(1);                                                                \
        }                                                                                      \
    } while (0)
#define SA_FIRST(a, ...) (a)
#define SA_EQ(a, b, ...) ((a) == (b))
#define cr_assert(...) SA_CHECK(1, SA_FIRST(__VA_ARGS__, 0), #__VA_ARGS__)
#define cr_expect(...) SA_CHECK(0, SA_FIRST(__VA_ARGS__, 0), #__VA_ARGS__)
#define cr_assert_eq(...) SA_CHECK(1, SA_EQ(__VA_ARGS__, 0), #__VA_ARGS__)
#define cr_expect_eq(...) SA_CHECK(0, SA_EQ(__VA_ARGS__, 0), #__VA_ARGS__)
#define cr_assert_not_null(...) SA_CHECK(1, SA_FIRST(__VA_ARGS__, 0) != NULL, #__VA_ARGS__)
#define cr_skip_test(...)                                                                      \
    do {                                                                                       \
        fprintf(stderr, "skipped: no OpenCL device\n");                                        \
        exit(77);                                                                              \
    } while (0)
#define Test(suite, name, ...) static void suite##_##name(void)
#else
#include <criterion/criterion.h>
#endif

#include <clmha.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

enum { E = 16, H = 4, L = 7, S = 9, N = 2, ITERS = 5, MAX_THREADS = 4 };
enum { OUT = L * N * E, WTS = N * L * S };

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

// One thread's work: its layer's parameters and the inputs of each of its calls.
typedef struct job {
    int index;
    float w_in[3 * E * E], b_in[3 * E], w_out[E * E], b_out[E];
    float q[ITERS][L * N * E], k[ITERS][S * N * E], v[ITERS][S * N * E];
    unsigned char kpm[ITERS][N * S];
    float out[ITERS][OUT], wts[ITERS][WTS];  // results
    clmha_context *ctx;                       // shared context, or NULL: create its own
    pthread_barrier_t *start;
    clmha_status status;
    char error[512];
} job;

static void job_init(job *j, int index) {
    memset(j, 0, sizeof *j);
    j->index = index;
    uint64_t s = 1000 + (uint64_t)index * 77;
    for (size_t i = 0; i < 3 * E * E; ++i) j->w_in[i] = 0.4f * frand(&s);
    for (size_t i = 0; i < 3 * E; ++i) j->b_in[i] = 0.1f * frand(&s);
    for (size_t i = 0; i < E * E; ++i) j->w_out[i] = 0.4f * frand(&s);
    for (size_t i = 0; i < E; ++i) j->b_out[i] = 0.1f * frand(&s);
    for (int it = 0; it < ITERS; ++it) {
        for (size_t i = 0; i < L * N * E; ++i) j->q[it][i] = frand(&s);
        for (size_t i = 0; i < S * N * E; ++i) j->k[it][i] = frand(&s);
        for (size_t i = 0; i < S * N * E; ++i) j->v[it][i] = frand(&s);
        // Item n masks its last n + it % 3 keys (never all of them).
        for (size_t n = 0; n < N; ++n)
            for (size_t t = 0; t < S; ++t) j->kpm[it][n * S + t] = t + n + (size_t)(it % 3) >= S;
    }
}

#define FAIL(j, st, ...)                                                                        \
    do {                                                                                       \
        (j)->status = (st);                                                                    \
        snprintf((j)->error, sizeof (j)->error, __VA_ARGS__);                                  \
        goto done;                                                                             \
    } while (0)

// Creates the layer (and the context when j->ctx is NULL), runs ITERS forward calls.
static void *job_run(void *arg) {
    job *j = arg;
    clmha_context *ctx = j->ctx, *own = NULL;
    clmha_layer *layer = NULL;
    clmha_status st;
    if (j->start) pthread_barrier_wait(j->start);
    if (!ctx) {
        if ((st = clmha_context_create_from_env(&own)))
            FAIL(j, st, "context: %s", clmha_last_create_error());
        ctx = own;
    }
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    if ((st = clmha_layer_create(&layer, ctx, &desc)))
        FAIL(j, st, "layer_create: %s", clmha_context_last_error(ctx));
    if ((st = clmha_layer_set_parameter(layer, "in_proj_weight", j->w_in, 3 * E * E)) ||
        (st = clmha_layer_set_parameter(layer, "in_proj_bias", j->b_in, 3 * E)) ||
        (st = clmha_layer_set_parameter(layer, "out_proj.weight", j->w_out, E * E)) ||
        (st = clmha_layer_set_parameter(layer, "out_proj.bias", j->b_out, E)))
        FAIL(j, st, "set_parameter: %s", clmha_context_last_error(ctx));
    for (int it = 0; it < ITERS; ++it) {
        clmha_forward_args args = {.struct_size = sizeof args,
            .query = {.ndim = 3, .shape = {L, N, E}, .data = j->q[it]},
            .key = {.ndim = 3, .shape = {S, N, E}, .data = j->k[it]},
            .value = {.ndim = 3, .shape = {S, N, E}, .data = j->v[it]},
            .key_padding_mask = {.kind = CLMHA_MASK_BOOL_IGNORE,
                                 .tensor = {.ndim = 2, .shape = {N, S}, .data = j->kpm[it]}},
            .need_weights = true};
        if ((st = clmha_layer_forward_host(layer, &args, j->out[it], OUT, j->wts[it], WTS)))
            FAIL(j, st, "forward %d: %s", it, clmha_context_last_error(ctx));
    }
done:
    clmha_layer_release(layer);
    clmha_context_release(own);
    return NULL;
}

// Serial results of jobs[0..count): one after the other, each on its own context.
static job *serial_results(int count) {
    job *serial = calloc((size_t)count, sizeof *serial);
    cr_assert_not_null(serial);
    for (int t = 0; t < count; ++t) {
        job_init(&serial[t], t);
        job_run(&serial[t]);
        if (serial[t].status == CLMHA_DEVICE_NOT_FOUND)
            cr_skip_test("no OpenCL device: %s", serial[t].error);
        cr_assert_eq(serial[t].status, CLMHA_SUCCESS, "serial job %d: %s", t, serial[t].error);
        for (int it = 0; it < ITERS; ++it)
            for (size_t i = 0; i < OUT; ++i)
                cr_assert(isfinite(serial[t].out[it][i]), "serial job %d call %d: non-finite", t,
                          it);
    }
    return serial;
}

// Runs jobs[0..count) in parallel threads released together, then compares with @p serial.
static void run_parallel(job *jobs, int count, const job *serial) {
    pthread_t threads[MAX_THREADS];
    pthread_barrier_t start;
    cr_assert_eq(pthread_barrier_init(&start, NULL, (unsigned)count), 0);
    for (int t = 0; t < count; ++t) {
        jobs[t].start = &start;
        cr_assert_eq(pthread_create(&threads[t], NULL, job_run, &jobs[t]), 0);
    }
    for (int t = 0; t < count; ++t) pthread_join(threads[t], NULL);
    pthread_barrier_destroy(&start);
    for (int t = 0; t < count; ++t) {
        cr_assert_eq(jobs[t].status, CLMHA_SUCCESS, "thread %d: %s: %s", t,
                     clmha_status_string(jobs[t].status), jobs[t].error);
        for (int it = 0; it < ITERS; ++it) {
            cr_expect(memcmp(jobs[t].out[it], serial[t].out[it], sizeof serial[t].out[it]) == 0,
                      "thread %d call %d: output differs from the serial run", t, it);
            cr_expect(memcmp(jobs[t].wts[it], serial[t].wts[it], sizeof serial[t].wts[it]) == 0,
                      "thread %d call %d: weights differ from the serial run", t, it);
        }
    }
}

Test(concurrency, four_threads_one_shared_context, .timeout = 1200) {
    enum { THREADS = 4 };
    job *serial = serial_results(THREADS);
    // A fresh context, so that the threads also build its kernel programs concurrently.
    clmha_context *ctx = NULL;
    cr_assert_eq(clmha_context_create_from_env(&ctx), CLMHA_SUCCESS, "%s",
                 clmha_last_create_error());
    job *jobs = calloc(THREADS, sizeof *jobs);
    cr_assert_not_null(jobs);
    for (int t = 0; t < THREADS; ++t) {
        job_init(&jobs[t], t);
        jobs[t].ctx = ctx;
    }
    run_parallel(jobs, THREADS, serial);
    clmha_context_release(ctx);
    free(jobs);
    free(serial);
}

Test(concurrency, three_contexts_in_parallel_threads, .timeout = 1200) {
    enum { THREADS = 3 };
    job *serial = serial_results(THREADS);
    job *jobs = calloc(THREADS, sizeof *jobs);
    cr_assert_not_null(jobs);
    for (int t = 0; t < THREADS; ++t) job_init(&jobs[t], t);  // ctx NULL: each creates its own
    run_parallel(jobs, THREADS, serial);
    free(jobs);
    free(serial);
}

// First forward calls at the same instant. CLBlast fills a process-wide table on its first use
// without a lock (src/device/blas.h); clmha runs CLBlast calls one at a time until one has
// succeeded. "First" is per process, so each round forks a child that has not touched OpenCL:
// its threads create their layers (on one shared context, or each on its own), wait at a
// barrier, then all make their first forward call at once. A round fails when the child
// crashes (SEGV, or a sanitizer report: abort_on_error=1), or a call fails or returns a
// non-finite output. The parent never touches OpenCL (so this test runs first in the
// standalone program). Rounds per mode: CLMHA_TEST_FIRST_CALL_ROUNDS, default 10 (4 under a
// sanitizer). Before clmha guarded these (release build, PoCL 3.1, 20 rounds each): one shared
// context 1 round failed (CLBlast: std::bad_alloc in its first GEMM), own contexts 17 crashed;
// under ASan (10 rounds each) 9 and 9 crashed: heap-use-after-free in clblast::Database's
// constructor, SEGV in strlen under PoCL's concurrent first device listing.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FIRST_CALL_ROUNDS 4
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define FIRST_CALL_ROUNDS 4
#endif
#endif
#ifndef FIRST_CALL_ROUNDS
#define FIRST_CALL_ROUNDS 10
#endif

typedef struct first_caller {
    job *j;
    clmha_context *shared;  // or NULL: the thread creates its own context
    pthread_barrier_t *start;
    int failed;  // 0, or the step that failed
} first_caller;

static void *first_call_run(void *arg) {
    first_caller *f = arg;
    job *j = f->j;
    clmha_context *ctx = f->shared, *own = NULL;
    clmha_layer *layer = NULL;
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    if (!ctx && clmha_context_create_from_env(&own) != CLMHA_SUCCESS) f->failed = 1;
    if (!ctx) ctx = own;
    if (!f->failed && (clmha_layer_create(&layer, ctx, &desc) ||
                       clmha_layer_set_parameter(layer, "in_proj_weight", j->w_in, 3 * E * E) ||
                       clmha_layer_set_parameter(layer, "out_proj.weight", j->w_out, E * E)))
        f->failed = 2;
    pthread_barrier_wait(f->start);  // every thread waits here, even one that failed
    clmha_forward_args args = {.struct_size = sizeof args,
        .query = {.ndim = 3, .shape = {L, N, E}, .data = j->q[0]},
        .key = {.ndim = 3, .shape = {S, N, E}, .data = j->k[0]},
        .value = {.ndim = 3, .shape = {S, N, E}, .data = j->v[0]},
        .need_weights = true};
    if (!f->failed &&
        clmha_layer_forward_host(layer, &args, j->out[0], OUT, j->wts[0], WTS) != CLMHA_SUCCESS) {
        fprintf(stderr, "first forward call: %s\n", clmha_context_last_error(ctx));
        f->failed = 3;
    }
    for (size_t i = 0; !f->failed && i < OUT; ++i)
        if (!isfinite(j->out[0][i])) f->failed = 4;
    clmha_layer_release(layer);
    clmha_context_release(own);
    return NULL;
}

// One round, in the child: exit status 0 pass, 1 a call failed, 77 no device.
static int first_calls_child(bool shared) {
    enum { THREADS = 4 };
    clmha_context *ctx = NULL;
    if (shared) {
        clmha_status st = clmha_context_create_from_env(&ctx);
        if (st == CLMHA_DEVICE_NOT_FOUND) return 77;
        if (st) return 1;
    }
    job *jobs = calloc(THREADS, sizeof *jobs);
    if (!jobs) return 1;
    first_caller f[THREADS];
    pthread_t threads[THREADS];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, THREADS);
    for (int t = 0; t < THREADS; ++t) {
        job_init(&jobs[t], t);
        f[t] = (first_caller){.j = &jobs[t], .shared = ctx, .start = &start};
        if (pthread_create(&threads[t], NULL, first_call_run, &f[t])) return 1;
    }
    int failed = 0;
    for (int t = 0; t < THREADS; ++t) {
        pthread_join(threads[t], NULL);
        if (f[t].failed && !failed) failed = f[t].failed;
    }
    pthread_barrier_destroy(&start);
    free(jobs);
    clmha_context_release(ctx);
    if (failed == 1 && !shared) return 77;  // no context: no device (a shared one said so above)
    return failed ? 1 : 0;
}

static void first_calls_rounds(bool shared) {
    int rounds = FIRST_CALL_ROUNDS;
    const char *env = getenv("CLMHA_TEST_FIRST_CALL_ROUNDS");
    if (env && atoi(env) > 0) rounds = atoi(env);
    int crashed = 0, failed = 0, skipped = 0;
    for (int r = 0; r < rounds; ++r) {
        fflush(NULL);
        pid_t pid = fork();
        cr_assert(pid >= 0, "fork failed");
        if (pid == 0) _exit(first_calls_child(shared));
        int status = 0;
        cr_assert_eq(waitpid(pid, &status, 0), pid);
        if (WIFEXITED(status) && WEXITSTATUS(status) == 77) ++skipped;
        else if (WIFEXITED(status) && WEXITSTATUS(status) != 0) ++failed;
        else if (!WIFEXITED(status)) {
            ++crashed;
            fprintf(stderr, "round %d: the child died of signal %d\n", r,
                    WIFSIGNALED(status) ? WTERMSIG(status) : 0);
        }
    }
    if (skipped == rounds) cr_skip_test("no OpenCL device");
    fprintf(stderr, "first calls (%s): %d rounds, %d crashed, %d failed\n",
            shared ? "one shared context" : "own contexts", rounds, crashed, failed);
    cr_expect_eq(crashed + failed, 0,
                 "first forward calls at once (%s): %d of %d rounds crashed, %d failed",
                 shared ? "one shared context" : "own contexts", crashed, rounds, failed);
}

Test(concurrency, first_calls_at_once_on_one_shared_context, .timeout = 1200) {
    first_calls_rounds(true);
}

Test(concurrency, first_calls_at_once_on_own_contexts, .timeout = 1200) {
    first_calls_rounds(false);
}

// Failing calls from two threads on one context: each thread reads the context's message right
// after its own failure. The message is the last one of any thread (clmha.h, Threading), so it
// may be either thread's, but it must be one of them whole, never a mix of both (and, under
// ThreadSanitizer, reading it must not race with the other thread recording its own).
typedef struct failer {
    clmha_layer *layer;
    const char *name;      // the unknown parameter name this thread sets
    const char *valid[2];  // the two complete messages
    pthread_barrier_t *start;
    int torn;
    char seen[512];
} failer;

static void *failer_run(void *arg) {
    failer *f = arg;
    float x = 0.0f;
    pthread_barrier_wait(f->start);
    for (int i = 0; i < 2000; ++i) {
        if (clmha_layer_set_parameter(f->layer, f->name, &x, 1) != CLMHA_INVALID_ARGUMENT) {
            ++f->torn;
            continue;
        }
        const char *m = clmha_context_last_error(clmha_layer_context(f->layer));
        if (strcmp(m, f->valid[0]) != 0 && strcmp(m, f->valid[1]) != 0 && !f->torn++)
            snprintf(f->seen, sizeof f->seen, "%s", m);
    }
    return NULL;
}

Test(concurrency, error_messages_from_two_threads_on_one_context, .timeout = 1200) {
    clmha_context *ctx = NULL;
    clmha_status st = clmha_context_create_from_env(&ctx);
    if (st == CLMHA_DEVICE_NOT_FOUND) cr_skip_test("no OpenCL device");
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_last_create_error());
    clmha_layer_desc desc = {.struct_size = sizeof desc,
                             .embed_dim = E, .num_heads = H, .bias = true};
    failer f[2] = {{.name = "no_such_parameter"}, {.name = "another_unknown_name_that_is_longer"}};
    static char messages[2][1024];
    float x = 0.0f;
    for (int t = 0; t < 2; ++t) {
        cr_assert_eq(clmha_layer_create(&f[t].layer, ctx, &desc), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(ctx));
        cr_assert_eq(clmha_layer_set_parameter(f[t].layer, f[t].name, &x, 1),
                     CLMHA_INVALID_ARGUMENT);
        snprintf(messages[t], sizeof messages[t], "%s", clmha_context_last_error(ctx));
    }
    pthread_barrier_t start;
    cr_assert_eq(pthread_barrier_init(&start, NULL, 2), 0);
    pthread_t threads[2];
    for (int t = 0; t < 2; ++t) {
        f[t].valid[0] = messages[0];
        f[t].valid[1] = messages[1];
        f[t].start = &start;
        cr_assert_eq(pthread_create(&threads[t], NULL, failer_run, &f[t]), 0);
    }
    for (int t = 0; t < 2; ++t) pthread_join(threads[t], NULL);
    pthread_barrier_destroy(&start);
    for (int t = 0; t < 2; ++t) {
        cr_expect_eq(f[t].torn, 0, "thread %d read %d mixed messages, e.g. \"%s\"", t, f[t].torn,
                     f[t].seen);
        clmha_layer_release(f[t].layer);
    }
    clmha_context_release(ctx);
}

// Messages are per thread (clmha.h): a thread that failed on a context reads its own message
// after another thread failed on the same context since, and a thread that never failed there
// reads "".
typedef struct own_failer {
    clmha_layer *layer;
    const char *name;  // the unknown parameter name this thread sets
    pthread_barrier_t *step;
    char seen[512];
} own_failer;

static void *own_failer_run(void *arg) {
    own_failer *f = arg;
    float x = 0.0f;
    if (f->name) clmha_layer_set_parameter(f->layer, f->name, &x, 1);
    pthread_barrier_wait(f->step);  // both have failed (or not)
    pthread_barrier_wait(f->step);  // the other thread failed once more meanwhile
    const clmha_context *ctx = clmha_layer_context(f->layer);
    snprintf(f->seen, sizeof f->seen, "%s", clmha_context_last_error(ctx));
    return NULL;
}

Test(concurrency, error_messages_are_the_calling_threads, .timeout = 600) {
    clmha_context *ctx = NULL;
    clmha_status st = clmha_context_create_from_env(&ctx);
    if (st == CLMHA_DEVICE_NOT_FOUND) cr_skip_test("no OpenCL device");
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_last_create_error());
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = E, .num_heads = H,
                             .bias = true};
    clmha_layer *layer = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    pthread_barrier_t step;
    cr_assert_eq(pthread_barrier_init(&step, NULL, 3), 0);
    own_failer f[2] = {{.layer = layer, .name = "first_threads_name", .step = &step},
                       {.layer = layer, .name = NULL, .step = &step}};
    pthread_t threads[2];
    for (int t = 0; t < 2; ++t)
        cr_assert_eq(pthread_create(&threads[t], NULL, own_failer_run, &f[t]), 0);
    pthread_barrier_wait(&step);
    float x = 0.0f;
    cr_expect_eq(clmha_layer_set_parameter(layer, "main_threads_name", &x, 1),
                 CLMHA_INVALID_ARGUMENT);
    pthread_barrier_wait(&step);
    for (int t = 0; t < 2; ++t) pthread_join(threads[t], NULL);
    pthread_barrier_destroy(&step);
    cr_expect(strstr(f[0].seen, "first_threads_name") != NULL, "thread 0 read \"%s\"",
              f[0].seen);
    cr_expect(f[1].seen[0] == '\0', "thread 1 never failed but read \"%s\"", f[1].seen);
    cr_expect(strstr(clmha_context_last_error(ctx), "main_threads_name") != NULL, "%s",
              clmha_context_last_error(ctx));
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}

// ---- attention as a function from several threads ----------------------------------------------

// Four threads call clmha_attention_forward_host() and clmha_attention_backward_host() on one
// context: two share a shape (one bare layer of the context's cache, its staging buffers and
// scratch), two have shapes of their own (two more bare layers, made while the others run).
// Every result must be bit-identical to the same calls made one after another.
enum { FN_THREADS = 4, FN_N = 2, FN_L = 6, FN_S = 9, FN_MAX = FN_N * 4 * FN_S * 16 };

typedef struct fn_job {
    size_t h, hkv, d;
    float q[FN_MAX], k[FN_MAX], v[FN_MAX], g[FN_MAX];
    float out[ITERS][FN_MAX], dq[ITERS][FN_MAX], dk[ITERS][FN_MAX], dv[ITERS][FN_MAX];
    clmha_context *ctx;
    int failed;
} fn_job;

static clmha_attention_args fn_args(fn_job *j) {
    return (clmha_attention_args){.struct_size = sizeof(clmha_attention_args),
        .query = {.ndim = 4, .shape = {FN_N, j->h, FN_L, j->d}, .data = j->q},
        .key = {.ndim = 4, .shape = {FN_N, j->hkv, FN_S, j->d}, .data = j->k},
        .value = {.ndim = 4, .shape = {FN_N, j->hkv, FN_S, j->d}, .data = j->v},
        .is_causal = true, .enable_gqa = true};
}

static void *fn_run(void *arg) {
    fn_job *j = arg;
    clmha_attention_args a = fn_args(j);
    size_t nq = FN_N * j->h * FN_L * j->d;
    for (int it = 0; it < ITERS && !j->failed; ++it) {
        if (clmha_attention_forward_host(j->ctx, &a, j->out[it], nq, NULL, 0, NULL, 0) ||
            clmha_attention_backward_host(j->ctx, &a, j->g, nq, j->dq[it], j->dk[it], j->dv[it],
                                          NULL)) {
            fprintf(stderr, "attention call: %s\n", clmha_context_last_error(j->ctx));
            j->failed = 1;
        }
    }
    return NULL;
}

static void fn_init(fn_job *j, int t, clmha_context *ctx) {
    static const size_t shapes[FN_THREADS][3] = {{4, 2, 8}, {4, 2, 8}, {2, 2, 16}, {4, 1, 4}};
    memset(j, 0, sizeof *j);
    j->h = shapes[t][0], j->hkv = shapes[t][1], j->d = shapes[t][2];
    j->ctx = ctx;
    uint64_t seed = 1000 + (uint64_t)t;
    for (size_t i = 0; i < FN_MAX; ++i) {
        j->q[i] = frand(&seed), j->k[i] = frand(&seed);
        j->v[i] = frand(&seed), j->g[i] = frand(&seed);
    }
}

Test(concurrency, attention_function_from_four_threads_on_one_context, .timeout = 1200) {
    clmha_context *ctx = NULL;
    if (clmha_context_create_from_env(&ctx) != CLMHA_SUCCESS) cr_skip_test("no OpenCL device");
    fn_job *serial = calloc(FN_THREADS, sizeof *serial), *par = calloc(FN_THREADS, sizeof *par);
    cr_assert(serial && par);
    for (int t = 0; t < FN_THREADS; ++t) {
        fn_init(&serial[t], t, ctx);
        fn_run(&serial[t]);
        cr_assert_eq(serial[t].failed, 0);
    }
    clmha_context_release(ctx);  // a fresh context: the threads make its bare layers
    cr_assert_eq(clmha_context_create_from_env(&ctx), CLMHA_SUCCESS);
    pthread_t threads[FN_THREADS];
    for (int t = 0; t < FN_THREADS; ++t) {
        fn_init(&par[t], t, ctx);
        cr_assert_eq(pthread_create(&threads[t], NULL, fn_run, &par[t]), 0);
    }
    for (int t = 0; t < FN_THREADS; ++t) pthread_join(threads[t], NULL);
    for (int t = 0; t < FN_THREADS; ++t) {
        cr_expect_eq(par[t].failed, 0, "thread %d failed", t);
        size_t nq = FN_N * par[t].h * FN_L * par[t].d, nk = FN_N * par[t].hkv * FN_S * par[t].d;
        for (int it = 0; it < ITERS; ++it) {
            cr_expect(memcmp(par[t].out[it], serial[t].out[0], nq * sizeof(float)) == 0,
                      "thread %d call %d: output differs from the serial run", t, it);
            cr_expect(memcmp(par[t].dq[it], serial[t].dq[0], nq * sizeof(float)) == 0 &&
                          memcmp(par[t].dk[it], serial[t].dk[0], nk * sizeof(float)) == 0 &&
                          memcmp(par[t].dv[it], serial[t].dv[0], nk * sizeof(float)) == 0,
                      "thread %d call %d: gradients differ from the serial run", t, it);
        }
    }
    double sum = 0;
    for (size_t i = 0; i < FN_N * 4 * FN_L * 8; ++i) sum += fabs(serial[0].out[0][i]);
    cr_expect(sum > 0.0, "the serial output is all zeros");
    free(serial), free(par);
    clmha_context_release(ctx);
}

#ifdef CLMHA_TEST_STANDALONE
int main(void) {
    // First: these fork children that must be the first in their process to touch OpenCL.
    concurrency_first_calls_at_once_on_one_shared_context();
    concurrency_first_calls_at_once_on_own_contexts();
    concurrency_four_threads_one_shared_context();
    concurrency_three_contexts_in_parallel_threads();
    concurrency_error_messages_from_two_threads_on_one_context();
    concurrency_error_messages_are_the_calling_threads();
    concurrency_attention_function_from_four_threads_on_one_context();
    printf("concurrency: %s\n", standalone_failures ? "FAIL" : "PASS");
    return standalone_failures ? 1 : 0;
}
#endif
