#define _POSIX_C_SOURCE 200809L
// A bounded soak (issue 37): 4 threads over 2 contexts loop for a fixed time on random mixed
// calls, valid and invalid, and the process's resident memory must stay flat.
//
// Each thread has its own layers (the header's threading rule: a layer, a KV cache and a saved
// state are used by one thread at a time), on the context it shares with another thread:
// float32 layers with and without bias, packed and separate projections, add_bias_kv, dropout,
// batch_first, the fused and the unfused core, and a float64 layer where the device has double
// precision. A thread picks at random: the host-array and the device-buffer forward pass (masks,
// is_causal, weights, dropout), the backward pass, its KV cache (create, paged or not, append
// and decode, truncate, reset, release), attention as a function (forward and backward),
// partial attention over two key ranges merged and projected, releasing and remaking a layer,
// and invalid calls. Every valid result is compared with the double-precision CPU reference
// (clmha_reference_forward() and friends) within the tolerances of the tests (1e-4 for float32,
// 2e-5 through a KV cache, 1e-12 for float64, gradients 1e-4 relative to 1 + their largest
// value); every invalid call must return its documented status with a message and leave its
// objects usable (the next valid call on them checks it).
//
// A plain program, not a Criterion suite: Criterion cannot start under ThreadSanitizer (see
// concurrency_standalone in tests/CMakeLists.txt), and the soak must run there too.
//
// Every 5 s it prints `t=..s rss=..MiB calls=.. valid=.. refused=..`; at the end the growth of
// the resident memory from the end of the warm-up (the first 20% of the run, at most 60 s, and
// at least WARM_OPS operations of every thread) to the end. Exit status 0 pass, 1 a wrong
// result, an unexpected status or growth above the bound (10% of the resident memory at the end
// of the warm-up + 16 MiB), 77 no OpenCL device.
//
// Commands (CTest runs `soak --seconds 20` as the test `soak`), from the source folder:
//   build/tests/soak --seconds 600 --threads 4 --seed 1
// Under AddressSanitizer (a build with -DCLMHA_SANITIZE=address,undefined), with the options
// CTest gives the sanitizer builds' tests (CLMHA_SANITIZER_ENV, tests/CMakeLists.txt):
//   export ASAN_OPTIONS=detect_leaks=1:use_sigaltstack=0
//   export LSAN_OPTIONS=suppressions=$PWD/tests/sanitizers/lsan.supp:use_tls=0
//   build-asan/tests/soak --seconds 180
// Under ThreadSanitizer (-DCLMHA_SANITIZE=thread; about 10 times slower):
//   export TSAN_OPTIONS=suppressions=$PWD/tests/sanitizers/tsan.supp:halt_on_error=1
//   build-tsan/tests/soak --seconds 120
// The device is $CLMHA_DEVICE's (clmha_context_create_from_env()), as in the tests.
#include <clmha.h>

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { MAX_THREADS = 16, MAX_LAYERS = 4, CACHE_BATCH = 2, CACHE_CAP = 24, PAGE = 8, PAGES = 6 };
// Operations every thread has done before the warm-up may end: its layers made and each kind of
// call run, so that the programs, scratch and caches the calls grow are in place (a slow
// build, ThreadSanitizer's, takes a third of a 20 s run to get there).
enum { WARM_OPS = 200 };

#define TOL_F32 1e-4
#define TOL_KV 2e-5
#define TOL_F64 1e-12

// ---- shared state -----------------------------------------------------------------------------

static atomic_ulong g_calls, g_valid, g_refused;
static atomic_bool g_stop, g_failed;
static double g_deadline;
static double g_warm_at;  // when the warm-up ended, seconds into the run

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// splitmix64: each thread's own stream, so a seed replays a thread's choices (the threads'
// interleaving still varies).
typedef struct prng {
    uint64_t s;
} prng;

static uint64_t rnd(prng *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double uni(prng *r) { return (double)(rnd(r) >> 11) * 0x1p-53; }
static size_t pick(prng *r, size_t lo, size_t hi) { return lo + rnd(r) % (hi - lo + 1); }
static bool coin(prng *r) { return rnd(r) & 1; }

static float *floats(prng *r, size_t count, double bound) {
    float *x = malloc((count ? count : 1) * sizeof *x);
    if (!x) abort();  // the soak's own arrays are a few KiB: out of memory is not its subject
    for (size_t i = 0; i < count; ++i) x[i] = (float)((2 * uni(r) - 1) * bound);
    return x;
}

static double *widen(const float *x, size_t count) {
    if (!x) return NULL;
    double *d = malloc((count ? count : 1) * sizeof *d);
    if (!d) abort();
    for (size_t i = 0; i < count; ++i) d[i] = x[i];
    return d;
}

static void *xcalloc(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size);
    if (!p) abort();
    return p;
}

// ---- layers -----------------------------------------------------------------------------------

typedef struct layer_cfg {
    size_t e, h, kdim, vdim;
    bool bias, add_bias_kv, batch_first;
    float dropout;
    clmha_impl impl;  // the layer's core (clmha_layer_set_impl())
    bool f64;
} layer_cfg;

// Slot 0 also serves the KV cache and partial attention (packed, no appended keys).
static const layer_cfg g_cfgs[MAX_LAYERS] = {
    {16, 4, 16, 16, true, false, false, 0.0f, CLMHA_IMPL_FUSED, false},
    {24, 3, 12, 20, true, true, false, 0.0f, CLMHA_IMPL_UNFUSED, false},
    {32, 2, 32, 32, false, false, true, 0.25f, CLMHA_IMPL_AUTO, false},
    {16, 2, 16, 16, true, false, false, 0.0f, CLMHA_IMPL_AUTO, true},
};

typedef struct layer_slot {
    layer_cfg cfg;
    clmha_layer_desc desc;
    clmha_layer *layer;
    float *w_in, *wq, *wk, *wv, *b_in, *wo, *bo, *bk, *bv;
    clmha_reference_params params;
} layer_slot;

typedef struct worker {
    int index;
    clmha_context *ctx;
    pthread_t thread;
    prng r;
    layer_slot slots[MAX_LAYERS];
    size_t num_slots;
    clmha_kv_cache *cache;  // slot 0's, CACHE_BATCH sequences of equal length
    bool cache_paged;
    size_t cache_len;
    float *history;  // the tokens the cache holds, (CACHE_CAP, CACHE_BATCH, E)
    const char *op;  // the operation running, for messages
    atomic_ulong ops;  // operations done (the warm-up waits for WARM_OPS of every thread)
} worker;

static void fail(worker *w, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    flockfile(stderr);
    fprintf(stderr, "soak: FAIL thread %d, %s: ", w->index, w->op);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    funlockfile(stderr);
    va_end(ap);
    atomic_store(&g_failed, true);
    atomic_store(&g_stop, true);
}

static void count_call(bool valid) {
    atomic_fetch_add(&g_calls, 1);
    atomic_fetch_add(valid ? &g_valid : &g_refused, 1);
}

// A valid call must succeed.
static bool ok(worker *w, clmha_status st, const char *call) {
    count_call(true);
    if (st == CLMHA_SUCCESS) return true;
    fail(w, "%s: %s: %s", call, clmha_status_string(st), clmha_context_last_error(w->ctx));
    return false;
}

// An invalid call must return @p want with a message: the context's, or without a context the
// thread's (clmha_last_create_error()).
static bool refused(worker *w, clmha_status st, clmha_status want, bool on_context,
                    const char *call) {
    count_call(false);
    if (st != want) {
        fail(w, "%s returned %s, expected %s (%s)", call, clmha_status_string(st),
             clmha_status_string(want), clmha_context_last_error(w->ctx));
        return false;
    }
    const char *msg = on_context ? clmha_context_last_error(w->ctx) : clmha_last_create_error();
    if (!msg || !*msg) {
        fail(w, "%s: %s without a message", call, clmha_status_string(st));
        return false;
    }
    return true;
}

static bool set_param(worker *w, layer_slot *s, const char *name, const float *x, size_t n) {
    if (!x) return true;
    return ok(w, clmha_layer_set_parameter(s->layer, name, x, n), name);
}

static bool slot_make_layer(worker *w, layer_slot *s) {
    if (!ok(w, clmha_layer_create(&s->layer, w->ctx, &s->desc), "clmha_layer_create"))
        return false;
    size_t e = s->cfg.e;
    return set_param(w, s, "in_proj_weight", s->w_in, 3 * e * e) &&
           set_param(w, s, "q_proj_weight", s->wq, e * e) &&
           set_param(w, s, "k_proj_weight", s->wk, e * s->cfg.kdim) &&
           set_param(w, s, "v_proj_weight", s->wv, e * s->cfg.vdim) &&
           set_param(w, s, "in_proj_bias", s->b_in, 3 * e) &&
           set_param(w, s, "out_proj.weight", s->wo, e * e) &&
           set_param(w, s, "out_proj.bias", s->bo, e) && set_param(w, s, "bias_k", s->bk, e) &&
           set_param(w, s, "bias_v", s->bv, e) &&
           ok(w, clmha_layer_set_impl(s->layer, s->cfg.impl), "clmha_layer_set_impl");
}

static bool slot_init(worker *w, layer_slot *s, const layer_cfg *cfg) {
    memset(s, 0, sizeof *s);
    s->cfg = *cfg;
    size_t e = cfg->e;
    s->desc = (clmha_layer_desc){.struct_size = sizeof s->desc, .embed_dim = e,
                                 .num_heads = cfg->h, .kdim = cfg->kdim, .vdim = cfg->vdim,
                                 .bias = cfg->bias, .add_bias_kv = cfg->add_bias_kv,
                                 .batch_first = cfg->batch_first, .dropout = cfg->dropout,
                                 .dtype = cfg->f64 ? CLMHA_DTYPE_F64 : CLMHA_DTYPE_F32};
    double bound = 1.0 / sqrt((double)e);
    if (cfg->kdim == e && cfg->vdim == e) {
        s->w_in = floats(&w->r, 3 * e * e, bound);
    } else {
        s->wq = floats(&w->r, e * e, bound);
        s->wk = floats(&w->r, e * cfg->kdim, bound);
        s->wv = floats(&w->r, e * cfg->vdim, bound);
    }
    s->wo = floats(&w->r, e * e, bound);
    if (cfg->bias) {
        s->b_in = floats(&w->r, 3 * e, 0.1);
        s->bo = floats(&w->r, e, 0.1);
    }
    if (cfg->add_bias_kv) {
        s->bk = floats(&w->r, e, 0.5);
        s->bv = floats(&w->r, e, 0.5);
    }
    s->params = (clmha_reference_params){
        .struct_size = sizeof s->params, .in_proj_weight = s->w_in, .q_proj_weight = s->wq,
        .k_proj_weight = s->wk, .v_proj_weight = s->wv, .in_proj_bias = s->b_in,
        .out_proj_weight = s->wo, .out_proj_bias = s->bo, .bias_k = s->bk, .bias_v = s->bv};
    return slot_make_layer(w, s);
}

static void slot_free(layer_slot *s) {
    clmha_layer_release(s->layer);
    float *all[] = {s->w_in, s->wq, s->wk, s->wv, s->b_in, s->wo, s->bo, s->bk, s->bv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) free(all[i]);
    memset(s, 0, sizeof *s);
}

// ---- one forward call ---------------------------------------------------------------------------

typedef struct fcall {
    const layer_slot *slot;
    size_t n, l, s, e, kd, vd, h;
    bool unbatched, self, f64;
    float *q, *k, *v, *kpm_f, *am_f;  // float masks' values (NULL for boolean ones)
    unsigned char *kpm_b, *am_b;      // boolean masks' bytes
    size_t kpm_count, am_count;
    double *q64, *k64, *v64, *kpm64, *am64;  // the float64 layer's host arrays
    clmha_forward_args args, args64;
    size_t out_count, w_count;
} fcall;

static clmha_tensor seq_tensor(const fcall *c, size_t len, size_t feat, const void *data) {
    clmha_tensor t = {.data = data};
    if (c->unbatched) {
        t.ndim = 2;
        t.shape[0] = len;
        t.shape[1] = feat;
    } else {
        t.ndim = 3;
        bool bf = c->slot->cfg.batch_first;
        t.shape[0] = bf ? c->n : len;
        t.shape[1] = bf ? len : c->n;
        t.shape[2] = feat;
    }
    return t;
}

// A mask of @p count values of @p kind: boolean bytes, or floats (-inf forbids).
static void make_mask(prng *r, clmha_mask_kind kind, size_t count, unsigned char **b, float **f) {
    if (kind == CLMHA_MASK_FLOAT) {
        *f = floats(r, count, 0.5);
        for (size_t i = 0; i < count; ++i)
            if (uni(r) < 0.2) (*f)[i] = -INFINITY;
        return;
    }
    *b = xcalloc(count, 1);
    double p = kind == CLMHA_MASK_BOOL_ATTEND ? 0.8 : 0.2;
    for (size_t i = 0; i < count; ++i) (*b)[i] = uni(r) < p;
}

static clmha_mask_kind random_kind(prng *r) {
    static const clmha_mask_kind kinds[] = {CLMHA_MASK_BOOL_IGNORE, CLMHA_MASK_BOOL_ATTEND,
                                            CLMHA_MASK_FLOAT};
    return kinds[rnd(r) % 3];
}

static void call_masks(worker *w, fcall *c) {
    clmha_forward_args *a = &c->args;
    if (coin(&w->r)) {
        clmha_mask_kind kind = random_kind(&w->r);
        c->kpm_count = c->n * c->s;
        make_mask(&w->r, kind, c->kpm_count, &c->kpm_b, &c->kpm_f);
        a->key_padding_mask = (clmha_mask){.kind = kind};
        a->key_padding_mask.tensor = (clmha_tensor){
            .ndim = c->unbatched ? 1 : 2, .shape = {c->unbatched ? c->s : c->n, c->s},
            .data = c->kpm_f ? (const void *)c->kpm_f : c->kpm_b};
    }
    if (coin(&w->r)) {
        clmha_mask_kind kind = random_kind(&w->r);
        bool three = coin(&w->r);  // (N*H, L, S), else (L, S)
        c->am_count = (three ? c->n * c->h : 1) * c->l * c->s;
        make_mask(&w->r, kind, c->am_count, &c->am_b, &c->am_f);
        a->attn_mask = (clmha_mask){.kind = kind};
        clmha_tensor t = {.ndim = 2, .shape = {c->l, c->s}};
        if (three) t = (clmha_tensor){.ndim = 3, .shape = {c->n * c->h, c->l, c->s}};
        t.data = c->am_f ? (const void *)c->am_f : c->am_b;
        a->attn_mask.tensor = t;
    }
    a->is_causal = uni(&w->r) < 0.3;
}

// The float64 layer's copy of the call: the same arguments on double arrays.
static void call_widen(fcall *c) {
    size_t qn = c->n * c->l * c->e;
    c->q64 = widen(c->q, qn);
    c->k64 = widen(c->k, c->n * c->s * c->kd);
    c->v64 = widen(c->v, c->n * c->s * c->vd);
    c->kpm64 = widen(c->kpm_f, c->kpm_count);
    c->am64 = widen(c->am_f, c->am_count);
    c->args64 = c->args;
    c->args64.query.data = c->q64;
    if (c->k64) c->args64.key.data = c->k64;
    if (c->v64) c->args64.value.data = c->v64;
    if (c->kpm64) c->args64.key_padding_mask.tensor.data = c->kpm64;
    if (c->am64) c->args64.attn_mask.tensor.data = c->am64;
}

// A random call of @p slot's layer: shapes, masks (with @p masks), weights (with @p weights),
// dropout in training where the layer has it, a core. Its output counts from the layer.
static bool call_make(worker *w, const layer_slot *slot, fcall *c, bool masks, bool weights) {
    memset(c, 0, sizeof *c);
    const layer_cfg *g = &slot->cfg;
    c->slot = slot;
    c->e = g->e, c->kd = g->kdim, c->vd = g->vdim, c->h = g->h, c->f64 = g->f64;
    c->unbatched = uni(&w->r) < 0.25;
    c->n = c->unbatched ? 1 : pick(&w->r, 1, 3);
    c->l = pick(&w->r, 1, 6);
    c->self = c->kd == c->e && c->vd == c->e && coin(&w->r);
    c->s = c->self ? c->l : pick(&w->r, 1, 8);
    clmha_forward_args *a = &c->args;
    *a = (clmha_forward_args){.struct_size = sizeof *a};
    c->q = floats(&w->r, c->n * c->l * c->e, 1.0);
    a->query = seq_tensor(c, c->l, c->e, c->q);
    if (!c->self) {
        c->k = floats(&w->r, c->n * c->s * c->kd, 1.0);
        c->v = floats(&w->r, c->n * c->s * c->vd, 1.0);
        a->key = seq_tensor(c, c->s, c->kd, c->k);
        a->value = seq_tensor(c, c->s, c->vd, c->v);
    }
    if (masks) call_masks(w, c);
    a->need_weights = weights && coin(&w->r);
    a->per_head_weights = a->need_weights && coin(&w->r);
    if (g->dropout > 0 && coin(&w->r)) {
        a->training = true;
        a->rng = (clmha_dropout_rng){.seed = rnd(&w->r), .offset = rnd(&w->r) >> 20};
    }
    if (a->need_weights)
        a->impl = g->impl == CLMHA_IMPL_FUSED || coin(&w->r) ? CLMHA_IMPL_UNFUSED : CLMHA_IMPL_AUTO;
    else
        a->impl = (clmha_impl)(rnd(&w->r) % 3);
    if (c->f64) call_widen(c);
    return ok(w, clmha_layer_output_counts(slot->layer, a, &c->out_count, &c->w_count),
              "clmha_layer_output_counts");
}

static void call_free(fcall *c) {
    void *all[] = {c->q, c->k, c->v, c->kpm_f, c->am_f, c->kpm_b, c->am_b,
                   c->q64, c->k64, c->v64, c->kpm64, c->am64};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) free(all[i]);
    memset(c, 0, sizeof *c);
}

// ---- comparisons ------------------------------------------------------------------------------

// Largest |got - want| (got floats, or doubles with @p f64) within @p tol; NaN fails.
static bool close_to(worker *w, const char *what, const void *got, bool f64, const double *want,
                     size_t count, double tol) {
    for (size_t i = 0; i < count; ++i) {
        double g = f64 ? ((const double *)got)[i] : ((const float *)got)[i];
        if (g == want[i]) continue;  // also -inf log-sum-exp rows (no key)
        double d = fabs(g - want[i]);
        if (!(d <= tol)) {
            fail(w, "%s[%zu] = %.9g, reference %.9g (tolerance %g)", what, i, g, want[i], tol);
            return false;
        }
    }
    return true;
}

// A gradient within @p tol relative to 1 + its largest value (test_backward_random.c's rule).
static bool grad_close(worker *w, const char *what, const float *got, const double *want,
                       size_t count) {
    double big = 0;
    for (size_t i = 0; i < count; ++i) big = fmax(big, fabs(want[i]));
    return close_to(w, what, got, false, want, count, TOL_F32 * (1 + big));
}

static bool reference(worker *w, const fcall *c, double *want, double *want_w) {
    char msg[256];
    clmha_forward_args a = c->args;
    a.save = NULL;  // what the device call keeps is no input of the reference
    clmha_status st = clmha_reference_forward(&c->slot->desc, &c->slot->params, &a, want,
                                              c->out_count, want_w, c->w_count, msg, sizeof msg);
    if (st == CLMHA_SUCCESS) return true;
    fail(w, "clmha_reference_forward: %s: %s", clmha_status_string(st), msg);
    return false;
}

// Compares a call's output and weights (floats, or doubles for the float64 layer).
static bool check_call(worker *w, const fcall *c, const void *out, const void *wts) {
    double *want = xcalloc(c->out_count, sizeof *want);
    double *want_w = c->w_count ? xcalloc(c->w_count, sizeof *want_w) : NULL;
    double tol = c->f64 ? TOL_F64 : TOL_F32;
    bool good = reference(w, c, want, want_w) &&
                close_to(w, "output", out, c->f64, want, c->out_count, tol) &&
                (!c->w_count || close_to(w, "weights", wts, c->f64, want_w, c->w_count, tol));
    free(want);
    free(want_w);
    return good;
}

// ---- operations: forward ------------------------------------------------------------------------

static layer_slot *any_slot(worker *w) { return &w->slots[rnd(&w->r) % w->num_slots]; }

static void op_forward_host(worker *w) {
    w->op = "forward (host arrays)";
    layer_slot *s = any_slot(w);
    fcall c;
    if (call_make(w, s, &c, true, true)) {
        size_t es = c.f64 ? sizeof(double) : sizeof(float);
        void *out = xcalloc(c.out_count, es), *wts = c.w_count ? xcalloc(c.w_count, es) : NULL;
        clmha_status st =
            c.f64 ? clmha_layer_forward_host_f64(s->layer, &c.args64, out, c.out_count, wts,
                                                 c.w_count)
                  : clmha_layer_forward_host(s->layer, &c.args, out, c.out_count, wts,
                                             c.w_count);
        if (ok(w, st, "clmha_layer_forward_host")) check_call(w, &c, out, wts);
        free(out);
        free(wts);
    }
    call_free(&c);
}

static cl_mem device_buffer(worker *w, const void *data, size_t bytes) {
    cl_int err = CL_SUCCESS;
    cl_mem_flags flags = CL_MEM_READ_WRITE | (data ? CL_MEM_COPY_HOST_PTR : 0);
    cl_mem b = clCreateBuffer(clmha_context_cl_context(w->ctx), flags, bytes ? bytes : 1,
                              (void *)data, &err);
    if (err != CL_SUCCESS) {
        fail(w, "clCreateBuffer(%zu bytes): %d", bytes, err);
        return NULL;
    }
    return b;
}

// The device copy of a host tensor of @p count elements (@p es bytes each); NULL when absent.
static bool upload(worker *w, clmha_tensor *t, const void *data, size_t count, size_t es,
                   cl_mem *keep) {
    if (!t->ndim) return true;
    *keep = device_buffer(w, data, count * es);
    t->buffer = *keep;
    t->data = NULL;
    return *keep != NULL;
}

static bool read_back(worker *w, cl_mem b, void *dst, size_t bytes) {
    cl_int err = clEnqueueReadBuffer(clmha_context_cl_queue(w->ctx), b, CL_TRUE, 0, bytes, dst,
                                     0, NULL, NULL);
    if (err == CL_SUCCESS) return true;
    fail(w, "clEnqueueReadBuffer: %d", err);
    return false;
}

// Runs @p c on device buffers: uploads, clmha_layer_forward(), waits for its event, reads.
static bool forward_device(worker *w, fcall *c, void *out, void *wts) {
    size_t es = c->f64 ? sizeof(double) : sizeof(float);
    clmha_forward_args a = c->f64 ? c->args64 : c->args;
    cl_mem mem[7] = {NULL};
    bool good =
        upload(w, &a.query, a.query.data, c->n * c->l * c->e, es, &mem[0]) &&
        upload(w, &a.key, a.key.data, c->n * c->s * c->kd, es, &mem[1]) &&
        upload(w, &a.value, a.value.data, c->n * c->s * c->vd, es, &mem[2]) &&
        upload(w, &a.key_padding_mask.tensor, a.key_padding_mask.tensor.data, c->kpm_count,
               c->kpm_f ? es : 1, &mem[3]) &&
        upload(w, &a.attn_mask.tensor, a.attn_mask.tensor.data, c->am_count, c->am_f ? es : 1,
               &mem[4]) &&
        (mem[5] = device_buffer(w, NULL, c->out_count * es)) != NULL &&
        (mem[6] = device_buffer(w, NULL, (c->w_count ? c->w_count : 1) * es)) != NULL;
    if (good) {
        cl_event ev = NULL;
        good = ok(w, clmha_layer_forward(c->slot->layer, &a, mem[5], 0, mem[6], 0, 0, NULL, &ev),
                  "clmha_layer_forward");
        if (good) {
            good = clWaitForEvents(1, &ev) == CL_SUCCESS;
            if (!good) fail(w, "clWaitForEvents failed");
            clReleaseEvent(ev);
        }
        good = good && read_back(w, mem[5], out, c->out_count * es) &&
               (!c->w_count || read_back(w, mem[6], wts, c->w_count * es));
    }
    for (size_t i = 0; i < 7; ++i)
        if (mem[i]) clReleaseMemObject(mem[i]);
    return good;
}

static void op_forward_device(worker *w) {
    w->op = "forward (device buffers)";
    layer_slot *s = any_slot(w);
    fcall c;
    if (call_make(w, s, &c, true, true)) {
        size_t es = c.f64 ? sizeof(double) : sizeof(float);
        void *out = xcalloc(c.out_count, es), *wts = c.w_count ? xcalloc(c.w_count, es) : NULL;
        if (forward_device(w, &c, out, wts)) check_call(w, &c, out, wts);
        free(out);
        free(wts);
    }
    call_free(&c);
}

// ---- operations: backward -----------------------------------------------------------------------

// The gradients the soak compares: the inputs', out_proj.weight's and in_proj_bias's.
typedef struct grads {
    float *q, *k, *v, *wo, *b_in;
    double *rq, *rk, *rv, *rwo, *rb_in;
} grads;

static bool compare_grads(worker *w, const fcall *c, const grads *g) {
    size_t e = c->e;
    return grad_close(w, "grad query", g->q, g->rq, c->n * c->l * e) &&
           (c->self || grad_close(w, "grad key", g->k, g->rk, c->n * c->s * c->kd)) &&
           (c->self || grad_close(w, "grad value", g->v, g->rv, c->n * c->s * c->vd)) &&
           grad_close(w, "grad out_proj.weight", g->wo, g->rwo, e * e) &&
           (!g->b_in || grad_close(w, "grad in_proj_bias", g->b_in, g->rb_in, 3 * e));
}

static void backward_check(worker *w, fcall *c, clmha_saved *saved) {
    size_t e = c->e, nk = c->n * c->s * c->kd, nv = c->n * c->s * c->vd;
    float *dy = floats(&w->r, c->out_count, 1.0);
    grads g = {.q = xcalloc(c->n * c->l * e, 4), .k = xcalloc(nk, 4), .v = xcalloc(nv, 4),
               .wo = xcalloc(e * e, 4), .b_in = c->slot->cfg.bias ? xcalloc(3 * e, 4) : NULL,
               .rq = xcalloc(c->n * c->l * e, 8), .rk = xcalloc(nk, 8), .rv = xcalloc(nv, 8),
               .rwo = xcalloc(e * e, 8), .rb_in = xcalloc(3 * e, 8)};
    clmha_backward_args b = {.struct_size = sizeof b, .forward = &c->args, .saved = saved,
                             .grad_output = c->args.query, .query = {.data = g.q},
                             .out_proj_weight = {.data = g.wo}, .in_proj_bias = {.data = g.b_in},
                             .impl = (clmha_impl)(rnd(&w->r) % 3)};
    b.grad_output.data = dy;
    clmha_reference_grads rg = {.struct_size = sizeof rg, .query = g.rq, .out_proj_weight = g.rwo,
                                .in_proj_bias = g.b_in ? g.rb_in : NULL};
    if (!c->self) {
        b.key.data = g.k, b.value.data = g.v;
        rg.key = g.rk, rg.value = g.rv;
    }
    // The fused backward needs a forward that ran the fused core; AUTO knows which ran.
    if (b.impl == CLMHA_IMPL_FUSED) b.impl = CLMHA_IMPL_AUTO;
    char msg[256];
    if (ok(w, clmha_layer_backward_host(c->slot->layer, &b), "clmha_layer_backward_host")) {
        clmha_status st = clmha_reference_backward(&c->slot->desc, &c->slot->params, &c->args,
                                                   dy, NULL, &rg, msg, sizeof msg);
        if (st != CLMHA_SUCCESS)
            fail(w, "clmha_reference_backward: %s: %s", clmha_status_string(st), msg);
        else
            compare_grads(w, c, &g);
    }
    void *all[] = {dy, g.q, g.k, g.v, g.wo, g.b_in, g.rq, g.rk, g.rv, g.rwo, g.rb_in};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) free(all[i]);
}

static void op_backward(worker *w) {
    w->op = "backward";
    layer_slot *s = &w->slots[rnd(&w->r) % 3];  // the float32 layers
    fcall c;
    clmha_saved *saved = NULL;
    if (call_make(w, s, &c, true, false) &&
        ok(w, clmha_saved_create(&saved, s->layer), "clmha_saved_create")) {
        c.args.save = saved;
        float *out = xcalloc(c.out_count, sizeof *out);
        if (ok(w, clmha_layer_forward_host(s->layer, &c.args, out, c.out_count, NULL, 0),
               "clmha_layer_forward_host (save)") &&
            check_call(w, &c, out, NULL))
            backward_check(w, &c, saved);
        free(out);
    }
    clmha_saved_release(saved);
    call_free(&c);
}

// ---- operations: the KV cache -------------------------------------------------------------------

static bool cache_lengths_are(worker *w, size_t want) {
    size_t len[CACHE_BATCH];
    if (!ok(w, clmha_kv_cache_lengths(w->cache, len, CACHE_BATCH), "clmha_kv_cache_lengths"))
        return false;
    for (size_t i = 0; i < CACHE_BATCH; ++i) {
        if (len[i] != want) {
            fail(w, "sequence %zu holds %zu tokens, expected %zu", i, len[i], want);
            return false;
        }
    }
    return true;
}

// A cache of slot 0's layer: contiguous (CACHE_CAP tokens a sequence) or paged (PAGES pages of
// PAGE tokens shared by the sequences, which then hold CACHE_CAP tokens each as well).
static bool cache_create(worker *w) {
    w->cache_paged = coin(&w->r);
    clmha_kv_cache_options o = {.struct_size = sizeof o};
    if (w->cache_paged) {
        o.page_size = PAGE;
        o.num_pages = PAGES;
    } else {
        o.capacity = CACHE_CAP;
    }
    w->cache_len = 0;
    return ok(w, clmha_kv_cache_create_with(&w->cache, w->slots[0].layer, CACHE_BATCH, &o),
              "clmha_kv_cache_create_with");
}

static void cache_release(worker *w) {
    clmha_kv_cache_release(w->cache);
    w->cache = NULL;
    w->cache_len = 0;
}

// The reference of the last @p m tokens' rows: their queries over every token the cache holds
// (bottom-right causal: query i sees tokens up to len - m + i).
static bool cache_check(worker *w, const float *x, size_t m, bool causal, const float *out) {
    const layer_slot *s = &w->slots[0];
    size_t e = s->cfg.e, len = w->cache_len, nb = CACHE_BATCH;
    clmha_forward_args r = {.struct_size = sizeof r};
    r.query = (clmha_tensor){.ndim = 3, .shape = {m, nb, e}, .data = x};
    r.key = (clmha_tensor){.ndim = 3, .shape = {len, nb, e}, .data = w->history};
    r.value = r.key;
    unsigned char *mask = NULL;
    if (causal) {
        mask = xcalloc(m * len, 1);
        for (size_t i = 0; i < m; ++i)
            for (size_t j = 0; j < len; ++j) mask[i * len + j] = j > len - m + i;
        r.attn_mask = (clmha_mask){.kind = CLMHA_MASK_BOOL_IGNORE,
                                   .tensor = {.ndim = 2, .shape = {m, len}, .data = mask}};
    }
    double *want = xcalloc(m * nb * e, sizeof *want);
    char msg[256];
    clmha_status st = clmha_reference_forward(&s->desc, &s->params, &r, want, m * nb * e, NULL,
                                              0, msg, sizeof msg);
    bool good = st == CLMHA_SUCCESS;
    if (!good) fail(w, "clmha_reference_forward: %s: %s", clmha_status_string(st), msg);
    good = good && close_to(w, "KV-cache output", out, false, want, m * nb * e, TOL_KV);
    free(want);
    free(mask);
    return good;
}

// Appends m tokens of every sequence, their queries attending over the cache; past the
// capacity the call must be refused and change nothing.
static void cache_append(worker *w) {
    const layer_slot *s = &w->slots[0];
    size_t e = s->cfg.e, nb = CACHE_BATCH, m = pick(&w->r, 1, 4), len = w->cache_len;
    if (w->cache_paged && len + m > CACHE_CAP) {
        // When a paged pool runs out depends on the pages forks share: not predicted here.
        if (ok(w, clmha_kv_cache_reset(w->cache), "clmha_kv_cache_reset")) w->cache_len = 0;
        return;
    }
    float *x = floats(&w->r, m * nb * e, 1.0), *out = xcalloc(m * nb * e, sizeof *out);
    bool causal = coin(&w->r);
    clmha_forward_args a = {.struct_size = sizeof a, .kv_cache = w->cache, .is_causal = causal};
    a.query = (clmha_tensor){.ndim = 3, .shape = {m, nb, e}, .data = x};
    a.key = a.query;
    a.value = a.query;
    clmha_status st = clmha_layer_forward_host(s->layer, &a, out, m * nb * e, NULL, 0);
    if (len + m > CACHE_CAP) {
        if (refused(w, st, CLMHA_SHAPE_MISMATCH, true, "append past the capacity"))
            cache_lengths_are(w, len);
    } else if (ok(w, st, "clmha_layer_forward_host (KV cache)")) {
        memcpy(w->history + len * nb * e, x, m * nb * e * sizeof *x);
        w->cache_len += m;
        if (cache_lengths_are(w, w->cache_len)) cache_check(w, x, m, causal, out);
    }
    free(x);
    free(out);
}

// Sequence 1 takes sequence 0's tokens (a paged cache shares its pages; a contiguous one
// refuses).
static void cache_fork(worker *w) {
    clmha_status st = clmha_kv_cache_fork(w->cache, 0, 1);
    if (!w->cache_paged) {
        refused(w, st, CLMHA_UNSUPPORTED, true, "clmha_kv_cache_fork (contiguous)");
        return;
    }
    if (!ok(w, st, "clmha_kv_cache_fork")) return;
    size_t e = w->slots[0].cfg.e;
    for (size_t t = 0; t < w->cache_len; ++t)
        memcpy(w->history + (t * CACHE_BATCH + 1) * e, w->history + t * CACHE_BATCH * e,
               e * sizeof(float));
}

static void op_kv(worker *w) {
    w->op = "KV cache";
    if (!w->cache) {
        cache_create(w);
        return;
    }
    unsigned k = (unsigned)(rnd(&w->r) % 12);
    if (k < 7) {
        cache_append(w);
    } else if (k == 7) {
        size_t t = pick(&w->r, 0, w->cache_len), lengths[CACHE_BATCH] = {t, t};
        if (ok(w, clmha_kv_cache_truncate(w->cache, lengths, CACHE_BATCH),
               "clmha_kv_cache_truncate")) {
            w->cache_len = t;
            cache_lengths_are(w, t);
        }
    } else if (k == 8) {
        if (ok(w, clmha_kv_cache_reset(w->cache), "clmha_kv_cache_reset")) {
            w->cache_len = 0;
            cache_lengths_are(w, 0);
        }
    } else if (k == 9) {
        cache_fork(w);
    } else {
        cache_release(w);
    }
}

// ---- operations: attention as a function, partial attention ------------------------------------

typedef struct attn_call {
    clmha_attention_args a;
    float *q, *k, *v, *mask;
    size_t oc, lc;
} attn_call;

static clmha_tensor head_tensor(bool nlhd, size_t n, size_t h, size_t len, size_t d,
                                const float *x) {
    clmha_tensor t = {.ndim = 4, .shape = {n, nlhd ? len : h, nlhd ? h : len, d}, .data = x};
    return t;
}

static bool attn_make(worker *w, attn_call *c) {
    memset(c, 0, sizeof *c);
    size_t n = pick(&w->r, 1, 2), h = coin(&w->r) ? 2 : 4, hkv = coin(&w->r) ? h : 1;
    size_t l = pick(&w->r, 1, 5), s = pick(&w->r, 1, 6), d = coin(&w->r) ? 4 : 8;
    bool nlhd = coin(&w->r);
    c->q = floats(&w->r, n * h * l * d, 1.0);
    c->k = floats(&w->r, n * hkv * s * d, 1.0);
    c->v = floats(&w->r, n * hkv * s * d, 1.0);
    clmha_attention_args *a = &c->a;
    *a = (clmha_attention_args){.struct_size = sizeof *a, .enable_gqa = hkv != h,
                                .layout = nlhd ? CLMHA_LAYOUT_NLHD : CLMHA_LAYOUT_NHLD};
    a->query = head_tensor(nlhd, n, h, l, d, c->q);
    a->key = head_tensor(nlhd, n, hkv, s, d, c->k);
    a->value = head_tensor(nlhd, n, hkv, s, d, c->v);
    unsigned k = (unsigned)(rnd(&w->r) % 3);
    if (k == 1) a->is_causal = true;
    if (k == 2) {
        c->mask = floats(&w->r, l * s, 0.5);
        for (size_t i = 0; i < l * s; ++i)
            if (uni(&w->r) < 0.2) c->mask[i] = -INFINITY;
        a->attn_mask = (clmha_mask){.kind = CLMHA_MASK_FLOAT,
                                    .tensor = {.ndim = 2, .shape = {l, s}, .data = c->mask}};
    }
    return ok(w, clmha_attention_output_counts(w->ctx, a, &c->oc, &c->lc, NULL),
              "clmha_attention_output_counts");
}

static void attn_free(attn_call *c) {
    free(c->q);
    free(c->k);
    free(c->v);
    free(c->mask);
}

static void attn_backward(worker *w, attn_call *c) {
    const size_t *ks = c->a.key.shape;
    size_t nq = c->oc, nk = ks[0] * ks[1] * ks[2] * ks[3];
    float *dy = floats(&w->r, c->oc, 1.0), *gq = xcalloc(nq, 4), *gk = xcalloc(nk, 4),
          *gv = xcalloc(nk, 4);
    double *rq = xcalloc(nq, 8), *rk = xcalloc(nk, 8), *rv = xcalloc(nk, 8);
    clmha_reference_grads rg = {.struct_size = sizeof rg, .query = rq, .key = rk, .value = rv};
    char msg[256];
    if (ok(w, clmha_attention_backward_host(w->ctx, &c->a, dy, c->oc, gq, gk, gv, NULL),
           "clmha_attention_backward_host")) {
        clmha_status st = clmha_reference_attention_backward(&c->a, dy, &rg, msg, sizeof msg);
        if (st != CLMHA_SUCCESS)
            fail(w, "clmha_reference_attention_backward: %s", msg);
        else if (grad_close(w, "grad query", gq, rq, nq) && grad_close(w, "grad key", gk, rk, nk))
            grad_close(w, "grad value", gv, rv, nk);
    }
    void *all[] = {dy, gq, gk, gv, rq, rk, rv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) free(all[i]);
}

static void op_attention(worker *w) {
    w->op = "attention as a function";
    attn_call c;
    if (attn_make(w, &c)) {
        bool with_lse = coin(&w->r);
        float *out = xcalloc(c.oc, 4), *lse = xcalloc(c.lc, 4);
        double *ro = xcalloc(c.oc, 8), *rl = xcalloc(c.lc, 8);
        char msg[256];
        if (ok(w, clmha_attention_forward_host(w->ctx, &c.a, out, c.oc, with_lse ? lse : NULL,
                                               with_lse ? c.lc : 0, NULL, 0),
               "clmha_attention_forward_host")) {
            clmha_status st = clmha_reference_attention(&c.a, ro, c.oc, rl, c.lc, NULL, 0, msg,
                                                        sizeof msg);
            if (st != CLMHA_SUCCESS)
                fail(w, "clmha_reference_attention: %s", msg);
            else if (close_to(w, "attention output", out, false, ro, c.oc, TOL_F32) &&
                     (!with_lse || close_to(w, "lse", lse, false, rl, c.lc, TOL_F32)) &&
                     coin(&w->r))
                attn_backward(w, &c);
        }
        free(out);
        free(lse);
        free(ro);
        free(rl);
    }
    attn_free(&c);
}

// Attention over keys [0, cut) and [cut, S) of slot 0's layer, merged and projected, against
// the reference's whole forward pass.
static bool partial_run(worker *w, size_t n, size_t l, size_t s, size_t cut, bool causal,
                        const float *q, const float *k, const float *v, float *out) {
    layer_slot *sl = &w->slots[0];
    size_t e = sl->cfg.e, d = e / sl->cfg.h, rows = n * sl->cfg.h * l;
    cl_mem m[9] = {NULL};  // query, keys and values of both ranges, acc (heads, lse), part
    m[0] = device_buffer(w, q, l * n * e * 4);
    m[1] = device_buffer(w, k, cut * n * e * 4);
    m[2] = device_buffer(w, v, cut * n * e * 4);
    m[3] = device_buffer(w, k + cut * n * e, (s - cut) * n * e * 4);
    m[4] = device_buffer(w, v + cut * n * e, (s - cut) * n * e * 4);
    m[5] = device_buffer(w, NULL, rows * d * 4);
    m[6] = device_buffer(w, NULL, rows * 4);
    m[7] = device_buffer(w, NULL, rows * d * 4);
    m[8] = device_buffer(w, NULL, rows * 4);
    cl_mem res = device_buffer(w, NULL, l * n * e * 4);
    bool good = res != NULL;
    for (size_t i = 0; i < 9; ++i) good = good && m[i];
    for (size_t r = 0; good && r < 2; ++r) {
        size_t j0 = r ? 0 : cut, j1 = r ? cut : s;
        clmha_forward_args a = {.struct_size = sizeof a, .is_causal = causal, .key_position = j0};
        a.query = (clmha_tensor){.ndim = 3, .shape = {l, n, e}, .buffer = m[0]};
        a.key = (clmha_tensor){.ndim = 3, .shape = {j1 - j0, n, e}, .buffer = m[r ? 1 : 3]};
        a.value = (clmha_tensor){.ndim = 3, .shape = {j1 - j0, n, e}, .buffer = m[r ? 2 : 4]};
        good = ok(w, clmha_layer_attend(sl->layer, &a, r == 0, m[r ? 7 : 5], 0, m[r ? 8 : 6], 0,
                                        0, NULL, NULL),
                  "clmha_layer_attend");
    }
    good = good && ok(w, clmha_attention_merge(w->ctx, rows, d, m[5], 0, m[6], 0, m[7], 0, m[8],
                                               0, 0, NULL, NULL),
                      "clmha_attention_merge");
    good = good && ok(w, clmha_layer_project_heads(sl->layer, n, l, m[5], 0, res, 0, 0, NULL,
                                                   NULL),
                      "clmha_layer_project_heads");
    good = good && read_back(w, res, out, l * n * e * 4);
    for (size_t i = 0; i < 9; ++i)
        if (m[i]) clReleaseMemObject(m[i]);
    if (res) clReleaseMemObject(res);
    return good;
}

static void op_partial(worker *w) {
    w->op = "partial attention + merge";
    layer_slot *sl = &w->slots[0];
    size_t e = sl->cfg.e, n = pick(&w->r, 1, 2), l = pick(&w->r, 1, 4), s = pick(&w->r, 2, 8);
    size_t cut = pick(&w->r, 1, s - 1);
    bool causal = coin(&w->r);
    float *q = floats(&w->r, l * n * e, 1.0), *k = floats(&w->r, s * n * e, 1.0),
          *v = floats(&w->r, s * n * e, 1.0), *out = xcalloc(l * n * e, 4);
    double *want = xcalloc(l * n * e, 8);
    if (partial_run(w, n, l, s, cut, causal, q, k, v, out)) {
        clmha_forward_args a = {.struct_size = sizeof a, .is_causal = causal};
        a.query = (clmha_tensor){.ndim = 3, .shape = {l, n, e}, .data = q};
        a.key = (clmha_tensor){.ndim = 3, .shape = {s, n, e}, .data = k};
        a.value = (clmha_tensor){.ndim = 3, .shape = {s, n, e}, .data = v};
        char msg[256];
        clmha_status st = clmha_reference_forward(&sl->desc, &sl->params, &a, want, l * n * e,
                                                  NULL, 0, msg, sizeof msg);
        if (st != CLMHA_SUCCESS)
            fail(w, "clmha_reference_forward: %s", msg);
        else
            close_to(w, "merged output", out, false, want, l * n * e, TOL_F32);
    }
    free(q);
    free(k);
    free(v);
    free(out);
    free(want);
}

// ---- operations: invalid calls, layers remade -------------------------------------------------

// A valid call on @p s after a refused one: the layer is still usable.
static void forward_after(worker *w, layer_slot *s) {
    fcall c;
    if (call_make(w, s, &c, false, false)) {
        float *out = xcalloc(c.out_count, sizeof *out);
        if (!c.f64 && ok(w, clmha_layer_forward_host(s->layer, &c.args, out, c.out_count, NULL, 0),
                         "clmha_layer_forward_host after a refused call"))
            check_call(w, &c, out, NULL);
        free(out);
    }
    call_free(&c);
}

// An invalid forward call of a float32 layer: the status it must return.
static void invalid_forward(worker *w, unsigned which) {
    layer_slot *s = &w->slots[rnd(&w->r) % 3];
    fcall c;
    if (!call_make(w, s, &c, false, false)) return;
    clmha_forward_args a = c.args;
    float *out = xcalloc(c.out_count + 1, sizeof *out);
    unsigned char *bytes = xcalloc((c.l + 1) * c.s * c.n * c.h + 1, 1);
    size_t count = c.out_count;
    clmha_layer *layer = s->layer;
    clmha_status want = CLMHA_INVALID_ARGUMENT, st;
    bool on_context = true;
    switch (which) {
    case 0: layer = NULL, on_context = false; break;
    case 1: a.struct_size = 0; break;
    case 2: a.query.shape[a.query.ndim - 1] = c.e + 1, want = CLMHA_SHAPE_MISMATCH; break;
    case 3:
        a.key_padding_mask = (clmha_mask){.kind = (clmha_mask_kind)17};
        a.key_padding_mask.tensor = (clmha_tensor){.ndim = 1, .shape = {c.s}, .data = bytes};
        want = CLMHA_INVALID_MASK;
        break;
    case 4:
        a.attn_mask = (clmha_mask){.kind = CLMHA_MASK_BOOL_IGNORE};
        a.attn_mask.tensor = (clmha_tensor){.ndim = 2, .shape = {c.l + 1, c.s}, .data = bytes};
        want = CLMHA_INVALID_MASK;
        break;
    case 5: count += 1, want = CLMHA_SHAPE_MISMATCH; break;
    case 6:
        a.attn_mask.tensor = (clmha_tensor){.ndim = 2, .shape = {c.l, c.s}, .data = bytes};
        want = CLMHA_INVALID_MASK;  // a tensor with kind NONE
        break;
    default: a.impl = (clmha_impl)9; break;
    }
    st = clmha_layer_forward_host(layer, &a, out, count, NULL, 0);
    bool good = refused(w, st, want, on_context, "invalid clmha_layer_forward_host");
    free(out);
    free(bytes);
    call_free(&c);
    if (good) forward_after(w, s);
}

static void invalid_cache(worker *w, unsigned which) {
    if (!w->cache && !cache_create(w)) return;
    size_t lengths[3] = {w->cache_len + 1, w->cache_len + 1, 0};
    if (which == 0) {
        refused(w, clmha_kv_cache_truncate(w->cache, lengths, CACHE_BATCH), CLMHA_INVALID_ARGUMENT,
                true, "clmha_kv_cache_truncate past the length");
    } else if (which == 1) {
        lengths[0] = lengths[1] = 0;
        refused(w, clmha_kv_cache_truncate(w->cache, lengths, 3), CLMHA_SHAPE_MISMATCH, true,
                "clmha_kv_cache_truncate of 3 sequences");
    } else {
        // Slot 1's layer (E 24) with slot 0's cache.
        layer_slot *s = &w->slots[1];
        fcall c;
        if (call_make(w, s, &c, false, false)) {
            c.args.kv_cache = w->cache;
            c.args.impl = CLMHA_IMPL_AUTO;  // the decode core takes no other
            float *out = xcalloc(c.out_count, sizeof *out);
            refused(w, clmha_layer_forward_host(s->layer, &c.args, out, c.out_count, NULL, 0),
                    CLMHA_INVALID_ARGUMENT, true, "a cache of another layer");
            free(out);
        }
        call_free(&c);
    }
    if (!atomic_load(&g_stop)) cache_lengths_are(w, w->cache_len);
}

static void invalid_other(worker *w, unsigned which) {
    layer_slot *s = &w->slots[0];
    clmha_layer *layer = NULL;
    clmha_layer_desc d = s->desc;
    float x[4] = {0};
    if (which == 0) {
        d.num_heads = 3;  // E 16
        refused(w, clmha_layer_create(&layer, w->ctx, &d), CLMHA_INVALID_ARGUMENT, true,
                "clmha_layer_create, E not a multiple of H");
    } else if (which == 1) {
        d.struct_size = 0;
        refused(w, clmha_layer_create(&layer, w->ctx, &d), CLMHA_INVALID_ARGUMENT, true,
                "clmha_layer_create, struct_size 0");
    } else if (which == 2) {
        if (refused(w, clmha_layer_set_parameter(s->layer, "out_proj.weight", x, 4),
                    CLMHA_SHAPE_MISMATCH, true, "clmha_layer_set_parameter, wrong count"))
            forward_after(w, s);
    } else if (which == 3) {
        refused(w, clmha_layer_set_parameter(s->layer, "no_such_weight", x, 4),
                CLMHA_INVALID_ARGUMENT, true, "clmha_layer_set_parameter, unknown name");
    } else if (which == 4) {
        attn_call c;
        if (attn_make(w, &c)) {
            c.a.is_causal = true;
            c.a.attn_mask = (clmha_mask){.kind = CLMHA_MASK_FLOAT};
            c.a.attn_mask.tensor = (clmha_tensor){.ndim = 1, .shape = {c.a.key.shape[2]},
                                                  .data = c.k};
            float *out = xcalloc(c.oc, 4);
            refused(w, clmha_attention_forward_host(w->ctx, &c.a, out, c.oc, NULL, 0, NULL, 0),
                    CLMHA_INVALID_ARGUMENT, true, "attention with is_causal and attn_mask");
            free(out);
        }
        attn_free(&c);
    } else {
        clmha_kv_cache *cache = NULL;
        refused(w, clmha_kv_cache_create(&cache, s->layer, CACHE_BATCH, 0),
                CLMHA_INVALID_ARGUMENT, true, "clmha_kv_cache_create, capacity 0");
    }
    if (layer) fail(w, "a refused clmha_layer_create made a layer");
    clmha_layer_release(layer);
}

// A backward call on a saved state that no forward call filled.
static void invalid_backward(worker *w) {
    layer_slot *s = &w->slots[0];
    fcall c;
    clmha_saved *saved = NULL;
    if (call_make(w, s, &c, false, false) &&
        ok(w, clmha_saved_create(&saved, s->layer), "clmha_saved_create")) {
        float *dy = xcalloc(c.out_count, 4), *gq = xcalloc(c.out_count, 4);
        clmha_backward_args b = {.struct_size = sizeof b, .forward = &c.args, .saved = saved,
                                 .grad_output = c.args.query, .query = {.data = gq}};
        b.grad_output.data = dy;
        refused(w, clmha_layer_backward_host(s->layer, &b), CLMHA_INVALID_ARGUMENT, true,
                "clmha_layer_backward_host, saved state never filled");
        free(dy);
        free(gq);
    }
    clmha_saved_release(saved);
    call_free(&c);
}

static void op_invalid(worker *w) {
    w->op = "invalid call";
    unsigned k = (unsigned)(rnd(&w->r) % 18);
    if (k < 8) invalid_forward(w, k);
    else if (k < 11) invalid_cache(w, k - 8);
    else if (k < 17) invalid_other(w, k - 11);
    else invalid_backward(w);
}

// Releases a layer and makes it again (the context's program cache serves it), or takes and
// drops a reference on the shared context.
static void op_churn(worker *w) {
    w->op = "layer remade";
    if (coin(&w->r)) {
        clmha_context_retain(w->ctx);
        clmha_context_release(w->ctx);
        return;
    }
    size_t i = rnd(&w->r) % w->num_slots;
    if (i == 0) cache_release(w);  // a cache belongs to its layer
    clmha_layer_release(w->slots[i].layer);
    w->slots[i].layer = NULL;
    if (slot_make_layer(w, &w->slots[i])) forward_after(w, &w->slots[i]);
}

// ---- threads ----------------------------------------------------------------------------------

typedef void (*op_fn)(worker *w);

static const struct {
    op_fn fn;
    unsigned weight;
    const char *name;
} g_ops[] = {
    {op_forward_host, 24, "forward_host"}, {op_forward_device, 12, "forward_device"},
    {op_backward, 12, "backward"},         {op_kv, 20, "kv_cache"},
    {op_attention, 10, "attention"},       {op_partial, 8, "partial"},
    {op_invalid, 12, "invalid"},           {op_churn, 2, "remake"},
};
enum { NUM_OPS = sizeof g_ops / sizeof g_ops[0] };
static atomic_ulong g_op_runs[NUM_OPS];

static void *worker_main(void *p) {
    worker *w = p;
    w->op = "setup";
    for (size_t i = 0; i < w->num_slots; ++i)
        if (!slot_init(w, &w->slots[i], &g_cfgs[i])) return NULL;
    unsigned total = 0;
    for (size_t i = 0; i < NUM_OPS; ++i) total += g_ops[i].weight;
    while (!atomic_load(&g_stop) && now_s() < g_deadline) {
        unsigned k = (unsigned)(rnd(&w->r) % total);
        size_t i = 0;
        while (k >= g_ops[i].weight) k -= g_ops[i++].weight;
        atomic_fetch_add(&g_op_runs[i], 1);
        g_ops[i].fn(w);
        atomic_fetch_add(&w->ops, 1);
    }
    return NULL;
}

static void worker_free(worker *w) {
    cache_release(w);
    for (size_t i = 0; i < MAX_LAYERS; ++i) slot_free(&w->slots[i]);
    free(w->history);
}

// ---- resident memory and main -----------------------------------------------------------------

static double rss_mib(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long size = 0, resident = 0;
    if (!f) return 0;
    if (fscanf(f, "%lu %lu", &size, &resident) != 2) resident = 0;
    fclose(f);
    return (double)resident * (double)sysconf(_SC_PAGESIZE) / (1024.0 * 1024.0);
}

typedef struct options {
    double seconds, warmup, bound_pct, bound_mib;
    int threads;
    uint64_t seed;
} options;

static int parse(int argc, char **argv, options *o) {
    *o = (options){.seconds = 600, .warmup = -1, .bound_pct = 10, .bound_mib = 16, .threads = 4,
                   .seed = 1};
    for (int i = 1; i + 1 < argc; i += 2) {
        char *end = NULL;
        double v = strtod(argv[i + 1], &end);
        if (!end || *end || v < 0) return fprintf(stderr, "soak: bad value %s\n", argv[i + 1]), 2;
        if (!strcmp(argv[i], "--seconds")) o->seconds = v;
        else if (!strcmp(argv[i], "--threads")) o->threads = (int)v;
        else if (!strcmp(argv[i], "--seed")) o->seed = (uint64_t)v;
        else if (!strcmp(argv[i], "--warmup")) o->warmup = v;
        else if (!strcmp(argv[i], "--max-growth-pct")) o->bound_pct = v;
        else if (!strcmp(argv[i], "--max-growth-mib")) o->bound_mib = v;
        else return fprintf(stderr, "soak: unknown option %s\n", argv[i]), 2;
    }
    if (argc % 2 == 0 || o->threads < 1 || o->threads > MAX_THREADS || o->seconds <= 0) {
        fprintf(stderr, "usage: soak [--seconds N] [--threads T (1..%d)] [--seed S] "
                        "[--warmup S] [--max-growth-pct P] [--max-growth-mib M]\n",
                MAX_THREADS);
        return 2;
    }
    if (o->warmup < 0) o->warmup = fmin(60, 0.2 * o->seconds);
    return 0;
}

static void print_sample(double t, double rss) {
    printf("t=%.0fs rss=%.1fMiB calls=%lu valid=%lu refused=%lu\n", t, rss,
           atomic_load(&g_calls), atomic_load(&g_valid), atomic_load(&g_refused));
    fflush(stdout);
}

static bool has_fp64(clmha_context *ctx) {
    cl_device_fp_config fp = 0;
    cl_int err = clGetDeviceInfo(clmha_context_cl_device(ctx), CL_DEVICE_DOUBLE_FP_CONFIG,
                                 sizeof fp, &fp, NULL);
    return err == CL_SUCCESS && fp != 0;
}

static bool all_warm(worker *workers, int count) {
    for (int i = 0; i < count; ++i)
        if (atomic_load(&workers[i].ops) < WARM_OPS) return false;
    return true;
}

// Samples the resident memory every 5 s until the threads' deadline; returns it at the end of
// the warm-up (in *warm; the end's when the warm-up did not end) and the end, and the peak. The
// end's sample is taken half a second before the deadline, while the threads still run: a
// thread that exits gives back its stack and, under AddressSanitizer, its fake stacks (~50 MiB
// for 4 threads), which would hide growth.
static bool monitor(const options *o, double t0, worker *workers, double *warm, double *end,
                    double *peak) {
    double next = t0 + 5, rss = rss_mib();
    bool warmed = false;
    *peak = rss;
    while (!atomic_load(&g_stop) && now_s() < g_deadline - 0.5) {
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
        double t = now_s();
        bool warm_now = !warmed && t >= t0 + o->warmup && all_warm(workers, o->threads);
        if (t < next && !warm_now) continue;
        rss = rss_mib();
        *peak = fmax(*peak, rss);
        if (warm_now) {
            warmed = true;
            *warm = rss;
            g_warm_at = t - t0;
            printf("warm-up done at t=%.0fs: rss=%.1fMiB\n", g_warm_at, rss);
        }
        if (t >= next) {
            print_sample(t - t0, rss);
            next += 5;
        }
    }
    *end = rss_mib();
    if (!warmed) *warm = *end;
    *peak = fmax(*peak, *end);
    return warmed;
}

int main(int argc, char **argv) {
    options o;
    int rc = parse(argc, argv, &o);
    if (rc) return rc;
    clmha_context *ctx[2] = {NULL, NULL};
    for (int i = 0; i < 2; ++i) {
        clmha_status st = clmha_context_create_from_env(&ctx[i]);
        if (st == CLMHA_DEVICE_NOT_FOUND) {
            fprintf(stderr, "soak: skipped: no OpenCL device (%s)\n", clmha_last_create_error());
            clmha_context_release(ctx[0]);
            return 77;
        }
        if (st) {
            fprintf(stderr, "soak: context: %s\n", clmha_last_create_error());
            clmha_context_release(ctx[0]);
            return 1;
        }
    }
    bool fp64 = has_fp64(ctx[0]);
    printf("soak: %.0f s, %d threads on 2 contexts (%s), seed %llu, float64 %s\n", o.seconds,
           o.threads, clmha_context_device_name(ctx[0]), (unsigned long long)o.seed,
           fp64 ? "yes" : "no (no double precision)");
    static worker workers[MAX_THREADS];
    double t0 = now_s();
    g_deadline = t0 + o.seconds;
    for (int i = 0; i < o.threads; ++i) {
        worker *w = &workers[i];
        *w = (worker){.index = i, .ctx = ctx[i % 2], .num_slots = fp64 ? 4 : 3,
                      .r = {o.seed * 0x100000001b3ull + (uint64_t)i * 0x9e3779b97f4a7c15ull}};
        w->history = xcalloc(CACHE_CAP * CACHE_BATCH * g_cfgs[0].e, sizeof(float));
        if (pthread_create(&w->thread, NULL, worker_main, w)) {
            fprintf(stderr, "soak: pthread_create failed\n");
            return 1;
        }
    }
    double warm = 0, end = 0, peak = 0;
    if (!monitor(&o, t0, workers, &warm, &end, &peak) && !atomic_load(&g_failed))
        printf("soak: the warm-up (%d operations a thread) did not end: no growth measured\n",
               WARM_OPS);
    for (int i = 0; i < o.threads; ++i) pthread_join(workers[i].thread, NULL);
    print_sample(now_s() - t0, end);
    for (int i = 0; i < o.threads; ++i) worker_free(&workers[i]);
    clmha_context_release(ctx[0]);
    clmha_context_release(ctx[1]);
    double growth = end - warm, bound = o.bound_pct / 100 * warm + o.bound_mib;
    bool grew = growth > bound, failed = atomic_load(&g_failed);
    printf("soak: calls=%lu valid=%lu refused=%lu; rss after the warm-up (t=%.0fs) %.1f MiB, "
           "at the end %.1f MiB, peak %.1f MiB: growth %+.1f MiB (bound %.1f MiB)\n",
           atomic_load(&g_calls), atomic_load(&g_valid), atomic_load(&g_refused), g_warm_at,
           warm, end, peak, growth, bound);
    printf("soak: operations:");
    for (size_t i = 0; i < NUM_OPS; ++i)
        printf(" %s=%lu", g_ops[i].name, atomic_load(&g_op_runs[i]));
    printf("\n");
    printf("soak: %s\n", failed ? "FAIL (a wrong result or status, above)"
                         : grew ? "FAIL (resident memory grew past the bound)"
                                : "pass");
    return failed || grew;
}
