#include "base/message.h"

#include <stdarg.h>
#include <stdio.h>

clmha_status clmha__msg(char *msg, size_t size, clmha_status status, const char *fmt, ...) {
    if (msg && size) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, size, fmt, ap);
        va_end(ap);
    }
    return status;
}

const char *clmha__shape_str(char *buf, size_t size, size_t ndim, const size_t *shape) {
    return clmha__shape_str_most(buf, size, ndim, shape, 4);
}

const char *clmha__shape_str_most(char *buf, size_t size, size_t ndim, const size_t *shape,
                                  size_t most) {
    size_t used = (size_t)snprintf(buf, size, "(");
    for (size_t i = 0; i < ndim && i < most && used < size; ++i)
        used += (size_t)snprintf(buf + used, size - used, i ? ", %zu" : "%zu", shape[i]);
    if (used < size) snprintf(buf + used, size - used, ndim == 1 ? ",)" : ")");
    return buf;
}
