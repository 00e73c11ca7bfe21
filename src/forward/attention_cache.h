// The bare layers of clmha_attention_forward(), per context (attention_cache.c): one per
// (H, H_kv, D, dtype), made on the first call that needs it, freed with the context; at most
// CLMHA__ATTENTION_CACHE_MAX of them, the least recently used freed first.
#ifndef CLMHA_FORWARD_ATTENTION_CACHE_H
#define CLMHA_FORWARD_ATTENTION_CACHE_H

#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"

// The most bare layers a context keeps (each holds the scratch of its largest call).
#define CLMHA__ATTENTION_CACHE_MAX 8

// Locks the attention cache of @p ctx (made on first use) and sets *layer to its bare layer for
// the heads (h, kvh) and variants (softcap on, alibi) of @p call, @p head_dim and @p dtype
// (float32 or float64, checked by the caller), made on first
// use (clmha__layer_new_bare() and every core's state). On success the cache stays locked until
// clmha__attention_unlock(): the layer is the caller's alone until then. On failure it is
// unlocked and *layer is NULL.
CLMHA__HIDDEN clmha_status clmha__attention_lock(clmha_context *ctx, const clmha__dims *call,
                                                 size_t head_dim, clmha_dtype dtype,
                                                 clmha_layer **layer);

// Unlocks what clmha__attention_lock() locked.
CLMHA__HIDDEN void clmha__attention_unlock(clmha_context *ctx);

#endif
