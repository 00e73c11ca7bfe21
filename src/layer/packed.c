// A packed call's sequences as unbatched calls (packed.h).
#include "layer/packed.h"

void clmha__packed_cut(clmha_tensor *t, size_t row0, size_t rows, size_t feat, size_t elem) {
    t->ndim = 2;
    t->shape[0] = rows, t->shape[1] = feat;
    t->offset += row0 * feat;
    if (t->data) t->data = (const char *)t->data + row0 * feat * elem;
}

void clmha__packed_args(const clmha__dims *d, const clmha_forward_args *a, size_t i,
                        clmha__packed_at at, size_t elem, clmha_forward_args *sub) {
    *sub = *a;
    sub->seq_lens = sub->kv_seq_lens = NULL;
    sub->num_seqs = 0;
    sub->save = NULL;
    sub->rng.offset += (uint64_t)i << 32;
    clmha__packed_cut(&sub->query, at.q0, d->seq_lens[i], d->e, elem);
    if (!d->key_is_query) clmha__packed_cut(&sub->key, at.k0, d->kv_seq_lens[i], d->kdim, elem);
    if (!d->value_is_key) clmha__packed_cut(&sub->value, at.k0, d->kv_seq_lens[i], d->vdim, elem);
}
