// Packed variable-length batches (clmha_forward_args::seq_lens): a packed call runs as one
// unbatched call per sequence on the sequence's rows of the packed tensors. The forward pass
// (src/forward/packed.c), the backward pass (src/backward/backward_packed.c) and the CPU
// reference (src/reference/) cut the call the same way, here.
#ifndef CLMHA_LAYER_PACKED_H
#define CLMHA_LAYER_PACKED_H

#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/shape.h"

// Where one sequence of a packed call starts: its first query and key/value token.
typedef struct clmha__packed_at {
    size_t q0, k0;
} clmha__packed_at;

// The unbatched call of sequence @p i (which has queries) of the packed call @p a (sizes @p d,
// resolved) whose tokens start at @p at: its query (L_i, E), key (S_i, kdim) and value
// (S_i, vdim) at their rows of a's tensors (offsets in elements; host data pointers advanced
// by @p elem bytes per element, the caller's element size), the rng offset advanced by i * 2^32
// (include/clmha.h), not packed, saving nothing.
CLMHA__HIDDEN void clmha__packed_args(const clmha__dims *d, const clmha_forward_args *a, size_t i,
                                      clmha__packed_at at, size_t elem, clmha_forward_args *sub);

// Packed tensor @p t (2-D, rows of @p feat elements) cut to its @p rows rows from row @p row0:
// the shape, the offset, and the host data pointer (@p elem bytes per element) when it has one.
CLMHA__HIDDEN void clmha__packed_cut(clmha_tensor *t, size_t row0, size_t rows, size_t feat,
                                     size_t elem);

// The start of the sequence after sequence @p i.
static inline clmha__packed_at clmha__packed_next(const clmha__dims *d, size_t i,
                                                  clmha__packed_at at) {
    return (clmha__packed_at){at.q0 + d->seq_lens[i], at.k0 + d->kv_seq_lens[i]};
}

#endif
