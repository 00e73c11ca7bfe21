// Writing a file whole or not at all: shared by the .npy and PNG writers of the clmha program
// and by the library's layer files and tuning files. (Compiled into the library and, with
// src/cli/npy.c, into clmha_support for the program and the tests.)
//
// What is replaced: only a regular file, or nothing (the path does not exist yet). An existing
// folder, FIFO, socket, device (/dev/null) or symbolic link at the path is refused and left as
// it is: a symbolic link is not followed, since a rename would replace the link, not the file
// it names (and a link to /proc/self/fd/1 or a device names no file at all).
#ifndef CLMHA_FILE_WRITE_H
#define CLMHA_FILE_WRITE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include <clmha.h>

// Writes the file's contents to @p f. On failure returns false and either leaves errno set or
// writes why to @p why (which starts empty).
typedef bool (*clmha__file_writer)(FILE *f, void *user, char *why, size_t why_size);

// Checks that @p path may be written: it does not exist, or it is a regular file (see above).
// On refusal @p msg reads "<path>: <reason>". Returns CLMHA_SUCCESS or CLMHA_IO_ERROR.
clmha_status clmha__file_check_target(const char *path, char *msg, size_t msg_size);

// Writes a temporary file through @p fill in @p path's folder (".clmha-XXXXXX": short, so that
// any legal file name can be written), flushes and syncs it and gives it the mode of the file
// it will replace (else rw-r--r--). *tmp gets its malloc'd name (the caller renames it over
// @p path, or removes it, and frees the name). Checks @p path first (clmha__file_check_target).
// On failure nothing is left behind and *tmp is NULL.
clmha_status clmha__file_write_temp(const char *path, clmha__file_writer fill, void *user,
                                    char **tmp, char *msg, size_t msg_size);

// Writes @p path whole through @p fill: clmha__file_write_temp, then rename over @p path. On
// failure nothing is left behind, any file at @p path is as it was, and @p msg names the file
// and the reason. Returns CLMHA_SUCCESS, CLMHA_IO_ERROR or CLMHA_OUT_OF_MEMORY.
clmha_status clmha__file_write_whole(const char *path, clmha__file_writer fill, void *user,
                                     char *msg, size_t msg_size);

#endif
