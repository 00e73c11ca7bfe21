// Opening and reading input files safely: only regular files are read, and a FIFO, a device
// or a terminal is refused at once instead of blocking or growing a buffer without bound.
// Shared by the library's readers (layer files, tuning files) and the program's .npy reader.
#ifndef CLMHA_FILE_READ_H
#define CLMHA_FILE_READ_H

#include <stddef.h>
#include <stdio.h>

#include <clmha.h>

// Opens @p path for reading without blocking (O_RDONLY | O_NONBLOCK | O_NOCTTY, so that a FIFO
// without a writer does not hang), checks with fstat on the opened descriptor that it is a
// regular file (refusing folders, FIFOs, sockets and devices such as /dev/zero or /dev/null),
// then clears O_NONBLOCK. On success *f is the stream (read it at most *size bytes: its size
// when opened) and the caller closes it. On failure *f is NULL and @p msg reads
// "<path>: <reason>". Returns CLMHA_SUCCESS or CLMHA_IO_ERROR; *missing (may be NULL) is true
// when the file does not exist.
clmha_status clmha__file_open_regular(const char *path, FILE **f, size_t *size, int *missing,
                                      char *msg, size_t msg_size);

// Reads the whole regular file @p path (see clmha__file_open_regular) into a malloc'd buffer
// of *size bytes plus a NUL byte after them. Refuses files larger than @p max_size bytes
// (CLMHA_INVALID_FILE) and files that change size while being read (CLMHA_IO_ERROR).
// Returns CLMHA_SUCCESS, CLMHA_IO_ERROR, CLMHA_INVALID_FILE or CLMHA_OUT_OF_MEMORY.
clmha_status clmha__file_read_whole(const char *path, size_t max_size, unsigned char **out,
                                    size_t *size, int *missing, char *msg, size_t msg_size);

#endif
