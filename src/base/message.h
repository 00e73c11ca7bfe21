// Message formatting shared by the library and the program: a status with a printf-style reason
// written into a caller's buffer, and shapes as text.
#ifndef CLMHA_BASE_MESSAGE_H
#define CLMHA_BASE_MESSAGE_H

#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// vsnprintf into msg (if not NULL and size > 0) and return status.
CLMHA__HIDDEN clmha_status clmha__msg(char *msg, size_t size, clmha_status status,
                                      const char *fmt, ...) CLMHA__PRINTF(4, 5);

// "(a, b, c)" for a shape ("(a,)" for one dimension; at most 4 dimensions shown).
CLMHA__HIDDEN const char *clmha__shape_str(char *buf, size_t size, size_t ndim,
                                           const size_t *shape);

// The same, with at most @p most dimensions shown.
CLMHA__HIDDEN const char *clmha__shape_str_most(char *buf, size_t size, size_t ndim,
                                                const size_t *shape, size_t most);

#endif
