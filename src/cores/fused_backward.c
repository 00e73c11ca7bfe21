// The fused core's backward pass (FlashAttention-2's algorithm, kernels
// cl/cores/fused_backward.cl): the probabilities are recomputed tile by tile from the saved
// q, k and log-sum-exp rows and never stored, so its only scratch is Drow, one float per query
// row (N*H*L). Its state (kernels, tile, that scratch) hangs off the fused core's, which hands
// its place to each hook; made on first use and freed with it. What it shares with the forward
// (the row vector width, the loop limit) is in fused_shared.c.
#include "cores/fused_backward.h"

#include "context/gemm.h"
#include "cores/block_mask.h"
#include "cores/core.h"
#include "cores/fused_shared.h"
#include "cores/kernel_args.h"
#include "device/held.h"
#include "layer/mods.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef clmha__arg arg;
#define ARG CLMHA__ARG
#define MASK_ARGS CLMHA__MASK_ARGS

// The kernels' mapping and tiles (their build options).
typedef struct tiles {
    bool rows_private;  // R rows per work-item in private memory, tiles of BT (-DROWS_PRIVATE)
    size_t b;           // work-group size (-DB); without rows_private also the rows per tile
    size_t r;           // rows per work-item (-DR; 1 without rows_private)
    size_t bt;          // rows per staged tile with rows_private (-DBT)
    size_t vw;          // vector width of the inner products (-DVW)
} tiles;

struct clmha__fused_backward {
    cl_kernel drow, dkdv, dq, block;
    tiles t;               // what they were built with
    clmha_status failed;   // why the kernels cannot be built here (then not retried)
    cl_mem drow_buf;       // Drow, N*H*L floats, grown on demand
    size_t drow_cap;
    bool gemms;            // the products in GEMMs, block by block (run_gemms())
    cl_mem block_s, block_g;  // run_gemms()'s block of scores and dO.v, grown on demand
    size_t block_s_cap, block_g_cap;
    // With clmha_mask_mod: the tiles it forbids, as dkdv and dq walk them (block_mask.c), and
    // as run_gemms() cuts the rows, with its host copy (of evaluation gemm_mask_seen).
    clmha__block_mask dkdv_blocks, dq_blocks, gemm_blocks;
    unsigned char *gemm_mask;
    size_t gemm_mask_cap;
    unsigned long gemm_mask_seen;
};

static void release_kernels(clmha__fused_backward *fb) {
    clmha__release_kernel(fb->drow);
    clmha__release_kernel(fb->dkdv);
    clmha__release_kernel(fb->dq);
    clmha__release_kernel(fb->block);
    fb->drow = fb->dkdv = fb->dq = fb->block = NULL;
}

void clmha__fused_backward_release(clmha__fused_backward *fb) {
    if (!fb) return;
    release_kernels(fb);
    clmha__release_mem(fb->drow_buf);
    clmha__release_mem(fb->block_s);
    clmha__release_mem(fb->block_g);
    clmha__block_mask_release(&fb->dkdv_blocks);
    clmha__block_mask_release(&fb->dq_blocks);
    clmha__block_mask_release(&fb->gemm_blocks);
    free(fb->gemm_mask);
    free(fb);
}

size_t clmha__fused_backward_rows(const clmha__fused_backward *fb) {
    return fb && fb->dkdv ? fb->t.b * fb->t.r : 0;
}

// ---- tile and build -----------------------------------------------------------------------------

// Local memory of the larger kernel (dkdv) in floats. One row per work-item: the query tile's q
// and dO rows, their lse and Drow. Rows private: those rows twice (as rows and transposed).
static size_t local_floats(const tiles *t, size_t hd) {
    return t->rows_private ? 4 * t->bt * hd + 2 * t->bt : 2 * t->b * hd + 2 * t->b;
}

// Private floats per work-item of the larger kernel (dkdv) with rows private: per row its k, v,
// dk and dv rows and the tile's scores, probabilities after dropout and dO.v.
static size_t private_floats(const tiles *t, size_t hd) { return t->r * (4 * hd + 3 * t->bt); }

// Local memory the tiles may use, in bytes: the device's less 1 KiB (room for what the compiler
// adds), and at most 32 KiB, so that a GPU keeps a few work-groups resident per compute unit.
static cl_ulong local_budget(const clmha_context *ctx) {
    cl_ulong dev = clmha__local_mem(ctx);
    cl_ulong budget = dev > 1024 ? dev - 1024 : 0;
    return budget < 32768 ? budget : 32768;
}

// The largest power of two up to @p cap within @p max_wg.
static size_t pow2_within(size_t cap, size_t max_wg) {
    size_t b = 1;
    while (b * 2 <= cap && b * 2 <= max_wg) b *= 2;
    return b;
}

// One row per work-item: the largest power of two up to 64 within @p max_wg whose tile fits in
// the budget; b 0 when not even one row does. (64 rows: each key row of dkdv then reads a query
// tile of 64 rows per barrier pair, and more buys little once the tile is past the cache line.)
static tiles tiles_one_row(const clmha_context *ctx, size_t max_wg, size_t hd, size_t vw) {
    tiles t = {.b = pow2_within(64, max_wg), .r = 1, .vw = vw};
    cl_ulong budget = local_budget(ctx);
    while (t.b > 1 && local_floats(&t, hd) * sizeof(float) > budget) t.b /= 2;
    if (local_floats(&t, hd) * sizeof(float) > budget) t.b = 0;
    return t;
}

// Rows private (classes without the coalesced GPU mapping: CPUs): work-groups of up to 16
// work-items with 4 rows each, tiles of 16 rows; then fewer rows per work-item while the
// private arrays pass the class's budget, and smaller tiles while the local memory passes the
// device's (bt 0: not even one row fits); vw narrowed to divide bt. Measured on PoCL (AVX-512,
// 2 cores, N=1 H=8 L=S=1024 D=64, best of 5 on a shared machine): 16x4 rows 136 ms, 8x4 143,
// 16x2 184, 32x2 232; tiles of 8 rows were ~2x slower than 16, and 32 (33 KiB of local memory
// at HD 64) no faster.
static tiles tiles_rows_private(const clmha_context *ctx, size_t max_wg, size_t hd, size_t vw) {
    tiles t = {.rows_private = true, .b = pow2_within(16, max_wg), .r = 4, .bt = 16, .vw = vw};
    while (t.r > 1 && private_floats(&t, hd) > ctx->cls->private_floats) --t.r;
    cl_ulong budget = local_budget(ctx);
    while (t.bt > 0 && local_floats(&t, hd) * sizeof(float) > budget) t.bt /= 2;
    while (t.vw > 1 && t.bt % t.vw) t.vw /= 2;
    return t;
}

// Builds the three kernels with tiles @p t and checks what each built kernel allows: *fits
// false (and no kernels) when a work-group limit (CL_KERNEL_WORK_GROUP_SIZE, which drivers may
// set below the device's) is below the work-group size, *wg_min receiving the smallest limit, or
// when the local memory used exceeds the device's.
static clmha_status build_tiles(clmha_context *ctx, clmha__fused_backward *fb, size_t hd,
                                const char *variants, const char *user, const tiles *t,
                                bool *fits, size_t *wg_min) {
    char options[256];
    snprintf(options, sizeof options,
             "-DHD=%zu -DB=%zu -DVW=%zu -DROWS_PRIVATE=%d -DR=%zu -DBT=%zu%s", hd, t->b, t->vw,
             (int)t->rows_private, t->r, t->bt ? t->bt : 1, variants);
    cl_program prog;
    clmha_status st = clmha__program_get_mod(ctx, "fused_backward", options, user, &prog);
    if (st || (st = clmha__kernel_make(ctx, prog, "fused_backward_drow", &fb->drow)) ||
        (st = clmha__kernel_make(ctx, prog, "fused_backward_dkdv", &fb->dkdv)) ||
        (st = clmha__kernel_make(ctx, prog, "fused_backward_dq", &fb->dq)) ||
        (st = clmha__kernel_make(ctx, prog, "fused_backward_block", &fb->block))) {
        release_kernels(fb);
        return st;
    }
    *wg_min = t->b;
    *fits = true;
    cl_kernel ks[] = {fb->drow, fb->dkdv, fb->dq};
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; ++i) {
        size_t wg;
        cl_ulong local;
        if ((st = clmha__kernel_limits(ctx, ks[i], &wg, &local))) {
            release_kernels(fb);
            return st;
        }
        if (wg < *wg_min) *wg_min = wg;
        if (local > clmha__local_mem(ctx)) *fits = false;
    }
    if (*wg_min < t->b) *fits = false;
    if (*fits) fb->t = *t;
    else release_kernels(fb);
    return CLMHA_SUCCESS;
}

// Builds the three kernels: with rows private where the class keeps rows private (CPUs), the
// device has no loop limit and they fit, else (or when that build does not fit the kernels' limits) one row per work-item
// with the largest tile that fits. While a built kernel's work-group limit is below the tile's,
// or its local memory exceeds the device's, rebuilds with a smaller work-group (the limit) or a
// smaller tile.
static clmha_status build(clmha_layer *l, clmha__fused_backward *fb) {
    clmha_context *ctx = l->ctx;
    size_t vw = clmha__fused_row_vw(ctx, l->d), max_wg = ctx->max_work_group;
    clmha_status st;
    bool fits;
    size_t wg_min;
    // A driver with a loop limit (llvmpipe) counts every iteration of the R-row loops, which
    // its compiler may keep: the rows-private kernels would pass loops_fit() at lengths the
    // one-row kernels cover (rusticl, vw 1: L=150 at head_dim 16), so it keeps one row.
    if (!ctx->cls->coalesced && !ctx->quirks.loop_limit) {
        tiles t = tiles_rows_private(ctx, max_wg, l->d, vw);
        while (t.bt) {
            if ((st = build_tiles(ctx, fb, l->d, clmha__layer_variant_options(l),
                                  l->mod_source, &t, &fits, &wg_min)))
                return st;
            if (fits) return CLMHA_SUCCESS;
            if (wg_min < t.b) t.b = pow2_within(t.b, wg_min);
            else t.bt /= 2;
            while (t.vw > 1 && t.bt % t.vw) t.vw /= 2;
        }
    }
    tiles t = tiles_one_row(ctx, max_wg, l->d, vw);
    while (t.b) {
        if ((st = build_tiles(ctx, fb, l->d, clmha__layer_variant_options(l), l->mod_source,
                              &t, &fits, &wg_min)))
            return st;
        if (fits) return CLMHA_SUCCESS;
        size_t next = wg_min < t.b ? tiles_one_row(ctx, wg_min, l->d, vw).b : t.b / 2;
        t.b = next < t.b ? next : t.b / 2;
    }
    tiles one = {.b = 1, .r = 1};
    return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                       "the fused backward kernels need %zu bytes of local memory for one row "
                       "per tile at head_dim %zu; the device has %llu",
                       local_floats(&one, l->d) * sizeof(float), l->d,
                       (unsigned long long)clmha__local_mem(ctx));
}

// Whether the products run in GEMMs, block by block (run_gemms()), rather than in the tiled
// kernels: where the GEMMs run in the host BLAS (a CPU BLAS is several times faster there than
// the kernels' products), unless CLMHA_FUSED_BACKWARD says "kernels" ("gemms" asks for them on
// any device).
static bool use_gemms(const clmha_context *ctx) {
    const char *env = getenv("CLMHA_FUSED_BACKWARD");
    if (env && !strcmp(env, "gemms")) return true;
    if (env && !strcmp(env, "kernels")) return false;
    return clmha_context_gemm(ctx) == CLMHA_GEMM_HOST;
}

// The state of @p l's fused backward pass, kept in *@p slot, its kernels built (on first use).
static clmha_status ensure(clmha__fused_backward **slot, clmha_layer *l,
                           clmha__fused_backward **out) {
    if (!*slot && !(*slot = calloc(1, sizeof **slot)))
        return clmha__fail(l->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    clmha__fused_backward *fb = *out = *slot;
    if (fb->dkdv) return CLMHA_SUCCESS;
    if (fb->failed)
        return clmha__fail(l->ctx, fb->failed,
                           "the fused backward kernels could not be built for head_dim %zu on "
                           "this device: %s",
                           l->d, clmha_status_string(fb->failed));
    fb->gemms = use_gemms(l->ctx);
    clmha_status st = build(l, fb);
    // A device that cannot build or hold the kernels will not later; an out-of-memory may pass.
    if (st == CLMHA_UNSUPPORTED || st == CLMHA_BUILD_FAILED) fb->failed = st;
    return st;
}

// Bytes of each of the two block buffers: whole planes at moderate lengths (the GEMMs then run
// batched over planes), a block of query rows of one plane beyond. Small enough for the
// block to stay in a CPU's caches between its GEMMs and the kernel: on PoCL with oneDNN (2
// cores, AVX-512, N 1, H 8, L 2048, D 64) the core's backward took 185 ms in blocks of 512
// rows (4 MiB), 238 ms in 1024 and 285 ms in whole planes (16 MiB, two per block); with the
// blocks transposed, 4 MiB was again the fastest of 1, 2, 4 and 8 MiB (interleaved runs).
#define BLOCK_BYTES ((size_t)4 << 20)

static size_t test_block_floats;

void clmha__test_set_fused_backward_block(size_t floats) { test_block_floats = floats; }

// The floats of each block buffer: BLOCK_BYTES (or the test hook's), within the device's
// largest allocation.
static size_t block_floats(const clmha_context *ctx) {
    size_t cap = test_block_floats ? test_block_floats : BLOCK_BYTES / sizeof(float);
    cl_ulong limit = clmha__max_alloc(ctx) / sizeof(float);
    return cap < limit ? cap : (size_t)limit;
}

// Whether this call's products run in GEMMs: the layer's choice (use_gemms()), when one key's
// row of a block (S' floats) fits in a block buffer; else the tiled kernels run it.
static bool gemms_for(const clmha_context *ctx, const clmha__fused_backward *fb,
                      const clmha__dims *d) {
    return fb->gemms && d->s_padded <= block_floats(ctx);
}

// ---- loop budget --------------------------------------------------------------------------------

// As clmha__fused_loops_fit() for the forward kernel: a loop of @p n iterations whose body runs
// @p body iterations costs n + 1 + n * body to a driver that counts every condition check.
static double loop_cost(double n, double body) { return n + 1 + n * body; }

// Whether every backward kernel's work-item stays below half the device's loop limit
// (clmha__fused_loop_limit(); always on devices without one). Counted as if the compiler kept
// every loop. One row per work-item: dkdv walks ceil(L / B) query tiles, dq ceil(S' / B) key
// tiles (fewer under a window: clmha__window_tiles()), each tile a staging loop of HD iterations and B rows of two HD-long loops (and
// Philox's ten rounds with dropout); the HD-long loops count HD iterations, though they run
// HD / VW (conservative). Rows private: ceil(L / BT) or ceil(S' / BT) tiles, each a staging
// loop of ceil(BT * HD / B) iterations, the products (BT / VW times HD times R, then HD / VW
// times BT times R), and per row the masks (BT, with an attn_mask row lookup), the
// probabilities, dropout (BT times ten rounds) and dS.
static bool loops_fit(const clmha_layer *l, const clmha__fused_backward *fb,
                      const clmha__dims *d, bool causal, bool dropout) {
    size_t limit = clmha__fused_loop_limit(l);
    if (!limit) return true;
    const tiles *t = &fb->t;
    double hd = (double)l->d, b = (double)t->b, r = (double)t->r, vw = (double)t->vw;
    // The query rows a group of keys walks and the keys a group of query rows walks: L and S',
    // or, under a window, the span of a group's b * r rows and the window (query_tiles_of(),
    // key_tiles_of()), in tiles of one size (bt rows private, else b).
    double step = t->rows_private ? (double)t->bt : b;
    double rows_l =
        step * clmha__window_tiles(d, causal, b * r, step, ceil((double)d->l / step));
    double rows_s =
        step * clmha__window_tiles(d, causal, b * r, step, ceil((double)d->s_padded / step));
    double dkdv, dq;
    if (t->rows_private) {
        double bt = (double)t->bt, rl = loop_cost(r, 0);
        double philox = dropout ? loop_cost(bt, loop_cost(10, 0)) : 0;
        double row = loop_cost(bt, 0) + 3 * loop_cost(bt / vw, 0) + philox;
        double tile = loop_cost(ceil(bt * hd / b), 0) + loop_cost(bt, 0) +
                      loop_cost(bt / vw, rl + loop_cost(hd, rl) + rl) + loop_cost(r, row) +
                      loop_cost(hd / vw, rl + loop_cost(bt, rl) + rl);
        double ends = 2 * loop_cost(r, loop_cost(hd, 0));  // loading and storing the rows
        dkdv = ends + loop_cost(ceil(rows_l / bt), tile);
        dq = ends + loop_cost(ceil(rows_s / bt), tile);
    } else {
        double row = 2 * loop_cost(hd, 0) + (dropout ? loop_cost(10, 0) : 0);
        double tile = loop_cost(hd, 0) + loop_cost(b, row);
        dkdv = 2 * loop_cost(hd, 0) + loop_cost(ceil(rows_l / b), tile);
        dq = 2 * loop_cost(hd, 0) + loop_cost(ceil(rows_s / b), tile);
    }
    double worst = dkdv > dq ? dkdv : dq;
    return worst <= (double)limit / 2;
}

// ---- the hooks ----------------------------------------------------------------------------------

// Why the fused backward does not run @p call: the call asked for it (CLMHA_IMPL_FUSED): it
// fails with @p why, unless its forward fell back (a driver kept the fused core from it), when
// the backward falls back too; else the next core runs it.
static void refuse(clmha__core_answer *answer, bool asked, bool fell_back, const char *why) {
    if (!asked || fell_back)
        clmha__core_answer_set(answer, asked ? CLMHA__CORE_FALLS_BACK : CLMHA__CORE_PASSES,
                               CLMHA_SUCCESS, "%s", why);
    else
        clmha__core_answer_set(answer, CLMHA__CORE_REFUSES, CLMHA_UNSUPPORTED,
                               "the fused backward core cannot run this call: %s", why);
}

clmha_status clmha__fused_backward_supports(clmha__fused_backward **slot, clmha_layer *l,
                                            const clmha__backward_call *call,
                                            clmha__core_answer *answer) {
    clmha_impl impl = clmha__backward_impl_of(l, call);
    // Asked for by the call itself only: the layer's choice (clmha_layer_set_impl()) is what
    // CLMHA_IMPL_AUTO prefers, and the header's AUTO runs the unfused backward after a forward
    // call that did not run the fused core (tests/device/test_core_dispatch.c).
    bool asked = call->impl == CLMHA_IMPL_FUSED;
    if (impl == CLMHA_IMPL_UNFUSED) {
        clmha__core_answer_set(answer, CLMHA__CORE_PASSES, CLMHA_SUCCESS,
                               "impl is CLMHA_IMPL_UNFUSED");
        return CLMHA_SUCCESS;
    }
    if (l->rs != sizeof(float)) {  // its kernels are float32's: a float64 layer's runs unfused
        refuse(answer, asked, false, "a float64 layer's backward runs in the unfused core");
        return CLMHA_SUCCESS;
    }
    if (!call->lse) {
        refuse(answer, asked, call->fell_back,
               "the forward call did not run the fused core (no saved log-sum-exp rows)");
        return CLMHA_SUCCESS;
    }
    if (call->grad_weights) {
        refuse(answer, asked, call->fell_back, "it takes no gradient of the attention weights");
        return CLMHA_SUCCESS;
    }
    if (call->grad_attn_mask || call->grad_kpm) {
        refuse(answer, asked, call->fell_back, "it computes no mask gradient");
        return CLMHA_SUCCESS;
    }
    clmha__fused_backward *fb = NULL;
    clmha_status st = ensure(slot, l, &fb);
    if (st == CLMHA_UNSUPPORTED || st == CLMHA_BUILD_FAILED) {
        refuse(answer, asked, call->fell_back,
               "its kernels cannot be built for this head_dim on this device");
        return CLMHA_SUCCESS;
    }
    if (st) return st;
    const clmha_forward_args *a = call->args;
    bool dropout = a->training && l->desc.dropout > 0.0f;
    if (!gemms_for(l->ctx, fb, call->dims) &&
        !loops_fit(l, fb, call->dims, a->is_causal, dropout)) {
        // A driver bug, not the call's fault: CLMHA_IMPL_FUSED runs the unfused backward, as
        // the forward does.
        refuse(answer, asked, true,
               "its loops would exceed the device's loop limit at these sequence lengths");
        return CLMHA_SUCCESS;
    }
    clmha__core_runs(answer);
    return CLMHA_SUCCESS;
}

// Enqueues one 2-D kernel over (ceil(rows / (b * r)) * b, planes) in groups of (b, 1): each
// work-item covers r rows.
static clmha_status launch_2d(clmha_context *ctx, cl_kernel k, const char *name, size_t rows,
                              size_t planes, const tiles *t, const arg *args, cl_uint nargs) {
    clmha_status st = clmha__set_args(ctx, k, name, args, nargs);
    if (st) return st;
    size_t b = t->b, per_group = b * t->r;
    size_t global[2] = {(rows + per_group - 1) / per_group * b, planes}, local[2] = {b, 1};
    cl_int err = clEnqueueNDRangeKernel(ctx->queue, k, 2, NULL, global, local, 0, NULL, NULL);
    return err != CL_SUCCESS ? clmha__cl_fail_on(ctx, err, "clEnqueueNDRangeKernel", name)
                             : CLMHA_SUCCESS;
}

// ---- the products in GEMMs ----------------------------------------------------------------------

// fused_backward_block over @p keys rows of @p cols floats (query rows): one work-group per
// key, of up to 64 work-items striding over its row.
static clmha_status launch_block(clmha_context *ctx, const clmha__fused_backward *fb,
                                 size_t cols, size_t keys, const arg *args, cl_uint nargs) {
    clmha_status st = clmha__set_args(ctx, fb->block, "fused_backward_block", args, nargs);
    if (st) return st;
    size_t wg = pow2_within(64, ctx->max_work_group);
    while (wg > 1 && wg / 2 >= cols) wg /= 2;
    size_t global[2] = {wg, keys}, local[2] = {wg, 1};
    cl_int err = clEnqueueNDRangeKernel(ctx->queue, fb->block, 2, NULL, global, local, 0, NULL,
                                        NULL);
    return err != CL_SUCCESS
               ? clmha__cl_fail_on(ctx, err, "clEnqueueNDRangeKernel", "fused_backward_block")
               : CLMHA_SUCCESS;
}

// Keys and rows (at least; a multiple of the vector width) per tile of run_gemms()'s block mask
// with clmha_mask_mod, and rows per block at most (a multiple of the tile's). Tiles of 32 rows
// rather than a block's: fused_backward_block calls the function in the tiles it neither allows
// nor forbids whole, which along a window's edges were ~2.5 times as many keys in tiles of 256
// rows (a training step with a causal window (1023, 0) as a mask function took 1.11 times the
// built-in window's at L 4096; in tiles of 32 rows, see docs/performance.md).
#define GEMM_MASK_KEYS 64
#define GEMM_MASK_TILE_ROWS 32
#define GEMM_MASK_ROWS 256

// One block of the products in GEMMs (run_gemms()): query rows [r0, r0 + nr) of planes
// [p0, p0 + np) against keys [c0, c0 + cols):
//   sᵀ = k qᵀ and dPdᵀ = v dOᵀ (GEMMs into the two block buffers, keys by rows),
//   Pdᵀ and dSᵀ from them (fused_backward_block: masks, lse, dropout, Drow),
//   dv += Pdᵀ dO, dk += scale dSᵀ q (beta @p beta_kv), dq = scale dS k (beta @p beta_q) (GEMMs;
//   the first two read A as stored: on PoCL with oneDNN, N 1, H 8, L 2048, the five products of
//   a block of 512 rows took 2.9 ms this way against 3.4 ms untransposed).
typedef struct block_of {
    size_t p0, np, r0, nr, c0, cols;
    size_t mask_rows;  // with clmha_mask_mod: the block mask's rows a tile (gemm_tile_rows())
    float beta_kv, beta_q;
} block_of;

static clmha_status block_products(clmha_layer *l, clmha__backward_call *call,
                                   clmha__fused_backward *fb, const clmha__mask_args *m,
                                   const block_of *bl) {
    clmha_context *ctx = l->ctx;
    const clmha__dims *d = call->dims;
    size_t tl = d->l, sp = d->s_padded, hd = l->d;
    size_t nr = bl->nr, cols = bl->cols, np = bl->np;
    float scale = (float)clmha__core_scale(l, call->scale);
    size_t q_off = (bl->p0 * tl + bl->r0) * hd, kv_off = (bl->p0 * sp + bl->c0) * hd;
    clmha_status st;
    // sᵀ = k qᵀ and dPdᵀ = v dOᵀ: (cols, nr) per plane.
    clmha__gemm_op s_op = {.tb = true, .m = cols, .n = nr, .k = hd, .alpha = 1.0f,
                           .a = call->k, .a_off = kv_off, .lda = hd, .a_stride = sp * hd,
                           .b = call->q, .b_off = q_off, .ldb = hd, .b_stride = tl * hd,
                           .c = fb->block_s, .ldc = nr, .c_stride = cols * nr, .batch = np};
    clmha__gemm_op g_op = s_op;
    g_op.a = call->v;
    g_op.b = call->d_o;
    g_op.c = fb->block_g;
    if ((st = clmha__gemm(ctx, "fused backward k q^T", &s_op)) ||
        (st = clmha__gemm(ctx, "fused backward v dO^T", &g_op)))
        return st;
    cl_ulong row0 = bl->r0, nrows = nr, plane0 = bl->p0, ncols = cols, col0 = bl->c0;
    cl_ulong tgt = tl, heads = l->h, src = d->s;
    cl_ulong mask_rows = bl->mask_rows, mask_keys = GEMM_MASK_KEYS, keys_padded = sp;
    cl_ulong split = call->lse_split_rows;
    arg args[] = {ARG(fb->block_s), ARG(fb->block_g),  ARG(call->lse),   ARG(split),
                  ARG(fb->drow_buf), ARG(row0),        ARG(nrows),        ARG(plane0),      ARG(ncols),
                  ARG(col0),        ARG(tgt),          ARG(heads),       ARG(src),
                  ARG(scale),       ARG(mask_rows),    ARG(mask_keys),   ARG(keys_padded),
                  MASK_ARGS(*m)};
    if ((st = launch_block(ctx, fb, nr, np * cols, args, sizeof args / sizeof args[0])))
        return st;
    // dv += Pdᵀ dO, dk += scale dSᵀ q (A as stored), dq = scale dS k.
    clmha__gemm_op dv_op = {.m = cols, .n = hd, .k = nr, .alpha = 1.0f, .beta = bl->beta_kv,
                            .a = fb->block_s, .lda = nr, .a_stride = cols * nr,
                            .b = call->d_o, .b_off = q_off, .ldb = hd, .b_stride = tl * hd,
                            .c = call->dv, .c_off = kv_off, .ldc = hd, .c_stride = sp * hd,
                            .batch = np};
    clmha__gemm_op dk_op = dv_op;
    dk_op.alpha = scale;
    dk_op.a = fb->block_g;
    dk_op.b = call->q;
    dk_op.c = call->dk;
    clmha__gemm_op dq_op = {.ta = true, .m = nr, .n = hd, .k = cols, .alpha = scale,
                            .beta = bl->beta_q, .a = fb->block_g, .lda = nr,
                            .a_stride = cols * nr, .b = call->k, .b_off = kv_off, .ldb = hd,
                            .b_stride = sp * hd, .c = call->dq, .c_off = q_off, .ldc = hd,
                            .c_stride = tl * hd, .batch = np};
    if ((st = clmha__gemm(ctx, "fused backward dv", &dv_op)) ||
        (st = clmha__gemm(ctx, "fused backward dk", &dk_op)) ||
        (st = clmha__gemm(ctx, "fused backward dq", &dq_op)))
        return st;
    return CLMHA_SUCCESS;
}

// Zeros the first @p floats floats of @p buf, with the layer's fill_rows kernel (cl/heads.cl)
// rather than clEnqueueFillBuffer: Oclgrind's uninitialised-value plugin takes a fill for
// pattern-sized host writes, each of which resets the whole buffer's shadow (see
// tools/oclgrind-check.sh), and then reports the GEMMs that add to the zeros.
static clmha_status zero_floats(clmha_layer *l, cl_mem buf, size_t floats) {
    cl_ulong off = 0, rows = 1, cols = floats;
    cl_uint has_bias = 0;
    arg args[] = {ARG(buf), ARG(off), ARG(l->ctx->dummy), ARG(has_bias), ARG(rows), ARG(cols)};
    return clmha__launch_rows(l->ctx, l->fill_rows, "fill_rows", 1, floats, l->heads_wg, args,
                              sizeof args / sizeof args[0]);
}

// The real keys [*c0, *c1) that query rows [r0, r0 + nr) may see under is_causal and the window
// @p m (empty: *c0 >= *c1); the appended keys are not windowed.
static void window_keys(const clmha__mask_args *m, size_t s, size_t r0, size_t nr, size_t *c0,
                        size_t *c1) {
    size_t last = r0 + nr - 1;
    *c0 = m->win_left >= 0 && r0 > (size_t)m->win_left ? r0 - (size_t)m->win_left : 0;
    *c1 = s;
    if (m->causal && last + 1 < *c1) *c1 = last + 1;
    if (m->win_right >= 0 && last + (size_t)m->win_right + 1 < *c1)
        *c1 = last + (size_t)m->win_right + 1;
}

// Rows per block of a call with a window whose planes do not fit a block buffer whole, and in
// *cols the keys a block covers at most: a block of r rows sees at most r + span real keys
// (span: window_left + window_right, window_right 0 with is_causal) and the appended ones, so
// it takes about span / 4 rows (a power of two, at least @p rows, what a call without a window
// takes: one key row of the plane per row, cap / S'), as many as fit @p cap floats. Measured on
// PoCL with oneDNN (2 cores, N 1, H 8, L = S = 16384, D 64, window (1023, 0) and is_causal,
// two interleaved runs) the backward took 2.2 / 1.7 s in blocks of 64 rows (cap / S'), 1.6 /
// 1.2 s in 128, 1.1 / 1.0 s in 256 and 1.2 / 1.25 s in 512: larger GEMMs, fewer calls, but
// every row of a block computed against all of its keys.
static size_t window_block_rows(const clmha__mask_args *m, const clmha__dims *d, size_t cap,
                                size_t rows, size_t *cols) {
    size_t sp = d->s_padded, appended = sp - d->s;
    *cols = sp;
    if (m->win_left < 0 || (m->win_right < 0 && !m->causal)) return rows;  // a side unbounded
    size_t span = (size_t)m->win_left + (m->causal ? 0 : (size_t)m->win_right);
    size_t r = 1;
    while (r * 2 <= span / 4 && r * 2 <= d->l) r *= 2;
    for (; r > rows; r /= 2) {
        size_t c = r + span + appended < sp ? r + span + appended : sp;
        if (r * c <= cap) {
            *cols = c;
            return r;
        }
    }
    return rows;
}

// With clmha_mask_mod: the block mask of run_gemms() in tiles of @p rows rows (gemm_tile_rows())
// by GEMM_MASK_KEYS keys, into *@p out (fused_backward_block reads it: no per-key call in a
// tile it allows or forbids whole), copied to the host (fb->gemm_mask, for mask_keys()) when it
// was evaluated anew.
static clmha_status gemm_mask(clmha_layer *l, clmha__fused_backward *fb, const clmha__dims *d,
                              size_t rows, cl_mem *out) {
    clmha_context *ctx = l->ctx;
    cl_mem buf;
    clmha_status st = clmha__block_mask_get(l, &fb->gemm_blocks, d, rows, GEMM_MASK_KEYS, &buf);
    if (!st) *out = buf;
    if (st || fb->gemm_mask_seen == fb->gemm_blocks.evaluations) return st;
    size_t bytes = d->n * l->h * ((d->l + rows - 1) / rows) *
                   ((d->s_padded + GEMM_MASK_KEYS - 1) / GEMM_MASK_KEYS);
    if (bytes > fb->gemm_mask_cap) {
        unsigned char *p = realloc(fb->gemm_mask, bytes);
        if (!p) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
        fb->gemm_mask = p, fb->gemm_mask_cap = bytes;
    }
    cl_int err = clEnqueueReadBuffer(ctx->queue, buf, CL_TRUE, 0, bytes, fb->gemm_mask, 0, NULL,
                                     NULL);
    if (err != CL_SUCCESS) return clmha__cl_fail(ctx, err, "clEnqueueReadBuffer(block mask)");
    fb->gemm_mask_seen = fb->gemm_blocks.evaluations;
    return CLMHA_SUCCESS;
}

// Rows per tile of gemm_mask(): GEMM_MASK_TILE_ROWS, or the vector width where that is larger,
// so that each vector of rows fused_backward_block computes lies in one tile.
static size_t gemm_tile_rows(const clmha__fused_backward *fb) {
    return fb->t.vw > GEMM_MASK_TILE_ROWS ? fb->t.vw : GEMM_MASK_TILE_ROWS;
}

// The real keys [*c0, *c1) that query rows [r0, r0 + nr) of plane @p p may see by the tiles
// of gemm_mask() (of @p tile_rows rows) that clmha_mask_mod does not forbid whole (empty:
// *c0 >= *c1).
static void mask_keys(const clmha__fused_backward *fb, const clmha__dims *d, size_t tile_rows,
                      size_t p, size_t r0, size_t nr, size_t *c0, size_t *c1) {
    size_t k_tiles = (d->s_padded + GEMM_MASK_KEYS - 1) / GEMM_MASK_KEYS;
    size_t r_tiles = (d->l + tile_rows - 1) / tile_rows;
    size_t first = k_tiles, last = 0;
    for (size_t r = r0 / tile_rows; r <= (r0 + nr - 1) / tile_rows; ++r) {
        const unsigned char *row = fb->gemm_mask + (p * r_tiles + r) * k_tiles;
        for (size_t t = 0; t < k_tiles && t * GEMM_MASK_KEYS < d->s; ++t)
            if (row[t] != 0) {  // MOD_BLOCK_NONE (cl/common.cl)
                if (t < first) first = t;
                if (t > last) last = t;
            }
    }
    *c0 = first == k_tiles ? d->s : first * GEMM_MASK_KEYS;
    *c1 = first == k_tiles ? d->s : (last + 1) * GEMM_MASK_KEYS;
    if (*c1 > d->s) *c1 = d->s;
}

// The products in GEMMs, block by block: the query rows are cut into blocks (several whole
// planes, or rows of one plane, per block: block_floats()), and each block runs
// block_products() over the keys its rows may see. The row blocks of a plane run from the last
// to the first. Without a window the first one writes dk and dv (beta 0) and covers every key;
// with is_causal (and no appended keys) the others leave out the keys past their last row,
// masked for all their rows. With a window (clmha__masks_of(): a bound that masks something)
// dq, dk and dv are zeroed first and every block adds (beta 1) its products over the real keys
// its rows may see (window_keys()) and, separately, over the appended keys, in blocks of
// window_block_rows(): the work grows linearly in L for a fixed window. With a user mask
// function the blocks are rows of one plane (at most GEMM_MASK_ROWS), each over the keys of the
// tiles its block mask does not forbid whole (mask_keys()), the appended ones apart, beta 1 on
// zeroed gradients as with a window. Drow is computed first,
// as for the kernels. Each gradient element is a sum in a fixed order (the GEMMs' and the
// blocks'): the same on every run with the same BLAS.
static clmha_status run_gemms(clmha_layer *l, clmha__backward_call *call,
                              clmha__fused_backward *fb) {
    clmha_context *ctx = l->ctx;
    const clmha__dims *d = call->dims;
    size_t planes = d->n * l->h, tl = d->l, sp = d->s_padded, hd = l->d;
    size_t cap = block_floats(ctx);
    size_t per_plane = tl * sp;
    size_t rows = per_plane <= cap ? tl : (cap / sp ? cap / sp : 1), cols = sp;
    size_t pp = per_plane <= cap ? cap / per_plane : 1;
    if (pp > planes) pp = planes;
    clmha__mask_args m = clmha__masks_of(l, call->args, d);
    bool windowed = m.win_left >= 0 || m.win_right >= 0;
    bool user_mask = (l->mods & CLMHA__MOD_MASK) != 0;
    if (windowed && per_plane > cap) rows = window_block_rows(&m, d, cap, rows, &cols);
    clmha_status st;
    size_t tile_rows = gemm_tile_rows(fb);
    if (user_mask) {  // one plane a block, GEMM_MASK_ROWS rows at most, whole tiles
        pp = 1, cols = sp;
        if (rows > GEMM_MASK_ROWS) rows = GEMM_MASK_ROWS;
        rows = rows < tile_rows ? tile_rows : rows / tile_rows * tile_rows;
        if ((st = gemm_mask(l, fb, d, tile_rows, &m.mod_blocks))) return st;
        windowed = true;  // the window's block walk, over mask_keys() as well
    }
    if ((st = clmha__layer_grow_core_scratch(l, &fb->block_s, &fb->block_s_cap, pp * rows * cols,
                                             "fused backward score block")) ||
        (st = clmha__layer_grow_core_scratch(l, &fb->block_g, &fb->block_g_cap, pp * rows * cols,
                                             "fused backward dO.v block")))
        return st;
    bool trim = m.causal && d->s == sp;
    size_t blocks = (tl + rows - 1) / rows;
    if (windowed && ((st = zero_floats(l, call->dq, planes * tl * hd)) ||
                     (st = zero_floats(l, call->dk, planes * sp * hd)) ||
                     (st = zero_floats(l, call->dv, planes * sp * hd))))
        return st;
    for (size_t p0 = 0; p0 < planes; p0 += pp) {
        size_t np = planes - p0 < pp ? planes - p0 : pp;
        for (size_t b = blocks; b-- > 0;) {
            size_t r0 = b * rows, nr = tl - r0 < rows ? tl - r0 : rows;
            block_of bl = {.p0 = p0, .np = np, .r0 = r0, .nr = nr, .mask_rows = tile_rows};
            if (!windowed) {
                bool first = b == blocks - 1;
                bl.cols = trim && !first && r0 + nr < sp ? r0 + nr : sp;
                bl.beta_kv = first ? 0.0f : 1.0f;
                if ((st = block_products(l, call, fb, &m, &bl))) return st;
                continue;
            }
            size_t c0, c1;
            window_keys(&m, d->s, r0, nr, &c0, &c1);
            if (user_mask) {
                size_t u0, u1;
                mask_keys(fb, d, tile_rows, p0, r0, nr, &u0, &u1);
                if (u0 > c0) c0 = u0;
                if (u1 < c1) c1 = u1;
            }
            bl.beta_kv = bl.beta_q = 1.0f;
            if (c0 < c1) {
                bl.c0 = c0, bl.cols = c1 - c0;
                if ((st = block_products(l, call, fb, &m, &bl))) return st;
            }
            if (d->s < sp) {  // the appended keys
                bl.c0 = d->s, bl.cols = sp - d->s;
                if ((st = block_products(l, call, fb, &m, &bl))) return st;
            }
        }
    }
    return CLMHA_SUCCESS;
}

// Drow = rowsum(dO * o) into the scratch, then either the products in GEMMs (run_gemms(), where
// gemms_for() says so) or dk and dv (one work-group per tile of key rows), then dq (one per
// tile of query rows). The kernels only read what the others write through the in-order
// queue.
clmha_status clmha__fused_backward_run(clmha__fused_backward **slot, clmha_layer *l,
                                      clmha__backward_call *call) {
    clmha_context *ctx = l->ctx;
    const clmha__dims *d = call->dims;
    clmha__fused_backward *fb = NULL;
    clmha_status st = ensure(slot, l, &fb);
    if (st) return st;
    size_t planes = d->n * l->h;
    cl_ulong rows = planes * d->l;
    if ((st = clmha__layer_grow_core_scratch(l, &fb->drow_buf, &fb->drow_cap, rows ? rows : 1,
                                             "fused backward Drow")))
        return st;
    arg drow_args[] = {ARG(call->d_o), ARG(call->o), ARG(fb->drow_buf), ARG(rows)};
    if ((st = clmha__launch(ctx, fb->drow, "fused_backward_drow", rows, fb->t.b, drow_args,
                            sizeof drow_args / sizeof drow_args[0])))
        return st;

    if (gemms_for(ctx, fb, d)) return run_gemms(l, call, fb);
    cl_ulong tgt = d->l, heads = l->h, src = d->s, srcp = d->s_padded;
    cl_ulong split = call->lse_split_rows;  // (clmha__backward_call::lse_split_rows)
    float scale = (float)clmha__core_scale(l, call->scale);
    clmha__mask_args m = clmha__masks_of(l, call->args, d), mq = m;
    // With clmha_mask_mod, the tiles it forbids: dkdv's groups of keys by tiles of rows, dq's
    // groups of rows by tiles of keys.
    const tiles *t = &fb->t;
    size_t group = t->rows_private ? t->b * t->r : t->b, tile = t->rows_private ? t->bt : t->b;
    if ((l->mods & CLMHA__MOD_MASK) &&
        ((st = clmha__block_mask_get(l, &fb->dkdv_blocks, d, tile, group, &m.mod_blocks)) ||
         (st = clmha__block_mask_get(l, &fb->dq_blocks, d, group, tile, &mq.mod_blocks))))
        return st;
    arg dkdv_args[] = {ARG(call->q),  ARG(call->k),     ARG(call->v),      ARG(call->d_o),
                       ARG(call->lse), ARG(split),       ARG(fb->drow_buf), ARG(call->dk),
                       ARG(call->dv),  ARG(tgt),         ARG(heads),        ARG(src),
                       ARG(srcp),      ARG(scale),       MASK_ARGS(m)};
    if ((st = launch_2d(ctx, fb->dkdv, "fused_backward_dkdv", d->s_padded, planes, &fb->t,
                        dkdv_args, sizeof dkdv_args / sizeof dkdv_args[0])))
        return st;
    arg dq_args[] = {ARG(call->q),   ARG(call->k), ARG(call->v),      ARG(call->d_o),
                     ARG(call->lse), ARG(split),   ARG(fb->drow_buf), ARG(call->dq),
                     ARG(tgt),       ARG(heads),   ARG(src),          ARG(srcp),
                     ARG(scale),     MASK_ARGS(mq)};
    return launch_2d(ctx, fb->dq, "fused_backward_dq", d->l, planes, &fb->t, dq_args,
                     sizeof dq_args / sizeof dq_args[0]);
}
