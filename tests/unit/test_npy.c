// The .npy reader and writer (src/cli/npy.c): files written by clmha__npy_write_f32 and
// clmha__npy_write_f64 and read back (as floats and, for float64 layers, as doubles),
// reference files written by NumPy (tests/npy/, made by tools/make_npy_fixtures.py; arange-based
// values, so no NumPy is needed here), and malformed files built in memory. Every refusal is
// checked for its exact status, a message substring, and a zeroed output.
#define _POSIX_C_SOURCE 200809L

#include <criterion/criterion.h>

#include "cli/npy.h"
#include "support.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MSG_SIZE 1024
#define FIXTURE(file) CLMHA_TEST_DATA_DIR "/npy/" file

// ---- helpers -------------------------------------------------------------------------------

static void assert_zeroed(const clmha__npy *a) {
    cr_assert_eq(a->kind, 0);
    cr_assert_eq(a->dtype[0], '\0');
    cr_assert_eq(a->ndim, 0);
    cr_assert_eq(a->count, 0);
    cr_assert_null(a->f32);
    cr_assert_null(a->f64);
    cr_assert_null(a->u8);
    for (size_t i = 0; i < CLMHA__NPY_MAX_DIMS; ++i) cr_assert_eq(a->shape[i], 0);
}

// Builds a .npy file of format version major.0 in @p buf: magic, version, the length of
// @p header, @p header as given, then @p data_bytes bytes 0, 1, 2, ...
static size_t build_version(unsigned char *buf, size_t cap, unsigned major, const char *header,
                            size_t data_bytes) {
    size_t len = strlen(header), prefix = major == 1 ? 10 : 12;
    cr_assert_leq(prefix + len + data_bytes, cap);
    memcpy(buf, "\x93NUMPY", 6);
    buf[6] = (unsigned char)major;
    buf[7] = 0;
    buf[8] = (unsigned char)(len & 0xFF);
    buf[9] = (unsigned char)(len >> 8 & 0xFF);
    if (major != 1) {
        buf[10] = (unsigned char)(len >> 16 & 0xFF);
        buf[11] = (unsigned char)(len >> 24 & 0xFF);
    }
    memcpy(buf + prefix, header, len);
    for (size_t i = 0; i < data_bytes; ++i) buf[prefix + len + i] = (unsigned char)i;
    return prefix + len + data_bytes;
}

static size_t build(unsigned char *buf, size_t cap, const char *header, size_t data_bytes) {
    return build_version(buf, cap, 1, header, data_bytes);
}

// Parses @p bytes expecting refusal with @p status and a message containing @p part (and the
// name "mem.npy" for file problems).
static void expect_refused(const void *bytes, size_t size, clmha_status status, const char *part) {
    clmha__npy a;
    memset(&a, 0xA5, sizeof a);
    char msg[MSG_SIZE] = "";
    clmha_status st = clmha__npy_parse(bytes, size, "mem.npy", &a, msg, sizeof msg);
    cr_assert_eq(st, status, "status %d (expected %d), message: %s", st, status, msg);
    cr_assert(strstr(msg, part), "message '%s' lacks '%s'", msg, part);
    if (status == CLMHA_INVALID_FILE || status == CLMHA_SIZE_OVERFLOW)
        cr_assert(strstr(msg, "mem.npy"), "message '%s' does not name the file", msg);
    assert_zeroed(&a);
}

static void expect_header_refused(const char *header, size_t data_bytes, clmha_status status,
                                  const char *part) {
    unsigned char buf[1024];
    size_t size = build(buf, sizeof buf, header, data_bytes);
    expect_refused(buf, size, status, part);
}

// Parses @p header followed by @p data_bytes bytes, which must be accepted.
static void parse_ok(const char *header, size_t data_bytes, clmha__npy *a) {
    unsigned char buf[1024];
    size_t size = build(buf, sizeof buf, header, data_bytes);
    char msg[MSG_SIZE] = "";
    clmha_status st = clmha__npy_parse(buf, size, "mem.npy", a, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "'%s' refused: %s", header, msg);
}

static void read_ok(const char *path, clmha__npy *a) {
    char msg[MSG_SIZE] = "";
    clmha_status st = clmha__npy_read(path, a, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: %s", path, msg);
}

static void assert_shape(const clmha__npy *a, size_t ndim, const size_t *shape) {
    cr_assert_eq(a->ndim, ndim);
    size_t count = 1;
    for (size_t i = 0; i < ndim; ++i) {
        cr_assert_eq(a->shape[i], shape[i], "dimension %zu: %zu, expected %zu", i, a->shape[i],
                     shape[i]);
        count *= shape[i];
    }
    cr_assert_eq(a->count, count);
}

static unsigned char *slurp(const char *path, size_t *size) {
    unsigned char *buf = (unsigned char *)read_file(path, size);
    cr_assert_not_null(buf, "cannot read %s", path);
    return buf;
}

// ---- write, then read back -----------------------------------------------------------------

static void round_trip(size_t ndim, const size_t *shape) {
    char dir[64], path[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-npy");
    snprintf(path, sizeof path, "%s/a.npy", dir);
    size_t count = 1;
    for (size_t i = 0; i < ndim; ++i) count *= shape[i];
    float *data = malloc((count ? count : 1) * sizeof *data);
    cr_assert_not_null(data);
    for (size_t i = 0; i < count; ++i) data[i] = (float)i * 0.5f - 3.25f;
    if (count > 2) {
        data[0] = -0.0f;
        data[1] = INFINITY;
        data[2] = 1e-40f;  // subnormal
    }
    cr_assert_eq(clmha__npy_write_f32(path, data, ndim, shape, msg, sizeof msg), CLMHA_SUCCESS,
                 "%s", msg);
    cr_assert_eq(tmpdir_count(dir), 1, "a temporary file was left behind");

    size_t size;
    unsigned char *bytes = slurp(path, &size);
    cr_assert_eq(bytes[6], 1);
    cr_assert_eq(bytes[7], 0);
    size_t data_at = 10 + (size_t)(bytes[8] | bytes[9] << 8);
    cr_assert_eq(data_at % 64, 0, "data starts at %zu", data_at);
    cr_assert_eq(bytes[data_at - 1], '\n');
    cr_assert_eq(size, data_at + 4 * count);
    free(bytes);

    clmha__npy a;
    read_ok(path, &a);
    cr_assert_eq(a.kind, CLMHA__NPY_FLOAT);
    cr_assert_str_eq(a.dtype, "<f4");
    assert_shape(&a, ndim, shape);
    if (count) cr_assert(memcmp(a.f32, data, count * sizeof *data) == 0, "values differ");
    clmha__npy_free(&a);
    assert_zeroed(&a);
    free(data);
    tmpdir_remove(dir);
}

Test(npy_write, round_trip_0d) { round_trip(0, NULL); }

Test(npy_write, round_trip_1d) {
    const size_t shape[] = {5};
    round_trip(1, shape);
}

Test(npy_write, round_trip_3d) {
    const size_t shape[] = {2, 3, 4};
    round_trip(3, shape);
}

Test(npy_write, round_trip_empty_and_8d) {
    const size_t empty[] = {0, 3};
    round_trip(2, empty);
    const size_t eight[] = {2, 1, 3, 1, 2, 1, 1, 2};
    round_trip(8, eight);
    const size_t wide[] = {123456789, 0, 987654321};  // long header, no data
    round_trip(3, wide);
}

// The writer's bytes are exactly NumPy's (np.save of the same array).
Test(npy_write, same_bytes_as_numpy) {
    char dir[64], path[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-npy");
    snprintf(path, sizeof path, "%s/b.npy", dir);
    float v[24];
    for (int i = 0; i < 24; ++i) v[i] = (float)i;
    const size_t shape[] = {2, 3, 4};
    cr_assert_eq(clmha__npy_write_f32(path, v, 3, shape, msg, sizeof msg), CLMHA_SUCCESS);
    size_t n1, n2;
    unsigned char *mine = slurp(path, &n1), *theirs = slurp(FIXTURE("f4_2x3x4.npy"), &n2);
    cr_assert_eq(n1, n2);
    cr_assert(memcmp(mine, theirs, n1) == 0);
    free(mine);
    free(theirs);

    float x = 3.5f;
    cr_assert_eq(clmha__npy_write_f32(path, &x, 0, NULL, msg, sizeof msg), CLMHA_SUCCESS);
    mine = slurp(path, &n1);
    theirs = slurp(FIXTURE("f4_scalar.npy"), &n2);
    cr_assert_eq(n1, n2);
    cr_assert(memcmp(mine, theirs, n1) == 0);
    free(mine);
    free(theirs);
    tmpdir_remove(dir);
}

Test(npy_write, overwrites_whole_file) {
    char dir[64], path[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-npy");
    snprintf(path, sizeof path, "%s/c.npy", dir);
    float big[100] = {0}, small[2] = {7.0f, 8.0f};
    const size_t s100[] = {100}, s2[] = {2};
    cr_assert_eq(clmha__npy_write_f32(path, big, 1, s100, msg, sizeof msg), CLMHA_SUCCESS);
    cr_assert_eq(clmha__npy_write_f32(path, small, 1, s2, msg, sizeof msg), CLMHA_SUCCESS);
    clmha__npy a;
    read_ok(path, &a);
    cr_assert_eq(a.count, 2);
    cr_assert_eq(a.f32[1], 8.0f);
    clmha__npy_free(&a);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq(sb.st_mode & 0777, 0644);
    cr_assert_eq(tmpdir_count(dir), 1);
    tmpdir_remove(dir);
}

Test(npy_write, missing_folder_is_io_error_and_leaves_nothing) {
    char dir[64], path[160], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-npy");
    snprintf(path, sizeof path, "%s/no/such/folder/d.npy", dir);
    float x = 1.0f;
    const size_t s1[] = {1};
    cr_assert_eq(clmha__npy_write_f32(path, &x, 1, s1, msg, sizeof msg), CLMHA_IO_ERROR);
    cr_assert(strstr(msg, "no/such/folder/d.npy"), "%s", msg);
    cr_assert(strstr(msg, "No such file or directory"), "%s", msg);
    cr_assert_eq(tmpdir_count(dir), 0);
    tmpdir_remove(dir);
}

// The rename fails (the target is a folder): the temporary file is removed.
Test(npy_write, failed_rename_removes_the_temporary_file) {
    char dir[64], path[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-npy");
    snprintf(path, sizeof path, "%s/e.npy", dir);
    cr_assert_eq(mkdir(path, 0755), 0);
    float x = 1.0f;
    const size_t s1[] = {1};
    cr_assert_eq(clmha__npy_write_f32(path, &x, 1, s1, msg, sizeof msg), CLMHA_IO_ERROR);
    cr_assert(strstr(msg, "e.npy"), "%s", msg);
    cr_assert_eq(tmpdir_count(dir), 1, "the temporary file was left behind");
    tmpdir_remove(dir);
}

// An existing FIFO or symbolic link (to /dev/null, to that FIFO) at the path is refused and
// left as it is; nothing else is created.
Test(npy_write, special_files_are_not_replaced, .timeout = 20) {
    char dir[64], path[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-npy");
    const char *names[] = {"fifo", "to-null", "to-fifo"};
    snprintf(path, sizeof path, "%s/fifo", dir);
    cr_assert_eq(mkfifo(path, 0600), 0);
    snprintf(path, sizeof path, "%s/to-null", dir);
    cr_assert_eq(symlink("/dev/null", path), 0);
    snprintf(path, sizeof path, "%s/to-fifo", dir);
    cr_assert_eq(symlink("fifo", path), 0);
    float x = 1.0f;
    const size_t s1[] = {1};
    for (int i = 0; i < 3; ++i) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        cr_expect_eq(clmha__npy_write_f32(path, &x, 1, s1, msg, sizeof msg), CLMHA_IO_ERROR,
                     "%s", path);
        cr_expect(strstr(msg, i ? "symbolic link" : "FIFO"), "%s", msg);
        struct stat sb;
        cr_assert_eq(lstat(path, &sb), 0);
        cr_expect(i ? S_ISLNK(sb.st_mode) : S_ISFIFO(sb.st_mode), "%s was replaced", path);
    }
    cr_assert_eq(tmpdir_count(dir), 3);
    tmpdir_remove(dir);
}

// A 255-byte file name (the longest most file systems allow) is written: the temporary file's
// name is short, not the target's name plus a suffix.
Test(npy_write, longest_file_name) {
    char dir[64], path[512], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-npy");
    int n = snprintf(path, sizeof path, "%s/", dir);
    memset(path + n, 'a', 251);
    memcpy(path + n + 251, ".npy", 5);
    float x = 2.0f;
    const size_t s1[] = {1};
    cr_assert_eq(clmha__npy_write_f32(path, &x, 1, s1, msg, sizeof msg), CLMHA_SUCCESS, "%s",
                 msg);
    clmha__npy a;
    read_ok(path, &a);
    cr_assert_eq(a.f32[0], 2.0f);
    clmha__npy_free(&a);
    cr_assert_eq(tmpdir_count(dir), 1);
    tmpdir_remove(dir);
}

Test(npy_write, bad_arguments) {
    char msg[MSG_SIZE] = "";
    float x = 0.0f;
    const size_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    cr_assert_eq(clmha__npy_write_f32("/tmp/never.npy", &x, 9, nine, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert(strstr(msg, "9 dimensions"), "%s", msg);
    const size_t huge[] = {SIZE_MAX / 2, 3};
    cr_assert_eq(clmha__npy_write_f32("/tmp/never.npy", &x, 2, huge, msg, sizeof msg),
                 CLMHA_SIZE_OVERFLOW);
    const size_t quarter[] = {SIZE_MAX / 4 + 1};
    cr_assert_eq(clmha__npy_write_f32("/tmp/never.npy", &x, 1, quarter, msg, sizeof msg),
                 CLMHA_SIZE_OVERFLOW);
    const size_t three[] = {3};
    cr_assert_eq(clmha__npy_write_f32("/tmp/never.npy", NULL, 1, three, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha__npy_write_f32(NULL, &x, 0, NULL, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha__npy_write_f32("/tmp/never.npy", &x, 1, NULL, NULL, 0),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(access("/tmp/never.npy", F_OK), -1);
}

// float64 files: doubles that no float holds, signed zero, infinities, NaN, the smallest
// subnormal and a value beyond float32's range come back bit for bit through
// clmha__npy_read_f64; clmha__npy_read rounds them to floats and counts the overflow.
Test(npy_write, round_trip_f64) {
    char dir[64], path[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-npy");
    snprintf(path, sizeof path, "%s/d.npy", dir);
    double v[12] = {0.1, -1.0 / 3.0, -0.0, INFINITY, -INFINITY, NAN, 0x1p-1074, 1e300,
                    1.0 + 0x1p-52, -2.5, 0x1.fffffffffffffp1023, 7.0};
    const size_t shape[] = {3, 4};
    cr_assert_eq(clmha__npy_write_f64(path, v, 2, shape, msg, sizeof msg), CLMHA_SUCCESS, "%s",
                 msg);
    cr_assert_eq(tmpdir_count(dir), 1, "a temporary file was left behind");
    size_t size;
    unsigned char *bytes = slurp(path, &size);
    size_t data_at = 10 + (size_t)(bytes[8] | bytes[9] << 8);
    cr_assert_eq(data_at % 64, 0, "data starts at %zu", data_at);
    cr_assert_eq(size, data_at + 8 * 12);
    cr_assert(memcmp(bytes + data_at, v, sizeof v) == 0, "the doubles differ");  // LE host
    free(bytes);

    clmha__npy a;
    char m2[MSG_SIZE] = "";
    cr_assert_eq(clmha__npy_read_f64(path, &a, m2, sizeof m2), CLMHA_SUCCESS, "%s", m2);
    cr_assert_eq(a.kind, CLMHA__NPY_FLOAT);
    cr_assert_str_eq(a.dtype, "<f8");
    assert_shape(&a, 2, shape);
    cr_assert_null(a.f32);
    cr_assert_null(a.u8);
    cr_assert_eq(a.overflowed, 0);
    cr_assert(memcmp(a.f64, v, sizeof v) == 0, "values differ");
    clmha__npy_free(&a);
    assert_zeroed(&a);

    read_ok(path, &a);  // as floats: rounded to nearest, beyond float32's range to inf
    cr_assert_null(a.f64);
    cr_assert_eq(a.f32[0], 0.1f);
    cr_assert_eq(a.f32[6], 0.0f);
    cr_assert(isinf(a.f32[7]) && a.f32[7] > 0);
    cr_assert(isinf(a.f32[10]) && a.f32[10] > 0);
    cr_assert(isnan(a.f32[5]));
    cr_assert_eq(a.overflowed, 2, "overflowed %zu", a.overflowed);  // 1e300 and DBL_MAX
    clmha__npy_free(&a);

    // The temporary-file variant leaves the rename to the caller.
    char *tmp = NULL;
    cr_assert_eq(clmha__npy_write_f64_temp(path, v, 2, shape, &tmp, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    cr_assert_not_null(tmp);
    cr_assert_eq(tmpdir_count(dir), 2);
    cr_assert_eq(rename(tmp, path), 0);
    free(tmp);
    cr_assert_eq(clmha__npy_read_f64(path, &a, m2, sizeof m2), CLMHA_SUCCESS, "%s", m2);
    cr_assert(memcmp(a.f64, v, sizeof v) == 0, "values differ");
    clmha__npy_free(&a);
    tmpdir_remove(dir);
}

// The float64 writer's bytes are exactly NumPy's (np.save of the same float64 array).
Test(npy_write, f64_same_bytes_as_numpy) {
    char dir[64], path[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-npy");
    snprintf(path, sizeof path, "%s/b.npy", dir);
    double v[6];
    for (int i = 0; i < 6; ++i) v[i] = i / 4.0 - 0.5;
    const size_t shape[] = {2, 3};
    cr_assert_eq(clmha__npy_write_f64(path, v, 2, shape, msg, sizeof msg), CLMHA_SUCCESS);
    size_t n1, n2;
    unsigned char *mine = slurp(path, &n1), *theirs = slurp(FIXTURE("f8_2x3.npy"), &n2);
    cr_assert_eq(n1, n2);
    cr_assert(memcmp(mine, theirs, n1) == 0);
    free(mine);
    free(theirs);
    tmpdir_remove(dir);
}

Test(npy_write, f64_bad_arguments) {
    char msg[MSG_SIZE] = "";
    double x = 0.0;
    const size_t three[] = {3}, eighth[] = {SIZE_MAX / 8 + 1};
    cr_assert_eq(clmha__npy_write_f64("/tmp/never.npy", NULL, 1, three, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha__npy_write_f64("/tmp/never.npy", &x, 1, eighth, msg, sizeof msg),
                 CLMHA_SIZE_OVERFLOW);
    char *tmp = (char *)"not reset";
    cr_assert_eq(clmha__npy_write_f64_temp("/tmp/never.npy", NULL, 1, three, &tmp, msg,
                                           sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert_null(tmp);
    cr_assert_eq(access("/tmp/never.npy", F_OK), -1);
}

// ---- files made by NumPy -------------------------------------------------------------------

static void check_arange_f4(const char *file, size_t ndim, const size_t *shape) {
    clmha__npy a;
    read_ok(file, &a);
    cr_assert_eq(a.kind, CLMHA__NPY_FLOAT);
    cr_assert_str_eq(a.dtype, "<f4");
    assert_shape(&a, ndim, shape);
    cr_assert_null(a.u8);
    for (size_t i = 0; i < a.count; ++i)
        cr_assert_eq(a.f32[i], (float)i, "%s element %zu: %g", file, i, (double)a.f32[i]);
    clmha__npy_free(&a);
}

Test(npy_numpy, f4_c_order) {
    const size_t shape[] = {2, 3, 4};
    check_arange_f4(FIXTURE("f4_2x3x4.npy"), 3, shape);
}

Test(npy_numpy, f4_fortran_order_2d) {
    const size_t shape[] = {3, 4};
    check_arange_f4(FIXTURE("f4_fortran_3x4.npy"), 2, shape);
}

Test(npy_numpy, f4_fortran_order_3d) {
    const size_t shape[] = {2, 3, 4};
    check_arange_f4(FIXTURE("f4_fortran_2x3x4.npy"), 3, shape);
}

Test(npy_numpy, format_versions_2_and_3) {
    const size_t s23[] = {2, 3}, s4[] = {4};
    check_arange_f4(FIXTURE("f4_v2_2x3.npy"), 2, s23);
    check_arange_f4(FIXTURE("f4_v3_4.npy"), 1, s4);
}

Test(npy_numpy, f4_scalar_and_empty) {
    clmha__npy a;
    read_ok(FIXTURE("f4_scalar.npy"), &a);
    assert_shape(&a, 0, NULL);
    cr_assert_eq(a.count, 1);
    cr_assert_eq(a.f32[0], 3.5f);
    clmha__npy_free(&a);
    const size_t s03[] = {0, 3};
    read_ok(FIXTURE("f4_0x3.npy"), &a);
    assert_shape(&a, 2, s03);
    clmha__npy_free(&a);
}

Test(npy_numpy, f8_converted_to_float) {
    clmha__npy a;
    read_ok(FIXTURE("f8_2x3.npy"), &a);
    const size_t shape[] = {2, 3};
    assert_shape(&a, 2, shape);
    cr_assert_eq(a.kind, CLMHA__NPY_FLOAT);
    cr_assert_str_eq(a.dtype, "<f8");
    for (size_t i = 0; i < 6; ++i) cr_assert_eq(a.f32[i], (float)i / 4.0f - 0.5f);
    clmha__npy_free(&a);
}

// Read as doubles: NumPy's float64 values exactly, its float32 ones widened, in C order from
// Fortran-order files too; boolean arrays stay bytes.
Test(npy_numpy, read_as_doubles) {
    clmha__npy a;
    char msg[MSG_SIZE] = "";
    cr_assert_eq(clmha__npy_read_f64(FIXTURE("f8_2x3.npy"), &a, msg, sizeof msg), CLMHA_SUCCESS,
                 "%s", msg);
    cr_assert_str_eq(a.dtype, "<f8");
    cr_assert_null(a.f32);
    for (size_t i = 0; i < 6; ++i) cr_assert_eq(a.f64[i], (double)i / 4.0 - 0.5);
    clmha__npy_free(&a);
    cr_assert_eq(clmha__npy_read_f64(FIXTURE("f4_fortran_2x3x4.npy"), &a, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    cr_assert_str_eq(a.dtype, "<f4");
    cr_assert_eq(a.count, 24);
    for (size_t i = 0; i < 24; ++i) cr_assert_eq(a.f64[i], (double)i, "element %zu", i);
    clmha__npy_free(&a);
    cr_assert_eq(clmha__npy_read_f64(FIXTURE("b1_2x3.npy"), &a, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    cr_assert_eq(a.kind, CLMHA__NPY_BOOL);
    cr_assert_null(a.f64);
    cr_assert_not_null(a.u8);
    clmha__npy_free(&a);
    // A refused file leaves nothing, as clmha__npy_read does.
    memset(&a, 0xA5, sizeof a);
    cr_assert_eq(clmha__npy_read_f64(FIXTURE("i8_3.npy"), &a, msg, sizeof msg),
                 CLMHA_INVALID_FILE);
    cr_assert(strstr(msg, "'<i8' is not supported"), "%s", msg);
    assert_zeroed(&a);
}

Test(npy_numpy, bool_and_uint8) {
    clmha__npy a;
    read_ok(FIXTURE("b1_2x3.npy"), &a);
    const size_t s23[] = {2, 3}, s5[] = {5};
    assert_shape(&a, 2, s23);
    cr_assert_eq(a.kind, CLMHA__NPY_BOOL);
    cr_assert_str_eq(a.dtype, "|b1");
    cr_assert_null(a.f32);
    const unsigned char b[6] = {1, 0, 1, 0, 0, 1};
    cr_assert(memcmp(a.u8, b, 6) == 0);
    clmha__npy_free(&a);

    read_ok(FIXTURE("u1_5.npy"), &a);
    assert_shape(&a, 1, s5);
    cr_assert_eq(a.kind, CLMHA__NPY_BOOL);
    cr_assert_str_eq(a.dtype, "|u1");
    const unsigned char u[5] = {0, 50, 100, 150, 200};
    cr_assert(memcmp(a.u8, u, 5) == 0);
    clmha__npy_free(&a);
}

static void expect_file_refused(const char *file, const char *part) {
    clmha__npy a;
    memset(&a, 0xA5, sizeof a);
    char msg[MSG_SIZE] = "";
    cr_assert_eq(clmha__npy_read(file, &a, msg, sizeof msg), CLMHA_INVALID_FILE, "%s", msg);
    cr_assert(strstr(msg, file), "message '%s' does not name the file", msg);
    cr_assert(strstr(msg, part), "message '%s' lacks '%s'", msg, part);
    assert_zeroed(&a);
}

Test(npy_numpy, refused_kinds) {
    expect_file_refused(FIXTURE("f4_big_endian.npy"), "'>f4' is big-endian");
    expect_file_refused(FIXTURE("i8_3.npy"), "dtype '<i8' is not supported");
    expect_file_refused(FIXTURE("object_3.npy"), "'|O': object arrays are not supported");
    expect_file_refused(FIXTURE("structured_2.npy"), "structured dtypes are not supported");
}

// ---- reading errors ------------------------------------------------------------------------

Test(npy_read, missing_file) {
    clmha__npy a;
    memset(&a, 0xA5, sizeof a);
    char msg[MSG_SIZE] = "";
    const char *path = "/tmp/clmha-no-such-dir/x.npy";
    cr_assert_eq(clmha__npy_read(path, &a, msg, sizeof msg), CLMHA_IO_ERROR);
    cr_assert(strstr(msg, path), "%s", msg);
    cr_assert(strstr(msg, "No such file or directory"), "%s", msg);
    assert_zeroed(&a);
}

Test(npy_read, folder) {
    clmha__npy a;
    memset(&a, 0xA5, sizeof a);
    char msg[MSG_SIZE] = "";
    cr_assert_eq(clmha__npy_read(CLMHA_TEST_DATA_DIR, &a, msg, sizeof msg), CLMHA_IO_ERROR);
    cr_assert(strstr(msg, "Is a directory"), "%s", msg);
    assert_zeroed(&a);
}

// Only a regular file is read: a FIFO without a writer, /dev/zero and /dev/null are refused at
// once (not a hang, not a buffer growing without bound, not an "empty file").
Test(npy_read, special_files_refused_at_once, .timeout = 20) {
    char dir[64], fifo[128], msg[MSG_SIZE] = "";
    tmpdir_make(dir, sizeof dir, "clmha-npy");
    snprintf(fifo, sizeof fifo, "%s/fifo.npy", dir);
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    const char *paths[] = {fifo, "/dev/zero", "/dev/null"};
    const char *kinds[] = {"FIFO", "character device", "character device"};
    for (int i = 0; i < 3; ++i) {
        clmha__npy a;
        memset(&a, 0xA5, sizeof a);
        cr_expect_eq(clmha__npy_read(paths[i], &a, msg, sizeof msg), CLMHA_IO_ERROR, "%s: %s",
                     paths[i], msg);
        cr_expect(strstr(msg, paths[i]) && strstr(msg, kinds[i]), "%s", msg);
        assert_zeroed(&a);
    }
    tmpdir_remove(dir);
}

Test(npy_read, malformed_file_names_its_path) {
    char dir[64], path[128];
    tmpdir_make(dir, sizeof dir, "clmha-npy");
    snprintf(path, sizeof path, "%s/short.npy", dir);
    unsigned char buf[256];
    size_t size =
        build(buf, sizeof buf, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,)}\n", 8);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(buf, 1, size, f), size);
    fclose(f);
    expect_file_refused(path, "truncated: expected 12 bytes of data, found 8");
    tmpdir_remove(dir);
}

Test(npy_read, bad_arguments) {
    char msg[MSG_SIZE] = "";
    clmha__npy a;
    cr_assert_eq(clmha__npy_read(NULL, &a, msg, sizeof msg), CLMHA_INVALID_ARGUMENT);
    assert_zeroed(&a);
    cr_assert_eq(clmha__npy_read(FIXTURE("f4_2x3x4.npy"), NULL, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha__npy_parse(NULL, 10, "x", &a, msg, sizeof msg), CLMHA_INVALID_ARGUMENT);
    clmha__npy_free(NULL);
    clmha__npy_free(&a);
}

// ---- malformed bytes -----------------------------------------------------------------------

#define GOOD_HEADER "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }\n"

Test(npy_parse, empty) { expect_refused("", 0, CLMHA_INVALID_FILE, "empty file"); }

Test(npy_parse, bad_magic) {
    unsigned char buf[256];
    size_t size = build(buf, sizeof buf, GOOD_HEADER, 12);
    buf[5] = 'Z';
    expect_refused(buf, size, CLMHA_INVALID_FILE, "not a .npy file");
    expect_refused("PK\x03\x04", 4, CLMHA_INVALID_FILE, "not a .npy file");
    expect_refused("\x93NUM", 4, CLMHA_INVALID_FILE, "truncated header");
}

Test(npy_parse, truncated_header) {
    unsigned char buf[256];
    build(buf, sizeof buf, GOOD_HEADER, 12);
    expect_refused(buf, 7, CLMHA_INVALID_FILE, "truncated header");
    expect_refused(buf, 9, CLMHA_INVALID_FILE, "truncated header");
    size_t size = build_version(buf, sizeof buf, 2, GOOD_HEADER, 12);
    (void)size;
    expect_refused(buf, 11, CLMHA_INVALID_FILE, "truncated header");
}

Test(npy_parse, header_length_past_the_end) {
    unsigned char buf[256];
    size_t size = build(buf, sizeof buf, GOOD_HEADER, 0);
    expect_refused(buf, size - 1, CLMHA_INVALID_FILE, "runs past the end of the file");
    size = build_version(buf, sizeof buf, 2, GOOD_HEADER, 0);
    buf[11] = 0x80;  // a 2 GiB header
    expect_refused(buf, size, CLMHA_INVALID_FILE, "header length 2147483706 runs past the end");
}

Test(npy_parse, versions) {
    unsigned char buf[256];
    size_t size = build(buf, sizeof buf, GOOD_HEADER, 12);
    buf[6] = 4;
    expect_refused(buf, size, CLMHA_INVALID_FILE, "unsupported .npy format version 4.0");
    buf[6] = 1;
    buf[7] = 1;
    expect_refused(buf, size, CLMHA_INVALID_FILE, "version 1.1");
    buf[6] = 0;
    buf[7] = 0;
    expect_refused(buf, size, CLMHA_INVALID_FILE, "version 0.0");

    clmha__npy a;
    char msg[MSG_SIZE];
    for (unsigned major = 2; major <= 3; ++major) {
        size = build_version(buf, sizeof buf, major, GOOD_HEADER, 12);
        cr_assert_eq(clmha__npy_parse(buf, size, "v", &a, msg, sizeof msg), CLMHA_SUCCESS, "%s",
                     msg);
        cr_assert_eq(a.count, 3);
        clmha__npy_free(&a);
        // a version 2/3 file read as if its length were 2 bytes is refused, not misread
        buf[6] = 1;
        expect_refused(buf, size, CLMHA_INVALID_FILE, "malformed header");
    }
}

Test(npy_parse, nul_in_header) {
    unsigned char buf[256];
    size_t size = build(buf, sizeof buf, GOOD_HEADER, 12);
    buf[10 + 20] = '\0';
    expect_refused(buf, size, CLMHA_INVALID_FILE, "NUL byte");
}

Test(npy_parse, header_grammar) {
    const struct {
        const char *header;
        const char *part;
    } rows[] = {
        {"['descr', '<f4']\n", "not a dict"},
        {"", "not a dict"},
        {"{'fortran_order': False, 'shape': (3,), }\n", "missing key 'descr'"},
        {"{'descr': '<f4', 'shape': (3,), }\n", "missing key 'fortran_order'"},
        {"{'descr': '<f4', 'fortran_order': False}\n", "missing key 'shape'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'x': 1}\n",
         "unexpected key 'x'"},
        {"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (3,)}\n",
         "key 'descr' appears twice"},
        {"{descr: '<f4', 'fortran_order': False, 'shape': (3,)}\n", "expected a quoted key"},
        {"{'descr: '<f4', 'fortran_order': False, 'shape': (3,)}\n", "unexpected key 'descr: '"},
        {"{'descr' '<f4', 'fortran_order': False, 'shape': (3,)}\n", "expected ':'"},
        {"{'descr': '<f4' 'fortran_order': False, 'shape': (3,)}\n", "expected ',' or '}'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,)\n", "expected ',' or '}'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,)}} \n", "unexpected text"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,)} x\n", "unexpected text"},
        {"{'descr': '<f\\x34', 'fortran_order': False, 'shape': (3,)}\n",
         "'descr' is not a string"},
        {"{'descr': 4, 'fortran_order': False, 'shape': (3,)}\n", "'descr' is not a string"},
        {"{'descr': '<f4', 'fortran_order': 0, 'shape': (3,)}\n",
         "'fortran_order' is not True or False"},
        {"{'descr': '<f4', 'fortran_order': Falsey, 'shape': (3,)}\n",
         "'fortran_order' is not True or False"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (3)}\n", "'shape' is not a tuple"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': [3]}\n", "'shape' is not a tuple"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': 3}\n", "'shape' is not a tuple"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,,)}\n", "expected a dimension"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (,)}\n", "expected a dimension"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (3 4)}\n",
         "expected ',' or ')' in 'shape'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (3.0,)}\n",
         "expected ',' or ')' in 'shape'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (-3,)}\n",
         "negative dimension in 'shape'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1)}\n",
         "more than 8 dimensions"},
        {"{,}\n", "expected a quoted key"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; ++i)
        expect_header_refused(rows[i].header, 12, CLMHA_INVALID_FILE, rows[i].part);
}

Test(npy_parse, sizes_that_overflow) {
    expect_header_refused(
        "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,)}\n", 12,
        CLMHA_SIZE_OVERFLOW, "dimension 99999999999999999999999 in 'shape' is too large");
    expect_header_refused(
        "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 2)}\n", 12,
        CLMHA_SIZE_OVERFLOW, "number of elements of 'shape' overflows");
    expect_header_refused(
        "{'descr': '<f8', 'fortran_order': False, 'shape': (2305843009213693952,)}\n", 12,
        CLMHA_SIZE_OVERFLOW, "data size overflows");
    // huge but representable: simply truncated
    expect_header_refused(
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 1000000000)}\n", 12,
        CLMHA_INVALID_FILE, "truncated: expected 4000000000000000000 bytes of data, found 12");
}

Test(npy_parse, data_size) {
    expect_header_refused(GOOD_HEADER, 8, CLMHA_INVALID_FILE,
                          "truncated: expected 12 bytes of data, found 8");
    expect_header_refused(GOOD_HEADER, 0, CLMHA_INVALID_FILE,
                          "truncated: expected 12 bytes of data, found 0");
    expect_header_refused(GOOD_HEADER, 16, CLMHA_INVALID_FILE,
                          "4 trailing bytes after the 12 bytes of data");
    expect_header_refused("{'descr': '<f4', 'fortran_order': False, 'shape': (0,)}\n", 1,
                          CLMHA_INVALID_FILE, "1 trailing bytes");
}

Test(npy_parse, refused_dtypes) {
    const struct {
        const char *descr;
        const char *part;
    } rows[] = {
        {"'>f4'", "dtype '>f4' is big-endian"},
        {"'>f8'", "dtype '>f8' is big-endian"},
        {"'<i8'", "dtype '<i8' is not supported"},
        {"'|i1'", "dtype '|i1' is not supported"},
        {"'<i4'", "dtype '<i4' is not supported"},
        {"'>f2'", "dtype '>f2' is big-endian"},
        {"'<f16'", "dtype '<f16' is not supported"},
        {"'|f4'", "dtype '|f4' is not supported"},
        {"'<c8'", "dtype '<c8' is not supported"},
        {"'<U3'", "dtype '<U3' is not supported"},
        {"'float32'", "dtype 'float32' is not supported"},
        {"''", "dtype '' is not supported"},
        {"'|O'", "object arrays are not supported"},
        {"'O'", "object arrays are not supported"},
        {"[('a', '<f4')]", "structured dtypes are not supported"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; ++i) {
        char header[256];
        snprintf(header, sizeof header, "{'descr': %s, 'fortran_order': False, 'shape': (3,)}\n",
                 rows[i].descr);
        expect_header_refused(header, 12, CLMHA_INVALID_FILE, rows[i].part);
    }
}

// ---- accepted variations -------------------------------------------------------------------

Test(npy_parse, header_variations) {
    const char *headers[] = {
        "{\"shape\":(2,3),\"fortran_order\":False,\"descr\":\"<f4\"}",
        "  {\t'fortran_order' : False ,\n'descr':'<f4',  'shape' : ( 2 , 3 , ) , }   \n",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }\n",
        "{'descr': '=f4', 'fortran_order': False, 'shape': (2, 3), }\n",
        "{'descr': 'f4', 'fortran_order': False, 'shape': (2, 3), }\n",
    };
    for (size_t i = 0; i < sizeof headers / sizeof headers[0]; ++i) {
        clmha__npy a;
        parse_ok(headers[i], 24, &a);
        const size_t shape[] = {2, 3};
        assert_shape(&a, 2, shape);
        cr_assert_eq(a.kind, CLMHA__NPY_FLOAT);
        // bytes 0..3 little-endian: 0x03020100
        uint32_t u;
        memcpy(&u, &a.f32[0], 4);
        cr_assert_eq(u, 0x03020100u, "header %zu", i);
        clmha__npy_free(&a);
    }
}

Test(npy_parse, one_byte_dtypes_and_f8) {
    const char *descrs[] = {"'|b1'", "'<b1'", "'|u1'", "'<u1'", "'=u1'", "'u1'"};
    for (size_t i = 0; i < sizeof descrs / sizeof descrs[0]; ++i) {
        char header[256];
        snprintf(header, sizeof header, "{'descr': %s, 'fortran_order': False, 'shape': (4,)}\n",
                 descrs[i]);
        clmha__npy a;
        parse_ok(header, 4, &a);
        cr_assert_eq(a.kind, CLMHA__NPY_BOOL);
        cr_assert_null(a.f32);
        const unsigned char expect[4] = {0, 1, 2, 3};
        cr_assert(memcmp(a.u8, expect, 4) == 0);
        clmha__npy_free(&a);
    }
    clmha__npy a;
    parse_ok("{'descr': 'f8', 'fortran_order': False, 'shape': (1,)}\n", 8, &a);
    cr_assert_eq(a.kind, CLMHA__NPY_FLOAT);
    cr_assert_eq(a.count, 1);
    clmha__npy_free(&a);
}

// float16: the bytes 0, 1, ... 5 are the halves 0x0100 and 0x0302 (subnormals: 256 and 770
// times 2^-24) and 0x0504 (2^-14 (1 + 260/1024)), widened exactly.
Test(npy_parse, f2) {
    clmha__npy a;
    parse_ok("{'descr': '<f2', 'fortran_order': False, 'shape': (3,)}\n", 6, &a);
    cr_assert_eq(a.kind, CLMHA__NPY_FLOAT);
    cr_assert_str_eq(a.dtype, "<f2");
    cr_assert_eq(a.count, 3);
    cr_expect_eq(a.f32[0], ldexpf(256.0f, -24));
    cr_expect_eq(a.f32[1], ldexpf(770.0f, -24));
    cr_expect_eq(a.f32[2], ldexpf(1.0f + 260.0f / 1024.0f, -14));
    clmha__npy_free(&a);
}

// Parsed as doubles: float16 bytes widen exactly (the same halves as above), and a float64
// value that no float holds is kept; malformed data is refused with nothing left.
Test(npy_parse, f2_and_f8_as_doubles) {
    unsigned char buf[1024];
    size_t size = build(buf, sizeof buf, "{'descr': '<f2', 'fortran_order': False, "
                                         "'shape': (3,)}\n", 6);
    clmha__npy a;
    char msg[MSG_SIZE] = "";
    cr_assert_eq(clmha__npy_parse_f64(buf, size, "mem.npy", &a, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    cr_assert_null(a.f32);
    cr_expect_eq(a.f64[0], ldexp(256.0, -24));
    cr_expect_eq(a.f64[1], ldexp(770.0, -24));
    cr_expect_eq(a.f64[2], ldexp(1.0 + 260.0 / 1024.0, -14));
    clmha__npy_free(&a);

    size = build(buf, sizeof buf, "{'descr': '<f8', 'fortran_order': False, 'shape': (1,)}\n",
                 0);
    const double third = 1.0 / 3.0;
    memcpy(buf + size, &third, 8);  // the test host is little-endian
    cr_assert_eq(clmha__npy_parse_f64(buf, size + 8, "mem.npy", &a, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    cr_assert_eq(a.f64[0], third);
    cr_assert_neq(a.f64[0], (double)(float)third);
    clmha__npy_free(&a);

    memset(&a, 0xA5, sizeof a);
    cr_assert_eq(clmha__npy_parse_f64(buf, size + 7, "mem.npy", &a, msg, sizeof msg),
                 CLMHA_INVALID_FILE);
    cr_assert(strstr(msg, "truncated"), "%s", msg);
    assert_zeroed(&a);
}

// Fortran order for every rank up to 8, against an index computation done here.
Test(npy_parse, fortran_order_any_rank) {
    for (size_t ndim = 0; ndim <= CLMHA__NPY_MAX_DIMS; ++ndim) {
        size_t shape[CLMHA__NPY_MAX_DIMS], count = 1;
        for (size_t k = 0; k < ndim; ++k) {
            shape[k] = 1 + (k * 5 + 2) % 3;  // 3, 1, 2, 3, 1, 2, ...
            count *= shape[k];
        }
        char header[256];
        int n = snprintf(header, sizeof header,
                         "{'descr': '<f4', 'fortran_order': True, 'shape': (");
        for (size_t k = 0; k < ndim; ++k)
            n += snprintf(header + n, sizeof header - (size_t)n, "%zu,", shape[k]);
        snprintf(header + n, sizeof header - (size_t)n, ")}\n");
        // element with Fortran linear index f holds the value f
        unsigned char buf[4096];
        size_t hlen = strlen(header);
        size_t size = build(buf, sizeof buf, header, 0);
        cr_assert_eq(size, 10 + hlen);
        for (size_t f = 0; f < count; ++f) {
            float v = (float)f;
            memcpy(buf + size + 4 * f, &v, 4);  // the test host is little-endian
        }
        clmha__npy a;
        char msg[MSG_SIZE];
        cr_assert_eq(clmha__npy_parse(buf, size + 4 * count, "f", &a, msg, sizeof msg),
                     CLMHA_SUCCESS, "%s", msg);
        cr_assert_eq(a.count, count);
        for (size_t c = 0; c < count; ++c) {
            // C-order index c -> multi-index -> Fortran linear index
            size_t rest = c, idx[CLMHA__NPY_MAX_DIMS];
            for (size_t k = ndim; k-- > 0;) {
                idx[k] = rest % shape[k];
                rest /= shape[k];
            }
            size_t f = 0;
            for (size_t k = ndim; k-- > 0;) f = f * shape[k] + idx[k];
            cr_assert_eq(a.f32[c], (float)f, "ndim %zu element %zu", ndim, c);
        }
        clmha__npy_free(&a);
    }
}

Test(npy_parse, message_buffer_optional) {
    clmha__npy a;
    cr_assert_eq(clmha__npy_parse("", 0, NULL, &a, NULL, 0), CLMHA_INVALID_FILE);
    char tiny[4] = "xxx";
    cr_assert_eq(clmha__npy_parse("", 0, "name", &a, tiny, sizeof tiny), CLMHA_INVALID_FILE);
    cr_assert_str_eq(tiny, "nam");
}
