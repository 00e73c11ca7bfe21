// Replays the fuzzers' seed corpora (fuzz/corpus/<harness>/) and every reproducer they found
// (tests/fuzz_regressions/<harness>/) through the same targets as the libFuzzer harnesses
// (fuzz/targets.h, fuzz/target_*.c): each input must return without a crash or a failed
// invariant. Seeds named valid_* must also succeed (the parse, or the shape resolution of the
// forward call, the backward call, the last KV-cache operation, the variants' call), and seeds
// named invalid_* must be refused. The device targets (backward_args, kv_ops, variants) create
// one OpenCL context per process; without a device their inputs are skipped.
//
// Links the targets built for the tests (clmha_test_fuzz_targets: the fuzz/target_*.c files on
// libclmha.a and clmha_support, without the fuzzers' instrumentation).
#define _POSIX_C_SOURCE 200809L

#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include <clmha.h>

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "targets.h"

#ifndef CLMHA_TEST_DATA_DIR
#error "CLMHA_TEST_DATA_DIR (absolute path of tests/) must be defined"
#endif

#define FUZZ_PATH_MAX 1024
#define FUZZ_DIR CLMHA_TEST_DATA_DIR "/../fuzz/corpus"
#define REGRESSIONS_DIR CLMHA_TEST_DATA_DIR "/fuzz_regressions"

// The harnesses, by the name of their corpus folder; the last ones run on the OpenCL device
// (their inputs are skipped where there is none).
typedef int (*fuzz_target)(const uint8_t *data, size_t size);
enum { HARNESSES = 6, FIRST_DEVICE = 3 };
static const char *const harnesses[HARNESSES] = {"safetensors",   "npy",    "forward_args",
                                                 "backward_args", "kv_ops", "variants"};
static const fuzz_target targets[HARNESSES] = {clmha_fuzz_safetensors,   clmha_fuzz_npy,
                                               clmha_fuzz_forward_args,  clmha_fuzz_backward_args,
                                               clmha_fuzz_kv_ops,        clmha_fuzz_variants};

// One input file to replay (plain arrays: parameters are copied into the test's process).
typedef struct fuzz_case {
    int harness;  // index in harnesses
    char path[FUZZ_PATH_MAX];
} fuzz_case;

static int run_target(int harness, const uint8_t *data, size_t size) {
    return targets[harness](data, size);
}

static int compare_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

// The regular files of @p dir, sorted, as malloc'd full paths (NULL and 0 when it is absent).
static char **list_dir(const char *dir, size_t *count) {
    *count = 0;
    DIR *d = opendir(dir);
    if (!d) return NULL;
    char **names = NULL;
    size_t cap = 0;
    struct dirent *ent;
    while ((ent = readdir(d)) != NULL) {
        if (ent->d_name[0] == '.') continue;
        if (*count == cap) {
            cap = cap ? 2 * cap : 64;
            char **grown = realloc(names, cap * sizeof *names);
            if (!grown) break;
            names = grown;
        }
        size_t len = strlen(dir) + 1 + strlen(ent->d_name) + 1;
        char *path = malloc(len);
        if (!path) break;
        snprintf(path, len, "%s/%s", dir, ent->d_name);
        names[(*count)++] = path;
    }
    closedir(d);
    if (*count) qsort(names, *count, sizeof *names, compare_names);
    return names;
}

static void free_list(char **names, size_t count) {
    for (size_t i = 0; i < count; ++i) free(names[i]);
    free(names);
}

static void free_cases(struct criterion_test_params *params) {
    if (params->params) cr_free(params->params);
}

ParameterizedTestParameters(fuzz_regressions, replay) {
    size_t total = 0, cap = 0;
    fuzz_case *cases = NULL;
    for (int h = 0; h < HARNESSES; ++h)
        for (int which = 0; which < 2; ++which) {
            char dir[FUZZ_PATH_MAX];
            snprintf(dir, sizeof dir, "%s/%s", which ? REGRESSIONS_DIR : FUZZ_DIR, harnesses[h]);
            size_t n;
            char **files = list_dir(dir, &n);
            for (size_t i = 0; i < n; ++i) {
                if (total == cap) {
                    size_t new_cap = cap ? 2 * cap : 128;
                    fuzz_case *grown = cr_malloc(new_cap * sizeof *grown);
                    if (!grown) break;
                    if (cases) memcpy(grown, cases, total * sizeof *cases);
                    if (cases) cr_free(cases);
                    cases = grown, cap = new_cap;
                }
                cases[total].harness = h;
                snprintf(cases[total].path, sizeof cases[total].path, "%s", files[i]);
                ++total;
            }
            free_list(files, n);
        }
    return cr_make_param_array(fuzz_case, cases, total, free_cases);
}

static uint8_t *read_all(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s: %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    cr_assert_not_null(buf);
    size_t got;
    while ((got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            cr_assert_not_null(buf);
        }
    }
    cr_assert(!ferror(f), "cannot read %s", path);
    fclose(f);
    // An exact-size copy, as libFuzzer gives it (so that a sanitized build sees over-reads).
    uint8_t *exact = malloc(n ? n : 1);
    cr_assert_not_null(exact);
    memcpy(exact, buf, n);
    free(buf);
    *size = n;
    return exact;
}

ParameterizedTest(fuzz_case *c, fuzz_regressions, replay, .timeout = 60) {
    const char *base = strrchr(c->path, '/');
    base = base ? base + 1 : c->path;
    cr_log_info("fuzz_%s %s", harnesses[c->harness], c->path);
    if (c->harness >= FIRST_DEVICE && !clmha_fuzz_have_device())
        cr_skip_test("no OpenCL device for fuzz_%s", harnesses[c->harness]);
    size_t size;
    uint8_t *data = read_all(c->path, &size);
    int st = run_target(c->harness, data, size);
    free(data);
    if (strncmp(base, "valid_", 6) == 0)
        cr_expect_eq(st, CLMHA_SUCCESS, "fuzz_%s %s: expected success, got %s",
                     harnesses[c->harness], c->path, clmha_status_string((clmha_status)st));
    else if (strncmp(base, "invalid_", 8) == 0)
        cr_expect_neq(st, CLMHA_SUCCESS, "fuzz_%s %s: expected a refusal, got success",
                      harnesses[c->harness], c->path);
}

// The corpora are where the test looks for them, and each has valid and invalid seeds (so a
// wrong path cannot make the replay above pass by finding nothing).
Test(fuzz_regressions, corpora_present) {
    for (int h = 0; h < HARNESSES; ++h) {
        char dir[FUZZ_PATH_MAX];
        snprintf(dir, sizeof dir, "%s/%s", FUZZ_DIR, harnesses[h]);
        size_t n, valid = 0, invalid = 0;
        char **files = list_dir(dir, &n);
        for (size_t i = 0; i < n; ++i) {
            const char *base = strrchr(files[i], '/') + 1;
            valid += strncmp(base, "valid_", 6) == 0;
            invalid += strncmp(base, "invalid_", 8) == 0;
        }
        free_list(files, n);
        cr_expect_geq(valid, 3, "%s: %zu valid_* seeds", dir, valid);
        cr_expect_geq(invalid, 3, "%s: %zu invalid_* seeds", dir, invalid);
    }
}

// Replays every input once more in this process, one after the other: the targets keep no state
// between inputs, so the results must not depend on the order (and a leak or a stale pointer
// between inputs would show up here under a sanitized build).
Test(fuzz_regressions, replay_all_in_one_process, .timeout = 120) {
    size_t total = 0;
    for (int h = 0; h < HARNESSES; ++h)
        for (int which = 0; which < 2; ++which) {
            char dir[FUZZ_PATH_MAX];
            snprintf(dir, sizeof dir, "%s/%s", which ? REGRESSIONS_DIR : FUZZ_DIR, harnesses[h]);
            size_t n;
            char **files = list_dir(dir, &n);
            bool skip = h >= FIRST_DEVICE && !clmha_fuzz_have_device();
            for (size_t i = 0; i < n && !skip; ++i) {
                size_t size;
                uint8_t *data = read_all(files[i], &size);
                int first = run_target(h, data, size);
                int again = run_target(h, data, size);
                cr_expect_eq(first, again, "%s: %d then %d", files[i], first, again);
                free(data);
            }
            total += n;
            free_list(files, n);
        }
    cr_expect_gt(total, 0);
}
