// A layer's user functions (mods.h): the scan of their source, the copy of it and of p, and the
// variant build options.
#include "layer/mods.h"

#include "base/checked.h"
#include "device/held.h"
#include "context/context.h"
#include "errors/errors.h"
#include "layer/layer.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The CLMHA__MOD_* bit of identifier [id, id + len), or 0.
static unsigned mod_bit(const char *id, size_t len) {
    static const struct {
        const char *name;
        unsigned bit;
    } names[] = {{"clmha_score_mod", CLMHA__MOD_SCORE},
                 {"clmha_score_mod_grad", CLMHA__MOD_GRAD},
                 {"clmha_mask_mod", CLMHA__MOD_MASK}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i)
        if (strlen(names[i].name) == len && memcmp(names[i].name, id, len) == 0)
            return names[i].bit;
    return 0;
}

static bool is_ident(char c) { return isalnum((unsigned char)c) || c == '_'; }

unsigned clmha__mods_scan(const char *source) {
    unsigned bits = 0;
    const char *p = source;
    while (p && *p) {
        if (p[0] == '/' && p[1] == '/') {  // a line comment
            while (*p && *p != '\n') ++p;
        } else if (p[0] == '/' && p[1] == '*') {  // a block comment
            const char *end = strstr(p + 2, "*/");
            p = end ? end + 2 : p + strlen(p);
        } else if (*p == '"' || *p == '\'') {  // a literal, escapes skipped
            char quote = *p++;
            while (*p && *p != quote) p += p[0] == '\\' && p[1] ? 2 : 1;
            if (*p) ++p;
        } else if (is_ident(*p)) {
            const char *id = p;
            while (is_ident(*p)) ++p;
            if (!isdigit((unsigned char)*id)) bits |= mod_bit(id, (size_t)(p - id));
        } else {
            ++p;
        }
    }
    return bits;
}

// The build options of the variants of @p l into l->variant_options (layer.h).
static void set_options(clmha_layer *l) {
    const clmha_layer_desc *d = &l->desc;
    snprintf(l->variant_options, sizeof l->variant_options, "%s%s%s%s%s%s",
             d->softcap > 0.0 ? " -DSOFTCAP=1" : "", d->alibi ? " -DALIBI=1" : "",
             d->sinks ? " -DSINKS=1" : "", l->mods & CLMHA__MOD_SCORE ? " -DUSER_SCORE=1" : "",
             l->mods & CLMHA__MOD_GRAD ? " -DUSER_GRAD=1" : "",
             l->mods & CLMHA__MOD_MASK ? " -DUSER_MASK=1" : "");
}

// l->mod_params: @p count floats from @p params (NULL: zeros), copied at creation (nothing
// enqueued).
static clmha_status make_params(clmha_layer *l, const float *params, size_t count) {
    clmha_context *ctx = l->ctx;
    float *zeros = params ? NULL : calloc(count, sizeof *zeros);
    if (!params && !zeros) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    cl_int err;
    clmha__count(ctx, 0, 1);
    l->mod_params = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
                                   count * sizeof(float), (void *)(params ? params : zeros),
                                   &err);
    clmha__held_new(CLMHA__HELD_MEM, l->mod_params);
    free(zeros);
    if (err != CL_SUCCESS) return clmha__cl_fail(ctx, err, "clCreateBuffer(mod_params)");
    return CLMHA_SUCCESS;
}

clmha_status clmha__layer_mods_init(clmha_layer *l, const char *source, const float *params,
                                    size_t count) {
    clmha_context *ctx = l->ctx;
    l->desc.mod_source = NULL;
    l->desc.mod_params = NULL;
    l->desc.mod_params_count = 0;
    if (!source || !*source) {
        if (count || params)
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                               "mod_params given without user functions (mod_source)");
        set_options(l);
        return CLMHA_SUCCESS;
    }
    l->mods = clmha__mods_scan(source);
    if (!l->mods)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "mod_source defines none of clmha_score_mod, clmha_score_mod_grad "
                           "and clmha_mask_mod");
    if (l->mods == CLMHA__MOD_GRAD)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "mod_source defines clmha_score_mod_grad without clmha_score_mod");
    size_t len = strlen(source);
    if (!(l->mod_source = malloc(len + 1)))
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    memcpy(l->mod_source, source, len + 1);
    l->desc.mod_source = l->mod_source;
    l->desc.mod_params_count = count;
    set_options(l);
    if (!count) return CLMHA_SUCCESS;
    if (count > SIZE_MAX / sizeof(float))
        return clmha__fail(ctx, CLMHA_SIZE_OVERFLOW, "mod_params_count %zu overflows", count);
    return make_params(l, params, count);
}

void clmha__layer_mods_free(clmha_layer *l) {
    clmha__release_mem(l->mod_params);
    l->mod_params = NULL;
    free(l->mod_source);
    l->mod_source = NULL;
}

clmha_status clmha__layer_mods_grad_check(clmha_layer *l, const char *what) {
    if (!(l->mods & CLMHA__MOD_SCORE) || (l->mods & CLMHA__MOD_GRAD)) return CLMHA_SUCCESS;
    return clmha__fail(l->ctx, CLMHA_UNSUPPORTED,
                       "%s needs clmha_score_mod_grad: the layer's mod_source defines "
                       "clmha_score_mod without its derivative",
                       what);
}

// Copies p of @p layer to (@p write: from) @p params, @p count floats, blocking.
static clmha_status params_copy(clmha_layer *layer, float *params, size_t count, bool write) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = layer->ctx;
    if (!layer->mod_source)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "the layer has no user functions (desc.mod_source)");
    if (count != layer->desc.mod_params_count)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "mod_params has %zu floats; the layer was created with "
                           "mod_params_count %zu",
                           count, layer->desc.mod_params_count);
    if (!count) return CLMHA_SUCCESS;
    if (!params) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "params is NULL");
    size_t bytes = count * sizeof(float);
    cl_int err = write ? clEnqueueWriteBuffer(ctx->queue, layer->mod_params, CL_TRUE, 0, bytes,
                                              params, 0, NULL, NULL)
                       : clEnqueueReadBuffer(ctx->queue, layer->mod_params, CL_TRUE, 0, bytes,
                                             params, 0, NULL, NULL);
    if (err != CL_SUCCESS)
        return clmha__cl_fail(ctx, err,
                              write ? "clEnqueueWriteBuffer(mod_params)"
                                    : "clEnqueueReadBuffer(mod_params)");
    if (write) ++layer->mod_version;
    return CLMHA_SUCCESS;
}

clmha_status clmha_layer_set_mod_params(clmha_layer *layer, const float *params, size_t count) {
    return params_copy(layer, (float *)params, count, true);  // not written through
}

clmha_status clmha_layer_get_mod_params(clmha_layer *layer, float *params, size_t count) {
    return params_copy(layer, params, count, false);
}
