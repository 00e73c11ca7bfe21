// CLBlast's HGEMM against its SGEMM on the device, side by side: whether a 16-bit layer would
// gain from half-precision products where the device has cl_khr_fp16 (include/clmha.h,
// clmha_dtype: 16-bit layers compute in float32 everywhere today).
//
// usage: hgemm_ratio [--reps R]
// The device is $CLMHA_DEVICE's (clmha_context_create_from_env()). For each shape, the two
// products run in turns, R rounds (default 15), each call timed on the host clock with
// clFinish; prints the median of each, their ratio, and the HGEMM result's max |error| against
// a double-precision product of the same (float16) operands, next to SGEMM's: HGEMM
// accumulates in half precision, so its error grows with k where SGEMM's stays at float32's.
// The operands are uniform in [-1, 1] (exact in float16), row-major, C = A·Bᵀ as the
// projections (m rows of k features against n weight rows). Exit status: 0 done, 1 setup error,
// 2 the device has no cl_khr_fp16.
#define _POSIX_C_SOURCE 200809L
#include <clmha.h>

#include <clblast_c.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/half.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, size_t n) {
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// A buffer holding @p bytes copied from @p host.
static cl_mem upload(cl_context c, const void *host, size_t bytes) {
    cl_int err;
    cl_mem m = clCreateBuffer(c, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, bytes, (void *)host,
                              &err);
    return err == CL_SUCCESS ? m : NULL;
}

typedef struct shape {
    const char *name;
    size_t m, n, k;
} shape;

int main(int argc, char **argv) {
    size_t reps = 15;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            reps = (size_t)strtoul(argv[++i], NULL, 10);
        } else {
            fprintf(stderr, "usage: %s [--reps R]\n", argv[0]);
            return 1;
        }
    }
    if (!reps) reps = 1;
    clmha_context *ctx;
    if (clmha_context_create_from_env(&ctx)) {
        fprintf(stderr, "hgemm_ratio: %s\n", clmha_last_create_error());
        return 1;
    }
    cl_device_id dev = clmha_context_cl_device(ctx);
    char ext[8192] = "";
    clGetDeviceInfo(dev, CL_DEVICE_EXTENSIONS, sizeof ext - 1, ext, NULL);
    printf("device: %s\n", clmha_context_device_name(ctx));
    if (!strstr(ext, "cl_khr_fp16")) {
        printf("no cl_khr_fp16: nothing to compare\n");
        clmha_context_release(ctx);
        return 2;
    }
    cl_context cc = clmha_context_cl_context(ctx);
    cl_command_queue q = clmha_context_cl_queue(ctx);
    // The products of a layer with E 512 at N·L = 1024 rows: the packed QKV projection, the
    // output projection, and one head's scores (D 64) over 1024 keys.
    const shape shapes[] = {{"QKV projection", 1024, 1536, 512},
                            {"output projection", 1024, 512, 512},
                            {"scores, one head", 1024, 1024, 64}};
    int status = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0] && !status; ++si) {
        const shape *s = &shapes[si];
        size_t na = s->m * s->k, nb = s->n * s->k, nc = s->m * s->n;
        float *af = malloc(na * 4), *bf = malloc(nb * 4), *cf = malloc(nc * 4);
        uint16_t *ah = malloc(na * 2), *bh = malloc(nb * 2), *ch = malloc(nc * 2);
        double *times = malloc(2 * reps * sizeof *times);
        if (!af || !bf || !cf || !ah || !bh || !ch || !times) return 1;
        uint64_t x = 88172645463325252ull + si;
        for (size_t i = 0; i < na + nb; ++i) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            // Multiples of 2^-10 in [-1, 1): exact in float16 and float32.
            float v = (float)((int)(x % 2048) - 1024) / 1024.0f;
            if (i < na) af[i] = v, ah[i] = clmha__f32_to_f16(v);
            else bf[i - na] = v, bh[i - na] = clmha__f32_to_f16(v);
        }
        cl_mem a32 = upload(cc, af, na * 4), b32 = upload(cc, bf, nb * 4),
               c32 = upload(cc, cf, nc * 4), a16 = upload(cc, ah, na * 2),
               b16 = upload(cc, bh, nb * 2), c16 = upload(cc, ch, nc * 2);
        if (!a32 || !b32 || !c32 || !a16 || !b16 || !c16) return 1;
        // Row-major C (m, n) = A (m, k) · B (n, k)ᵀ.
        for (size_t r = 0; r <= reps && !status; ++r) {  // round 0: warm-up (kernel builds)
            for (int h = 0; h < 2; ++h) {
                int which = (int)((r + (size_t)h) % 2);  // alternate the order
                double t0 = now_ms();
                CLBlastStatusCode st =
                    which ? CLBlastHgemm(CLBlastLayoutRowMajor, CLBlastTransposeNo,
                                         CLBlastTransposeYes, s->m, s->n, s->k, 0x3C00, a16, 0,
                                         s->k, b16, 0, s->k, 0, c16, 0, s->n, &q, NULL)
                          : CLBlastSgemm(CLBlastLayoutRowMajor, CLBlastTransposeNo,
                                         CLBlastTransposeYes, s->m, s->n, s->k, 1.0f, a32, 0,
                                         s->k, b32, 0, s->k, 0.0f, c32, 0, s->n, &q, NULL);
                clFinish(q);
                if (st != CLBlastSuccess) {
                    fprintf(stderr, "hgemm_ratio: CLBlast%cgemm failed (%d)\n",
                            which ? 'H' : 'S', (int)st);
                    status = 1;
                    break;
                }
                if (r) times[which * reps + r - 1] = now_ms() - t0;
            }
        }
        if (!status) {
            clEnqueueReadBuffer(q, c32, CL_TRUE, 0, nc * 4, cf, 0, NULL, NULL);
            clEnqueueReadBuffer(q, c16, CL_TRUE, 0, nc * 2, ch, 0, NULL, NULL);
            double err32 = 0, err16 = 0, cmax = 0;
            for (size_t i = 0; i < s->m; ++i)
                for (size_t j = 0; j < s->n; ++j) {
                    double ref = 0;
                    for (size_t t = 0; t < s->k; ++t)
                        ref += (double)af[i * s->k + t] * bf[j * s->k + t];
                    cmax = fmax(cmax, fabs(ref));
                    err32 = fmax(err32, fabs(cf[i * s->n + j] - ref));
                    err16 = fmax(err16, fabs(clmha__f16_to_f32(ch[i * s->n + j]) - ref));
                }
            double ms32 = median(times, reps), ms16 = median(times + reps, reps);
            double gflop = 2.0 * s->m * s->n * s->k / 1e9;
            printf("%-18s m %4zu n %4zu k %4zu: sgemm %8.3f ms (%6.1f GFLOP/s), hgemm %8.3f ms "
                   "(%6.1f GFLOP/s), hgemm/sgemm time %.2f; max |error| sgemm %.2e, hgemm %.2e "
                   "(max |C| %.1f)\n",
                   s->name, s->m, s->n, s->k, ms32, gflop / ms32 * 1e3, ms16,
                   gflop / ms16 * 1e3, ms16 / ms32, err32, err16, cmax);
        }
        clReleaseMemObject(a32), clReleaseMemObject(b32), clReleaseMemObject(c32);
        clReleaseMemObject(a16), clReleaseMemObject(b16), clReleaseMemObject(c16);
        free(af), free(bf), free(cf), free(ah), free(bh), free(ch), free(times);
    }
    clmha_context_release(ctx);
    return status;
}
