// Kernel programs: built from the sources embedded at build time (cl/*.cl, cl/cores/*.cl),
// cached per context by family and build options (programs.h).
#include "context/programs.h"

#include "context/context.h"
#include "device/held.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// A compiled program, cached by kernel family, build options and user source.
typedef struct program {
    char *key;  // "family|options|user source"
    cl_program program;
    struct program *next;
} program;

struct clmha__programs {
    pthread_mutex_t lock;  // guards list
    program *list;
};

clmha__programs *clmha__programs_create(void) {
    clmha__programs *cache = calloc(1, sizeof *cache);
    if (cache) pthread_mutex_init(&cache->lock, NULL);
    return cache;
}

void clmha__programs_release(clmha__programs *cache) {
    if (!cache) return;
    program *p = cache->list;
    while (p) {
        program *next = p->next;
        clmha__release_program(p->program);
        free(p->key);
        free(p);
        p = next;
    }
    pthread_mutex_destroy(&cache->lock);
    free(cache);
}

// Looks @p key up in @p cache.
static cl_program find(clmha__programs *cache, const char *key) {
    cl_program found = NULL;
    pthread_mutex_lock(&cache->lock);
    for (program *p = cache->list; p && !found; p = p->next)
        if (strcmp(p->key, key) == 0) found = p->program;
    pthread_mutex_unlock(&cache->lock);
    return found;
}

// Test hook: extra build options appended to every program build (see programs.h).
static _Atomic(const char *) extra_options = NULL;

void clmha__test_set_extra_build_options(const char *options) { extra_options = options; }

// The embedded file named @p name (clmha__cl_sources), or NULL.
static const clmha__cl_source *embedded(const char *name) {
    for (size_t i = 0; i < clmha__cl_sources_count; ++i)
        if (strcmp(clmha__cl_sources[i].name, name) == 0) return &clmha__cl_sources[i];
    return NULL;
}

// The sources of a kernel family: cl/real.cl (the element type), then cl/common.cl and
// @p user (a layer's user functions; NULL: none) for an attention core's (cl/cores/), then the
// family's file; @p path receives the family's file. Returns the number of strings (0 for an
// unknown family).
static cl_uint family_sources(const char *family, const char *user, const char *src[4],
                              size_t size[4], const char **path) {
    const clmha__cl_source *own = embedded(family), *common = embedded("common"),
                           *real = embedded("real");
    if (!own || !common || !real) return 0;
    cl_uint n = 0;
    src[n] = real->text, size[n++] = real->size;
    if (strncmp(own->path, "cl/cores/", 9) == 0) {
        src[n] = common->text, size[n++] = common->size;
        if (user) src[n] = user, size[n++] = strlen(user);
    }
    src[n] = own->text, size[n++] = own->size;
    *path = own->path;
    return n;
}

// Builds one program; on a build failure the message carries the build log.
static clmha_status build(clmha_context *ctx, const char *family, const char *options,
                          const char *user, cl_program *out) {
    const char *src[4];
    size_t size[4];
    const char *path = NULL;
    cl_uint count = family_sources(family, user, src, size, &path);
    if (!count)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "unknown kernel family %s", family);
    cl_int err;
    cl_program prog = clCreateProgramWithSource(ctx->cl_ctx, count, src, size, &err);
    clmha__held_new(CLMHA__HELD_PROGRAM, prog);
    if (err != CL_SUCCESS) return clmha__cl_fail(ctx, err, "clCreateProgramWithSource");
    // The options are sized to fit, never cut: the cache key holds them whole.
    const char *extra = extra_options;
    size_t all_size = strlen(options) + (extra ? 1 + strlen(extra) : 0) + 1;
    char *all_options = malloc(all_size);
    if (!all_options) {
        clmha__release_program(prog);
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    }
    snprintf(all_options, all_size, "%s%s%s", options, extra ? " " : "", extra ? extra : "");
    clmha__count(ctx, 1, 0);
    err = clBuildProgram(prog, 1, &ctx->device, all_options, NULL, NULL);
    clmha_status st = CLMHA_SUCCESS;
    if (err != CL_SUCCESS) {
        char log[CLMHA__ERROR_SIZE - 200] = "";
        clGetProgramBuildInfo(prog, ctx->device, CL_PROGRAM_BUILD_LOG, sizeof log - 1, log, NULL);
        clmha__release_program(prog);
        st = clmha__fail(ctx, err == CL_BUILD_PROGRAM_FAILURE ? CLMHA_BUILD_FAILED
                                                              : CLMHA_OPENCL_ERROR,
                         "clBuildProgram: building %s%s with options \"%s\" failed (%s):\n%s",
                         path,
                         user ? " with the user functions (mod_source)" : "", all_options,
                         clmha__cl_error_name(err), log);
    } else {
        *out = prog;
    }
    free(all_options);
    return st;
}

clmha_status clmha__program_get(clmha_context *ctx, const char *family, const char *options,
                                cl_program *out) {
    return clmha__program_get_mod(ctx, family, options, NULL, out);
}

clmha_status clmha__program_get_mod(clmha_context *ctx, const char *family,
                                    const char *options, const char *user, cl_program *out) {
    clmha__programs *cache = ctx->programs;
    if (user && !*user) user = NULL;
    size_t key_len = strlen(family) + strlen(options) + (user ? strlen(user) : 0) + 3;
    char *key = malloc(key_len);
    if (!key) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    snprintf(key, key_len, "%s|%s|%s", family, options, user ? user : "");

    // The lock is not held while building: two threads may build the same program at once,
    // and the second to finish keeps the first one's.
    cl_program found = find(cache, key);
    if (found) {
        *out = found;
        free(key);
        return CLMHA_SUCCESS;
    }
    cl_program prog = NULL;
    clmha_status st = build(ctx, family, options, user, &prog);
    if (st) {
        free(key);
        return st;
    }
    program *entry = malloc(sizeof *entry);
    if (!entry) {
        clmha__release_program(prog);
        free(key);
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    }
    entry->key = key;
    entry->program = prog;
    pthread_mutex_lock(&cache->lock);
    for (program *p = cache->list; p; p = p->next) {
        if (strcmp(p->key, key) == 0) {  // another thread built it meanwhile
            *out = p->program;
            pthread_mutex_unlock(&cache->lock);
            clmha__release_program(prog);
            free(key);
            free(entry);
            return CLMHA_SUCCESS;
        }
    }
    entry->next = cache->list;
    cache->list = entry;
    pthread_mutex_unlock(&cache->lock);
    *out = prog;
    return CLMHA_SUCCESS;
}
