// What the test files share (see support.h).
#define _POSIX_C_SOURCE 200809L

#include "support.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

// ---- device -------------------------------------------------------------------------------------

clmha_context *context_or_skip(void) {
    clmha_context *ctx = NULL;
    clmha_status st = clmha_context_create_from_env(&ctx);
    if (st == CLMHA_DEVICE_NOT_FOUND)
        cr_skip_test("no OpenCL device: %s", clmha_last_create_error());
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_context_create_from_env: %s",
                 clmha_last_create_error());
    return ctx;
}

bool has_fp64(clmha_context *ctx) {
    cl_device_fp_config config = 0;
    cl_int err = clGetDeviceInfo(clmha_context_cl_device(ctx), CL_DEVICE_DOUBLE_FP_CONFIG,
                                 sizeof config, &config, NULL);
    return err == CL_SUCCESS && config != 0;
}

clmha_context *fp64_context_or_skip(void) {
    clmha_context *ctx = context_or_skip();
    if (!has_fp64(ctx)) {
        clmha_context_release(ctx);
        cr_skip_test("the device has no double precision (CL_DEVICE_DOUBLE_FP_CONFIG is 0)");
    }
    return ctx;
}

// ---- temporary folders and files ----------------------------------------------------------------

void tmpdir_make(char *dir, size_t size, const char *prefix) {
    int n = snprintf(dir, size, "/tmp/%s-XXXXXX", prefix);
    cr_assert(n > 0 && (size_t)n < size, "tmpdir_make: '%s' is too long for %zu bytes", prefix,
              size);
    cr_assert_not_null(mkdtemp(dir), "mkdtemp(%s) failed", dir);
}

size_t tmpdir_list(const char *dir, char *names, size_t names_size) {
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "cannot open the folder %s", dir);
    size_t count = 0, used = 0;
    if (names && names_size) names[0] = '\0';
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (names && used < names_size)
            used += (size_t)snprintf(names + used, names_size - used, "%s%s", count ? " " : "",
                                     e->d_name);
        ++count;
    }
    closedir(d);
    return count;
}

size_t tmpdir_count(const char *dir) { return tmpdir_list(dir, NULL, 0); }

void tmpdir_remove(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    char path[1024];
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (remove(path) != 0) tmpdir_remove(path);  // a folder with files: empty it first
    }
    closedir(d);
    rmdir(dir);
}

void write_bytes(const char *path, const void *bytes, size_t size) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot create %s", path);
    cr_assert_eq(fwrite(bytes, 1, size, f), size);
    cr_assert_eq(fclose(f), 0);
}

char *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap + 1);
    size_t got;
    while (buf && (got = fread(buf + len, 1, cap - len, f)) > 0) {
        len += got;
        if (len == cap) {
            char *bigger = realloc(buf, 2 * cap + 1);
            if (!bigger) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = bigger;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf) buf[len] = '\0';
    if (size) *size = len;
    return buf;
}

// ---- random data --------------------------------------------------------------------------------

uint64_t prng_next(prng *r) {
    uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double prng_uniform(prng *r) { return (double)(prng_next(r) >> 11) * 0x1.0p-53; }

size_t prng_range(prng *r, size_t lo, size_t hi) {
    return lo + (size_t)(prng_next(r) % (uint64_t)(hi - lo + 1));
}

bool prng_bool(prng *r) { return prng_next(r) >> 63; }

double prng_normal(prng *r) {
    double u1 = 1.0 - prng_uniform(r);  // (0, 1]
    double u2 = prng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

float *alloc_floats(size_t count) {
    float *p = malloc((count ? count : 1) * sizeof *p);
    cr_assert_not_null(p, "out of memory");
    return p;
}

float *uniform_floats(prng *r, size_t count, double bound) {
    float *p = alloc_floats(count);
    for (size_t i = 0; i < count; ++i) p[i] = (float)((2.0 * prng_uniform(r) - 1.0) * bound);
    return p;
}

float *normal_floats(prng *r, size_t count) {
    float *p = alloc_floats(count);
    for (size_t i = 0; i < count; ++i) p[i] = (float)prng_normal(r);
    return p;
}

float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

// ---- error metrics ------------------------------------------------------------------------------

// |d|, or +inf when d is NaN or infinite.
static double abs_or_inf(double d) { return isfinite(d) ? fabs(d) : INFINITY; }

double max_abs_err(const float *got, const double *want, size_t count) {
    double m = 0.0;
    for (size_t i = 0; i < count; ++i) m = fmax(m, abs_or_inf((double)got[i] - want[i]));
    return m;
}

double max_abs_err_d(const double *got, const double *want, size_t count) {
    double m = 0.0;
    for (size_t i = 0; i < count; ++i) m = fmax(m, abs_or_inf(got[i] - want[i]));
    return m;
}

double max_abs_of(const double *x, size_t count) {
    double m = 0.0;
    for (size_t i = 0; i < count; ++i) m = fmax(m, fabs(x[i]));
    return m;
}

double max_abs_diff(const float *a, const float *b, size_t count) {
    double m = 0.0;
    for (size_t i = 0; i < count; ++i) m = fmax(m, abs_or_inf((double)a[i] - (double)b[i]));
    return m;
}

error_stats error_stats_of(const float *got, const double *want, size_t count) {
    error_stats e = {0.0, 0.0};
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < count; ++i) {
        double d = abs_or_inf((double)got[i] - want[i]);
        e.max_abs = fmax(e.max_abs, d);
        num += d * d;
        den += want[i] * want[i];
    }
    e.nmse = den > 0.0 ? num / den : num;
    return e;
}

// ---- case stride --------------------------------------------------------------------------------

case_stride case_stride_get(const char *suite, size_t total) {
    case_stride s = {1, 0};
    const char *env = getenv("CLMHA_TEST_CASE_STRIDE");
    if (!env || !*env) return s;
    unsigned long k = 0, o = 0;
    int used = 0;
    if (!((sscanf(env, "%lu:%lu%n", &k, &o, &used) == 2 || sscanf(env, "%lu%n", &k, &used) == 1) &&
          env[used] == '\0' && k >= 1 && o < k)) {
        fprintf(stderr, "%s: CLMHA_TEST_CASE_STRIDE='%s': want K or K:O with K >= 1, O < K\n",
                suite, env);
        exit(2);
    }
    s.k = k, s.o = o;
    size_t kept = total > s.o ? (total - s.o + s.k - 1) / s.k : 0;
    fprintf(stderr, "%s: CLMHA_TEST_CASE_STRIDE=%s: %zu of %zu cases (every %zu-th from %zu)\n",
            suite, env, kept, total, s.k, s.o);
    return s;
}

bool case_stride_keeps(case_stride s, size_t i) { return i >= s.o && (i - s.o) % s.k == 0; }

void case_params_free(struct criterion_test_params *crp) { cr_free(crp->params); }

// ---- reference counts of the caller's OpenCL objects --------------------------------------------

static const char *const ref_kind_name[] = {"cl_context", "cl_command_queue", "cl_event"};

cl_uint refs_of(ref_kind kind, const void *object) {
    cl_uint n = 0;
    cl_int err = CL_INVALID_VALUE;
    switch (kind) {
    case REF_CONTEXT:
        err = clGetContextInfo((cl_context)object, CL_CONTEXT_REFERENCE_COUNT, sizeof n, &n, NULL);
        break;
    case REF_QUEUE:
        err = clGetCommandQueueInfo((cl_command_queue)object, CL_QUEUE_REFERENCE_COUNT, sizeof n,
                                    &n, NULL);
        break;
    case REF_EVENT:
        err = clGetEventInfo((cl_event)object, CL_EVENT_REFERENCE_COUNT, sizeof n, &n, NULL);
        break;
    }
    cr_assert_eq(err, CL_SUCCESS, "reading the %s reference count: error %d",
                 ref_kind_name[kind], err);
    return n;
}

static void refs_retain(ref_kind kind, const void *object, bool retain) {
    cl_int err = CL_INVALID_VALUE;
    switch (kind) {
    case REF_CONTEXT:
        err = retain ? clRetainContext((cl_context)object) : clReleaseContext((cl_context)object);
        break;
    case REF_QUEUE:
        err = retain ? clRetainCommandQueue((cl_command_queue)object)
                     : clReleaseCommandQueue((cl_command_queue)object);
        break;
    case REF_EVENT:
        err = retain ? clRetainEvent((cl_event)object) : clReleaseEvent((cl_event)object);
        break;
    }
    cr_assert_eq(err, CL_SUCCESS, "%s %s: error %d", retain ? "retaining" : "releasing",
                 ref_kind_name[kind], err);
}

static void refs_sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

cl_uint refs_settled(ref_kind kind, const void *object, cl_uint want) {
    cl_uint n = refs_of(kind, object);
    for (int i = 0; i < 500 && n != want; ++i) {
        refs_sleep_ms(10);
        n = refs_of(kind, object);
    }
    return n;
}

cl_uint refs_steady(ref_kind kind, const void *object) {
    cl_uint n = refs_of(kind, object);
    for (int same = 0, i = 0; same < 5 && i < 200; ++i) {
        refs_sleep_ms(10);
        cl_uint m = refs_of(kind, object);
        same = m == n ? same + 1 : 0;
        n = m;
    }
    return n;
}

bool refs_move(ref_kind kind, const void *object) {
    cl_uint before = 0, retained = 0;
    for (int attempt = 0; attempt < 3; ++attempt) {
        before = refs_of(kind, object);
        refs_retain(kind, object, true);
        retained = refs_of(kind, object);
        refs_retain(kind, object, false);
        if (retained == before + 1) return true;
        refs_sleep_ms(20);
    }
    fprintf(stderr,
            "note: this driver reports %s reference count %u -> %u across clRetain: its counts "
            "are not checked; clmha's own counts of the OpenCL objects it holds are\n",
            ref_kind_name[kind], before, retained);
    return false;
}

bool context_refs_show_objects(cl_context context) {
    cl_uint before = refs_of(REF_CONTEXT, context);
    cl_int err;
    cl_mem probe = clCreateBuffer(context, CL_MEM_READ_WRITE, 16, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer(16 bytes): error %d", err);
    cl_uint with = refs_of(REF_CONTEXT, context);
    clReleaseMemObject(probe);
    refs_settled(REF_CONTEXT, context, before);
    if (with == before + 1) return true;
    fprintf(stderr,
            "note: a cl_mem does not hold its cl_context on this driver (references %u -> %u): "
            "the context's count cannot show a leaked OpenCL object; clmha's own counts of the "
            "objects it holds are checked\n",
            before, with);
    return false;
}

void assert_refs_back(ref_kind kind, const void *object, bool counts_move, cl_uint want,
                      const char *when) {
    if (!counts_move) return;  // refs_move() said so on stderr
    cl_uint n = refs_settled(kind, object, want);
    cr_assert_eq(n, want, "%s references %u %s (waited 5 s), expected %u", ref_kind_name[kind],
                 n, when, want);
}

double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void test_env_open(test_env *e, const char *prefix) {
    memset(e, 0, sizeof *e);
    e->ctx = context_or_skip();
    tmpdir_make(e->dir, sizeof e->dir, prefix);
}

void test_env_close(test_env *e) {
    tmpdir_remove(e->dir);
    clmha_context_release(e->ctx);
}

// ---- user functions in OpenCL C and their host forms ------------------------------------------

const char user_test_source[] =
    "clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k,\n"
    "                           __global const float *p) {\n"
    "    return s + p[0] * sin(s) + p[1] * (clmha_real)(h + 1) * cos(p[2] * (clmha_real)(q - k))\n"
    "           + p[3] * (clmha_real)b;\n"
    "}\n"
    "clmha_real clmha_score_mod_grad(clmha_real s, int b, int h, int q, int k,\n"
    "                                __global const float *p) {\n"
    "    return 1 + p[0] * cos(s);\n"
    "}\n"
    "int clmha_mask_mod(int b, int h, int q, int k, __global const float *p) {\n"
    "    return k == 0 || (q + 2 * k + h + b) % 5 != 4;\n"
    "}\n";

const float user_test_params[USER_TEST_PARAMS] = {0.5f, 0.25f, 0.75f, -0.125f};

double test_user_score(double s, int b, int h, int q, int k, const float *p) {
    return s + p[0] * sin(s) + p[1] * (double)(h + 1) * cos(p[2] * (double)(q - k)) +
           p[3] * (double)b;
}

double test_user_score_grad(double s, int b, int h, int q, int k, const float *p) {
    (void)b, (void)h, (void)q, (void)k;
    return 1 + p[0] * cos(s);
}

int test_user_mask(int b, int h, int q, int k, const float *p) {
    (void)p;
    return k == 0 || (q + 2 * k + h + b) % 5 != 4;
}
