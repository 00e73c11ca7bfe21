#include "base/struct_in.h"

#include <string.h>

#include "base/message.h"

static size_t struct_size_of(const void *s) {
    size_t n;
    memcpy(&n, s, sizeof n);  // the first member of every sized struct
    return n;
}

// The checks both directions share; 0 when @p n is a usable struct_size.
static clmha_status check_size(size_t n, size_t min_size, const char *arg, const char *type,
                               char *msg, size_t msg_size) {
    if (n == 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "%s->struct_size is 0: set it to sizeof(%s) (CLMHA_STRUCT_INIT(%s))",
                          arg, type, type);
    if (n < min_size)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "%s->struct_size is %zu, smaller than the smallest %s (%zu bytes): "
                          "set it to sizeof(%s)",
                          arg, n, type, min_size, type);
    if (n > CLMHA__STRUCT_SIZE_MAX)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "%s->struct_size is %zu, not a size of %s (uninitialised?): set it to "
                          "sizeof(%s)",
                          arg, n, type, type);
    return CLMHA_SUCCESS;
}

clmha_status clmha__struct_in(void *dst, size_t size, const void *src, size_t min_size,
                              const char *arg, const char *type, char *msg, size_t msg_size) {
    memset(dst, 0, size);
    if (!src) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "%s is NULL", arg);
    size_t n = struct_size_of(src);
    clmha_status st = check_size(n, min_size, arg, type, msg, msg_size);
    if (st) return st;
    if (n > size) {
        const unsigned char *tail = (const unsigned char *)src + size;
        for (size_t i = 0; i < n - size; ++i)
            if (tail[i])
                return clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                                  "%s->struct_size is %zu but this library's %s has %zu bytes, "
                                  "and byte %zu is set: the caller was built against a newer "
                                  "clmha than this one (%s) and uses a field it does not have",
                                  arg, n, type, size, size + i, CLMHA_VERSION_STRING);
        n = size;
    }
    memcpy(dst, src, n);
    memcpy(dst, &size, sizeof size);
    return CLMHA_SUCCESS;
}

clmha_status clmha__struct_out_check(const void *dst, size_t min_size, const char *arg,
                                     const char *type, char *msg, size_t msg_size) {
    if (!dst) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "%s is NULL", arg);
    return check_size(struct_size_of(dst), min_size, arg, type, msg, msg_size);
}

void clmha__struct_out(void *dst, const void *src, size_t size) {
    size_t n = struct_size_of(dst), head = sizeof n;
    size_t copy = n < size ? n : size;
    if (copy > head)
        memcpy((unsigned char *)dst + head, (const unsigned char *)src + head, copy - head);
    if (n > size) memset((unsigned char *)dst + size, 0, n - size);
}
