// The public tuning functions over the store: clmha_context_tuning_import(),
// clmha_context_tuning_export(), clmha_context_tuning_source() and clmha_context_tuning_note() (clmha_context_tune(), the
// search, is in src/tuning_search/tune.c).
#define _POSIX_C_SOURCE 200809L

#include "context/context.h"
#include "tuning_store/store.h"

#include <stdlib.h>
#include <string.h>

clmha_status clmha_context_tuning_import(clmha_context *ctx, const char *json) {
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    if (!json) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "json is NULL");
    clmha__tuning t;
    clmha__tuning_meta meta;
    char msg[1024];
    clmha__tuning_target tg = clmha__context_tuning_target(ctx);
    clmha_status st = clmha__tuning_from_json(&tg, json, &t, &meta, msg, sizeof msg);
    if (st) return clmha__fail(ctx, st, "clmha_context_tuning_import: %s", msg);
    return clmha__tuning_apply(&tg, &t, &meta, CLMHA_TUNING_SOURCE_IMPORTED,
                              "imported tuning applied");
}

clmha_status clmha_context_tuning_export(const clmha_context *ctx, char *json, size_t size,
                                         size_t *needed) {
    if (needed) *needed = 0;
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    clmha__tuning t;
    clmha__tuning_meta meta;
    if (!clmha__tuning_current(ctx->device, &t, &meta))
        return clmha__fail(ctx, CLMHA_NOT_READY,
                           "clmha_context_tuning_export: no tuning is applied to this device "
                           "(CLBlast's own parameters are in use; see clmha_context_tune)");
    clmha__tuning_target tg = clmha__context_tuning_target(ctx);
    char *text = clmha__tuning_to_json(&tg, &t, &meta);
    if (!text) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    size_t len = strlen(text) + 1;
    if (needed) *needed = len;
    clmha_status st = CLMHA_SUCCESS;
    if (json && size >= len)
        memcpy(json, text, len);
    else if (json || size)
        st = clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                         "clmha_context_tuning_export: the buffer holds %zu bytes, the tuning "
                         "needs %zu",
                         json ? size : 0, len);
    free(text);
    return st;
}

clmha_tuning_source clmha_context_tuning_source(const clmha_context *ctx) {
    return ctx ? clmha__tuning_source_of(ctx->device) : CLMHA_TUNING_SOURCE_CLBLAST;
}

clmha_status clmha_context_tuning_note(const clmha_context *ctx, char *text, size_t size) {
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    if (!text || !size)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "text is NULL or size is 0");
    clmha__tuning_get_note(ctx->device, text, size);
    return CLMHA_SUCCESS;
}
