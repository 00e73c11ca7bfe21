// CLMHA_TEST_CASE_STRIDE=K or K:O (K >= 1, 0 <= O < K): the PyTorch-case suites (test_golden,
// test_cli) run only cases O, O+K, O+2K, ... of their list. For driver lanes where every case
// costs a full compile of CLBlast's kernels (Intel's CPU runtime keeps no program cache):
// .ci/run's Intel lane. Unset or empty: every case. Header-only; needs Criterion.
#ifndef CLMHA_TESTS_CASE_STRIDE_H
#define CLMHA_TESTS_CASE_STRIDE_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct case_stride {
    size_t k, o;
} case_stride;

// The stride from the environment; an unreadable value stops the suite (exit status 2) rather
// than silently running another subset. @p suite and @p total name what is selected on stderr.
static case_stride case_stride_get(const char *suite, size_t total) {
    case_stride s = {1, 0};
    const char *env = getenv("CLMHA_TEST_CASE_STRIDE");
    if (!env || !*env) return s;
    unsigned long k = 0, o = 0;
    int used = 0;
    if (!((sscanf(env, "%lu:%lu%n", &k, &o, &used) == 2 || sscanf(env, "%lu%n", &k, &used) == 1) &&
          env[used] == '\0' && k >= 1 && o < k)) {
        fprintf(stderr, "%s: CLMHA_TEST_CASE_STRIDE='%s': want K or K:O with K >= 1, O < K\n",
                suite, env);
        exit(2);
    }
    s.k = k, s.o = o;
    size_t kept = total > s.o ? (total - s.o + s.k - 1) / s.k : 0;
    fprintf(stderr, "%s: CLMHA_TEST_CASE_STRIDE=%s: %zu of %zu cases (every %zu-th from %zu)\n",
            suite, env, kept, total, s.k, s.o);
    return s;
}

static inline bool case_stride_keeps(case_stride s, size_t i) {
    return i >= s.o && (i - s.o) % s.k == 0;
}

#endif  // CLMHA_TESTS_CASE_STRIDE_H
