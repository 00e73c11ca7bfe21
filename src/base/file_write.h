// Writing a file whole or not at all: shared by the .npy and PNG writers of the clmha program
// and by the library's layer files and tuning files. (Compiled into the library and, with
// src/cli/npy.c, into clmha_support for the program and the tests.)
#ifndef CLMHA_FILE_WRITE_H
#define CLMHA_FILE_WRITE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include <clmha.h>

// Writes the file's contents to @p f. On failure returns false and either leaves errno set or
// writes why to @p why (which starts empty).
typedef bool (*clmha__file_writer)(FILE *f, void *user, char *why, size_t why_size);

// Writes @p path through @p fill into a temporary file in the same folder ("<path>.tmp.XXXXXX"),
// flushes and syncs it, gives it the mode of the file it replaces (else rw-r--r--) and renames it
// over @p path. On failure nothing is left behind, and @p msg names the file and the reason.
// Returns CLMHA_SUCCESS, CLMHA_IO_ERROR or CLMHA_OUT_OF_MEMORY.
clmha_status clmha__file_write_whole(const char *path, clmha__file_writer fill, void *user,
                                     char *msg, size_t msg_size);

#endif
