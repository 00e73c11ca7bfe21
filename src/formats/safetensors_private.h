// What the files of src/formats/ share about .safetensors files and no other module uses:
// safetensors_header.c (parsing and checking the header), safetensors_layer.c (the layer a
// parsed file describes) and safetensors_io.c (clmha_layer_load, clmha_layer_save).
#ifndef CLMHA_FORMATS_SAFETENSORS_PRIVATE_H
#define CLMHA_FORMATS_SAFETENSORS_PRIVATE_H

#include <stddef.h>
#include <stdint.h>

#include "clmha.h"

#include "base/defs.h"
#include "base/message.h"
#include "formats/safetensors.h"

// Longest quoted user string (tensor name, dtype, metadata value) put in a message.
#define CLMHA__ST_QUOTE_MAX 64

// The 8 bytes at @p p as a little-endian integer (the header length, an F64 value).
static inline uint64_t clmha__st_le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

// Reads the @p len characters at @p p as a decimal integer: digits only (no sign, no space).
// Returns 0 and sets *out when they are one, 1 when they are not (or len is 0), 2 when it is
// larger than SIZE_MAX (*out untouched then).
CLMHA__HIDDEN int clmha__st_digits(const char *p, size_t len, size_t *out);

// A decimal number without sign, as __metadata__ dropout and softcap are written: digits, an
// optional fraction and exponent ("0.1", ".5", "1e-05"), whatever the C locale. False for
// anything else; a value past the double range is infinity.
CLMHA__HIDDEN bool clmha__st_decimal(const char *s, double *out);

// Index of the first byte of @p s (n bytes) that is not valid UTF-8, or n.
CLMHA__HIDDEN size_t clmha__st_utf8_invalid_at(const unsigned char *s, size_t n);

// "(2, 3)" for a shape of any rank up to CLMHA__ST_MAX_DIMS.
static inline const char *clmha__st_shape_text(char *buf, size_t size, size_t ndim,
                                               const size_t *shape) {
    return clmha__shape_str_most(buf, size, ndim, shape, CLMHA__ST_MAX_DIMS);
}

// The message for a header length @p n over the header limit of @p limits, for the file
// @p name; returns CLMHA_INVALID_FILE.
CLMHA__HIDDEN clmha_status clmha__st_header_too_long(uint64_t n, clmha__st_limits limits,
                                                     const char *name, char *msg,
                                                     size_t msg_size);

#endif
