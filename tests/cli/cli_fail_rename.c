// Preloaded (LD_PRELOAD) into the clmha program by tests/cli/test_cli.c: rename() fails with EIO when
// its target ends with $CLMHA_TEST_FAIL_RENAME, as a failing file system would make it, even for
// root; every other rename is the C library's. It lets a test fail the second of two renames.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int rename(const char *from, const char *to) {
    const char *tail = getenv("CLMHA_TEST_FAIL_RENAME");
    size_t n = tail ? strlen(tail) : 0, m = strlen(to);
    if (n && m >= n && strcmp(to + m - n, tail) == 0) {
        errno = EIO;
        return -1;
    }
    int (*real)(const char *, const char *);
    void *sym = dlsym(RTLD_NEXT, "rename");
    memcpy(&real, &sym, sizeof real);  // (ISO C has no cast from object to function pointer)
    return real(from, to);
}
