// Test support that needs the library's internals (the held-object hook): only for the tests
// that link libclmha.a (CLMHA_TESTS_USING_INTERNALS in tests/CMakeLists.txt), as the static
// library clmha_test_support_internal. The rest is in support.h.
#ifndef CLMHA_TESTS_SUPPORT_INTERNAL_H
#define CLMHA_TESTS_SUPPORT_INTERNAL_H

#include "support.h"

#include "device/held.h"

// clmha's counts of the OpenCL objects it holds, by kind (libclmha.a test hook).
void held_counts(long held[CLMHA__HELD_KINDS]);

// Asserts that clmha holds no OpenCL object at all (@p when: "after releasing everything").
void assert_nothing_held(const char *when);

#endif  // CLMHA_TESTS_SUPPORT_INTERNAL_H
