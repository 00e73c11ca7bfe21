// The process-wide counts of the OpenCL objects clmha holds (held.h).
#include "device/held.h"

#include <stdatomic.h>

static _Atomic long held[CLMHA__HELD_KINDS];

void clmha__held_add(clmha__held_kind kind, long delta) { atomic_fetch_add(&held[kind], delta); }

void clmha__test_held(long counts[CLMHA__HELD_KINDS]) {
    for (int k = 0; k < CLMHA__HELD_KINDS; ++k) counts[k] = atomic_load(&held[k]);
}
