// The block masks of clmha_mask_mod (block_mask.h).
#include "cores/block_mask.h"

#include "base/checked.h"
#include "context/programs.h"
#include "cores/kernel_args.h"
#include "device/held.h"

#include <stdio.h>

void clmha__block_mask_release(clmha__block_mask *bm) {
    clmha__release_kernel(bm->kernel);
    clmha__release_mem(bm->buf);
    *bm = (clmha__block_mask){0};
}

clmha_status clmha__block_mask_get(clmha_layer *l, clmha__block_mask *bm, const clmha__dims *d,
                                   size_t rows, size_t keys, cl_mem *out) {
    clmha_context *ctx = l->ctx;
    size_t planes = d->n * l->h;
    if (bm->valid && !l->bare && bm->planes == planes && bm->heads == l->h && bm->l == d->l &&
        bm->s == d->s && bm->s_padded == d->s_padded && bm->rows == rows && bm->keys == keys &&
        bm->q_pos == d->q_pos && bm->k_pos == d->k_pos && bm->version == l->mod_version) {
        *out = bm->buf;
        return CLMHA_SUCCESS;
    }
    bm->valid = false;
    clmha_status st;
    if (!bm->kernel) {
        char options[224];
        snprintf(options, sizeof options, "%s%s", clmha__layer_real_options(l),
                 clmha__layer_variant_options(l));
        cl_program prog;
        if ((st = clmha__program_get_mod(ctx, "block_mask", options, l->mod_source, &prog)) ||
            (st = clmha__kernel_make(ctx, prog, "mod_block_mask", &bm->kernel)) ||
            (st = clmha__kernel_limits(ctx, bm->kernel, &bm->wg, NULL)))
            return st;
        if (bm->wg > 64) bm->wg = 64;
    }
    size_t q_tiles = (d->l + rows - 1) / rows, k_tiles = (d->s_padded + keys - 1) / keys, t;
    if (!clmha__mul(planes, q_tiles, &t) || !clmha__mul(t, k_tiles, &t))
        return clmha__fail(ctx, CLMHA_SIZE_OVERFLOW, "the block mask's size overflows");
    size_t words = (t + 3) / 4;  // clmha__grow_buffer counts floats
    if ((st = clmha__layer_grow_core_scratch(l, &bm->buf, &bm->cap, words,
                                             "the block mask of clmha_mask_mod")))
        return st;
    cl_ulong heads = l->h, tgt = d->l, src = d->s, srcp = d->s_padded, r = rows, k = keys,
             tiles = t, mod_off, q_pos = d->q_pos, k_pos = d->k_pos;
    cl_mem mod_p = clmha__mod_params_of(l, &mod_off);
    clmha__arg args[] = {CLMHA__ARG(bm->buf), CLMHA__ARG(heads), CLMHA__ARG(tgt),
                         CLMHA__ARG(src),     CLMHA__ARG(srcp),  CLMHA__ARG(r),
                         CLMHA__ARG(k),       CLMHA__ARG(tiles), CLMHA__ARG(mod_p),
                         CLMHA__ARG(mod_off), CLMHA__ARG(q_pos), CLMHA__ARG(k_pos)};
    if ((st = clmha__launch(ctx, bm->kernel, "mod_block_mask", t, bm->wg, args,
                            sizeof args / sizeof args[0])))
        return st;
    bm->valid = true;
    bm->planes = planes;
    bm->heads = l->h;
    bm->l = d->l;
    bm->s = d->s;
    bm->s_padded = d->s_padded;
    bm->rows = rows;
    bm->keys = keys;
    bm->q_pos = d->q_pos;
    bm->k_pos = d->k_pos;
    bm->version = l->mod_version;
    ++bm->evaluations;
    *out = bm->buf;
    return CLMHA_SUCCESS;
}
