// The program cache of a context: kernel programs built from the sources embedded at build time
// (cl/*.cl, cl/cores/*.cl), kept by kernel family and build options. A small object with its
// own lock; the context holds one.
#ifndef CLMHA_CONTEXT_PROGRAMS_H
#define CLMHA_CONTEXT_PROGRAMS_H

#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// One embedded kernel file: the table clmha__cl_sources, generated at build time from
// CMakeLists.txt's CLMHA_CL_SOURCES by cmake/embed_cl.cmake (cl_sources.c in the build tree).
typedef struct clmha__cl_source {
    const char *name;  // the file name without .cl: the kernel family ("heads", "fused")
    const char *path;  // "cl/heads.cl", "cl/cores/fused.cl" (in build failure messages)
    const char *text;  // NUL-terminated
    size_t size;       // without the NUL
} clmha__cl_source;

CLMHA__HIDDEN extern const clmha__cl_source clmha__cl_sources[];
CLMHA__HIDDEN extern const size_t clmha__cl_sources_count;

typedef struct clmha__programs clmha__programs;

// An empty cache (NULL when out of host memory).
CLMHA__HIDDEN clmha__programs *clmha__programs_create(void);

// Releases every program of @p cache and frees it (NULL is ignored).
CLMHA__HIDDEN void clmha__programs_release(clmha__programs *cache);

// Builds (or finds in the context's cache) the program of kernel family @p family with build
// @p options. A family is the name of an embedded file (clmha__cl_sources): "heads"
// (cl/heads.cl), and each attention core's, "unfused", "fused", ... (cl/cores/NAME.cl), built
// with cl/common.cl in front. The context keeps the program.
CLMHA__HIDDEN clmha_status clmha__program_get(clmha_context *ctx, const char *family,
                                              const char *options, cl_program *out);

// clmha__program_get() with a layer's user functions @p user (clmha_layer_desc::mod_source;
// NULL or "": none) between cl/common.cl and an attention core's file; the cache keeps a
// program per source.
CLMHA__HIDDEN clmha_status clmha__program_get_mod(clmha_context *ctx, const char *family,
                                                  const char *options, const char *user,
                                                  cl_program *out);

// Test hook (reachable only by linking libclmha.a): appends @p options to every later program
// build, e.g. "-DCLMHA_FORCE_BUILD_ERROR" to make cl/heads.cl fail to compile. NULL clears it.
// The string must outlive its use.
CLMHA__HIDDEN void clmha__test_set_extra_build_options(const char *options);

#endif
