// Layer files through a context: clmha_layer_load() reads a .safetensors file, checks it
// (clmha__safetensors_parse_as(), clmha__safetensors_layer()), creates the layer and sets its
// parameters; clmha_layer_save() writes the layer's parameters as F32 tensors (F64 for a float64
// layer), all or nothing (a temporary file renamed over the destination).
#define _POSIX_C_SOURCE 200809L

#include "formats/safetensors.h"

#include "base/checked.h"
#include "base/file_read.h"
#include "base/file_write.h"
#include "base/half.h"
#include "base/struct_in.h"
#include "errors/errors.h"
#include "formats/safetensors_private.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- loading ------------------------------------------------------------------------------

static void errno_text(int err, char *buf, size_t size) {
    if (strerror_r(err, buf, size) != 0) snprintf(buf, size, "error %d", err);
}

// Reads the whole file at @p path into a malloc'd buffer; a header longer than @p limits allow,
// and a file written by torch.save(), are refused before the rest is read.
static clmha_status read_file(const clmha_context *ctx, const char *path,
                              clmha__st_limits limits, unsigned char **out, size_t *out_size) {
    char why[256];
    clmha_status st = CLMHA_SUCCESS;
    unsigned char *buf = NULL;
    *out = NULL;
    *out_size = 0;
    // Only a regular file: a FIFO would block, a device never end (src/base/file_read.h).
    FILE *f = NULL;
    size_t file_size = 0;
    char open_msg[CLMHA__ERROR_SIZE];
    st = clmha__file_open_regular(path, &f, &file_size, NULL, open_msg, sizeof open_msg);
    if (st) return clmha__fail(ctx, st, "%s", open_msg);
    // The header's length first: a header longer than a layer's can be is refused before the
    // file is read or a buffer sized for it.
    // 9 bytes: the length and the header's first byte (torch.save()'s files are told apart
    // by them).
    unsigned char head[9];
    size_t size = fread(head, 1, sizeof head, f);
    char msg[CLMHA__ERROR_SIZE];
    if (ferror(f)) {  // (before the bytes are judged: a failed read is not a short file)
        errno_text(errno, why, sizeof why);
        st = clmha__fail(ctx, CLMHA_IO_ERROR, "cannot read %s: %s", path, why);
        goto fail;
    }
    if ((st = clmha__st_torch_save_check(head, size, file_size, path, msg, sizeof msg))) {
        st = clmha__fail(ctx, st, "%s", msg);
        goto fail;
    }
    if (size >= 8 && clmha__st_le64(head) > clmha__st_max_header(limits)) {
        st = clmha__fail(
            ctx, clmha__st_header_too_long(clmha__st_le64(head), limits, path, msg, sizeof msg),
            "%s", msg);
        goto fail;
    }
    // The rest, up to the size fstat gave, plus one byte to see a file that grew meanwhile.
    size_t cap = (file_size < sizeof head ? sizeof head : file_size) + 1;
    if (!(buf = malloc(cap))) {
        st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "%s: out of host memory (%zu bytes)", path,
                         cap);
        goto fail;
    }
    memcpy(buf, head, size);
    if (size == sizeof head) size += fread(buf + size, 1, cap - size, f);
    // cap > size read so far: file_size >= 9 when all 9 bytes came.
    if (ferror(f)) {
        errno_text(errno, why, sizeof why);
        st = clmha__fail(ctx, CLMHA_IO_ERROR, "cannot read %s: %s", path, why);
        goto fail;
    }
    if (size > file_size) {
        st = clmha__fail(ctx, CLMHA_IO_ERROR, "cannot read %s: it grew while being read", path);
        goto fail;
    }
    fclose(f);
    *out = buf;
    *out_size = size;
    return CLMHA_SUCCESS;
fail:
    free(buf);
    fclose(f);
    return st;
}

// Re-records the context's last message prefixed with the path.
static clmha_status fail_with_path(clmha_context *ctx, clmha_status st, const char *path) {
    char prev[CLMHA__ERROR_SIZE];
    snprintf(prev, sizeof prev, "%s", clmha_context_last_error(ctx));
    return clmha__fail(ctx, st, "%s: %s", path, prev);
}

// p of the user functions (the tensor mod_params, as doubles in @p values) into @p layer: floats,
// rounded to nearest.
static clmha_status set_mod_params(clmha_layer *layer, const double *values, size_t count) {
    float *p = malloc(count * sizeof *p);
    if (!p)
        return clmha__fail(clmha_layer_context(layer), CLMHA_OUT_OF_MEMORY, "out of host memory");
    for (size_t i = 0; i < count; ++i) p[i] = clmha__double_to_float(values[i]);
    clmha_status st = clmha_layer_set_mod_params(layer, p, count);
    free(p);
    return st;
}

// The layer of the file at @p path under @p load (NULL: plain), of dtype @p dtype.
static clmha_status load(clmha_layer **out, clmha_context *ctx, const char *path,
                         const clmha__st_load *load, clmha_dtype dtype) {
    unsigned char *bytes = NULL;
    size_t size = 0;
    clmha__st_file file = {0};
    clmha__st_view *view = NULL;
    clmha_layer *layer = NULL;
    double *values = NULL;
    clmha_layer_desc desc;
    char msg[CLMHA__ERROR_SIZE];
    bool prefixed = load && load->prefix && load->prefix[0];
    clmha__st_limits limits = prefixed ? CLMHA__ST_MODEL_LIMITS : CLMHA__ST_LAYER_LIMITS;
    clmha_status st = read_file(ctx, path, limits, &bytes, &size);
    if (st) goto fail;
    if (!(view = malloc(sizeof *view))) {
        st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", path);
        goto fail;
    }
    if ((st = clmha__safetensors_parse_as(bytes, size, path, limits, &file, msg, sizeof msg)) ||
        (st = clmha__safetensors_layer(&file, path, load, view, &desc, msg, sizeof msg))) {
        st = clmha__fail(ctx, st, "%s", msg);
        goto fail;
    }

    size_t most = 1;
    for (size_t i = 0; i < view->file.tensor_count; ++i)
        if (view->tensors[i].count > most) most = view->tensors[i].count;
    size_t bytes_needed = 0;  // fits: the desc check bounds every parameter's size
    if (!clmha__mul(most, sizeof *values, &bytes_needed)) {
        st = clmha__fail(ctx, CLMHA_SIZE_OVERFLOW, "%s: a tensor is too large", path);
        goto fail;
    }
    values = malloc(bytes_needed);
    if (!values) {
        st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", path);
        goto fail;
    }
    desc.dtype = dtype;
    if ((st = clmha_layer_create(&layer, ctx, &desc))) {
        st = fail_with_path(ctx, st, path);
        goto fail;
    }
    for (size_t i = 0; i < view->file.tensor_count; ++i) {
        const clmha__st_tensor *t = &view->tensors[i];
        clmha__st_view_to_double(view, i, values);
        if (strcmp(t->param, "mod_params") == 0)
            st = set_mod_params(layer, values, t->count);
        else
            st = clmha_layer_set_parameter_f64(layer, t->param, values, t->count);
        if (st) {
            st = fail_with_path(ctx, st, path);
            goto fail;
        }
    }
    *out = layer;
    layer = NULL;
fail:
    clmha_layer_release(layer);
    free(values);
    free(view);
    clmha__safetensors_free(&file);
    free(bytes);
    return st;
}

// The checks every load entry point starts with.
static clmha_status load_args(clmha_layer **out, clmha_context *ctx, const char *path) {
    if (!out) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "out is NULL");
    *out = NULL;
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    if (!path) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "path is NULL");
    return CLMHA_SUCCESS;
}

clmha_status clmha_layer_load_as(clmha_layer **out, clmha_context *ctx, const char *path,
                                 clmha_dtype dtype) {
    clmha_status st = load_args(out, ctx, path);
    return st ? st : load(out, ctx, path, NULL, dtype);
}

clmha_status clmha_layer_load(clmha_layer **out, clmha_context *ctx, const char *path) {
    return clmha_layer_load_as(out, ctx, path, CLMHA_DTYPE_F32);
}

clmha_status clmha_layer_load_prefixed(clmha_layer **out, clmha_context *ctx, const char *path,
                                       const clmha_load_options *options) {
    clmha_status st = load_args(out, ctx, path);
    if (st || !options) return st ? st : load(out, ctx, path, NULL, CLMHA_DTYPE_F32);
    clmha_load_options o;
    char msg[CLMHA__ERROR_SIZE];
    if ((st = CLMHA__STRUCT_IN(clmha_load_options, &o, options, "options", msg, sizeof msg)))
        return clmha__fail(ctx, st, "%s", msg);
    if (o.batch_first != CLMHA_BATCH_FIRST_AUTO && o.batch_first != CLMHA_BATCH_FIRST_NO &&
        o.batch_first != CLMHA_BATCH_FIRST_YES)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "options->batch_first is %d, expected CLMHA_BATCH_FIRST_AUTO (0), "
                           "CLMHA_BATCH_FIRST_NO (1) or CLMHA_BATCH_FIRST_YES (2)",
                           (int)o.batch_first);
    clmha__st_load l = {.prefix = o.prefix, .num_heads = o.num_heads,
                        .batch_first = o.batch_first};
    return load(out, ctx, path, &l, o.dtype);
}

// ---- saving -------------------------------------------------------------------------------

// Appends to a fixed buffer; false when it does not fit.
static bool append(char *buf, size_t size, size_t *used, const char *fmt, ...)
    CLMHA__PRINTF(4, 5);
static bool append(char *buf, size_t size, size_t *used, const char *fmt, ...) {
    if (*used >= size) return false;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + *used, size - *used, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= size - *used) return false;
    *used += (size_t)n;
    return true;
}

// @p raw (printf's text of a number) into @p buf with '.' as the decimal point whatever the C
// locale (its decimal separator, one or more bytes, becomes one '.').
static void point_text(const char *raw, char *buf, size_t size) {
    size_t o = 0;
    bool in_point = false;
    for (const char *p = raw; *p && o + 1 < size; ++p) {
        bool plain = (*p >= '0' && *p <= '9') || *p == 'e' || *p == '-' || *p == '+';
        if (plain) buf[o++] = *p;
        else if (!in_point) buf[o++] = '.';
        in_point = !plain;
    }
    buf[o] = '\0';
}

// %.9g of a float with '.' as the decimal point whatever the C locale.
static void float_text(float v, char *buf, size_t size) {
    char raw[64];
    snprintf(raw, sizeof raw, "%.9g", (double)v);
    point_text(raw, buf, size);
}

// A double as the shortest "%.Ng" text (N up to 17, '.' as the decimal point whatever the C
// locale) that clmha_layer_load() reads back as the same double; a whole number below 10^17
// without an exponent ("50", not "5e+01").
static void double_text(double v, char *buf, size_t size) {
    int whole = v >= 1.0 && v < 1e17 ? (int)floor(log10(v)) + 1 : 1;  // digits before the point
    for (int digits = whole; digits <= 17; ++digits) {
        char raw[64];
        snprintf(raw, sizeof raw, "%.*g", digits, v);
        point_text(raw, buf, size);
        double back;
        if (clmha__st_decimal(buf, &back) && back == v) return;
    }
}

typedef struct save_entry {
    const char *name;
    size_t ndim;
    size_t shape[3];
    size_t count;
} save_entry;

// What clmha_layer_save writes: the header's length (8 bytes, little-endian), the header and
// the tensors' @p count elements of @p elem bytes (already little-endian).
typedef struct safetensors_out {
    const char *header;
    size_t header_len;
    const void *data;
    size_t count, elem;
} safetensors_out;

static bool write_safetensors(FILE *f, void *user, char *why, size_t why_size) {
    (void)why, (void)why_size;  // errno says why
    const safetensors_out *o = user;
    unsigned char len_bytes[8];
    for (int i = 0; i < 8; ++i)
        len_bytes[i] = (unsigned char)((uint64_t)o->header_len >> (8 * i));
    return fwrite(len_bytes, 1, 8, f) == 8 &&
           fwrite(o->header, 1, o->header_len, f) == o->header_len &&
           fwrite(o->data, o->elem, o->count, f) == o->count;
}

// The tensors a layer of descriptor @p d has, in the order of the file, with their PyTorch
// shapes (into @p list, room for 12) and element counts; *total: the sum of the counts.
static size_t save_list(clmha_layer *layer, const clmha_layer_desc *d, save_entry *list,
                        size_t *total) {
    // kve: the key/value heads' width (grouped-query attention: num_kv_heads * D, else E).
    size_t e = d->embed_dim, kve = d->num_kv_heads * (e / d->num_heads);
    bool gqa = d->num_kv_heads != d->num_heads;
    size_t n = 0;
    if (d->kdim == e && d->vdim == e && !gqa) {
        list[n++] = (save_entry){"in_proj_weight", 2, {3 * e, e}, 0};
    } else {
        list[n++] = (save_entry){"q_proj_weight", 2, {e, e}, 0};
        list[n++] = (save_entry){"k_proj_weight", 2, {kve, d->kdim}, 0};
        list[n++] = (save_entry){"v_proj_weight", 2, {kve, d->vdim}, 0};
    }
    if (d->bias) list[n++] = (save_entry){"in_proj_bias", 1, {e + 2 * kve}, 0};
    list[n++] = (save_entry){"out_proj.weight", 2, {e, e}, 0};
    if (d->bias) list[n++] = (save_entry){"out_proj.bias", 1, {e}, 0};
    if (d->add_bias_kv) {
        list[n++] = (save_entry){"bias_k", 3, {1, 1, kve}, 0};
        list[n++] = (save_entry){"bias_v", 3, {1, 1, kve}, 0};
    }
    if (d->alibi) list[n++] = (save_entry){"alibi_slopes", 1, {d->num_heads}, 0};
    if (d->sinks) list[n++] = (save_entry){"sinks", 1, {d->num_heads}, 0};
    bool p = d->mod_source && d->mod_params_count;
    if (p) list[n++] = (save_entry){"mod_params", 1, {d->mod_params_count}, 0};
    // The layer exists, so its parameters fit in memory: these sums do not overflow.
    *total = 0;
    for (size_t i = 0; i < n; ++i) {
        list[i].count = p && i == n - 1 ? d->mod_params_count
                                        : clmha_layer_parameter_count(layer, list[i].name);
        *total += list[i].count;
    }
    return n;
}

// @p text as a JSON string (quoted; '"', '\\' and control bytes escaped; UTF-8 as it is).
static bool append_json_string(char *buf, size_t size, size_t *used, const char *text) {
    bool ok = append(buf, size, used, "\"");
    for (const unsigned char *c = (const unsigned char *)text; ok && *c; ++c) {
        if (*c == '"' || *c == '\\') ok = append(buf, size, used, "\\%c", *c);
        else if (*c == '\n') ok = append(buf, size, used, "\\n");
        else if (*c == '\t') ok = append(buf, size, used, "\\t");
        else if (*c < 0x20) ok = append(buf, size, used, "\\u%04x", (unsigned)*c);
        else ok = append(buf, size, used, "%c", *c);
    }
    return ok && append(buf, size, used, "\"");
}

// The file's JSON header (metadata from @p d, the @p n tensors of @p list with elements of
// @p elem bytes, one after the other), padded with spaces to a multiple of 8 bytes, into
// @p header (*used bytes). False when it does not fit.
static bool save_header(const clmha_layer_desc *d, const save_entry *list, size_t n,
                        size_t elem, char *header, size_t size, size_t *used) {
    char dropout[64];
    size_t offset = 0;
    *used = 0;
    float_text(d->dropout, dropout, sizeof dropout);
    bool ok = append(header, size, used,
                     "{\"__metadata__\":{\"format\":\"pt\",\"num_heads\":\"%zu\","
                     "\"batch_first\":\"%s\",\"add_zero_attn\":\"%s\",\"dropout\":\"%s\"",
                     d->num_heads, d->batch_first ? "true" : "false",
                     d->add_zero_attn ? "true" : "false", dropout);
    // num_kv_heads only for grouped-query attention: other files stay as they were.
    if (ok && d->num_kv_heads != d->num_heads)
        ok = append(header, size, used, ",\"num_kv_heads\":\"%zu\"", d->num_kv_heads);
    // window only for a layer with a sliding window, likewise.
    if (ok && d->window)
        ok = append(header, size, used, ",\"window\":\"%lld,%lld\"", (long long)d->window_left,
                    (long long)d->window_right);
    // softcap and alibi only for a layer that has them, likewise.
    if (ok && d->softcap > 0.0) {
        char softcap[64];
        double_text(d->softcap, softcap, sizeof softcap);
        ok = append(header, size, used, ",\"softcap\":\"%s\"", softcap);
    }
    if (ok && d->alibi) ok = append(header, size, used, ",\"alibi\":\"true\"");
    if (ok && d->mod_source) {  // the user functions' source, a JSON string
        ok = append(header, size, used, ",\"mod_source\":");
        ok = ok && append_json_string(header, size, used, d->mod_source);
    }
    ok = ok && append(header, size, used, "}");
    for (size_t i = 0; i < n && ok; ++i) {
        const save_entry *s = &list[i];
        ok = append(header, size, used, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", s->name,
                    elem == 8 ? "F64" : "F32");
        for (size_t k = 0; k < s->ndim && ok; ++k)
            ok = append(header, size, used, k ? ",%zu" : "%zu", s->shape[k]);
        ok = ok && append(header, size, used, "],\"data_offsets\":[%zu,%zu]}", offset,
                          offset + s->count * elem);
        offset += s->count * elem;
    }
    ok = ok && append(header, size, used, "}");
    while (ok && *used % 8 != 0) ok = append(header, size, used, " ");
    return ok;
}

// The values of the @p n tensors of @p list, one after the other, as little-endian float32
// (float64 when @p f64) into @p data (@p total elements).
static clmha_status save_data(clmha_layer *layer, const save_entry *list, size_t n, bool f64,
                              size_t total, unsigned char *data) {
    size_t elem = f64 ? 8 : 4;
    for (size_t i = 0, at = 0; i < n; at += list[i].count, ++i) {
        const char *name = list[i].name;
        size_t count = list[i].count;
        clmha_status st;
        if (strcmp(name, "mod_params") == 0) {  // p: floats, widened exactly for a F64 file
            float *p = f64 ? malloc(count * sizeof *p) : (float *)data + at;
            if (!p) return clmha__fail(clmha_layer_context(layer), CLMHA_OUT_OF_MEMORY,
                                       "out of host memory");
            st = clmha_layer_get_mod_params(layer, p, count);
            for (size_t k = 0; f64 && !st && k < count; ++k) ((double *)data)[at + k] = p[k];
            if (f64) free(p);
        } else {
            st = f64 ? clmha_layer_get_parameter_f64(layer, name, (double *)data + at, count)
                     : clmha_layer_get_parameter(layer, name, (float *)data + at, count);
        }
        if (st) return st;
    }
    const uint32_t one = 1;
    if (*(const unsigned char *)&one != 1) {  // big-endian host: reverse every element's bytes
        unsigned char *p = data;
        for (size_t i = 0; i < total; ++i, p += elem)
            for (size_t b = 0; b < elem / 2; ++b) {
                unsigned char t = p[b];
                p[b] = p[elem - 1 - b], p[elem - 1 - b] = t;
            }
    }
    return CLMHA_SUCCESS;
}

clmha_status clmha_layer_save(clmha_layer *layer, const char *path) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = clmha_layer_context(layer);
    if (!path) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "path is NULL");
    if (!*path) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "path is empty");

    clmha_status st = CLMHA_SUCCESS;
    unsigned char *data = NULL;
    char *header = NULL;

    clmha_layer_desc d = {.struct_size = sizeof d};
    clmha_layer_get_desc(layer, &d);
    // A float64 layer's parameters as F64 tensors, any other's as F32 (a 16-bit layer's values
    // widened exactly).
    bool f64 = d.dtype == CLMHA_DTYPE_F64;
    size_t elem = f64 ? 8 : 4;
    save_entry list[12];
    size_t total;
    size_t n = save_list(layer, &d, list, &total);

    // The header: names and numbers fit in 2 KiB; a user functions' source takes at most six
    // bytes a byte (\u00XX), and must be UTF-8 and fit the header limit of clmha_layer_load().
    size_t source_len = d.mod_source ? strlen(d.mod_source) : 0;
    if (source_len && clmha__st_utf8_invalid_at((const unsigned char *)d.mod_source,
                                                source_len) < source_len) {
        st = clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                         "%s: the layer's mod_source is not valid UTF-8; a safetensors header "
                         "holds UTF-8 text only",
                         path);
        goto fail;
    }
    size_t header_size = 2048 + 6 * source_len, used;
    if (!(header = malloc(header_size))) {
        st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", path);
        goto fail;
    }
    if (!save_header(&d, list, n, elem, header, header_size, &used)) {
        // cannot happen: the names are fixed, the numbers short, the source's room counted
        st = clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "%s: header too long", path);
        goto fail;
    }
    if (used > CLMHA__ST_MAX_HEADER) {
        st = clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                         "%s: the header would take %zu bytes with the layer's mod_source (%zu "
                         "bytes), more than the %zu a layer file may have",
                         path, used, source_len, CLMHA__ST_MAX_HEADER);
        goto fail;
    }
    data = malloc((total ? total : 1) * elem);
    if (!data) {
        st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "%s: out of host memory", path);
        goto fail;
    }
    if ((st = save_data(layer, list, n, f64, total, data))) {
        st = fail_with_path(ctx, st, path);
        goto fail;
    }

    // All or nothing: a temporary file next to the destination, renamed over it.
    safetensors_out o = {.header = header, .header_len = used, .data = data, .count = total,
                         .elem = elem};
    char msg[CLMHA__ERROR_SIZE - 64];
    if ((st = clmha__file_write_whole(path, write_safetensors, &o, msg, sizeof msg)))
        st = clmha__fail(ctx, st, "%s", msg);
fail:
    free(data);
    free(header);
    return st;
}
