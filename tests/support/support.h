// What the test files share (libuv's task.h): a context on $CLMHA_DEVICE or a skipped test,
// temporary folders, deterministic random data, error metrics, the case stride of the
// PyTorch-case suites and the reference counts of the caller's OpenCL objects.
//
// Built once into the static library clmha_test_support (tests/CMakeLists.txt) that every test
// links. Uses Criterion (a failed check fails the calling test) and clmha's public API only;
// what needs the library's internals is in support_internal.h.
#ifndef CLMHA_TESTS_SUPPORT_H
#define CLMHA_TESTS_SUPPORT_H

#include <clmha.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// ---- device -------------------------------------------------------------------------------------

// A context on $CLMHA_DEVICE (clmha_context_create_from_env). Skips the calling test when there
// is no OpenCL device; fails it on any other error.
clmha_context *context_or_skip(void);

// Whether the device of @p ctx has double precision (CL_DEVICE_DOUBLE_FP_CONFIG not 0; an OpenCL
// 1.1 device without cl_khr_fp64 may refuse the query, which means none too): float64 layers,
// calls and caches need it.
bool has_fp64(clmha_context *ctx);

// context_or_skip() on a device with double precision; skips the calling test elsewhere.
clmha_context *fp64_context_or_skip(void);

// ---- temporary folders and files ----------------------------------------------------------------

// Makes a fresh folder "/tmp/<prefix>-XXXXXX" and writes its path to @p dir (@p size bytes; 64
// is enough for a short prefix). Fails the test when it cannot.
void tmpdir_make(char *dir, size_t size, const char *prefix);

// Number of entries of @p dir (without . and ..); their names, separated by spaces, go to
// @p names when it is not NULL. Fails the test when the folder cannot be read.
size_t tmpdir_list(const char *dir, char *names, size_t names_size);

// tmpdir_list(dir, NULL, 0).
size_t tmpdir_count(const char *dir);

// Removes @p dir with everything in it (subfolders too). Quiet when it is already gone.
void tmpdir_remove(const char *dir);

// Writes @p size bytes to @p path (created or truncated). Fails the test when it cannot.
void write_bytes(const char *path, const void *bytes, size_t size);

// The whole file @p path, malloc'd and NUL-terminated (its size, without the NUL, goes to
// @p size when not NULL); NULL when it cannot be read.
char *read_file(const char *path, size_t *size);

// ---- random data --------------------------------------------------------------------------------

// splitmix64 numbers: deterministic, the same on every platform.
typedef struct prng {
    uint64_t state;
} prng;

uint64_t prng_next(prng *r);

// Uniform in [0, 1).
double prng_uniform(prng *r);

// Uniform integer in [lo, hi].
size_t prng_range(prng *r, size_t lo, size_t hi);

bool prng_bool(prng *r);

// Standard normal (Box-Muller).
double prng_normal(prng *r);

// malloc'd room for @p count floats (at least one); fails the test when out of memory.
float *alloc_floats(size_t count);

// @p count floats uniform in [-bound, bound) (malloc'd).
float *uniform_floats(prng *r, size_t count, double bound);

// @p count standard normal floats (malloc'd).
float *normal_floats(prng *r, size_t count);

// A 64-bit LCG's next number, as a float uniform in [-1, 1): the small fixed-size suites' data.
float frand(uint64_t *state);

// ---- error metrics ------------------------------------------------------------------------------

// Largest |got[i] - want[i]|; a NaN or infinite difference counts as +inf.
double max_abs_err(const float *got, const double *want, size_t count);

// max_abs_err for double results.
double max_abs_err_d(const double *got, const double *want, size_t count);

// Largest |x[i]| (NaN is ignored).
double max_abs_of(const double *x, size_t count);

// Largest |a[i] - b[i]| of two float arrays; a NaN or infinite difference counts as +inf.
double max_abs_diff(const float *a, const float *b, size_t count);

// Seconds on the monotonic clock since an arbitrary start (for the tests' time limits).
double now_seconds(void);

// A context (or the test skipped without a device) and a fresh temporary folder: the state of
// the file tests (test_safetensors, test_load_options).
typedef struct test_env {
    clmha_context *ctx;
    char dir[64];
} test_env;
void test_env_open(test_env *e, const char *prefix);
// Removes the folder and releases the context.
void test_env_close(test_env *e);

// Max absolute error (as max_abs_err) and normalised mean squared error, sum (got - want)^2 /
// sum want^2 (the plain sum when want is all zero): ggml's test-backend-ops compares by NMSE.
typedef struct error_stats {
    double max_abs, nmse;
} error_stats;

error_stats error_stats_of(const float *got, const double *want, size_t count);

// ---- user functions in OpenCL C and their host forms ------------------------------------------

// A user score function, its derivative and a mask function (clmha_layer_desc::mod_source) that
// reproduce no built-in variant: s + p0 sin s + p1 (h + 1) cos(p2 (q - k)) + p3 b, and a mask
// that forbids key k of query q where (q + 2k + h + b) mod 5 = 4, except key 0 (no row is fully
// masked). p holds USER_TEST_PARAMS floats (user_test_params()); the test_user_* functions are
// their host forms (clmha_reference_params::score_mod, ...), for the CPU reference.
#define USER_TEST_PARAMS 4
extern const char user_test_source[];
extern const float user_test_params[USER_TEST_PARAMS];
double test_user_score(double s, int b, int h, int q, int k, const float *p);
double test_user_score_grad(double s, int b, int h, int q, int k, const float *p);
int test_user_mask(int b, int h, int q, int k, const float *p);

// ---- case stride --------------------------------------------------------------------------------

// CLMHA_TEST_CASE_STRIDE=K or K:O (K >= 1, 0 <= O < K): the PyTorch-case suites (test_golden,
// test_cli) run only cases O, O+K, O+2K, ... of their list. For driver lanes where every case
// costs a full compile of CLBlast's kernels (Intel's CPU runtime keeps no program cache):
// .ci/run's Intel lane. Unset or empty: every case.
typedef struct case_stride {
    size_t k, o;
} case_stride;

// The stride from the environment; an unreadable value stops the suite (exit status 2) rather
// than silently running another subset. @p suite and @p total name what is selected on stderr.
case_stride case_stride_get(const char *suite, size_t total);

bool case_stride_keeps(case_stride s, size_t i);

// Frees the parameter array of a parameterized suite (cr_make_param_array's cleanup), which the
// suite allocated with cr_malloc.
struct criterion_test_params;
void case_params_free(struct criterion_test_params *crp);

// ---- reference counts of the caller's OpenCL objects --------------------------------------------
//
// Drivers differ in what CL_*_REFERENCE_COUNT reports (tools/driver-probes/refcounts.c shows it):
// - PoCL: exact, and every cl_mem, command queue, cl_program and cl_kernel holds its context, so
//   the context's count shows any object left behind.
// - Mesa's rusticl: the same, but its queue's worker thread drops references to the context up
//   to ~0.5 s after the release call returned. refs_settled() waits (up to 5 s) for a count.
// - Intel's CPU runtime (2026.2): clRetain/clRelease move the count, but a cl_mem or queue does
//   not hold its context, so the context's count never shows an object left behind
//   (context_refs_show_objects() finds this out).
// - A driver whose count does not move on clRetain (none of the four lanes' drivers) is found
//   by refs_move().
// Checks therefore (a) always compare clmha's own counts of the OpenCL objects it holds
// (support_internal.h) with what they must be, and (b) compare the driver's count after waiting
// for it to settle where it means something, and say on stderr where it does not, so that no
// check passes vacuously in silence.

typedef enum ref_kind { REF_CONTEXT, REF_QUEUE, REF_EVENT } ref_kind;

// The driver's reference count of @p object (a cl_context, cl_command_queue or cl_event).
cl_uint refs_of(ref_kind kind, const void *object);

// The reference count of @p object once it has stayed the same for five reads 10 ms apart (at
// most 2 s): a driver may drop the references of finished commands a moment after they finish
// (Mesa rusticl once read 22, then 21, right after a clFinish).
cl_uint refs_steady(ref_kind kind, const void *object);

// Polls the reference count of @p object every 10 ms until it equals @p want, for up to 5 s;
// returns the last count read.
cl_uint refs_settled(ref_kind kind, const void *object, cl_uint want);

// true when retaining @p object once raises its reported reference count by one (checked up to
// three times, in case a late release of the driver's own lands in between); the object is left
// as it was. On false, says on stderr that the driver's counts of this kind cannot be checked.
bool refs_move(ref_kind kind, const void *object);

// true when a cl_mem created on @p context raises the context's reference count (PoCL, rusticl),
// so that the count shows objects left behind; the buffer is released again. On false, says on
// stderr that the context's count cannot show a leaked object.
bool context_refs_show_objects(cl_context context);

// Asserts that the reference count of @p object comes back to @p want (waiting for it to
// settle) when @p counts_move, the result of refs_move() on the same object.
void assert_refs_back(ref_kind kind, const void *object, bool counts_move, cl_uint want,
                      const char *when);

#endif  // CLMHA_TESTS_SUPPORT_H
