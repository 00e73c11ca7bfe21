// NumPy .npy files (format versions 1.0, 2.0 and 3.0, see numpy.lib.format):
//
//   "\x93NUMPY" major minor  header-length (2 bytes LE for 1.0, 4 bytes LE for 2.0 / 3.0)
//   header: a Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
//           padded with spaces and ended by '\n'
//   data:   the elements, C or Fortran order
//
// The header is parsed by hand: the grammar is tiny and fixed (three keys, in any order, with
// string, boolean and tuple-of-integers values), so no Python-literal evaluator is needed. Every
// size is checked before it is used; nothing here prints or exits.
#define _POSIX_C_SOURCE 200809L

#include "npy.h"

#include "base/checked.h"
#include "base/file_read.h"
#include "base/file_write.h"
#include "base/half.h"
#include "base/message.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

_Static_assert(sizeof(float) == 4 && sizeof(double) == 8, "IEEE 754 float and double needed");

static const unsigned char npy_magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};

// ---- messages and sizes ----------------------------------------------------------------------

static bool host_little_endian(void) {
    const uint16_t one = 1;
    unsigned char first;
    memcpy(&first, &one, 1);
    return first == 1;
}

static float load_f4(const unsigned char *p) {
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                 (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static double load_f8(const unsigned char *p) {
    uint64_t u = 0;
    for (int i = 7; i >= 0; --i) u = u << 8 | p[i];
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

static void store_f8(unsigned char *p, double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    for (int i = 0; i < 8; ++i) p[i] = (unsigned char)(u >> (8 * i) & 0xFF);
}

static void store_f4(unsigned char *p, float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    p[0] = (unsigned char)(u & 0xFF);
    p[1] = (unsigned char)(u >> 8 & 0xFF);
    p[2] = (unsigned char)(u >> 16 & 0xFF);
    p[3] = (unsigned char)(u >> 24 & 0xFF);
}

// ---- header --------------------------------------------------------------------------------

typedef struct header {
    const char *descr;  // points into the header; not NUL-terminated
    size_t descr_len;
    bool fortran_order;
    size_t ndim;
    size_t shape[CLMHA__NPY_MAX_DIMS];
} header;

typedef struct parser {
    const char *p, *end;
    const char *name;
    char *msg;
    size_t msg_size;
} parser;

static void skip_ws(parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' ||
                               *ps->p == '\r'))
        ++ps->p;
}

static bool accept(parser *ps, char c) {
    if (ps->p < ps->end && *ps->p == c) {
        ++ps->p;
        return true;
    }
    return false;
}

static bool peek(const parser *ps, char c) { return ps->p < ps->end && *ps->p == c; }

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static bool is_word_char(char c) {
    return is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

// Accepts the Python keyword @p word (not followed by more identifier characters).
static bool accept_word(parser *ps, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) return false;
    if (ps->p + n < ps->end && is_word_char(ps->p[n])) return false;
    ps->p += n;
    return true;
}

// A Python string literal in single or double quotes, without escapes.
static bool parse_string(parser *ps, const char **s, size_t *len) {
    if (!peek(ps, '\'') && !peek(ps, '"')) return false;
    char quote = *ps->p++;
    const char *start = ps->p;
    while (ps->p < ps->end && *ps->p != quote) {
        if (*ps->p == '\\' || *ps->p == '\n') return false;
        ++ps->p;
    }
    if (ps->p == ps->end) return false;
    *s = start;
    *len = (size_t)(ps->p - start);
    ++ps->p;
    return true;
}

static clmha_status malformed(const parser *ps, const char *what) {
    return clmha__msg(ps->msg, ps->msg_size, CLMHA_INVALID_FILE, "%s: malformed header: %s",
                      ps->name, what);
}

// A tuple of non-negative integers: (), (3,), (2, 3), (2, 3,). Python 2's long suffix (3L) is
// accepted, as NumPy does for old files.
static clmha_status parse_shape(parser *ps, header *h) {
    if (!accept(ps, '(')) return malformed(ps, "'shape' is not a tuple");
    h->ndim = 0;
    skip_ws(ps);
    if (accept(ps, ')')) return CLMHA_SUCCESS;
    for (;;) {
        skip_ws(ps);
        if (peek(ps, '-'))
            return clmha__msg(ps->msg, ps->msg_size, CLMHA_INVALID_FILE,
                              "%s: negative dimension in 'shape'", ps->name);
        if (ps->p == ps->end || !is_digit(*ps->p))
            return malformed(ps, "expected a dimension in 'shape'");
        const char *start = ps->p;
        size_t v = 0;
        bool overflow = false;
        while (ps->p < ps->end && is_digit(*ps->p)) {
            size_t digit = (size_t)(*ps->p - '0');
            if (v > (SIZE_MAX - digit) / 10) overflow = true;
            else v = v * 10 + digit;
            ++ps->p;
        }
        if (overflow)
            return clmha__msg(ps->msg, ps->msg_size, CLMHA_SIZE_OVERFLOW,
                              "%s: dimension %.*s in 'shape' is too large", ps->name,
                              (int)(ps->p - start > 40 ? 40 : ps->p - start), start);
        if (peek(ps, 'L') || peek(ps, 'l')) ++ps->p;
        if (h->ndim == CLMHA__NPY_MAX_DIMS)
            return clmha__msg(ps->msg, ps->msg_size, CLMHA_INVALID_FILE,
                              "%s: more than %d dimensions in 'shape'", ps->name,
                              CLMHA__NPY_MAX_DIMS);
        h->shape[h->ndim++] = v;
        skip_ws(ps);
        if (accept(ps, ')')) {
            // (3) is an integer in Python, not a tuple
            if (h->ndim == 1) return malformed(ps, "'shape' is not a tuple");
            return CLMHA_SUCCESS;
        }
        if (!accept(ps, ',')) return malformed(ps, "expected ',' or ')' in 'shape'");
        skip_ws(ps);
        if (accept(ps, ')')) return CLMHA_SUCCESS;
    }
}

enum { KEY_DESCR = 1, KEY_FORTRAN = 2, KEY_SHAPE = 4 };

static clmha_status parse_header(parser *ps, header *h) {
    clmha_status st;
    unsigned seen = 0;
    skip_ws(ps);
    if (!accept(ps, '{')) return malformed(ps, "not a dict (no opening '{')");
    for (;;) {
        skip_ws(ps);
        if (accept(ps, '}')) break;
        const char *key;
        size_t key_len;
        if (!parse_string(ps, &key, &key_len)) return malformed(ps, "expected a quoted key");
        unsigned which = 0;
        if (key_len == 5 && memcmp(key, "descr", 5) == 0) which = KEY_DESCR;
        else if (key_len == 13 && memcmp(key, "fortran_order", 13) == 0) which = KEY_FORTRAN;
        else if (key_len == 5 && memcmp(key, "shape", 5) == 0) which = KEY_SHAPE;
        else
            return clmha__msg(ps->msg, ps->msg_size, CLMHA_INVALID_FILE,
                              "%s: malformed header: unexpected key '%.*s'", ps->name,
                              (int)(key_len > 40 ? 40 : key_len), key);
        if (seen & which)
            return clmha__msg(ps->msg, ps->msg_size, CLMHA_INVALID_FILE,
                              "%s: malformed header: key '%.*s' appears twice", ps->name,
                              (int)key_len, key);
        seen |= which;
        skip_ws(ps);
        if (!accept(ps, ':')) return malformed(ps, "expected ':' after a key");
        skip_ws(ps);
        switch (which) {
        case KEY_DESCR:
            if (peek(ps, '['))
                return clmha__msg(
                    ps->msg, ps->msg_size, CLMHA_INVALID_FILE,
                    "%s: structured dtypes are not supported (float32, float64, bool or "
                    "uint8 arrays only)",
                    ps->name);
            if (!parse_string(ps, &h->descr, &h->descr_len))
                return malformed(ps, "'descr' is not a string");
            break;
        case KEY_FORTRAN:
            if (accept_word(ps, "True")) h->fortran_order = true;
            else if (accept_word(ps, "False")) h->fortran_order = false;
            else return malformed(ps, "'fortran_order' is not True or False");
            break;
        default:
            if ((st = parse_shape(ps, h))) return st;
            break;
        }
        skip_ws(ps);
        if (accept(ps, ',')) continue;
        if (accept(ps, '}')) break;
        return malformed(ps, "expected ',' or '}' after a value");
    }
    skip_ws(ps);
    if (ps->p != ps->end) return malformed(ps, "unexpected text after the closing '}'");
    if (!(seen & KEY_DESCR)) return malformed(ps, "missing key 'descr'");
    if (!(seen & KEY_FORTRAN)) return malformed(ps, "missing key 'fortran_order'");
    if (!(seen & KEY_SHAPE)) return malformed(ps, "missing key 'shape'");
    return CLMHA_SUCCESS;
}

// Classifies the dtype string: sets *kind, *itemsize (1, 4 or 8) or refuses it.
static clmha_status classify_dtype(const header *h, const char *name, clmha__npy_kind *kind,
                                   size_t *itemsize, char *msg, size_t msg_size) {
    const char *s = h->descr;
    size_t n = h->descr_len;
    int shown = (int)(n > 40 ? 40 : n);
    char order = 0;
    if (n > 0 && (s[0] == '<' || s[0] == '>' || s[0] == '=' || s[0] == '|')) {
        order = s[0];
        ++s;
        --n;
    }
    if (n == 2 && (memcmp(s, "b1", 2) == 0 || memcmp(s, "u1", 2) == 0)) {
        *kind = CLMHA__NPY_BOOL;  // one byte: the byte order does not matter
        *itemsize = 1;
        return CLMHA_SUCCESS;
    }
    if (n == 2 && (memcmp(s, "f2", 2) == 0 || memcmp(s, "f4", 2) == 0 ||
                   memcmp(s, "f8", 2) == 0)) {
        bool little = order == '<' || ((order == '=' || order == 0) && host_little_endian());
        bool big = order == '>' || ((order == '=' || order == 0) && !host_little_endian());
        if (little) {
            *kind = CLMHA__NPY_FLOAT;
            *itemsize = (size_t)(s[1] - '0');
            return CLMHA_SUCCESS;
        }
        if (big)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "%s: dtype '%.*s' is big-endian; only little-endian ('<f2', '<f4', '<f8') "
                              "floats are supported",
                              name, shown, h->descr);
    }
    if (n >= 1 && s[0] == 'O')
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: dtype '%.*s': object arrays are not supported", name, shown,
                          h->descr);
    return clmha__msg(
        msg, msg_size, CLMHA_INVALID_FILE,
        "%s: dtype '%.*s' is not supported (float16 '<f2', float32 '<f4', float64 '<f8', bool "
        "'|b1' or "
        "uint8 '|u1' only)",
        name, shown, h->descr);
}

// ---- parsing -------------------------------------------------------------------------------

void clmha__npy_free(clmha__npy *a) {
    if (!a) return;
    free(a->f32);
    free(a->f64);
    free(a->u8);
    memset(a, 0, sizeof *a);
}

// The fixed part of the file (@p b, @p size bytes): the magic string, a version this reads and
// the header's length; *prefix: the bytes before the header, *header_len: the header's. The
// header holds no NUL byte.
static clmha_status read_preamble(const unsigned char *b, size_t size, const char *name,
                                  size_t *prefix_out, size_t *header_len_out, char *msg,
                                  size_t msg_size) {
    if (size == 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "%s: empty file, not a .npy file",
                          name);
    if (memcmp(b, npy_magic, size < 6 ? size : 6) != 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: not a .npy file (it does not start with \"\\x93NUMPY\")", name);
    if (size < 8)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "%s: truncated header (%zu bytes)",
                          name, size);
    unsigned major = b[6], minor = b[7];
    if (major < 1 || major > 3 || minor != 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: unsupported .npy format version %u.%u (1.0, 2.0 and 3.0 are "
                          "supported)",
                          name, major, minor);
    size_t prefix = major == 1 ? 10 : 12;
    if (size < prefix)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "%s: truncated header (%zu bytes)",
                          name, size);
    size_t header_len = major == 1 ? (size_t)b[8] | (size_t)b[9] << 8
                                   : (size_t)b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 |
                                         (size_t)b[11] << 24;
    if (header_len > size - prefix)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: header length %zu runs past the end of the file (%zu bytes)", name,
                          header_len, size);
    if (memchr(b + prefix, '\0', header_len))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: malformed header: it contains a NUL byte", name);
    *prefix_out = prefix;
    *header_len_out = header_len;
    return CLMHA_SUCCESS;
}

// The element count of the array @p h describes (*count), whose @p found bytes of data must be
// exactly count * @p itemsize.
static clmha_status check_data_size(const header *h, size_t itemsize, size_t found,
                                    size_t *count_out, const char *name, char *msg,
                                    size_t msg_size) {
    size_t count = 1, data_bytes;
    for (size_t i = 0; i < h->ndim; ++i)
        if (!clmha__mul(count, h->shape[i], &count))
            return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                              "%s: the number of elements of 'shape' overflows", name);
    if (!clmha__mul(count, itemsize, &data_bytes))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW, "%s: the data size overflows", name);
    if (found < data_bytes)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: truncated: expected %zu bytes of data, found %zu", name, data_bytes,
                          found);
    if (found > data_bytes)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "%s: %zu trailing bytes after the %zu bytes of data", name,
                          found - data_bytes, data_bytes);
    *count_out = count;
    return CLMHA_SUCCESS;
}

// Allocates the @p count values of @p a (a->kind known): floats, doubles with @p f64, bytes.
static clmha_status alloc_values(clmha__npy *a, size_t count, bool f64, const char *name,
                                 char *msg, size_t msg_size) {
    // count * itemsize fits in the file, so count * sizeof(float) cannot overflow; doubles
    // from 2-byte items could (in theory), so their size is checked.
    size_t alloc = count ? count : 1, alloc_bytes = 0;
    if (a->kind == CLMHA__NPY_FLOAT && f64 && clmha__mul(alloc, sizeof *a->f64, &alloc_bytes))
        a->f64 = malloc(alloc_bytes);
    else if (a->kind == CLMHA__NPY_FLOAT && !f64) a->f32 = malloc(alloc * sizeof *a->f32);
    else if (a->kind == CLMHA__NPY_BOOL) a->u8 = malloc(alloc);
    if (!a->f32 && !a->f64 && !a->u8)
        return clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY,
                          "%s: out of memory (%zu elements)", name, count);
    return CLMHA_SUCCESS;
}

// The @p count elements of @p data (items of @p itemsize bytes, in the order @p h says) into
// the values of @p a, in C order; float64 rounded to float unless @p f64 (a->overflowed counts
// the finite values that became infinite).
static void copy_values(clmha__npy *a, const unsigned char *data, const header *h,
                        size_t itemsize, size_t count, bool f64) {
    // Fortran order: walk the output in C order and follow the element in the file, whose
    // strides are 1, shape[0], shape[0]*shape[1], ... (no overflow: their product is count).
    bool transpose = h->fortran_order && h->ndim > 1 && count > 0;
    size_t stride[CLMHA__NPY_MAX_DIMS], index[CLMHA__NPY_MAX_DIMS] = {0};
    for (size_t k = 0; k < h->ndim; ++k)
        stride[k] = k == 0 ? 1 : stride[k - 1] * h->shape[k - 1];
    size_t src = 0;
    for (size_t o = 0; o < count; ++o) {
        size_t at = transpose ? src : o;
        if (a->kind == CLMHA__NPY_BOOL) {
            a->u8[o] = data[at];
        } else if (itemsize == 8 && !f64) {
            double d = load_f8(data + at * 8);
            a->f32[o] = clmha__double_to_float(d);
            if (isinf(a->f32[o]) && !isinf(d)) ++a->overflowed;
        } else {
            // float16 and float32 widen exactly; float64 is kept as it is
            double x = itemsize == 8 ? load_f8(data + at * 8)
                       : itemsize == 4
                           ? load_f4(data + at * 4)
                           : clmha__f16_to_f32((uint16_t)(data[at * 2] | data[at * 2 + 1] << 8));
            if (f64) a->f64[o] = x;
            else a->f32[o] = (float)x;
        }
        if (!transpose) continue;
        for (size_t k = h->ndim; k-- > 0;) {
            if (++index[k] < h->shape[k]) {
                src += stride[k];
                break;
            }
            src -= (h->shape[k] - 1) * stride[k];
            index[k] = 0;
        }
    }
}

// clmha__npy_parse(), float arrays into doubles with @p f64.
static clmha_status parse(const void *bytes, size_t size, const char *name, bool f64,
                          clmha__npy *out, char *msg, size_t msg_size) {
    clmha_status st = CLMHA_SUCCESS;
    clmha__npy a;
    memset(&a, 0, sizeof a);
    if (out) memset(out, 0, sizeof *out);
    if (!name) name = "(npy data)";
    if (!out || (!bytes && size > 0))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "%s: out or bytes is NULL", name);
    const unsigned char *b = bytes;
    size_t prefix = 0, header_len = 0, itemsize = 0, count = 0;
    if ((st = read_preamble(b, size, name, &prefix, &header_len, msg, msg_size))) goto fail;
    const char *text = (const char *)b + prefix;
    header h;
    memset(&h, 0, sizeof h);
    parser ps = {.p = text, .end = text + header_len, .name = name, .msg = msg,
                 .msg_size = msg_size};
    if ((st = parse_header(&ps, &h)) ||
        (st = classify_dtype(&h, name, &a.kind, &itemsize, msg, msg_size)) ||
        (st = check_data_size(&h, itemsize, size - prefix - header_len, &count, name, msg,
                              msg_size)) ||
        (st = alloc_values(&a, count, f64, name, msg, msg_size)))
        goto fail;
    copy_values(&a, b + prefix + header_len, &h, itemsize, count, f64);

    memcpy(a.dtype, h.descr, h.descr_len);  // at most 3 characters once accepted
    a.dtype[h.descr_len] = '\0';
    a.ndim = h.ndim;
    memcpy(a.shape, h.shape, sizeof a.shape);
    a.count = count;
    *out = a;
    return CLMHA_SUCCESS;
fail:
    clmha__npy_free(&a);
    return st;
}

clmha_status clmha__npy_parse(const void *bytes, size_t size, const char *name, clmha__npy *out,
                              char *msg, size_t msg_size) {
    return parse(bytes, size, name, false, out, msg, msg_size);
}

clmha_status clmha__npy_parse_f64(const void *bytes, size_t size, const char *name,
                                  clmha__npy *out, char *msg, size_t msg_size) {
    return parse(bytes, size, name, true, out, msg, msg_size);
}

// ---- reading -------------------------------------------------------------------------------

// The largest .npy file read: far above any array the program can hand to a device, far below
// what a mistaken input (a disk image, a core dump) would take.
#define NPY_FILE_MAX ((size_t)1 << 40)

static clmha_status read_npy(const char *path, bool f64, clmha__npy *out, char *msg,
                             size_t msg_size) {
    if (out) memset(out, 0, sizeof *out);
    if (!path || !out)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "path or out is NULL");
    // Regular files only: a FIFO or a device (/dev/zero) is refused instead of blocking or
    // growing a buffer without bound.
    unsigned char *buf = NULL;
    size_t size = 0;
    clmha_status st = clmha__file_read_whole(path, NPY_FILE_MAX, &buf, &size, NULL, msg, msg_size);
    if (st == CLMHA_SUCCESS) st = parse(buf, size, path, f64, out, msg, msg_size);
    free(buf);
    return st;
}

clmha_status clmha__npy_read(const char *path, clmha__npy *out, char *msg, size_t msg_size) {
    return read_npy(path, false, out, msg, msg_size);
}

clmha_status clmha__npy_read_f64(const char *path, clmha__npy *out, char *msg,
                                 size_t msg_size) {
    return read_npy(path, true, out, msg, msg_size);
}

// ---- writing -------------------------------------------------------------------------------

// The element types written: float32, float16 (floats rounded to nearest even), float64.
typedef enum npy_type { NPY_F4, NPY_F2, NPY_F8 } npy_type;

// What clmha__npy_write_f32/_f64 write: the prefix, the header and the values, little-endian.
typedef struct npy_out {
    const unsigned char *prefix;  // 10 bytes
    const char *head;
    size_t header_len;
    const float *data;    // NPY_F4, NPY_F2
    const double *data8;  // NPY_F8
    size_t count;
    npy_type type;
} npy_out;

static bool write_npy(FILE *f, void *user, char *why, size_t why_size) {
    (void)why, (void)why_size;  // errno says why
    const npy_out *o = user;
    bool ok = fwrite(o->prefix, 1, 10, f) == 10 &&
              fwrite(o->head, 1, o->header_len, f) == o->header_len;
    unsigned char chunk[4096];
    size_t item = o->type == NPY_F8 ? 8 : o->type == NPY_F2 ? 2 : 4;
    for (size_t i = 0; ok && i < o->count;) {
        size_t n = o->count - i < sizeof chunk / item ? o->count - i : sizeof chunk / item;
        for (size_t j = 0; j < n; ++j) {
            if (o->type == NPY_F8) {
                store_f8(chunk + 8 * j, o->data8[i + j]);
            } else if (o->type == NPY_F4) {
                store_f4(chunk + 4 * j, o->data[i + j]);
            } else {
                uint16_t h = clmha__f32_to_f16(o->data[i + j]);
                chunk[2 * j] = (unsigned char)h, chunk[2 * j + 1] = (unsigned char)(h >> 8);
            }
        }
        ok = fwrite(chunk, item, n, f) == n;
        i += n;
    }
    return ok;
}

// Writes the array to @p path whole (@p tmp NULL) or to a temporary file next to it whose
// name goes to *tmp (see clmha__file_write_temp).
// @p data (floats) or @p data8 (doubles, NPY_F8) holds the values.
static clmha_status write_array(const char *path, const float *data, const double *data8,
                                npy_type type, size_t ndim, const size_t *shape, char **tmp,
                                char *msg, size_t msg_size) {
    if (!path || (ndim > 0 && !shape))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "path or shape is NULL");
    if (ndim > CLMHA__NPY_MAX_DIMS)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "%s: %zu dimensions (at most %d can be written)", path, ndim,
                          CLMHA__NPY_MAX_DIMS);
    size_t count = 1, bytes;
    for (size_t i = 0; i < ndim; ++i)
        if (!clmha__mul(count, shape[i], &count))
            return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW, "%s: the shape's size overflows",
                              path);
    size_t item = type == NPY_F8 ? 8 : type == NPY_F2 ? 2 : 4;
    if (!clmha__mul(count, item, &bytes))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW, "%s: the data size overflows", path);
    if (count > 0 && (type == NPY_F8 ? !data8 : !data))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "%s: data is NULL", path);

    // Header: 10-byte prefix + dict + spaces + '\n', a multiple of 64 bytes in all. At most
    // 8 dimensions of 20 digits: far below version 1.0's 65535-byte limit.
    char head[512];
    size_t used = (size_t)snprintf(head, sizeof head,
                                   "{'descr': '%s', 'fortran_order': False, 'shape': (",
                                   type == NPY_F8 ? "<f8" : type == NPY_F2 ? "<f2" : "<f4");
    for (size_t i = 0; i < ndim; ++i)
        used += (size_t)snprintf(head + used, sizeof head - used, i ? ", %zu" : "%zu", shape[i]);
    used += (size_t)snprintf(head + used, sizeof head - used, ndim == 1 ? ",), }" : "), }");
    size_t total = (10 + used + 1 + 63) / 64 * 64;  // + 1 for the '\n'
    size_t header_len = total - 10;
    unsigned char prefix[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0,
                                (unsigned char)(header_len & 0xFF),
                                (unsigned char)(header_len >> 8)};
    memset(head + used, ' ', header_len - 1 - used);
    head[header_len - 1] = '\n';

    npy_out o = {.prefix = prefix, .head = head, .header_len = header_len, .data = data,
                 .data8 = data8, .count = count, .type = type};
    return tmp ? clmha__file_write_temp(path, write_npy, &o, tmp, msg, msg_size)
               : clmha__file_write_whole(path, write_npy, &o, msg, msg_size);
}

clmha_status clmha__npy_write_f32(const char *path, const float *data, size_t ndim,
                                  const size_t *shape, char *msg, size_t msg_size) {
    return write_array(path, data, NULL, NPY_F4, ndim, shape, NULL, msg, msg_size);
}

clmha_status clmha__npy_write_f32_temp(const char *path, const float *data, size_t ndim,
                                       const size_t *shape, bool half, char **tmp, char *msg,
                                       size_t msg_size) {
    *tmp = NULL;
    return write_array(path, data, NULL, half ? NPY_F2 : NPY_F4, ndim, shape, tmp, msg,
                       msg_size);
}

clmha_status clmha__npy_write_f64(const char *path, const double *data, size_t ndim,
                                  const size_t *shape, char *msg, size_t msg_size) {
    return write_array(path, NULL, data, NPY_F8, ndim, shape, NULL, msg, msg_size);
}

clmha_status clmha__npy_write_f64_temp(const char *path, const double *data, size_t ndim,
                                       const size_t *shape, char **tmp, char *msg,
                                       size_t msg_size) {
    *tmp = NULL;
    return write_array(path, NULL, data, NPY_F8, ndim, shape, tmp, msg, msg_size);
}
