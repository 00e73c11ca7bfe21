// The bare layers of clmha_attention_forward() (attention_cache.h). The context holds the cache
// as an opaque pointer with its release hook (the context is below the layers); the layers hold
// no reference to the context, so that the context's last release frees them (first, while its
// queue and programs still exist).
#include "forward/attention_cache.h"

#include "context/context.h"
#include "cores/core.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct entry {
    size_t heads, kv_heads, head_dim;
    clmha_dtype dtype;           // float32 or float64: the layer's element
    bool softcap, alibi, sinks;  // the variants its programs are built with
    clmha_layer *layer;          // its user functions: layer->mod_source (NULL: none)
    struct entry *next;
} entry;

typedef struct cache {
    pthread_mutex_t lock;  // held from clmha__attention_lock() to clmha__attention_unlock()
    entry *first;          // the most recently used first
} cache;

static void cache_release(void *p) {
    cache *c = p;
    if (!c) return;
    for (entry *e = c->first; e;) {
        entry *next = e->next;
        clmha_layer_release(e->layer);  // bare: releases no context
        free(e);
        e = next;
    }
    pthread_mutex_destroy(&c->lock);
    free(c);
}

// The cache of @p ctx, made on first use (under the context's lock); NULL when out of memory.
static cache *cache_of(clmha_context *ctx) {
    pthread_mutex_lock(&ctx->lock);
    cache *c = ctx->attention;
    if (!c && (c = calloc(1, sizeof *c)) != NULL) {
        pthread_mutex_init(&c->lock, NULL);
        ctx->attention = c;
        ctx->attention_release = cache_release;
    }
    pthread_mutex_unlock(&ctx->lock);
    return c;
}

// A new entry's bare layer with every core's state.
static clmha_status make(clmha_context *ctx, cache *c, const clmha__dims *call,
                         size_t head_dim, clmha_dtype dtype, clmha_layer **out) {
    entry *e = calloc(1, sizeof *e);
    if (!e) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    clmha_status st =
        clmha__layer_new_bare(&e->layer, ctx, call->h, call->kvh, head_dim, dtype, call);
    if (!st && (st = clmha__cores_create(e->layer))) clmha_layer_release(e->layer);
    if (st) {
        free(e);
        return st;
    }
    *e = (entry){call->h,     call->kvh,   head_dim, dtype, call->softcap > 0.0,
                 call->alibi, call->sinks, e->layer, c->first};
    c->first = e;
    *out = e->layer;
    return CLMHA_SUCCESS;
}

// Past CLMHA__ATTENTION_CACHE_MAX entries, the least recently used goes (its layer's buffers
// stay alive, held by OpenCL, until the commands enqueued on them finish).
static void evict(cache *c) {
    size_t k = 0;
    for (entry **p = &c->first; *p; ++k) {
        if (k < CLMHA__ATTENTION_CACHE_MAX) {
            p = &(*p)->next;
            continue;
        }
        entry *e = *p;
        *p = e->next;
        clmha_layer_release(e->layer);
        free(e);
    }
}

clmha_status clmha__attention_lock(clmha_context *ctx, const clmha__dims *call,
                                   size_t head_dim, clmha_dtype dtype, clmha_layer **layer) {
    size_t heads = call->h, kv_heads = call->kvh;
    bool softcap = call->softcap > 0.0, alibi = call->alibi, sinks = call->sinks;
    const char *mods = call->mod_source;
    *layer = NULL;
    cache *c = cache_of(ctx);
    if (!c) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    pthread_mutex_lock(&c->lock);
    for (entry **p = &c->first; *p; p = &(*p)->next) {
        entry *e = *p;
        if (e->heads == heads && e->kv_heads == kv_heads && e->head_dim == head_dim &&
            e->dtype == dtype && e->softcap == softcap && e->alibi == alibi && e->sinks == sinks &&
            (mods ? e->layer->mod_source && strcmp(e->layer->mod_source, mods) == 0
                  : !e->layer->mod_source)) {
            *p = e->next;  // to the front
            e->next = c->first;
            c->first = e;
            *layer = e->layer;
            return CLMHA_SUCCESS;
        }
    }
    clmha_status st = make(ctx, c, call, head_dim, dtype, layer);
    if (st) pthread_mutex_unlock(&c->lock);
    else evict(c);
    return st;
}

void clmha__attention_unlock(clmha_context *ctx) {
    cache *c = ctx->attention;
    pthread_mutex_unlock(&c->lock);
}
