// Opening and reading input files safely (see file_read.h).
#define _POSIX_C_SOURCE 200809L

#include "base/file_read.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/message.h"

static const char *kind_of(mode_t mode) {
    if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "not a regular file";
}

clmha_status clmha__file_open_regular(const char *path, FILE **f, size_t *size, int *missing,
                                      char *msg, size_t msg_size) {
    *f = NULL;
    *size = 0;
    if (missing) *missing = 0;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        if (missing) *missing = errno == ENOENT;
        return clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "%s: cannot open: %s", path,
                          strerror(errno));
    }
    struct stat sb;
    clmha_status st = CLMHA_IO_ERROR;
    if (fstat(fd, &sb) != 0) {
        clmha__msg(msg, msg_size, st, "%s: cannot read: %s", path, strerror(errno));
    } else if (S_ISDIR(sb.st_mode)) {
        clmha__msg(msg, msg_size, st, "%s: cannot read: %s", path, strerror(EISDIR));
    } else if (!S_ISREG(sb.st_mode)) {
        clmha__msg(msg, msg_size, st, "%s: is %s, not a regular file", path, kind_of(sb.st_mode));
    } else if (sb.st_size < 0 || (uintmax_t)sb.st_size >= SIZE_MAX) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "%s: too large to read", path);
    } else {
        int flags = fcntl(fd, F_GETFL);
        if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0 || !(*f = fdopen(fd, "rb")))
            clmha__msg(msg, msg_size, st, "%s: cannot read: %s", path, strerror(errno));
        else
            st = CLMHA_SUCCESS;
    }
    if (st) {
        close(fd);
        return st;
    }
    *size = (size_t)sb.st_size;
    return CLMHA_SUCCESS;
}

clmha_status clmha__file_read_whole(const char *path, size_t max_size, unsigned char **out,
                                    size_t *size, int *missing, char *msg, size_t msg_size) {
    *out = NULL;
    *size = 0;
    FILE *f;
    size_t expected;
    clmha_status st = clmha__file_open_regular(path, &f, &expected, missing, msg, msg_size);
    if (st) return st;
    unsigned char *buf = NULL;
    if (expected > max_size) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "%s: %zu bytes, larger than the %zu bytes accepted", path, expected,
                        max_size);
        goto fail;
    }
    // One byte more than expected: a file that grew since fstat is noticed.
    if (!(buf = malloc(expected + 1))) {
        st = clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY,
                        "%s: out of memory (%zu bytes to read it)", path, expected + 1);
        goto fail;
    }
    size_t n = fread(buf, 1, expected + 1, f);
    if (ferror(f)) {
        st = clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "%s: cannot read: %s", path,
                        strerror(errno));
        goto fail;
    }
    if (n != expected) {
        st = clmha__msg(msg, msg_size, CLMHA_IO_ERROR,
                        "%s: the file changed size while being read (%zu bytes, then %s%zu)", path,
                        expected, n > expected ? "more than " : "", n > expected ? expected : n);
        goto fail;
    }
    buf[n] = '\0';
    fclose(f);
    *out = buf;
    *size = n;
    return CLMHA_SUCCESS;
fail:
    free(buf);
    fclose(f);
    return st;
}
