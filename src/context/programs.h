// The program cache of a context: kernel programs built from the sources embedded at build time
// (cl/*.cl, cl/cores/*.cl), kept by kernel family and build options. A small object with its
// own lock; the context holds one.
#ifndef CLMHA_CONTEXT_PROGRAMS_H
#define CLMHA_CONTEXT_PROGRAMS_H

#include "clmha.h"

#include "base/defs.h"

typedef struct clmha__programs clmha__programs;

// An empty cache (NULL when out of host memory).
CLMHA__HIDDEN clmha__programs *clmha__programs_create(void);

// Releases every program of @p cache and frees it (NULL is ignored).
CLMHA__HIDDEN void clmha__programs_release(clmha__programs *cache);

// Builds (or finds in the context's cache) the program of kernel family @p family with build
// @p options. Families: "heads" (cl/heads.cl), "unfused" (cl/common.cl + cl/cores/unfused.cl),
// "fused" (cl/common.cl + cl/cores/fused.cl). The context keeps the program.
CLMHA__HIDDEN clmha_status clmha__program_get(clmha_context *ctx, const char *family,
                                              const char *options, cl_program *out);

// Test hook (reachable only by linking libclmha.a): appends @p options to every later program
// build, e.g. "-DCLMHA_FORCE_BUILD_ERROR" to make cl/heads.cl fail to compile. NULL clears it.
// The string must outlive its use.
CLMHA__HIDDEN void clmha__test_set_extra_build_options(const char *options);

#endif
