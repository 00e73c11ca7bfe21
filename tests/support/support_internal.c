// Test support that needs the library's internals (see support_internal.h).
#include "support_internal.h"

#include <criterion/criterion.h>

static const char *const held_kind_name[CLMHA__HELD_KINDS] = {
    "cl_context", "cl_command_queue", "cl_device_id", "cl_mem", "cl_program", "cl_kernel"};

void held_counts(long held[CLMHA__HELD_KINDS]) { clmha__test_held(held); }

void assert_nothing_held(const char *when) {
    long held[CLMHA__HELD_KINDS];
    held_counts(held);
    for (int k = 0; k < CLMHA__HELD_KINDS; ++k)
        cr_assert_eq(held[k], 0, "clmha still holds %ld %s references %s", held[k],
                     held_kind_name[k], when);
}
