// The decode core (decode.c), as the tests see it beyond the core interface.
#ifndef CLMHA_CORES_DECODE_H
#define CLMHA_CORES_DECODE_H

#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// How the decode core cuts the cached keys each query row sees into ranges: enough ranges that
// the call has split[0] work-items per compute unit (ITEMS_PER_CU) over its query rows, each
// range at least split[1] keys (MIN_KEYS) of the most a row sees (the longest sequence, or a
// sliding window's width), at least one range. The defaults:
// 8 items per compute unit on CPUs, 256 on GPUs; 64 keys. A tuning's "DecodeSplit" replaces
// them (clmha_context_tune() searches them); $CLMHA_DECODE_PARTS fixes the count.
CLMHA__HIDDEN void clmha__decode_default_split(const clmha_context *ctx, size_t split[2]);

// The number of ranges for @p split, @p rows query-row groups (N · KV heads · L) and
// @p longest keys, the most a query row sees, on the device of @p ctx.
CLMHA__HIDDEN size_t clmha__decode_parts(const clmha_context *ctx, const size_t split[2],
                                         size_t rows, size_t longest);

// The tuner's override for @p layer: its decode calls use @p split (NULL: back to the device's
// tuning or the defaults). Not thread-safe with calls on the layer.
CLMHA__HIDDEN void clmha__decode_set_split(clmha_layer *layer, const size_t split[2]);

// Test hook (reachable only by linking libclmha.a): cut every sequence's keys into @p parts
// ranges (0: the core's own choice), so that the merge of parts shows on short caches. Not
// thread-safe: set it while no forward call runs.
CLMHA__HIDDEN void clmha__test_set_decode_parts(size_t parts);

#endif
