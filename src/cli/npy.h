// NumPy .npy files: reading float16/float32/float64/bool/uint8 arrays (as floats, or as doubles
// for float64 layers) and writing float32, float16 or float64 arrays.
// Used by the `clmha` program and the tests; not part of the library's public API.
#ifndef CLMHA_NPY_H
#define CLMHA_NPY_H

#include <clmha.h>
#include <stdbool.h>

#define CLMHA__NPY_MAX_DIMS 8

typedef enum clmha__npy_kind {
    CLMHA__NPY_FLOAT = 0,  // '<f2', '<f4' or '<f8' (converted to float, or double: see f64)
    CLMHA__NPY_BOOL,       // '|b1' or '|u1' (one byte per element, 0 or not)
} clmha__npy_kind;

typedef struct clmha__npy {
    clmha__npy_kind kind;
    char dtype[8];        // as in the file's header: "<f2", "<f4", "<f8", "|b1", "|u1"
    size_t ndim;
    size_t shape[CLMHA__NPY_MAX_DIMS];
    size_t count;         // product of shape (1 for 0-D)
    size_t overflowed;    // '<f8' read as floats: finite values beyond float32's range, +-inf
    float *f32;           // kind FLOAT read as floats: count floats (malloc'd), else NULL
    double *f64;          // kind FLOAT read as doubles (clmha__npy_parse_f64): count doubles
                          // (malloc'd; '<f8' exact, '<f2' and '<f4' widened), else NULL
    unsigned char *u8;    // kind BOOL: count bytes (malloc'd)
} clmha__npy;

// Parses a whole .npy file held in memory (versions 1.0, 2.0, 3.0). Fortran-order arrays are
// transposed to C order. Anything else (big-endian, other dtypes, object arrays, truncated data,
// trailing bytes, sizes that overflow) is refused with CLMHA_INVALID_FILE and a message naming
// @p name and the problem. On failure *out is zeroed and nothing is allocated.
clmha_status clmha__npy_parse(const void *bytes, size_t size, const char *name, clmha__npy *out,
                              char *msg, size_t msg_size);

// clmha__npy_parse(), but a float array's values go to out->f64 as doubles (out->f32 stays
// NULL, out->overflowed 0): a float64 layer reads '<f8' files exactly.
clmha_status clmha__npy_parse_f64(const void *bytes, size_t size, const char *name,
                                  clmha__npy *out, char *msg, size_t msg_size);

// Reads and parses @p path (CLMHA_IO_ERROR when it cannot be read or is not a regular file:
// a FIFO, a device or a folder is refused at once, without blocking).
clmha_status clmha__npy_read(const char *path, clmha__npy *out, char *msg, size_t msg_size);

// clmha__npy_read() into doubles, as clmha__npy_parse_f64() parses.
clmha_status clmha__npy_read_f64(const char *path, clmha__npy *out, char *msg,
                                 size_t msg_size);

// Writes a float32 C-order array ('<f4', version 1.0). The file appears whole or not at all
// (temporary file in the same folder, then rename).
clmha_status clmha__npy_write_f32(const char *path, const float *data, size_t ndim,
                                  const size_t *shape, char *msg, size_t msg_size);

// Like clmha__npy_write_f32 (or, with @p half, '<f2': the floats rounded to float16), but
// writes a temporary file in @p path's folder and leaves the renaming to the caller: *tmp gets
// its malloc'd name (NULL on failure, when nothing is left).
clmha_status clmha__npy_write_f32_temp(const char *path, const float *data, size_t ndim,
                                       const size_t *shape, bool half, char **tmp, char *msg,
                                       size_t msg_size);

// A float64 C-order array ('<f8', the doubles exactly), whole or not at all like
// clmha__npy_write_f32.
clmha_status clmha__npy_write_f64(const char *path, const double *data, size_t ndim,
                                  const size_t *shape, char *msg, size_t msg_size);

// clmha__npy_write_f64 to a temporary file whose renaming is the caller's, as
// clmha__npy_write_f32_temp.
clmha_status clmha__npy_write_f64_temp(const char *path, const double *data, size_t ndim,
                                       const size_t *shape, char **tmp, char *msg,
                                       size_t msg_size);

// Frees the arrays of @p a and zeroes it. Accepts NULL.
void clmha__npy_free(clmha__npy *a);

#endif
