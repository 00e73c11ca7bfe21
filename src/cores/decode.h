// The decode core (decode.c), as the tests see it beyond the core interface.
#ifndef CLMHA_CORES_DECODE_H
#define CLMHA_CORES_DECODE_H

#include <stddef.h>

#include "base/defs.h"

// Test hook (reachable only by linking libclmha.a): cut every sequence's keys into @p parts
// ranges (0: the core's own choice), so that the merge of parts shows on short caches. Not
// thread-safe: set it while no forward call runs.
CLMHA__HIDDEN void clmha__test_set_decode_parts(size_t parts);

#endif
