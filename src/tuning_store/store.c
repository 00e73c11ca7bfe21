// The tuning store (see store.h): the per-device registry, applying a tuning through
// CLBlastOverrideParameters, the tuning folder and files, JSON, and the stored tuning applied
// at context creation.
//
// What CLBlast 1.5.3 does with overrides (src/api_common.cpp, src/routine.cpp):
// - CLBlastOverrideParameters(device, kernel, precision, ...) replaces the database entry of
//   (platform, device, precision, kernel) in a process-wide cache. Every parameter of the kernel
//   must be given (else CLBlastMissingOverrideParameter). CLBlastClearCache() clears compiled
//   programs only: overrides survive the release of clmha contexts.
// - Sgemm and SgemmStridedBatched read seven database entries: Copy, Pad, Transpose,
//   Padtranspose (helpers of the indirect path), Xgemm, XgemmDirect and GemmRoutine. Each can be
//   overridden alone: overriding Xgemm does not require GemmRoutine; the helpers keep their own
//   parameters and need nothing (they pad and transpose to whatever MWG/NWG/KWG Xgemm asks).
// - GemmRoutine's XGEMM_MIN_INDIRECT_SIZE picks the path per call: direct when m·n·k (per batch
//   item) < size³, else indirect. 0 forces indirect; a huge value forces direct.
// - A program is cached under a key made of every parameter value of the seven kernels, so any
//   change compiles a new program (several seconds on PoCL) at the next call of each routine
//   (Sgemm and SgemmStridedBatched are two programs).
#define _POSIX_C_SOURCE 200809L

#include "tuning_store/store.h"

#include "tuning_store/builtin.h"

#include "base/file_read.h"
#include "base/file_write.h"
#include "base/message.h"
#include "device/blas.h"
#include "device/held.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <clblast_c.h>

#define TUNING_FORMAT "clmha-gemm-tuning"
#define TUNING_VERSION 1
#define TUNING_FILE_MAX (1u << 20)  // a tuning file is a few hundred bytes
#define NOTE_SIZE 1024

// ---- the per-device registry -------------------------------------------------------------------

typedef struct device_state {
    cl_device_id device;
    bool stored_considered;  // apply_stored ran for this device in this process
    bool applied;            // `tuning` is in effect (CLBlast's database is overridden)
    clmha_tuning_source source;  // where `tuning` came from (CLBLAST while none is applied)
    clmha__tuning tuning;
    clmha__tuning_meta meta;
    char note[NOTE_SIZE];
} device_state;

// One entry per device seen in the process, grown on demand (CLBlast's overrides are
// process-wide too); never shrunk.
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static device_state *registry;
static size_t registry_count, registry_capacity;
static size_t test_registry_limit = SIZE_MAX;  // clmha__test_set_tuning_registry_limit()

void clmha__test_set_tuning_registry_limit(size_t devices) {
    pthread_mutex_lock(&registry_lock);
    test_registry_limit = devices;
    pthread_mutex_unlock(&registry_lock);
}

// What the note says of a device the registry could not take.
#define NOT_RECORDED \
    "no tuning applied: clmha could not record this device's tuning (out of host memory)"

// The state of @p device, created when new (NULL when it cannot grow: out of host memory).
// Lock held.
static device_state *state_of(cl_device_id device) {
    for (size_t i = 0; i < registry_count; ++i)
        if (registry[i].device == device) return &registry[i];
    if (registry_count >= test_registry_limit) return NULL;
    if (registry_count == registry_capacity) {
        size_t cap = registry_capacity ? 2 * registry_capacity : 8;
        device_state *grown = realloc(registry, cap * sizeof *grown);
        if (!grown) return NULL;
        registry = grown;
        registry_capacity = cap;
    }
    device_state *s = &registry[registry_count++];
    memset(s, 0, sizeof *s);
    s->device = device;
    snprintf(s->note, sizeof s->note, "no tuning applied: CLBlast's own parameters");
    return s;
}

void clmha__tuning_set_note(cl_device_id device, const char *fmt, ...) {
    pthread_mutex_lock(&registry_lock);
    device_state *s = state_of(device);
    if (s) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(s->note, sizeof s->note, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&registry_lock);
}

bool clmha__tuning_current(cl_device_id device, clmha__tuning *t, clmha__tuning_meta *meta) {
    pthread_mutex_lock(&registry_lock);
    device_state *s = state_of(device);
    bool applied = s && s->applied;
    if (applied) {
        *t = s->tuning;
        if (meta) *meta = s->meta;
    }
    pthread_mutex_unlock(&registry_lock);
    return applied;
}

clmha_tuning_source clmha__tuning_source_of(cl_device_id device) {
    pthread_mutex_lock(&registry_lock);
    device_state *s = state_of(device);
    clmha_tuning_source source = s && s->applied ? s->source : CLMHA_TUNING_SOURCE_CLBLAST;
    pthread_mutex_unlock(&registry_lock);
    return source;
}

void clmha__tuning_get_note(cl_device_id device, char *text, size_t size) {
    pthread_mutex_lock(&registry_lock);
    device_state *s = state_of(device);
    snprintf(text, size, "%s", s ? s->note : NOT_RECORDED);
    pthread_mutex_unlock(&registry_lock);
}

bool clmha__tuning_fused(cl_device_id device, size_t fused[CLMHA__FUSED_PARAMS]) {
    clmha__tuning t;
    if (!clmha__tuning_current(device, &t, NULL) || !t.has_fused) return false;
    memcpy(fused, t.fused, sizeof t.fused);
    return true;
}

bool clmha__tuning_decode(cl_device_id device, size_t decode[CLMHA__DECODE_PARAMS]) {
    clmha__tuning t;
    if (!clmha__tuning_current(device, &t, NULL) || !t.has_decode) return false;
    memcpy(decode, t.decode, sizeof t.decode);
    return true;
}

// ---- applying ----------------------------------------------------------------------------------

// Overrides one kernel; no registry update.
static clmha_status override(const clmha__tuning_target *tg, const char *kernel, size_t count,
                             const char *const *names, const size_t *values) {
    int st;
    CLMHA__BLAS(st, CLBlastOverrideParameters(tg->device, kernel, CLBlastPrecisionSingle, count,
                                              (const char **)names, values));
    if (st != CLBlastSuccess)
        return clmha__fail(tg->owner, CLMHA_BLAS_ERROR,
                           "CLBlastOverrideParameters(%s) failed: CLBlast status %d (%s)", kernel,
                           st, clmha__blas_status_name(st, NULL));
    return CLMHA_SUCCESS;
}

clmha_status clmha__tuning_override(const clmha__tuning_target *tg, const clmha__tuning *t) {
    clmha_status st = CLMHA_SUCCESS;
    if (t->has_xgemm &&
        (st = override(tg, "Xgemm", CLMHA__XGEMM_PARAMS, clmha__xgemm_names, t->xgemm)))
        return st;
    if (t->has_direct &&
        (st = override(tg, "XgemmDirect", CLMHA__DIRECT_PARAMS, clmha__direct_names, t->direct)))
        return st;
    if (t->has_routine &&
        (st = override(tg, "GemmRoutine", 1, clmha__routine_names, &t->min_indirect)))
        return st;
    return CLMHA_SUCCESS;
}

size_t clmha__tuning_local_mem(const clmha__tuning_target *tg) {
    return tg->info->local_mem_bytes ? (size_t)tg->info->local_mem_bytes : 16384;
}

clmha_status clmha__tuning_apply(const clmha__tuning_target *tg, const clmha__tuning *t,
                                 const clmha__tuning_meta *meta, clmha_tuning_source kind,
                                 const char *source) {
    char msg[512];
    if (!clmha__tuning_check(t, clmha__tuning_local_mem(tg), tg->max_work_group, msg, sizeof msg))
        return clmha__fail(tg->owner, CLMHA_INVALID_FILE, "%s", msg);
    // A device the registry cannot take gets no override: export and the note would not
    // know of it.
    pthread_mutex_lock(&registry_lock);
    bool recorded = state_of(tg->device) != NULL;
    pthread_mutex_unlock(&registry_lock);
    if (!recorded)
        return clmha__fail(tg->owner, CLMHA_OUT_OF_MEMORY,
                           "the tuning was not applied: clmha could not record it for this "
                           "device (out of host memory)");
    clmha_status st = clmha__tuning_override(tg, t);
    pthread_mutex_lock(&registry_lock);
    device_state *s = state_of(tg->device);
    if (s && st == CLMHA_SUCCESS) {
        // Kernels the new tuning leaves alone keep what was in effect.
        clmha__tuning merged = s->applied ? s->tuning : (clmha__tuning){0};
        if (t->has_xgemm) memcpy(merged.xgemm, t->xgemm, sizeof merged.xgemm);
        if (t->has_direct) memcpy(merged.direct, t->direct, sizeof merged.direct);
        if (t->has_routine) merged.min_indirect = t->min_indirect;
        if (t->has_fused) memcpy(merged.fused, t->fused, sizeof merged.fused);
        merged.has_fused |= t->has_fused;
        if (t->has_decode) memcpy(merged.decode, t->decode, sizeof merged.decode);
        merged.has_decode |= t->has_decode;
        merged.has_xgemm |= t->has_xgemm;
        merged.has_direct |= t->has_direct;
        merged.has_routine |= t->has_routine;
        s->tuning = merged;
        s->applied = true;
        s->source = kind;
        s->meta = meta ? *meta : (clmha__tuning_meta){0};
        s->stored_considered = true;  // an explicit tuning wins over the stored file
        snprintf(s->note, sizeof s->note, "%s", source);
    }
    pthread_mutex_unlock(&registry_lock);
    return st;
}

// ---- files -----------------------------------------------------------------------------------

clmha_status clmha__tuning_dir(char *dir, size_t size, char *msg, size_t msg_size) {
    const char *env = getenv("CLMHA_TUNING_DIR");
    int n;
    if (env && env[0]) {
        n = snprintf(dir, size, "%s", env);
    } else {
        const char *xdg = getenv("XDG_CACHE_HOME");
        const char *home = getenv("HOME");
        if (xdg && xdg[0] == '/')  // the XDG spec ignores relative paths
            n = snprintf(dir, size, "%s/clmha", xdg);
        else if (home && home[0])
            n = snprintf(dir, size, "%s/.cache/clmha", home);
        else
            return clmha__msg(msg, msg_size, CLMHA_IO_ERROR,
                              "no folder for tuning files: set $CLMHA_TUNING_DIR (or "
                              "$XDG_CACHE_HOME or $HOME)");
    }
    if (n < 0 || (size_t)n >= size)
        return clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "the tuning folder's path is too long");
    while (n > 1 && dir[n - 1] == '/') dir[--n] = '\0';
    return CLMHA_SUCCESS;
}

// Appends @p s to @p out keeping [A-Za-z0-9._-], other runs of bytes become one '_'.
static size_t sanitise(char *out, size_t size, size_t used, const char *s, size_t max_len) {
    size_t start = used;
    bool last_sub = false;
    for (; *s && used + 1 < size && used - start < max_len; ++s) {
        unsigned char c = (unsigned char)*s;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '-' || c == '_';
        if (ok) {
            out[used++] = (char)c;
            last_sub = false;
        } else if (!last_sub) {
            out[used++] = '_';
            last_sub = true;
        }
    }
    if (used == start && used + 1 < size) out[used++] = '_';
    out[used] = '\0';
    return used;
}

clmha_status clmha__tuning_path(const clmha__tuning_target *tg, char *path, size_t size, char *msg,
                                size_t msg_size) {
    char dir[4096];
    clmha_status st = clmha__tuning_dir(dir, sizeof dir, msg, msg_size);
    if (st) return st;
    char name[256];
    size_t used = sanitise(name, sizeof name, 0, tg->info->platform_name, 80);
    used = clmha__tuning_append(name, sizeof name, used, "--");
    sanitise(name, sizeof name, used, tg->info->device_name, 120);
    int n = snprintf(path, size, "%s/%s.json", dir, name);
    if (n < 0 || (size_t)n >= size)
        return clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "the tuning file's path is too long");
    return CLMHA_SUCCESS;
}

// mkdir -p
static clmha_status make_dirs(const char *dir, char *msg, size_t msg_size) {
    char buf[4096];
    int n = snprintf(buf, sizeof buf, "%s", dir);
    if (n < 0 || (size_t)n >= sizeof buf)
        return clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "folder path too long");
    for (char *p = buf + 1;; ++p) {
        if (*p == '/' || *p == '\0') {
            char saved = *p;
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "cannot create folder %s: %s",
                                  buf, strerror(errno));
            *p = saved;
            if (!saved) break;
        }
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "%s is not a folder", dir);
    return CLMHA_SUCCESS;
}

// Writes the NUL-terminated @p user.
static bool write_text(FILE *f, void *user, char *why, size_t why_size) {
    (void)why, (void)why_size;  // errno says why
    size_t len = strlen(user);
    return fwrite(user, 1, len, f) == len;
}

clmha_status clmha__tuning_write_file(const char *path, const char *text, char *msg,
                                      size_t msg_size) {
    char dir[4096];
    int n = snprintf(dir, sizeof dir, "%s", path);
    if (n < 0 || (size_t)n >= sizeof dir)
        return clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "path too long");
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        clmha_status st = make_dirs(dir, msg, msg_size);
        if (st) return st;
    }
    return clmha__file_write_whole(path, write_text, (void *)text, msg, msg_size);
}

// Reads a whole file (at most TUNING_FILE_MAX bytes) as a NUL-terminated string. Only a regular
// file is read: a FIFO or a device at the path is refused at once (the tuning is then ignored
// as unusable) instead of blocking every run.
static clmha_status read_text(const char *path, char **out, bool *missing, char *msg,
                              size_t msg_size) {
    *out = NULL;
    unsigned char *buf = NULL;
    size_t n = 0;
    int absent = 0;
    clmha_status st =
        clmha__file_read_whole(path, TUNING_FILE_MAX, &buf, &n, &absent, msg, msg_size);
    *missing = absent != 0;
    if (st) return st;
    if (strlen((const char *)buf) != n) {
        free(buf);
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "%s holds a NUL byte", path);
    }
    *out = (char *)buf;
    return CLMHA_SUCCESS;
}

// ---- JSON --------------------------------------------------------------------------------------

// The kernels a tuning file may hold, in the file's order: the name, the parameters' names, and
// where their values and the kernel's has_ flag are in a clmha__tuning (offsets).
typedef struct kernel_fields {
    const char *name;
    size_t count;
    const char *const *names;
    size_t values, has;
} kernel_fields;

#define KERNEL(name, count, names, values, has) \
    {name, count, names, offsetof(clmha__tuning, values), offsetof(clmha__tuning, has)}
static const kernel_fields kernel_table[] = {
    KERNEL("Xgemm", CLMHA__XGEMM_PARAMS, clmha__xgemm_names, xgemm, has_xgemm),
    KERNEL("XgemmDirect", CLMHA__DIRECT_PARAMS, clmha__direct_names, direct, has_direct),
    KERNEL("GemmRoutine", 1, clmha__routine_names, min_indirect, has_routine),
    KERNEL("FusedAttention", CLMHA__FUSED_PARAMS, clmha__fused_names, fused, has_fused),
    KERNEL("DecodeSplit", CLMHA__DECODE_PARAMS, clmha__decode_names, decode, has_decode),
};
#undef KERNEL

void clmha__tuning_utc_now(char *buf, size_t size) {
    time_t now = time(NULL);
    struct tm tm;
    if (gmtime_r(&now, &tm))
        strftime(buf, size, "%Y-%m-%dT%H:%M:%SZ", &tm);
    else
        snprintf(buf, size, "unknown");
}

static bool add_params(cJSON *kernels, const char *kernel, size_t count,
                       const char *const *names, const size_t *values) {
    cJSON *o = cJSON_AddObjectToObject(kernels, kernel);
    if (!o) return false;
    for (size_t i = 0; i < count; ++i)
        if (!cJSON_AddNumberToObject(o, names[i], (double)values[i])) return false;
    return true;
}

char *clmha__tuning_to_json(const clmha__tuning_target *tg, const clmha__tuning *t,
                            const clmha__tuning_meta *meta) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    cJSON *kernels = NULL;
    bool ok = cJSON_AddStringToObject(root, "format", TUNING_FORMAT) &&
              cJSON_AddNumberToObject(root, "version", TUNING_VERSION) &&
              cJSON_AddStringToObject(root, "platform", tg->info->platform_name) &&
              cJSON_AddStringToObject(root, "device", tg->info->device_name) &&
              cJSON_AddStringToObject(root, "driver", tg->info->driver_version) &&
              cJSON_AddStringToObject(root, "clblast", CLMHA__CLBLAST_VERSION) &&
              cJSON_AddStringToObject(root, "precision", "float32") &&
              (kernels = cJSON_AddObjectToObject(root, "kernels"));
    for (size_t i = 0; ok && i < sizeof kernel_table / sizeof kernel_table[0]; ++i) {
        const kernel_fields *f = &kernel_table[i];
        if (*(const bool *)((const char *)t + f->has))
            ok = add_params(kernels, f->name, f->count, f->names,
                            (const size_t *)((const char *)t + f->values));
    }
    if (ok && meta && (meta->tuned_gflops > 0 || meta->date[0])) {
        cJSON *m = cJSON_AddObjectToObject(root, "measured");
        // Rounded to 0.1 GFLOP/s: the file stays readable.
        ok = m && cJSON_AddNumberToObject(m, "sgemm_1024_default_gflops",
                                          round(meta->default_gflops * 10) / 10) &&
             cJSON_AddNumberToObject(m, "sgemm_1024_tuned_gflops",
                                     round(meta->tuned_gflops * 10) / 10) &&
             cJSON_AddStringToObject(m, "layer", meta->layer) &&
             cJSON_AddNumberToObject(m, "layer_projection_default_gflops",
                                     round(meta->default_layer_gflops * 10) / 10) &&
             cJSON_AddNumberToObject(m, "layer_projection_tuned_gflops",
                                     round(meta->tuned_layer_gflops * 10) / 10) &&
             cJSON_AddNumberToObject(m, "candidates", (double)meta->candidates) &&
             cJSON_AddNumberToObject(m, "seconds", round(meta->seconds)) &&
             cJSON_AddStringToObject(m, "date", meta->date);
    }
    char *text = ok ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (!text) return NULL;
    // cJSON's allocator is malloc unless the application changed it: copy to be sure the
    // caller can free() it.
    size_t len = strlen(text);
    char *copy = malloc(len + 2);
    if (copy) {
        memcpy(copy, text, len);
        copy[len] = '\n';
        copy[len + 1] = '\0';
    }
    cJSON_free(text);
    return copy;
}

static clmha_status parse_params(const cJSON *obj, const char *kernel, size_t count,
                                 const char *const *names, size_t *values, char *msg,
                                 size_t msg_size) {
    if (!cJSON_IsObject(obj))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "kernels.%s is not an object",
                          kernel);
    for (const cJSON *item = obj->child; item; item = item->next) {
        bool known = false;
        for (size_t i = 0; i < count && !known; ++i)
            known = item->string && strcmp(item->string, names[i]) == 0;
        if (!known)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "kernels.%s has an unknown parameter \"%.40s\"", kernel,
                              item->string ? item->string : "");
    }
    for (size_t i = 0; i < count; ++i) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, names[i]);
        if (!v)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "kernels.%s lacks parameter %s (every one is needed)", kernel,
                              names[i]);
        double d = cJSON_IsNumber(v) ? v->valuedouble : -1;
        if (!cJSON_IsNumber(v) || !(d >= 0 && d <= CLMHA__TUNING_PARAM_MAX) || d != floor(d))
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "kernels.%s.%s must be an integer from 0 to %.0f", kernel, names[i],
                              CLMHA__TUNING_PARAM_MAX);
        values[i] = (size_t)d;
    }
    return CLMHA_SUCCESS;
}

static double meta_number(const cJSON *m, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(m, name);
    return cJSON_IsNumber(v) && isfinite(v->valuedouble) && v->valuedouble >= 0 ? v->valuedouble
                                                                                : 0;
}

static void meta_string(const cJSON *m, const char *name, char *out, size_t size) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(m, name);
    if (cJSON_IsString(v) && v->valuestring) snprintf(out, size, "%s", v->valuestring);
}

// True when @p kernels names one of CLBlast's kernels (the tuning depends on its version).
static bool names_clblast_kernel(const cJSON *kernels) {
    for (const cJSON *k = kernels->child; k; k = k->next)
        if (k->string &&
            (strcmp(k->string, "Xgemm") == 0 || strcmp(k->string, "XgemmDirect") == 0 ||
             strcmp(k->string, "GemmRoutine") == 0))
            return true;
    return false;
}

static const char *string_field(const cJSON *root, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

// The top-level fields of a tuning file: NULL where absent or (but for version and kernels)
// not a string.
typedef struct file_head {
    const char *format, *platform, *device, *driver, *precision, *clblast;
    const cJSON *version, *kernels;
} file_head;

static file_head head_of(const cJSON *root) {
    return (file_head){.format = string_field(root, "format"),
                       .version = cJSON_GetObjectItemCaseSensitive(root, "version"),
                       .platform = string_field(root, "platform"),
                       .device = string_field(root, "device"),
                       .driver = string_field(root, "driver"),
                       .precision = string_field(root, "precision"),
                       .clblast = string_field(root, "clblast"),
                       .kernels = cJSON_GetObjectItemCaseSensitive(root, "kernels")};
}

// Whether @p root (its fields in @p h) is a tuning file this clmha reads: the format and
// version, the fields every tuning has, the precision, a kernels object. CLMHA_INVALID_FILE
// with the reason when not.
static clmha_status check_format(const cJSON *root, const file_head *h, char *msg,
                                 size_t msg_size) {
    if (!cJSON_IsObject(root) || !h->format || strcmp(h->format, TUNING_FORMAT) != 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "not a clmha tuning (\"format\" must be \"" TUNING_FORMAT "\")");
    if (!cJSON_IsNumber(h->version) || h->version->valuedouble != TUNING_VERSION)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "unsupported tuning version (this clmha reads version %d)",
                          TUNING_VERSION);
    if (!h->platform || !h->device || !h->driver)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "the tuning lacks \"platform\", \"device\" or \"driver\"");
    if (h->precision && strcmp(h->precision, "float32") != 0)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "the tuning is for precision \"%.20s\", clmha needs \"float32\"",
                          h->precision);
    if (!cJSON_IsObject(h->kernels))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                          "the tuning lacks a \"kernels\" object");
    return CLMHA_SUCCESS;
}

// Whether the tuning of @p h (check_format() passed) is for @p tg's device and driver and, when
// it holds CLBlast's kernels, for this CLBlast version. CLMHA_UNSUPPORTED with the reason when
// not.
static clmha_status check_target(const file_head *h, const clmha__tuning_target *tg, char *msg,
                                 size_t msg_size) {
    const clmha_device_info *info = tg->info;
    if (strcmp(h->platform, info->platform_name) != 0 ||
        strcmp(h->device, info->device_name) != 0)
        return clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                          "the tuning is for device \"%.100s\" of platform \"%.100s\", not for "
                          "this context's \"%s\" of \"%s\"",
                          h->device, h->platform, info->device_name, info->platform_name);
    if (strcmp(h->driver, info->driver_version) != 0)
        return clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                          "the tuning is for driver version \"%.60s\", the device has \"%s\" "
                          "(tune again: clmha tune)",
                          h->driver, info->driver_version);
    if (!names_clblast_kernel(h->kernels) ||
        (h->clblast && strcmp(h->clblast, CLMHA__CLBLAST_VERSION) == 0))
        return CLMHA_SUCCESS;
    // CLBlast's parameters (names, constraints, what its kernels do with them) belong to a
    // CLBlast version. A file without "clblast" was written by a clmha older than the field.
    if (h->clblast)
        return clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                          "the tuning is for CLBlast %.40s, this clmha uses CLBlast "
                          CLMHA__CLBLAST_VERSION " (tune again: clmha tune)",
                          h->clblast);
    return clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                      "the tuning does not say which CLBlast version it is for (an older "
                      "clmha wrote it), this clmha uses CLBlast " CLMHA__CLBLAST_VERSION
                      " (tune again: clmha tune)");
}

// Reads each kernel of the object @p kernels into @p t (its has_ flag set), in the file's
// order; stops at the first that is unknown or malformed.
static clmha_status read_kernels(const cJSON *kernels, clmha__tuning *t, char *msg,
                                 size_t msg_size) {
    for (const cJSON *k = kernels->child; k; k = k->next) {
        const char *name = k->string ? k->string : "";
        const kernel_fields *f = NULL;
        for (size_t i = 0; i < sizeof kernel_table / sizeof kernel_table[0] && !f; ++i)
            if (strcmp(name, kernel_table[i].name) == 0) f = &kernel_table[i];
        if (!f)
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "unknown kernel \"%.40s\" (known: Xgemm, XgemmDirect, GemmRoutine, "
                              "FusedAttention, DecodeSplit)",
                              name);
        clmha_status st = parse_params(k, f->name, f->count, f->names,
                                       (size_t *)((char *)t + f->values), msg, msg_size);
        *(bool *)((char *)t + f->has) = true;
        if (st) return st;
    }
    return CLMHA_SUCCESS;
}

// The "measured" object of @p root, when there is one, into @p meta (what is missing or
// malformed stays 0 or empty).
static void read_measured(const cJSON *root, clmha__tuning_meta *meta) {
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "measured");
    if (!cJSON_IsObject(m)) return;
    meta->default_gflops = meta_number(m, "sgemm_1024_default_gflops");
    meta->tuned_gflops = meta_number(m, "sgemm_1024_tuned_gflops");
    meta->default_layer_gflops = meta_number(m, "layer_projection_default_gflops");
    meta->tuned_layer_gflops = meta_number(m, "layer_projection_tuned_gflops");
    meta->candidates = (size_t)meta_number(m, "candidates");
    meta->seconds = meta_number(m, "seconds");
    meta_string(m, "layer", meta->layer, sizeof meta->layer);
    meta_string(m, "date", meta->date, sizeof meta->date);
}

clmha_status clmha__tuning_from_json(const clmha__tuning_target *tg, const char *json,
                                     clmha__tuning *t, clmha__tuning_meta *meta, char *msg,
                                     size_t msg_size) {
    memset(t, 0, sizeof *t);
    if (meta) memset(meta, 0, sizeof *meta);
    if (strlen(json) > TUNING_FILE_MAX)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "the tuning is larger than %u bytes",
                          TUNING_FILE_MAX);
    cJSON *root = cJSON_Parse(json);
    if (!root)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "the tuning is not valid JSON");
    file_head h = head_of(root);
    clmha_status st = check_format(root, &h, msg, msg_size);
    if (!st) st = check_target(&h, tg, msg, msg_size);
    if (!st) st = read_kernels(h.kernels, t, msg, msg_size);
    if (!st && !clmha__tuning_check(t, clmha__tuning_local_mem(tg), tg->max_work_group, msg,
                                    msg_size))
        st = CLMHA_INVALID_FILE;
    if (!st && meta) read_measured(root, meta);
    cJSON_Delete(root);
    if (st) memset(t, 0, sizeof *t);
    return st;
}

// ---- the stored tuning, at context creation -------------------------------------------------

const clmha__builtin_set *clmha__tuning_builtin_of(const clmha__tuning_target *tg) {
    char version[256] = "";
    cl_uint width = 0;
    clGetDeviceInfo(tg->device, CL_DEVICE_VERSION, sizeof version - 1, version, NULL);
    clGetDeviceInfo(tg->device, CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT, sizeof width, &width, NULL);
    clmha__builtin_device d = {.type = tg->info->type,
                               .platform_name = tg->info->platform_name,
                               .device_name = tg->info->device_name,
                               .device_version = version,
                               .native_float_width = width};
    return clmha__builtin_match(&d);
}

// Applies @p t with note @p source, or notes why it was not (@p fail_note, then the reason);
// never fails: the message the thread had is put back.
static bool apply_quietly(const clmha__tuning_target *tg, const clmha__tuning *t,
                          const clmha__tuning_meta *meta, clmha_tuning_source kind,
                          const char *source, const char *fail_note) {
    char saved[CLMHA__ERROR_SIZE];
    snprintf(saved, sizeof saved, "%s", clmha__error_last(tg->errors));
    if (!clmha__tuning_apply(tg, t, meta, kind, source)) return true;
    clmha__tuning_set_note(tg->device, "%s: %s", fail_note, clmha__error_last(tg->errors));
    // context creation did not fail: put back the message the thread had
    clmha__error_restore(tg->errors, saved);
    return false;
}

// No stored tuning was applied (@p why says why): the device's built-in set, if it has one,
// with a note that keeps @p why.
static void apply_builtin(const clmha__tuning_target *tg, const char *why) {
    const clmha__builtin_set *b = clmha__tuning_builtin_of(tg);
    if (!b) {
        clmha__tuning_set_note(tg->device, "%s", why);
        return;
    }
    char source[NOTE_SIZE], fail[NOTE_SIZE];
    snprintf(source, sizeof source, "built-in parameters for %s applied%s; %s", b->name,
             b->measured ? "" : " (derived, not measured on such a device)", why);
    snprintf(fail, sizeof fail, "%s; built-in parameters for %s not applied", why, b->name);
    apply_quietly(tg, &b->tuning, NULL, CLMHA_TUNING_SOURCE_BUILTIN, source, fail);
}

void clmha__tuning_apply_stored(const clmha__tuning_target *tg) {
    pthread_mutex_lock(&registry_lock);
    device_state *s = state_of(tg->device);
    bool skip = !s || s->stored_considered;
    if (s) s->stored_considered = true;
    pthread_mutex_unlock(&registry_lock);
    if (skip) return;  // once per device and process; an explicit tuning is kept

    const char *env = getenv("CLMHA_TUNING");
    char why[6144];  // cut to NOTE_SIZE when it becomes the note
    if (env && (strcmp(env, "off") == 0 || strcmp(env, "0") == 0)) {
        clmha__tuning_set_note(tg->device,
                               "no tuning applied: CLBlast's own parameters ($CLMHA_TUNING=%s: "
                               "neither the stored tuning nor built-in parameters)",
                               env);
        return;
    }
    if (env && strcmp(env, "builtin") == 0) {
        apply_builtin(tg, "stored tuning not loaded ($CLMHA_TUNING=builtin)");
        return;
    }
    char path[4400], msg[1024];
    if (clmha__tuning_path(tg, path, sizeof path, msg, sizeof msg)) {
        snprintf(why, sizeof why, "no stored tuning: %s", msg);
        apply_builtin(tg, why);
        return;
    }
    char *text = NULL;
    bool missing = false;
    if (read_text(path, &text, &missing, msg, sizeof msg)) {
        if (missing)
            snprintf(why, sizeof why, "no stored tuning (%s not found; create it with clmha tune)",
                     path);
        else
            snprintf(why, sizeof why, "stored tuning ignored: %s", msg);
        apply_builtin(tg, why);
        return;
    }
    clmha__tuning t;
    clmha__tuning_meta meta;
    clmha_status st = clmha__tuning_from_json(tg, text, &t, &meta, msg, sizeof msg);
    free(text);
    if (st) {
        snprintf(why, sizeof why, "stored tuning %s ignored: %s", path, msg);
        apply_builtin(tg, why);
        return;
    }
    char source[sizeof path + 64], fail[sizeof path + 64];
    snprintf(source, sizeof source, "stored tuning %s applied", path);
    snprintf(fail, sizeof fail, "stored tuning %s ignored", path);
    if (!apply_quietly(tg, &t, &meta, CLMHA_TUNING_SOURCE_STORED, source, fail)) {
        clmha__tuning_get_note(tg->device, why, sizeof why);
        apply_builtin(tg, why);
    }
}
