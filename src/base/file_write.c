// Writing a file whole or not at all (see file_write.h).
#define _POSIX_C_SOURCE 200809L

#include "base/file_write.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/message.h"

static const char *kind_of(mode_t mode) {
    if (S_ISDIR(mode)) return "a folder";
    if (S_ISLNK(mode)) return "a symbolic link";
    if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "not a regular file";
}

clmha_status clmha__file_check_target(const char *path, char *msg, size_t msg_size) {
    struct stat sb;
    if (lstat(path, &sb) != 0) {
        if (errno == ENOENT) return CLMHA_SUCCESS;
        return clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "%s: %s", path, strerror(errno));
    }
    if (S_ISREG(sb.st_mode)) return CLMHA_SUCCESS;
    return clmha__msg(msg, msg_size, CLMHA_IO_ERROR,
                      "%s: is %s; only a regular file is replaced (left as it is)", path,
                      kind_of(sb.st_mode));
}

clmha_status clmha__file_write_temp(const char *path, clmha__file_writer fill, void *user,
                                    char **tmp_out, char *msg, size_t msg_size) {
    static const char name[] = ".clmha-XXXXXX";
    *tmp_out = NULL;
    if (!msg) msg_size = 0;
    clmha_status st = clmha__file_check_target(path, msg, msg_size);
    if (st) return st;
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path) + 1 : 0;  // with the '/'
    char *tmp = malloc(dir_len + sizeof name);
    if (!tmp) return clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY, "%s: out of memory", path);
    memcpy(tmp, path, dir_len);
    memcpy(tmp + dir_len, name, sizeof name);
    int fd = mkstemp(tmp);
    if (fd < 0) {
        st = clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "%s: cannot create the temporary file %s: %s",
                        path, tmp, strerror(errno));
        free(tmp);
        return st;
    }
    // mkstemp makes the file 0600: take the mode of the file it replaces, else rw-r--r--.
    struct stat sb;
    mode_t mode = lstat(path, &sb) == 0 && S_ISREG(sb.st_mode)
                      ? (sb.st_mode & 07777)
                      : (S_IRUSR | S_IWUSR | S_IRGRP | S_IROTH);
    char why[256] = "";
    FILE *f = fchmod(fd, mode) == 0 ? fdopen(fd, "wb") : NULL;
    bool ok = f != NULL;
    if (!ok) {
        snprintf(why, sizeof why, "%s", strerror(errno));
        close(fd);
    } else {
        errno = 0;
        ok = fill(f, user, why, sizeof why) && fflush(f) == 0 && fsync(fileno(f)) == 0;
        if (!ok && !why[0]) snprintf(why, sizeof why, "%s", strerror(errno ? errno : EIO));
        if (fclose(f) != 0 && ok) {
            ok = false;
            snprintf(why, sizeof why, "%s", strerror(errno));
        }
    }
    if (!ok) {
        remove(tmp);
        free(tmp);
        return clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "cannot write '%s': %s", path, why);
    }
    *tmp_out = tmp;
    return CLMHA_SUCCESS;
}

clmha_status clmha__file_write_whole(const char *path, clmha__file_writer fill, void *user,
                                     char *msg, size_t msg_size) {
    char *tmp = NULL;
    clmha_status st = clmha__file_write_temp(path, fill, user, &tmp, msg, msg_size);
    if (st) return st;
    // (A special file could have appeared at the path since the check: rename replaces only
    // the directory entry, never writes into it.)
    if (rename(tmp, path) != 0) {
        st = clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "cannot rename '%s' to '%s': %s", tmp,
                        path, strerror(errno));
        remove(tmp);
    }
    free(tmp);
    return st;
}
