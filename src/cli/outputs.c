// The output files of `clmha run`: distinct outputs, all-or-none writing (see outputs.h).
#define _POSIX_C_SOURCE 200809L

#include "outputs.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "cli.h"
#include "npy.h"

// ---- distinct outputs -------------------------------------------------------------------------

// The identity of a file: its device and inode (following symbolic links), else, for a path
// that does not exist yet, its folder's device and inode and its last component.
typedef struct file_id {
    bool exists;
    dev_t dev;
    ino_t ino;
    const char *base;
} file_id;

static bool file_id_of(const char *path, file_id *id) {
    struct stat sb;
    memset(id, 0, sizeof *id);
    if (stat(path, &sb) == 0) {
        id->exists = true;
        id->dev = sb.st_dev;
        id->ino = sb.st_ino;
        return true;
    }
    const char *slash = strrchr(path, '/');
    id->base = slash ? slash + 1 : path;
    size_t len = slash ? (size_t)(slash - path) : 1;
    if (slash && len == 0) len = 1;
    char *dir = malloc(len + 1);
    if (!dir) return false;
    memcpy(dir, slash ? path : ".", len);
    dir[len] = '\0';
    bool ok = stat(dir, &sb) == 0;
    free(dir);
    id->dev = sb.st_dev;
    id->ino = sb.st_ino;
    return ok;
}

static bool same_file(const file_id *a, const file_id *b) {
    if (a->exists != b->exists || a->dev != b->dev || a->ino != b->ino) return false;
    return a->exists || strcmp(a->base, b->base) == 0;
}

bool clmha__cli_outputs_distinct(const char *cmd, const clmha__cli_out *out, size_t count,
                                 const clmha__cli_in *in, size_t in_count) {
    file_id *id = malloc((count ? count : 1) * sizeof *id);
    if (!id) {
        clmha__cli_report(cmd, "out of memory");
        return false;
    }
    bool ok = true;
    for (size_t i = 0; i < count && ok; ++i)
        if (!file_id_of(out[i].path, &id[i])) count = 0;  // refused later, with a better message
    for (size_t i = 0; i < count && ok; ++i)
        for (size_t k = i + 1; k < count && ok; ++k)
            if (same_file(&id[i], &id[k])) {
                clmha__cli_report(cmd, "%s %s and %s %s name the same file", out[i].flag,
                                  out[i].path, out[k].flag, out[k].path);
                ok = false;
            }
    for (size_t i = 0; i < count && ok; ++i) {
        if (!id[i].exists) continue;  // a new file is no input
        for (size_t k = 0; k < in_count && ok; ++k) {
            file_id other;
            if (!in[k].path || !file_id_of(in[k].path, &other) || !same_file(&id[i], &other))
                continue;
            clmha__cli_report(cmd, "%s %s names the input %s %s; it would be overwritten",
                              out[i].flag, out[i].path, in[k].flag, in[k].path);
            ok = false;
        }
    }
    free(id);
    return ok;
}

// ---- all-or-none writing ----------------------------------------------------------------------

// Renames the temporary files over the outputs, all or none: an output that exists is kept as a
// hard link (a backup) until every rename succeeded, and put back when a later rename fails.
// Returns the index of the output that failed (errno set), or -1 when all were renamed.
static long commit(char *const *tmp, const clmha__cli_out *out, size_t count) {
    char **backup = calloc(count ? count : 1, sizeof *backup);
    if (!backup) {
        errno = ENOMEM;
        return 0;
    }
    size_t renamed = 0;
    long failed = -1;
    int err = 0;
    for (size_t i = 0; i < count && failed < 0; ++i) {
        struct stat sb;
        if (lstat(out[i].path, &sb) != 0) continue;  // a new file: removed if a rename fails
        size_t n = strlen(tmp[i]);
        if (!(backup[i] = malloc(n + 2))) {
            failed = (long)i, err = ENOMEM;
            break;
        }
        memcpy(backup[i], tmp[i], n);
        memcpy(backup[i] + n, "b", 2);  // next to our own (unique) temporary file
        if (link(out[i].path, backup[i]) != 0) {
            failed = (long)i, err = errno;
            free(backup[i]);
            backup[i] = NULL;
        }
    }
    while (failed < 0 && renamed < count) {
        if (rename(tmp[renamed], out[renamed].path) != 0) failed = (long)renamed, err = errno;
        else ++renamed;
    }
    for (size_t i = 0; i < count; ++i) {
        if (failed >= 0 && i < renamed) {  // put back what was there before
            if (backup[i]) rename(backup[i], out[i].path);
            else remove(out[i].path);
        } else if (backup[i]) {
            remove(backup[i]);
        }
        free(backup[i]);
    }
    free(backup);
    errno = err;
    return failed;
}

static bool committed;

bool clmha__cli_outputs_committed(void) { return committed; }

bool clmha__cli_write_outputs(const char *cmd, const clmha__cli_out *out, size_t count) {
    char **tmp = calloc(count ? count : 1, sizeof *tmp);
    if (!tmp) {
        clmha__cli_report(cmd, "out of memory (no output written)");
        return false;
    }
    char msg[1024] = "";
    bool ok = true;
    for (size_t i = 0; i < count && ok; ++i) {
        const clmha__cli_out *o = &out[i];
        if (o->f64 ? clmha__npy_write_f64_temp(o->path, o->f64, o->ndim, o->shape, &tmp[i], msg,
                                               sizeof msg)
                   : clmha__npy_write_f32_temp(o->path, o->data, o->ndim, o->shape, o->half,
                                               &tmp[i], msg, sizeof msg)) {
            clmha__cli_report(cmd, "%s %s: %s (no output written)", out[i].flag, out[i].path,
                              clmha__cli_without_path(msg, out[i].path));
            ok = false;
        }
    }
    // What the command printed goes out before the files are committed: a stdout that cannot
    // be written fails the run (main.c), and a failed run leaves every file as it was.
    errno = 0;
    if (ok && (fflush(stdout) != 0 || ferror(stdout))) {
        clmha__cli_report(cmd, "cannot write to stdout: %s (no output written)",
                          errno ? strerror(errno) : "write error");
        ok = false;
    }
    long failed = ok ? commit(tmp, out, count) : -1;
    if (failed >= 0) {
        clmha__cli_report(cmd,
                          "%s %s: cannot rename %s to it: %s (no output written; every file is "
                          "as it was)",
                          out[failed].flag, out[failed].path, tmp[failed], strerror(errno));
        ok = false;
    }
    for (size_t i = 0; i < count; ++i) {
        if (!ok && tmp[i]) remove(tmp[i]);
        free(tmp[i]);
    }
    free(tmp);
    committed = ok && count;
    return ok;
}
