// GEMM tuning (see tuning.h): parameter sets, the per-device registry, tuning files, import and
// export, and the search of clmha_context_tune().
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

#include "tuning.h"

#include "base/file_write.h"
#include "base/struct_in.h"

#include "layer.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
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
#define PARAM_MAX 1048576.0         // largest accepted parameter value (XGEMM_MIN_INDIRECT_SIZE)

const char *const clmha__xgemm_names[CLMHA__XGEMM_PARAMS] = {
    "GEMMK", "KREG", "KWG",  "KWI", "MDIMA", "MDIMC", "MWG",  "NDIMB",
    "NDIMC", "NWG",  "SA",   "SB",  "STRM",  "STRN",  "VWM",  "VWN"};
const char *const clmha__fused_names[CLMHA__FUSED_PARAMS] = {"BQ", "BK", "RPW", "VW"};

const char *const clmha__direct_names[CLMHA__DIRECT_PARAMS] = {
    "KWID", "MDIMAD", "MDIMCD", "NDIMBD", "NDIMCD", "PADA", "PADB", "VWMD", "VWND", "WGD"};

enum { GEMMK, KREG, KWG, KWI, MDIMA, MDIMC, MWG, NDIMB, NDIMC, NWG, SA, SB, STRM, STRN, VWM, VWN };
enum { KWID, MDIMAD, MDIMCD, NDIMBD, NDIMCD, PADA, PADB, VWMD, VWND, WGD };

const clmha__tuning clmha__tuning_clblast_generic = {
    .has_xgemm = true,
    .has_direct = true,
    .has_routine = true,
    .xgemm = {0, 1, 32, 2, 8, 8, 32, 16, 16, 32, 1, 1, 0, 0, 4, 2},
    .direct = {2, 8, 8, 8, 8, 1, 1, 1, 1, 16},
    .min_indirect = 896,
};

// CPU sets that seed the Xgemm search, most promising first: what the searches found on a
// 2-core Zen 4 with PoCL 3.1 (skylake-avx512 target) and their closest rivals, measured there
// with bench/gemm_ratio (sgemm 1024³, CLBlast and OpenBLAS 0.3.21 on 2 threads timed in turns).
// All have 16×16 floats per work-item in float8 × float4 steps (VWM 8, VWN 4) and no local
// memory; they differ in the work-group's shape and the K loop:
//   0. 2×8 work-items, KWG 32, STRM (found by a 300 s search): on a quiet machine ~154 GFLOP/s
//      column-major with B transposed (no pad/transpose kernels) against OpenBLAS's ~194 (0.79),
//      ~130 row-major with B transposed (0.67); CLBlast's generic set: ~27 (0.14). A later
//      300 s search on a busy machine chose 4×16 work-items, KWG 32, no STRM: the same speed.
//   1. 4×4 work-items, KWG 8, STRM (found by a 600 s search): ~0.74 and ~0.64.
//   2. the earlier hand-picked set (4×4, KWG 16, VWN 8, no STRM): about set 1's speed.
//   3. set 1 on 128×128 tiles (8×8 work-items).
// Measured slower there, left to the walk and the random draws: VWM 16 (~6× slower), GEMMK 1
// (KREG 4: 10-50 % slower even where it needs no transposes), VWN 1, 32×8 or 8×32 floats per
// work-item, 8×16, KWI 8.
static const size_t xgemm_seeds[][CLMHA__XGEMM_PARAMS] = {
    {0, 1, 32, 2, 2, 2, 32, 8, 8, 128, 0, 0, 1, 0, 8, 4},
    {0, 1, 8, 2, 4, 4, 64, 4, 4, 64, 0, 0, 1, 0, 8, 4},
    {0, 1, 16, 2, 4, 4, 64, 4, 4, 64, 0, 0, 0, 0, 8, 8},
    {0, 1, 8, 2, 8, 8, 128, 8, 8, 128, 0, 0, 1, 0, 8, 4},
};
#define XGEMM_SEEDS (sizeof xgemm_seeds / sizeof xgemm_seeds[0])

// ---- checks and formatting -------------------------------------------------------------------

#define REQUIRE(cond, ...)                                          \
    do {                                                            \
        if (!(cond)) {                                              \
            clmha__msg(msg, size, CLMHA_INVALID_FILE, __VA_ARGS__); \
            return false;                                           \
        }                                                           \
    } while (0)

static bool pow2_upto16(size_t v) { return v == 1 || v == 2 || v == 4 || v == 8 || v == 16; }
static bool multiple(size_t a, size_t b) { return b != 0 && a % b == 0; }

// CLBlast's constraints for Xgemm (src/tuning/kernels/xgemm.hpp and the kernel's own
// definitions in xgemm_part1.opencl) and the device's limits.
static bool check_xgemm(const size_t *p, size_t local_mem, size_t max_wg, char *msg,
                        size_t size) {
    for (int i = 0; i < CLMHA__XGEMM_PARAMS; ++i)
        REQUIRE(p[i] > 0 || i == GEMMK || i == SA || i == SB || i == STRM || i == STRN,
                "Xgemm %s must be at least 1", clmha__xgemm_names[i]);
    REQUIRE(p[GEMMK] <= 1, "Xgemm GEMMK must be 0 or 1 (got %zu)", p[GEMMK]);
    REQUIRE(p[SA] <= 1 && p[SB] <= 1 && p[STRM] <= 1 && p[STRN] <= 1,
            "Xgemm SA, SB, STRM and STRN must be 0 or 1");
    REQUIRE(pow2_upto16(p[VWM]) && pow2_upto16(p[VWN]),
            "Xgemm VWM and VWN must be 1, 2, 4, 8 or 16 (got %zu, %zu)", p[VWM], p[VWN]);
    REQUIRE(multiple(p[KWG], p[KWI]), "Xgemm KWG (%zu) must be a multiple of KWI (%zu)", p[KWG],
            p[KWI]);
    REQUIRE(multiple(p[MWG], p[MDIMC] * p[VWM]),
            "Xgemm MWG (%zu) must be a multiple of MDIMC*VWM (%zu)", p[MWG], p[MDIMC] * p[VWM]);
    REQUIRE(multiple(p[NWG], p[NDIMC] * p[VWN]),
            "Xgemm NWG (%zu) must be a multiple of NDIMC*VWN (%zu)", p[NWG], p[NDIMC] * p[VWN]);
    REQUIRE(multiple(p[MWG], p[MDIMA] * p[VWM]),
            "Xgemm MWG (%zu) must be a multiple of MDIMA*VWM (%zu)", p[MWG], p[MDIMA] * p[VWM]);
    REQUIRE(multiple(p[NWG], p[NDIMB] * p[VWN]),
            "Xgemm NWG (%zu) must be a multiple of NDIMB*VWN (%zu)", p[NWG], p[NDIMB] * p[VWN]);
    if (p[GEMMK] == 0) {
        size_t threads = p[MDIMC] * p[NDIMC];
        REQUIRE(multiple(threads, p[MDIMA]) && multiple(threads, p[NDIMB]),
                "Xgemm MDIMC*NDIMC (%zu) must be a multiple of MDIMA and NDIMB", threads);
        REQUIRE(multiple(p[KWG], threads / p[MDIMA]) && multiple(p[KWG], threads / p[NDIMB]),
                "Xgemm KWG (%zu) must be a multiple of MDIMC*NDIMC/MDIMA and /NDIMB", p[KWG]);
        REQUIRE(p[KREG] == 1, "Xgemm KREG must be 1 with GEMMK 0");
    } else {
        REQUIRE(multiple(p[KREG], p[VWN]), "Xgemm KREG (%zu) must be a multiple of VWN (%zu)",
                p[KREG], p[VWN]);
        REQUIRE(p[MDIMA] == p[MDIMC] && p[NDIMB] == p[NDIMC],
                "Xgemm with GEMMK 1 needs MDIMA = MDIMC and NDIMB = NDIMC");
        REQUIRE(p[SA] == 0 && p[SB] == 0, "Xgemm with GEMMK 1 needs SA = SB = 0");
    }
    REQUIRE(p[MDIMC] * p[NDIMC] <= max_wg,
            "Xgemm work-group MDIMC*NDIMC = %zu exceeds the device's %zu", p[MDIMC] * p[NDIMC],
            max_wg);
    size_t local = 4 * (p[SA] * p[KWG] * p[MWG] + p[SB] * p[KWG] * p[NWG]);
    REQUIRE(local <= local_mem, "Xgemm needs %zu bytes of local memory, the device has %zu",
            local, local_mem);
    return true;
}

// CLBlast's constraints for XgemmDirect (src/tuning/kernels/xgemm_direct.hpp).
static bool check_direct(const size_t *p, size_t local_mem, size_t max_wg, char *msg,
                         size_t size) {
    for (int i = 0; i < CLMHA__DIRECT_PARAMS; ++i)
        REQUIRE(p[i] > 0 || i == PADA || i == PADB, "XgemmDirect %s must be at least 1",
                clmha__direct_names[i]);
    REQUIRE(p[PADA] <= 1 && p[PADB] <= 1, "XgemmDirect PADA and PADB must be 0 or 1");
    REQUIRE(pow2_upto16(p[VWMD]) && pow2_upto16(p[VWND]),
            "XgemmDirect VWMD and VWND must be 1, 2, 4, 8 or 16 (got %zu, %zu)", p[VWMD],
            p[VWND]);
    REQUIRE(multiple(p[WGD], p[KWID]), "XgemmDirect WGD (%zu) must be a multiple of KWID (%zu)",
            p[WGD], p[KWID]);
    REQUIRE(multiple(p[WGD], p[MDIMCD] * p[VWMD]) && multiple(p[WGD], p[NDIMCD] * p[VWND]),
            "XgemmDirect WGD (%zu) must be a multiple of MDIMCD*VWMD and NDIMCD*VWND", p[WGD]);
    REQUIRE(multiple(p[WGD], p[MDIMAD] * p[VWMD]) && multiple(p[WGD], p[NDIMBD] * p[VWND]),
            "XgemmDirect WGD (%zu) must be a multiple of MDIMAD*VWMD and NDIMBD*VWND", p[WGD]);
    size_t threads = p[MDIMCD] * p[NDIMCD];
    REQUIRE(multiple(threads, p[MDIMAD]) && multiple(threads, p[NDIMBD]),
            "XgemmDirect MDIMCD*NDIMCD (%zu) must be a multiple of MDIMAD and NDIMBD", threads);
    REQUIRE(multiple(p[WGD], threads / p[MDIMAD]) && multiple(p[WGD], threads / p[NDIMBD]),
            "XgemmDirect WGD (%zu) must be a multiple of MDIMCD*NDIMCD/MDIMAD and /NDIMBD",
            p[WGD]);
    REQUIRE(threads <= max_wg, "XgemmDirect work-group MDIMCD*NDIMCD = %zu exceeds the device's %zu",
            threads, max_wg);
    size_t local = 4 * (p[WGD] * (p[WGD] + p[PADA]) + p[WGD] * (p[WGD] + p[PADB]));
    REQUIRE(local <= local_mem, "XgemmDirect needs %zu bytes of local memory, the device has %zu",
            local, local_mem);
#undef REQUIRE
    return true;
}

// The fused kernel's tiles: BQ a power of two within the work-group limit, BK a power of two
// up to 256, RPW 1 to 4, VW 1, 2, 4, 8 or 16 dividing BK. (Whether a tile fits in local memory
// and VW divides head_dim depend on the layer; clmha__fused_tiles_for() adjusts those.)
static bool check_fused(const size_t *p, size_t max_wg, char *msg, size_t msg_size) {
    size_t bq = p[0], bk = p[1], rpw = p[2], vw = p[3];
    const char *why = !bq || (bq & (bq - 1)) || bq > max_wg ? "BQ must be a power of two within "
                                                              "the device's work-group limit"
                      : !bk || (bk & (bk - 1)) || bk > 256 ? "BK must be a power of two up to 256"
                      : !rpw || rpw > 4                    ? "RPW must be 1 to 4"
                      : !vw || vw > 16 || (vw & (vw - 1)) || bk % vw
                          ? "VW must be 1, 2, 4, 8 or 16 and divide BK"
                          : NULL;
    if (why)
        clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                   "FusedAttention BQ=%zu BK=%zu RPW=%zu VW=%zu: %s (work-group limit %zu)", bq,
                   bk, rpw, vw, why, max_wg);
    return !why;
}

bool clmha__tuning_check(const clmha__tuning *t, size_t local_mem, size_t max_wg, char *msg,
                         size_t msg_size) {
    if (!t->has_xgemm && !t->has_direct && !t->has_routine && !t->has_fused) {
        clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "the tuning names no kernel");
        return false;
    }
    if (t->has_xgemm && !check_xgemm(t->xgemm, local_mem, max_wg, msg, msg_size)) return false;
    if (t->has_direct && !check_direct(t->direct, local_mem, max_wg, msg, msg_size)) return false;
    if (t->has_fused && !check_fused(t->fused, max_wg, msg, msg_size)) return false;
    if (t->has_routine && t->min_indirect > (size_t)PARAM_MAX) {
        clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                   "GemmRoutine XGEMM_MIN_INDIRECT_SIZE %zu is above %.0f", t->min_indirect,
                   PARAM_MAX);
        return false;
    }
    return true;
}

static size_t append(char *buf, size_t size, size_t used, const char *fmt, ...)
    CLMHA__PRINTF(4, 5);
static size_t append(char *buf, size_t size, size_t used, const char *fmt, ...) {
    if (used >= size) return used;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + used, size - used, fmt, ap);
    va_end(ap);
    return n < 0 ? used : used + (size_t)n;
}

void clmha__tuning_format(const clmha__tuning *t, char *buf, size_t size) {
    if (!size) return;
    buf[0] = '\0';
    size_t used = 0;
    if (t->has_xgemm) {
        used = append(buf, size, used, "Xgemm:");
        for (int i = 0; i < CLMHA__XGEMM_PARAMS; ++i)
            used = append(buf, size, used, " %s=%zu", clmha__xgemm_names[i], t->xgemm[i]);
    }
    if (t->has_direct) {
        used = append(buf, size, used, "%sXgemmDirect:", used ? "; " : "");
        for (int i = 0; i < CLMHA__DIRECT_PARAMS; ++i)
            used = append(buf, size, used, " %s=%zu", clmha__direct_names[i], t->direct[i]);
    }
    if (t->has_routine)
        used = append(buf, size, used, "%sGemmRoutine: XGEMM_MIN_INDIRECT_SIZE=%zu",
                      used ? "; " : "", t->min_indirect);
    if (t->has_fused) {
        used = append(buf, size, used, "%sFusedAttention:", used ? "; " : "");
        for (int i = 0; i < CLMHA__FUSED_PARAMS; ++i)
            used = append(buf, size, used, " %s=%zu", clmha__fused_names[i], t->fused[i]);
    }
}

// ---- the per-device registry -------------------------------------------------------------------

#define MAX_DEVICES 32

typedef struct device_state {
    cl_device_id device;
    bool stored_considered;  // apply_stored ran for this device in this process
    bool applied;            // `tuning` is in effect (CLBlast's database is overridden)
    clmha__tuning tuning;
    clmha__tuning_meta meta;
    char note[1024];
} device_state;

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static device_state registry[MAX_DEVICES];
static size_t registry_count;

// The state of @p device, created when new (NULL when the registry is full). Lock held.
static device_state *state_of(cl_device_id device) {
    for (size_t i = 0; i < registry_count; ++i)
        if (registry[i].device == device) return &registry[i];
    if (registry_count == MAX_DEVICES) return NULL;
    device_state *s = &registry[registry_count++];
    memset(s, 0, sizeof *s);
    s->device = device;
    snprintf(s->note, sizeof s->note, "no tuning applied: CLBlast's own parameters");
    return s;
}

static void set_note(cl_device_id device, const char *fmt, ...) CLMHA__PRINTF(2, 3);
static void set_note(cl_device_id device, const char *fmt, ...) {
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

// The tuning in effect for @p device (false when none was applied in this process).
static bool current_tuning(cl_device_id device, clmha__tuning *t, clmha__tuning_meta *meta) {
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

bool clmha__tuning_fused(cl_device_id device, size_t fused[CLMHA__FUSED_PARAMS]) {
    clmha__tuning t;
    if (!current_tuning(device, &t, NULL) || !t.has_fused) return false;
    memcpy(fused, t.fused, sizeof t.fused);
    return true;
}

// ---- applying ----------------------------------------------------------------------------------

static const char *blast_status_text(int st) {
    switch (st) {
    case CLBlastInvalidOverrideKernel: return "invalid kernel name";
    case CLBlastMissingOverrideParameter: return "missing parameter";
    case CLBlastDatabaseError: return "no database entry";
    default: return "see clblast_c.h";
    }
}

// Overrides one kernel; no registry update.
static clmha_status override(clmha_context *ctx, const char *kernel, size_t count,
                             const char *const *names, const size_t *values) {
    int st = CLBlastOverrideParameters(ctx->device, kernel, CLBlastPrecisionSingle, count,
                                       (const char **)names, values);
    if (st != CLBlastSuccess)
        return clmha__fail(ctx, CLMHA_BLAS_ERROR,
                           "CLBlastOverrideParameters(%s) failed: CLBlast status %d (%s)", kernel,
                           st, blast_status_text(st));
    return CLMHA_SUCCESS;
}

// Overrides every kernel present in @p t; no registry update.
static clmha_status override_all(clmha_context *ctx, const clmha__tuning *t) {
    static const char *const routine_names[1] = {"XGEMM_MIN_INDIRECT_SIZE"};
    clmha_status st = CLMHA_SUCCESS;
    if (t->has_xgemm &&
        (st = override(ctx, "Xgemm", CLMHA__XGEMM_PARAMS, clmha__xgemm_names, t->xgemm)))
        return st;
    if (t->has_direct &&
        (st = override(ctx, "XgemmDirect", CLMHA__DIRECT_PARAMS, clmha__direct_names, t->direct)))
        return st;
    if (t->has_routine &&
        (st = override(ctx, "GemmRoutine", 1, routine_names, &t->min_indirect)))
        return st;
    return CLMHA_SUCCESS;
}

static size_t device_local_mem(const clmha_context *ctx) {
    return ctx->info.local_mem_bytes ? (size_t)ctx->info.local_mem_bytes : 16384;
}

clmha_status clmha__tuning_apply(clmha_context *ctx, const clmha__tuning *t,
                                 const clmha__tuning_meta *meta, const char *source) {
    char msg[512];
    if (!clmha__tuning_check(t, device_local_mem(ctx), ctx->max_work_group, msg, sizeof msg))
        return clmha__fail(ctx, CLMHA_INVALID_FILE, "%s", msg);
    clmha_status st = override_all(ctx, t);
    pthread_mutex_lock(&registry_lock);
    device_state *s = state_of(ctx->device);
    if (s && st == CLMHA_SUCCESS) {
        // Kernels the new tuning leaves alone keep what was in effect.
        clmha__tuning merged = s->applied ? s->tuning : (clmha__tuning){0};
        if (t->has_xgemm) memcpy(merged.xgemm, t->xgemm, sizeof merged.xgemm);
        if (t->has_direct) memcpy(merged.direct, t->direct, sizeof merged.direct);
        if (t->has_routine) merged.min_indirect = t->min_indirect;
        if (t->has_fused) memcpy(merged.fused, t->fused, sizeof merged.fused);
        merged.has_fused |= t->has_fused;
        merged.has_xgemm |= t->has_xgemm;
        merged.has_direct |= t->has_direct;
        merged.has_routine |= t->has_routine;
        s->tuning = merged;
        s->applied = true;
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

clmha_status clmha__tuning_path(const clmha_context *ctx, char *path, size_t size, char *msg,
                                size_t msg_size) {
    char dir[4096];
    clmha_status st = clmha__tuning_dir(dir, sizeof dir, msg, msg_size);
    if (st) return st;
    char name[256];
    size_t used = sanitise(name, sizeof name, 0, ctx->info.platform_name, 80);
    used = append(name, sizeof name, used, "--");
    sanitise(name, sizeof name, used, ctx->info.device_name, 120);
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

// Reads a whole file (at most TUNING_FILE_MAX bytes) as a NUL-terminated string.
static clmha_status read_text(const char *path, char **out, bool *missing, char *msg,
                              size_t msg_size) {
    *out = NULL;
    *missing = false;
    FILE *f = fopen(path, "rb");
    if (!f) {
        *missing = errno == ENOENT;
        return clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "cannot open %s: %s", path,
                          strerror(errno));
    }
    char *buf = malloc(TUNING_FILE_MAX + 1);
    if (!buf) {
        fclose(f);
        return clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY, "out of host memory");
    }
    size_t n = fread(buf, 1, TUNING_FILE_MAX + 1, f);
    bool err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return clmha__msg(msg, msg_size, CLMHA_IO_ERROR, "cannot read %s", path);
    }
    if (n > TUNING_FILE_MAX) {
        free(buf);
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "%s is larger than %u bytes", path,
                          TUNING_FILE_MAX);
    }
    buf[n] = '\0';
    if (strlen(buf) != n) {
        free(buf);
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "%s holds a NUL byte", path);
    }
    *out = buf;
    return CLMHA_SUCCESS;
}

// ---- JSON --------------------------------------------------------------------------------------

static void utc_now(char *buf, size_t size) {
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

char *clmha__tuning_to_json(const clmha_context *ctx, const clmha__tuning *t,
                            const clmha__tuning_meta *meta) {
    static const char *const routine_names[1] = {"XGEMM_MIN_INDIRECT_SIZE"};
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    char clblast[32];
    snprintf(clblast, sizeof clblast, "%d.%d.%d", CLBLAST_VERSION_MAJOR, CLBLAST_VERSION_MINOR,
             CLBLAST_VERSION_PATCH);
    cJSON *kernels = NULL;
    bool ok = cJSON_AddStringToObject(root, "format", TUNING_FORMAT) &&
              cJSON_AddNumberToObject(root, "version", TUNING_VERSION) &&
              cJSON_AddStringToObject(root, "platform", ctx->info.platform_name) &&
              cJSON_AddStringToObject(root, "device", ctx->info.device_name) &&
              cJSON_AddStringToObject(root, "driver", ctx->info.driver_version) &&
              cJSON_AddStringToObject(root, "clblast", clblast) &&
              cJSON_AddStringToObject(root, "precision", "float32") &&
              (kernels = cJSON_AddObjectToObject(root, "kernels"));
    if (ok && t->has_xgemm)
        ok = add_params(kernels, "Xgemm", CLMHA__XGEMM_PARAMS, clmha__xgemm_names, t->xgemm);
    if (ok && t->has_direct)
        ok = add_params(kernels, "XgemmDirect", CLMHA__DIRECT_PARAMS, clmha__direct_names,
                        t->direct);
    if (ok && t->has_routine)
        ok = add_params(kernels, "GemmRoutine", 1, routine_names, &t->min_indirect);
    if (ok && t->has_fused)
        ok = add_params(kernels, "FusedAttention", CLMHA__FUSED_PARAMS, clmha__fused_names,
                        t->fused);
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
                              "kernels.%s lacks parameter %s (CLBlast needs all of them)", kernel,
                              names[i]);
        double d = cJSON_IsNumber(v) ? v->valuedouble : -1;
        if (!cJSON_IsNumber(v) || !(d >= 0 && d <= PARAM_MAX) || d != floor(d))
            return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                              "kernels.%s.%s must be an integer from 0 to %.0f", kernel, names[i],
                              PARAM_MAX);
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

static const char *string_field(const cJSON *root, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

clmha_status clmha__tuning_from_json(const clmha_context *ctx, const char *json,
                                     clmha__tuning *t, clmha__tuning_meta *meta, char *msg,
                                     size_t msg_size) {
    static const char *const routine_names[1] = {"XGEMM_MIN_INDIRECT_SIZE"};
    memset(t, 0, sizeof *t);
    if (meta) memset(meta, 0, sizeof *meta);
    if (strlen(json) > TUNING_FILE_MAX)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "the tuning is larger than %u bytes",
                          TUNING_FILE_MAX);
    cJSON *root = cJSON_Parse(json);
    if (!root)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "the tuning is not valid JSON");
    clmha_status st = CLMHA_SUCCESS;
    const char *format = string_field(root, "format");
    const cJSON *version = cJSON_GetObjectItemCaseSensitive(root, "version");
    const char *platform = string_field(root, "platform");
    const char *device = string_field(root, "device");
    const char *driver = string_field(root, "driver");
    const char *precision = string_field(root, "precision");
    const cJSON *kernels = cJSON_GetObjectItemCaseSensitive(root, "kernels");
    if (!cJSON_IsObject(root) || !format || strcmp(format, TUNING_FORMAT) != 0) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "not a clmha tuning (\"format\" must be \"" TUNING_FORMAT "\")");
    } else if (!cJSON_IsNumber(version) || version->valuedouble != TUNING_VERSION) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "unsupported tuning version (this clmha reads version %d)",
                        TUNING_VERSION);
    } else if (!platform || !device || !driver) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "the tuning lacks \"platform\", \"device\" or \"driver\"");
    } else if (precision && strcmp(precision, "float32") != 0) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                        "the tuning is for precision \"%.20s\", clmha needs \"float32\"",
                        precision);
    } else if (!cJSON_IsObject(kernels)) {
        st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "the tuning lacks a \"kernels\" object");
    } else if (strcmp(platform, ctx->info.platform_name) != 0 ||
               strcmp(device, ctx->info.device_name) != 0) {
        st = clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                        "the tuning is for device \"%.100s\" of platform \"%.100s\", not for this "
                        "context's \"%s\" of \"%s\"",
                        device, platform, ctx->info.device_name, ctx->info.platform_name);
    } else if (strcmp(driver, ctx->info.driver_version) != 0) {
        st = clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                        "the tuning is for driver version \"%.60s\", the device has \"%s\" "
                        "(tune again: clmha tune)",
                        driver, ctx->info.driver_version);
    }
    for (const cJSON *k = st ? NULL : kernels->child; k && !st; k = k->next) {
        const char *name = k->string ? k->string : "";
        if (strcmp(name, "Xgemm") == 0) {
            st = parse_params(k, "Xgemm", CLMHA__XGEMM_PARAMS, clmha__xgemm_names, t->xgemm, msg,
                              msg_size);
            t->has_xgemm = true;
        } else if (strcmp(name, "XgemmDirect") == 0) {
            st = parse_params(k, "XgemmDirect", CLMHA__DIRECT_PARAMS, clmha__direct_names,
                              t->direct, msg, msg_size);
            t->has_direct = true;
        } else if (strcmp(name, "GemmRoutine") == 0) {
            st = parse_params(k, "GemmRoutine", 1, routine_names, &t->min_indirect, msg,
                              msg_size);
            t->has_routine = true;
        } else if (strcmp(name, "FusedAttention") == 0) {
            st = parse_params(k, "FusedAttention", CLMHA__FUSED_PARAMS, clmha__fused_names,
                              t->fused, msg, msg_size);
            t->has_fused = true;
        } else {
            st = clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                            "unknown kernel \"%.40s\" (known: Xgemm, XgemmDirect, GemmRoutine, "
                            "FusedAttention)",
                            name);
        }
    }
    if (!st && !clmha__tuning_check(t, device_local_mem(ctx), ctx->max_work_group, msg, msg_size))
        st = CLMHA_INVALID_FILE;
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "measured");
    if (!st && meta && cJSON_IsObject(m)) {
        meta->default_gflops = meta_number(m, "sgemm_1024_default_gflops");
        meta->tuned_gflops = meta_number(m, "sgemm_1024_tuned_gflops");
        meta->default_layer_gflops = meta_number(m, "layer_projection_default_gflops");
        meta->tuned_layer_gflops = meta_number(m, "layer_projection_tuned_gflops");
        meta->candidates = (size_t)meta_number(m, "candidates");
        meta->seconds = meta_number(m, "seconds");
        meta_string(m, "layer", meta->layer, sizeof meta->layer);
        meta_string(m, "date", meta->date, sizeof meta->date);
    }
    cJSON_Delete(root);
    if (st) memset(t, 0, sizeof *t);
    return st;
}

// ---- stored tuning, import, export, note ----------------------------------------------------------

void clmha__tuning_apply_stored(clmha_context *ctx) {
    pthread_mutex_lock(&registry_lock);
    device_state *s = state_of(ctx->device);
    bool skip = !s || s->stored_considered;
    if (s) s->stored_considered = true;
    pthread_mutex_unlock(&registry_lock);
    if (skip) return;  // once per device and process; an explicit tuning is kept

    const char *env = getenv("CLMHA_TUNING");
    if (env && (strcmp(env, "off") == 0 || strcmp(env, "0") == 0)) {
        set_note(ctx->device, "stored tuning not loaded ($CLMHA_TUNING=%s)", env);
        return;
    }
    char path[4400], msg[1024];
    if (clmha__tuning_path(ctx, path, sizeof path, msg, sizeof msg)) {
        set_note(ctx->device, "no stored tuning: %s", msg);
        return;
    }
    char *text = NULL;
    bool missing = false;
    if (read_text(path, &text, &missing, msg, sizeof msg)) {
        if (missing)
            set_note(ctx->device, "no stored tuning (%s not found; create it with clmha tune)",
                     path);
        else
            set_note(ctx->device, "stored tuning ignored: %s", msg);
        return;
    }
    clmha__tuning t;
    clmha__tuning_meta meta;
    clmha_status st = clmha__tuning_from_json(ctx, text, &t, &meta, msg, sizeof msg);
    free(text);
    if (st) {
        set_note(ctx->device, "stored tuning %s ignored: %s", path, msg);
        return;
    }
    char source[sizeof path + 64];
    snprintf(source, sizeof source, "stored tuning %s applied", path);
    char saved[CLMHA__ERROR_SIZE];
    memcpy(saved, ctx->last_error, sizeof saved);
    if (clmha__tuning_apply(ctx, &t, &meta, source)) {
        set_note(ctx->device, "stored tuning %s ignored: %s", path, ctx->last_error);
        memcpy(ctx->last_error, saved, sizeof saved);  // context creation did not fail
    }
}

clmha_status clmha_context_tuning_import(clmha_context *ctx, const char *json) {
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    if (!json) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "json is NULL");
    clmha__tuning t;
    clmha__tuning_meta meta;
    char msg[1024];
    clmha_status st = clmha__tuning_from_json(ctx, json, &t, &meta, msg, sizeof msg);
    if (st) return clmha__fail(ctx, st, "clmha_context_tuning_import: %s", msg);
    return clmha__tuning_apply(ctx, &t, &meta, "imported tuning applied");
}

clmha_status clmha_context_tuning_export(const clmha_context *ctx, char *json, size_t size,
                                         size_t *needed) {
    if (needed) *needed = 0;
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    clmha__tuning t;
    clmha__tuning_meta meta;
    if (!current_tuning(ctx->device, &t, &meta))
        return clmha__fail(ctx, CLMHA_NOT_READY,
                           "clmha_context_tuning_export: no tuning is applied to this device "
                           "(CLBlast's own parameters are in use; see clmha_context_tune)");
    char *text = clmha__tuning_to_json(ctx, &t, &meta);
    if (!text) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    size_t len = strlen(text) + 1;
    if (needed) *needed = len;
    clmha_status st = CLMHA_SUCCESS;
    if (json && size >= len)
        memcpy(json, text, len);
    else if (json || size)
        st = clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                         "clmha_context_tuning_export: the buffer holds %zu bytes, the tuning "
                         "needs %zu",
                         json ? size : 0, len);
    free(text);
    return st;
}

clmha_status clmha_context_tuning_note(const clmha_context *ctx, char *text, size_t size) {
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    if (!text || !size)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "text is NULL or size is 0");
    pthread_mutex_lock(&registry_lock);
    device_state *s = state_of(ctx->device);
    snprintf(text, size, "%s", s ? s->note : "no tuning applied");
    pthread_mutex_unlock(&registry_lock);
    return CLMHA_SUCCESS;
}

// ---- the search ------------------------------------------------------------------------------------
//
// The GEMMs are timed on the device with clFinish around each call (wall clock, so the indirect
// path's pad/transpose kernels and buffer allocations count). A candidate is compiled by its
// first call (several seconds on PoCL), so the budget buys a few dozen candidates; the search
// spends it as follows:
//   0. "before": the GEMM shapes timed with the parameters in effect (nothing overridden yet).
//   A. Xgemm (indirect path forced: XGEMM_MIN_INDIRECT_SIZE = 0), timed on the plain sgemm
//      shapes (1024³ and each layer's projections): the seeds, then a greedy walk from the best
//      found (first improvement, single-parameter steps, CPU-friendly order), then
//      prior-weighted random samples. Sgemm program only.
//   B. XgemmDirect (direct path forced), timed on the strided batched shapes (QKᵀ and A·V of
//      each layer). Strided batched program only.
//   C. Both paths timed on the shapes of the other phase; XGEMM_MIN_INDIRECT_SIZE is the split
//      of m·n·k that minimises the summed time; the final set is applied, checked on every shape
//      and timed again.
// On a machine shared with other work, timings taken a minute apart differ by 2× and more, so
// within A and B every candidate is timed again in turns with the best so far (both programs
// are built by then: switching costs nothing) and judged on those turns, and the three leaders
// are timed in turns before a phase picks its winner.
// Every candidate must pass a correctness check against a double-precision CPU GEMM on the same
// random data (odd-sized GEMMs that exercise padding, plus samples of each timed product):
// max |C - ref| / max |ref| <= 1e-4.

#define CHECK_TOLERANCE 1e-4
#define MAX_LAYERS 4
#define MAX_SHAPES (1 + 4 * MAX_LAYERS)
#define FORCE_DIRECT 1048576  // XGEMM_MIN_INDIRECT_SIZE that makes every GEMM direct

typedef struct gshape {
    char label[64];
    size_t m, n, k, batch;  // batch 0: plain sgemm; >= 1: strided batched
    bool tb;                // B transposed (B is n×k), else k×n; row-major, C m×n
    cl_mem a, b, c;
    float *ha, *hb;
    double t_ind, t_dir;    // fastest seconds with each path (phase A/B/C), 0 unknown
    double before, after;   // median seconds before and after tuning
    double before_best;     // fastest before tuning
} gshape;

typedef struct tuner {
    clmha_context *ctx;
    const clmha_tune_options *opts;
    gshape shapes[MAX_SHAPES];
    size_t nshapes;
    gshape checks[6];  // odd-sized correctness GEMMs: 2 plain, 2 batched, 2 plain above the split
    size_t nchecks;
    size_t skip_direct_below;  // final check: XgemmDirect untouched, skip its GEMMs (0: none)
    double start, budget;
    size_t tried, rejected;
    double cost_sum;   // seconds spent in candidates (for the estimate of the next one)
    double best_gflops;  // sgemm 1024³ of the best Xgemm so far
    uint64_t rng;
    bool overridden;   // CLBlast's parameters were changed by this run
    double phase_cost[2];  // seconds spent in Xgemm [0] and XgemmDirect [1] candidates
    size_t phase_tried[2];
    char msg[1024];
} tuner;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t next_rand(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static float rand_unit(uint64_t *s) {
    return (float)((next_rand(s) >> 40) * (2.0 / 16777216.0) - 1.0);  // [-1, 1)
}

static double flops(const gshape *s) {
    return 2.0 * (double)s->m * (double)s->n * (double)s->k * (double)(s->batch ? s->batch : 1);
}

static size_t a_count(const gshape *s) { return s->m * s->k * (s->batch ? s->batch : 1); }
static size_t b_count(const gshape *s) { return s->n * s->k * (s->batch ? s->batch : 1); }
static size_t c_count(const gshape *s) { return s->m * s->n * (s->batch ? s->batch : 1); }

static void shape_free(gshape *s) {
    clmha__release_mem(s->a);
    clmha__release_mem(s->b);
    clmha__release_mem(s->c);
    free(s->ha);
    free(s->hb);
    s->a = s->b = s->c = NULL;
    s->ha = s->hb = NULL;
}

static clmha_status shape_alloc(tuner *T, gshape *s) {
    clmha_context *ctx = T->ctx;
    size_t na = a_count(s), nb = b_count(s), nc = c_count(s);
    s->ha = malloc(na * sizeof(float));
    s->hb = malloc(nb * sizeof(float));
    if (!s->ha || !s->hb) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    for (size_t i = 0; i < na; ++i) s->ha[i] = rand_unit(&T->rng);
    for (size_t i = 0; i < nb; ++i) s->hb[i] = rand_unit(&T->rng);
    cl_int err;
    s->a = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
                          na * sizeof(float), s->ha, &err);
    clmha__held_new(CLMHA__HELD_MEM, s->a);
    if (err == CL_SUCCESS) {
        s->b = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
                              nb * sizeof(float), s->hb, &err);
        clmha__held_new(CLMHA__HELD_MEM, s->b);
    }
    if (err == CL_SUCCESS) {
        s->c = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE, nc * sizeof(float), NULL, &err);
        clmha__held_new(CLMHA__HELD_MEM, s->c);
    }
    if (err != CL_SUCCESS) return clmha__cl_fail(ctx, err, "clCreateBuffer(tuning matrices)");
    return CLMHA_SUCCESS;
}

// One GEMM of @p s, waited for. Returns the CLBlast status.
static int shape_run(clmha_context *ctx, const gshape *s) {
    cl_command_queue q = ctx->queue;
    size_t ldb = s->tb ? s->k : s->n;
    CLBlastTranspose tb = s->tb ? CLBlastTransposeYes : CLBlastTransposeNo;
    int st;
    if (!s->batch)
        st = CLBlastSgemm(CLBlastLayoutRowMajor, CLBlastTransposeNo, tb, s->m, s->n, s->k, 1.0f,
                          s->a, 0, s->k, s->b, 0, ldb, 0.0f, s->c, 0, s->n, &q, NULL);
    else
        st = CLBlastSgemmStridedBatched(CLBlastLayoutRowMajor, CLBlastTransposeNo, tb, s->m,
                                        s->n, s->k, 1.0f, s->a, 0, s->k, s->m * s->k, s->b, 0,
                                        ldb, s->n * s->k, 0.0f, s->c, 0, s->n, s->m * s->n,
                                        s->batch, &q, NULL);
    cl_int err = clFinish(q);
    return st != CLBlastSuccess ? st : err;
}

// Compares C of the last run of @p s with a double-precision CPU GEMM: every element of small
// products, else @p samples random elements plus the corners. Writes the error to *rel.
static clmha_status shape_check(tuner *T, const gshape *s, size_t samples, double *rel) {
    clmha_context *ctx = T->ctx;
    size_t nc = c_count(s), batches = s->batch ? s->batch : 1;
    float *hc = malloc(nc * sizeof(float));
    if (!hc) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    cl_int err = clEnqueueReadBuffer(ctx->queue, s->c, CL_TRUE, 0, nc * sizeof(float), hc, 0, NULL,
                                     NULL);
    if (err != CL_SUCCESS) {
        free(hc);
        return clmha__cl_fail(ctx, err, "clEnqueueReadBuffer(tuning check)");
    }
    bool all = nc <= 65536;
    size_t count = all ? nc : samples + 4 * batches;
    double max_err = 0, max_ref = 0;
    bool nan = false;
    for (size_t t = 0; t < count; ++t) {
        size_t idx;
        if (all) {
            idx = t;
        } else if (t < samples) {
            idx = (size_t)(next_rand(&T->rng) % nc);
        } else {  // the four corners of every batch item
            size_t bi = (t - samples) / 4, corner = (t - samples) % 4;
            size_t i = corner & 1 ? s->m - 1 : 0, j = corner & 2 ? s->n - 1 : 0;
            idx = bi * s->m * s->n + i * s->n + j;
        }
        size_t bi = idx / (s->m * s->n), i = idx / s->n % s->m, j = idx % s->n;
        const float *a = s->ha + bi * s->m * s->k + i * s->k;
        const float *b = s->hb + bi * s->n * s->k;
        double ref = 0;
        if (s->tb)
            for (size_t p = 0; p < s->k; ++p) ref += (double)a[p] * b[j * s->k + p];
        else
            for (size_t p = 0; p < s->k; ++p) ref += (double)a[p] * b[p * s->n + j];
        double got = hc[idx];
        if (isnan(got) || isinf(got)) nan = true;
        max_err = fmax(max_err, fabs(got - ref));
        max_ref = fmax(max_ref, fabs(ref));
    }
    free(hc);
    *rel = nan ? INFINITY : max_err / fmax(max_ref, 1e-30);
    return CLMHA_SUCCESS;
}

static bool goes_direct(const gshape *s, size_t min_indirect) {
    double c = (double)min_indirect;
    return (double)s->m * (double)s->n * (double)s->k < c * c * c;
}

// Runs the correctness GEMMs of the given kinds (plain, batched): false when a run fails or an
// error exceeds the tolerance (the reason goes to T->msg).
static bool run_checks(tuner *T, bool plain, bool batched) {
    for (size_t i = 0; i < T->nchecks; ++i) {
        const gshape *s = &T->checks[i];
        if ((s->batch ? !batched : !plain)) continue;
        if (T->skip_direct_below && goes_direct(s, T->skip_direct_below)) continue;
        int st = shape_run(T->ctx, s);
        if (st != 0) {
            snprintf(T->msg, sizeof T->msg, "%s: CLBlast status %d", s->label, st);
            return false;
        }
        double rel;
        if (shape_check(T, s, 0, &rel)) return false;
        if (!(rel <= CHECK_TOLERANCE)) {
            snprintf(T->msg, sizeof T->msg, "%s: wrong result (max rel error %.2e)", s->label, rel);
            return false;
        }
    }
    return true;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// Times @p s: up to @p reps runs; stops after two when the faster of them is above @p slower_than
// seconds (0: no limit). *best = fastest, *median = median. False on a failed run (T->msg).
static bool shape_time(tuner *T, gshape *s, int reps, double slower_than, double *best,
                       double *median) {
    double t[16];
    int n = 0;
    for (; n < reps && n < 16; ++n) {
        double t0 = now_s();
        int st = shape_run(T->ctx, s);
        t[n] = now_s() - t0;
        if (st != 0) {
            snprintf(T->msg, sizeof T->msg, "%s: CLBlast status %d", s->label, st);
            return false;
        }
        if (n == 1 && slower_than > 0 && fmin(t[0], t[1]) > slower_than) {
            ++n;
            break;
        }
    }
    qsort(t, (size_t)n, sizeof t[0], cmp_double);
    *best = t[0];
    *median = t[n / 2];
    return true;
}

// Times the shapes of one kind (plain or batched) and checks samples of their products.
// times[i] gets the fastest time of shape i (0 for shapes of the other kind). *total is their
// sum; a candidate slower than 2.5× @p reference (a total, 0 = none) is cut short and returns
// true with *total = INFINITY. False on a failure (T->msg says why).
static bool time_kind(tuner *T, bool batched, int reps, double reference, double *times,
                      double *total) {
    *total = 0;
    for (size_t i = 0; i < T->nshapes; ++i) times[i] = 0;
    for (size_t i = 0; i < T->nshapes; ++i) {
        gshape *s = &T->shapes[i];
        times[i] = 0;
        if ((s->batch != 0) != batched) continue;
        double best, median;
        double limit = reference > 0 ? fmax(2.5 * reference - *total, 1e-3) : 0;
        if (!shape_time(T, s, reps, limit, &best, &median)) return false;
        double rel;
        if (shape_check(T, s, 256, &rel)) return false;
        if (!(rel <= CHECK_TOLERANCE)) {
            snprintf(T->msg, sizeof T->msg, "%s: wrong result (max rel error %.2e)", s->label, rel);
            return false;
        }
        times[i] = best;
        *total += best;
        if (reference > 0 && *total > 2.5 * reference) {
            *total = INFINITY;
            return true;
        }
    }
    return true;
}

static double elapsed(const tuner *T) { return now_s() - T->start; }

static void progress(tuner *T, const char *phase) {
    if (!T->opts || !T->opts->progress) return;
    double avg = T->tried ? T->cost_sum / (double)T->tried : 8.0;
    double left = T->budget - elapsed(T);
    size_t estimate = T->tried + (left > 0 ? (size_t)(left / fmax(avg, 0.5)) : 0);
    char line[256];
    if (T->best_gflops > 0)
        snprintf(line, sizeof line, "%zu/%zu candidates, best %.1f GFLOP/s (%s)", T->tried,
                 estimate, T->best_gflops, phase);
    else
        snprintf(line, sizeof line, "%zu/%zu candidates (%s)", T->tried, estimate, phase);
    double fraction = fmin(1.0, fmax(0.0, elapsed(T) / T->budget));
    T->opts->progress(fraction, line, T->opts->user_data);
}

// ---- candidate spaces ------------------------------------------------------------------------------

// Xgemm, GEMMK 0, in "natural" coordinates: work-group MDIMC×NDIMC, each work-item MWI×NWI.
enum { XC_MDIMC, XC_NDIMC, XC_MWI, XC_NWI, XC_VWM, XC_VWN, XC_KWG, XC_KWI, XC_SA, XC_SB, XC_STRM,
       XC_STRN, XC_DIMS };
static const size_t xc_ladder[XC_DIMS][6] = {
    {1, 2, 4, 8, 16, 0}, {1, 2, 4, 8, 16, 0}, {4, 8, 16, 32, 64, 0}, {2, 4, 8, 16, 32, 0},
    {1, 2, 4, 8, 16, 0}, {1, 2, 4, 8, 16, 0}, {8, 16, 32, 64, 0, 0}, {1, 2, 4, 8, 0, 0},
    {0, 1, 0, 0, 0, 0},  {0, 1, 0, 0, 0, 0},  {0, 1, 0, 0, 0, 0},    {0, 1, 0, 0, 0, 0}};
static const size_t xc_ladder_len[XC_DIMS] = {5, 5, 5, 5, 5, 5, 4, 4, 2, 2, 2, 2};

// XgemmDirect: MDIMAD = MDIMCD, NDIMBD = NDIMCD.
enum { DC_WGD, DC_MDIMCD, DC_NDIMCD, DC_KWID, DC_VWMD, DC_VWND, DC_PADA, DC_PADB, DC_DIMS };
static const size_t dc_ladder[DC_DIMS][5] = {
    {8, 16, 32, 64, 0}, {1, 2, 4, 8, 16}, {1, 2, 4, 8, 16}, {1, 2, 4, 8, 16},
    {1, 2, 4, 8, 16},   {1, 2, 4, 8, 16}, {0, 1, 0, 0, 0},  {0, 1, 0, 0, 0}};
static const size_t dc_ladder_len[DC_DIMS] = {4, 5, 5, 5, 5, 5, 2, 2};

typedef struct cand {
    size_t c[XC_DIMS];  // XC_DIMS >= DC_DIMS
} cand;

static void xc_params(const cand *x, size_t *p) {
    const size_t *c = x->c;
    size_t v[CLMHA__XGEMM_PARAMS] = {0,           1,           c[XC_KWG],  c[XC_KWI],
                                     c[XC_MDIMC], c[XC_MDIMC], c[XC_MDIMC] * c[XC_MWI],
                                     c[XC_NDIMC], c[XC_NDIMC], c[XC_NDIMC] * c[XC_NWI],
                                     c[XC_SA],    c[XC_SB],    c[XC_STRM], c[XC_STRN],
                                     c[XC_VWM],   c[XC_VWN]};
    memcpy(p, v, sizeof v);
}

static bool xc_from_params(const size_t *p, cand *x) {
    if (p[GEMMK] != 0 || p[MDIMA] != p[MDIMC] || p[NDIMB] != p[NDIMC] || !p[MDIMC] ||
        !p[NDIMC] || p[MWG] % p[MDIMC] || p[NWG] % p[NDIMC])
        return false;
    size_t c[XC_DIMS] = {p[MDIMC],        p[NDIMC], p[MWG] / p[MDIMC], p[NWG] / p[NDIMC],
                         p[VWM],          p[VWN],   p[KWG],            p[KWI],
                         p[SA],           p[SB],    p[STRM],           p[STRN]};
    memcpy(x->c, c, sizeof c);
    return true;
}

static void dc_params(const cand *d, size_t *p) {
    const size_t *c = d->c;
    size_t v[CLMHA__DIRECT_PARAMS] = {c[DC_KWID],   c[DC_MDIMCD], c[DC_MDIMCD], c[DC_NDIMCD],
                                      c[DC_NDIMCD], c[DC_PADA],   c[DC_PADB],   c[DC_VWMD],
                                      c[DC_VWND],   c[DC_WGD]};
    memcpy(p, v, sizeof v);
}

static bool xc_valid(const tuner *T, const cand *x) {
    const size_t *c = x->c;
    if (c[XC_MDIMC] * c[XC_MWI] > 256 || c[XC_NDIMC] * c[XC_NWI] > 256) return false;
    if (c[XC_MWI] * c[XC_NWI] > 1024) return false;  // accumulators per work-item
    size_t p[CLMHA__XGEMM_PARAMS];
    xc_params(x, p);
    return check_xgemm(p, device_local_mem(T->ctx), T->ctx->max_work_group, NULL, 0);
}

static bool dc_valid(const tuner *T, const cand *d) {
    size_t p[CLMHA__DIRECT_PARAMS];
    dc_params(d, p);
    return check_direct(p, device_local_mem(T->ctx), T->ctx->max_work_group, NULL, 0);
}

static double log2d(double v) { return log(v) / log(2.0); }

// Prior for a CPU device (higher is tried first): 256 accumulators per work-item (16 AVX-512
// registers), wide vectors, small work-groups, no local memory (barriers make PoCL keep every
// work-item's registers in memory), KWG 16/32. On a GPU the same order is merely a start.
static double xc_prior(const tuner *T, const cand *x) {
    const size_t *c = x->c;
    bool cpu = (T->ctx->info.type & CL_DEVICE_TYPE_CPU) != 0;
    double acc = (double)(c[XC_MWI] * c[XC_NWI]);
    double s = -fabs(log2d(acc / 256.0));
    // PoCL on AVX-512 measured: VWM 8 best, 16 about half as fast (float16 is split badly).
    s -= c[XC_VWM] == 8 ? 0 : c[XC_VWM] == 4 ? 0.5 : c[XC_VWM] == 16 ? 1.5 : 2;
    s -= c[XC_VWN] == 4 || c[XC_VWN] == 8 ? 0 : c[XC_VWN] == 16 ? 0.5 : 1;
    s -= 1.5 * (double)(c[XC_SA] + c[XC_SB]) * (cpu ? 1 : -0.5);
    s -= 0.5 * (double)(c[XC_STRM] + c[XC_STRN]);
    double wg = (double)(c[XC_MDIMC] * c[XC_NDIMC]);
    s -= cpu ? fabs(log2d(wg / 24.0)) * 0.5 : fabs(log2d(wg / 256.0)) * 0.5;
    s -= c[XC_KWG] == 16 || c[XC_KWG] == 32 ? 0 : 0.5;
    s -= c[XC_KWI] == 2 || c[XC_KWI] == 4 ? 0 : 0.5;
    return s;
}

// XgemmDirect on PoCL: its work-items share local memory across barriers, and the kernel's
// build time grows steeply with the tile per work-item (WGD/MDIMCD × WGD/NDIMCD): 16 builds in
// ~40 s, 64 took over 3 minutes. On a CPU small tiles per work-item come first.
static double dc_prior(const tuner *T, const cand *d) {
    const size_t *c = d->c;
    bool cpu = (T->ctx->info.type & CL_DEVICE_TYPE_CPU) != 0;
    double mwi = (double)(c[DC_WGD] / c[DC_MDIMCD]), nwi = (double)(c[DC_WGD] / c[DC_NDIMCD]);
    double s = cpu ? -fmax(0.0, log2d(mwi * nwi / 16.0)) * 1.5 - fabs(log2d(mwi * nwi / 16.0)) * 0.3
                   : -fabs(log2d(mwi * nwi / 64.0)) * 0.7;
    s -= c[DC_VWMD] >= 2 ? 0 : 1;
    s -= c[DC_VWND] >= 2 ? 0 : 0.5;
    double wg = (double)(c[DC_MDIMCD] * c[DC_NDIMCD]);
    s -= fabs(log2d(wg / 64.0)) * 0.5;
    s -= c[DC_KWID] >= 2 && c[DC_KWID] <= 8 ? 0 : 0.5;
    s -= 0.3 * (double)(c[DC_PADA] + c[DC_PADB]) * (cpu ? 1 : -1);
    s -= c[DC_WGD] == 16 || c[DC_WGD] == 32 ? 0 : 0.3;
    return s;
}

// Index of @p v on a ladder, or -1.
static int ladder_index(const size_t *ladder, size_t len, size_t v) {
    for (size_t i = 0; i < len; ++i)
        if (ladder[i] == v) return (int)i;
    return -1;
}

typedef struct cand_list {
    cand items[512];
    double prior[512];
    size_t count;
} cand_list;

static bool same_cand(const cand *a, const cand *b) { return memcmp(a, b, sizeof *a) == 0; }

static bool list_has(const cand *items, size_t count, const cand *x) {
    for (size_t i = 0; i < count; ++i)
        if (same_cand(&items[i], x)) return true;
    return false;
}

// Neighbours of @p centre: one coordinate one step along its ladder, and the work moved
// between the work-group and the work-item (MDIMC×2 with MWI/2 and so on: same tile).
static void neighbours(const tuner *T, bool direct, const cand *centre, const cand *seen,
                       size_t nseen, cand_list *out) {
    out->count = 0;
    size_t dims = direct ? DC_DIMS : XC_DIMS;
    for (size_t d = 0; d < dims; ++d) {
        const size_t *ladder = direct ? dc_ladder[d] : xc_ladder[d];
        size_t len = direct ? dc_ladder_len[d] : xc_ladder_len[d];
        int at = ladder_index(ladder, len, centre->c[d]);
        for (int step = -1; step <= 1; step += 2) {
            cand x = *centre;
            if (at < 0) {
                if (step > 0) continue;
                x.c[d] = ladder[0];
            } else {
                int to = at + step;
                if (to < 0 || to >= (int)len) continue;
                x.c[d] = ladder[to];
            }
            if (out->count < 512 && !list_has(seen, nseen, &x) &&
                !list_has(out->items, out->count, &x) &&
                (direct ? dc_valid(T, &x) : xc_valid(T, &x)))
                out->items[out->count++] = x;
        }
    }
    if (!direct) {  // same tile, threads traded for work per thread
        for (int dim = 0; dim < 2; ++dim) {
            size_t th = dim ? XC_NDIMC : XC_MDIMC, wi = dim ? XC_NWI : XC_MWI;
            for (int up = 0; up < 2; ++up) {
                cand x = *centre;
                if (up) {
                    if (x.c[wi] < 2) continue;
                    x.c[th] *= 2, x.c[wi] /= 2;
                } else {
                    if (x.c[th] < 2) continue;
                    x.c[th] /= 2, x.c[wi] *= 2;
                }
                if (ladder_index(xc_ladder[th], xc_ladder_len[th], x.c[th]) < 0 ||
                    ladder_index(xc_ladder[wi], xc_ladder_len[wi], x.c[wi]) < 0)
                    continue;
                if (out->count < 512 && !list_has(seen, nseen, &x) &&
                    !list_has(out->items, out->count, &x) && xc_valid(T, &x))
                    out->items[out->count++] = x;
            }
        }
    }
    for (size_t i = 0; i < out->count; ++i)
        out->prior[i] = direct ? dc_prior(T, &out->items[i]) : xc_prior(T, &out->items[i]);
    // Highest prior first (insertion sort: short lists).
    for (size_t i = 1; i < out->count; ++i) {
        cand x = out->items[i];
        double p = out->prior[i];
        size_t j = i;
        for (; j > 0 && out->prior[j - 1] < p; --j) {
            out->items[j] = out->items[j - 1];
            out->prior[j] = out->prior[j - 1];
        }
        out->items[j] = x;
        out->prior[j] = p;
    }
}

// A random valid candidate, drawn by prior (the best of a few random draws).
static bool random_cand(tuner *T, bool direct, const cand *seen, size_t nseen, cand *out) {
    size_t dims = direct ? DC_DIMS : XC_DIMS;
    double best_prior = -INFINITY;
    bool found = false;
    for (int draw = 0; draw < 400; ++draw) {
        cand x = {{0}};
        for (size_t d = 0; d < dims; ++d) {
            size_t len = direct ? dc_ladder_len[d] : xc_ladder_len[d];
            x.c[d] = (direct ? dc_ladder[d] : xc_ladder[d])[next_rand(&T->rng) % len];
        }
        if (!(direct ? dc_valid(T, &x) : xc_valid(T, &x)) || list_has(seen, nseen, &x)) continue;
        // A random jitter keeps the draws diverse.
        double p = (direct ? dc_prior(T, &x) : xc_prior(T, &x)) +
                   (double)(next_rand(&T->rng) % 1000) / 400.0;
        if (p > best_prior) best_prior = p, *out = x, found = true;
        if (draw > 40 && found) break;
    }
    return found;
}

// ---- phases -----------------------------------------------------------------------------------------

typedef struct result {
    bool ok;
    double cost;                  // seconds the candidate took (build included)
    double total;                 // summed fastest seconds over the phase's shapes
    double times[MAX_SHAPES];
} result;

// Applies @p t, checks and times one candidate. *r gets its result (ok false when it failed to
// build, run or check).
static void try_candidate(tuner *T, const clmha__tuning *t, bool batched, double reference,
                          const char *phase, result *r) {
    double t0 = now_s();
    r->ok = false;
    r->total = INFINITY;
    T->msg[0] = '\0';
    T->overridden = true;
    // Phase A checks samples of its timed products only: the odd-sized plain GEMMs would build
    // the pad kernels too (seconds per candidate on PoCL); the final check runs them.
    if (override_all(T->ctx, t) == CLMHA_SUCCESS && run_checks(T, false, batched) &&
        time_kind(T, batched, 5, reference, r->times, &r->total))
        r->ok = true;
    if (!r->ok) ++T->rejected;
    ++T->tried;
    r->cost = now_s() - t0;
    T->cost_sum += r->cost;
#ifdef CLMHA_TUNE_TRACE  // developer builds: -DCLMHA_TUNE_TRACE prints every candidate
    char params[640];
    clmha__tuning shown = *t;
    shown.has_routine = false;
    (batched ? &shown.has_xgemm : &shown.has_direct)[0] = false;
    clmha__tuning_format(&shown, params, sizeof params);
    fprintf(stderr, "[tune %6.1fs] %s %s: %s", elapsed(T), phase, params,
            r->ok ? "" : T->msg);
    if (r->ok)
        for (size_t i = 0; i < T->nshapes; ++i)
            if (r->times[i] > 0)
                fprintf(stderr, " %.1f", flops(&T->shapes[i]) / r->times[i] / 1e9);
    fprintf(stderr, " GFLOP/s (%.1f s)\n", now_s() - t0);
#endif
    progress(T, phase);
}

// Seconds a candidate of a phase is expected to take (a build of the Sgemm program for Xgemm,
// of the larger strided batched one for XgemmDirect).
static double expected_cost(const tuner *T, bool direct) {
    if (T->phase_tried[direct]) return T->phase_cost[direct] / (double)T->phase_tried[direct];
    double xgemm = T->phase_tried[0] ? T->phase_cost[0] / (double)T->phase_tried[0] : 10.0;
    // A direct candidate builds the larger batched program, and on PoCL its kernel takes ~10×
    // longer to build than Xgemm's.
    bool cpu = (T->ctx->info.type & CL_DEVICE_TYPE_CPU) != 0;
    return direct ? (cpu ? 8 : 3) * xgemm : xgemm;
}

static void trace_turns(const tuner *T, const char *phase, const double *tbest,
                        const double *tx) {
#ifdef CLMHA_TUNE_TRACE
    fprintf(stderr, "[tune %6.1fs] %s in turns, best | candidate:", elapsed(T), phase);
    for (size_t i = 0; i < T->nshapes; ++i)
        if (tbest[i] > 0 && tx[i] > 0)
            fprintf(stderr, " %.1f | %.1f", flops(&T->shapes[i]) / tbest[i] / 1e9,
                    flops(&T->shapes[i]) / tx[i] / 1e9);
    fprintf(stderr, " GFLOP/s\n");
#else
    (void)T, (void)phase, (void)tbest, (void)tx;
#endif
}

// Times @p a and @p b in turns (ROUNDS_IN_TURNS rounds of 2 runs each, their programs already
// built) on the shapes of one kind; ta[i] and tb[i] get each shape's fastest time (0 for shapes
// of the other kind). On a machine shared with other work, timings taken a minute apart are not
// comparable; timings taken in turns are. False on a failure (T->msg says why).
#define ROUNDS_IN_TURNS 3
static bool time_in_turns(tuner *T, const clmha__tuning *a, const clmha__tuning *b,
                          bool batched, double *ta, double *tb) {
    for (size_t i = 0; i < T->nshapes; ++i) ta[i] = tb[i] = 0;
    for (int round = 0; round < ROUNDS_IN_TURNS; ++round)
        for (int which = 0; which < 2; ++which) {
            double times[MAX_SHAPES], total, *keep = which ? tb : ta;
            if (override_all(T->ctx, which ? b : a) != CLMHA_SUCCESS ||
                !time_kind(T, batched, 2, 0, times, &total))
                return false;
            for (size_t i = 0; i < T->nshapes; ++i)
                if (times[i] > 0 && (keep[i] <= 0 || times[i] < keep[i])) keep[i] = times[i];
        }
    return true;
}

// Search over one kernel (Xgemm or XgemmDirect) until @p deadline (seconds since start):
// the seeds, then a walk from the best (single steps, in prior order; an improvement of 2 %
// or more moves the centre), then prior-weighted random samples (an improvement starts a new
// walk). @p base holds the other kernels' values. *best_cand and *best get the winner.
static bool search(tuner *T, bool direct, clmha__tuning base, size_t min_indirect,
                   const cand *seeds, size_t nseeds, double (*deadline)(const tuner *),
                   cand *best_cand, result *best) {
    enum { SEEDS, WALK_START, WALK, RANDOM } mode = SEEDS;
    enum { MAX_SEEN = 256 };
    const char *phase = direct ? "XgemmDirect" : "Xgemm";
    base.has_routine = true;
    base.min_indirect = min_indirect;
    if (direct)
        base.has_direct = true;
    else
        base.has_xgemm = true;
    best->ok = false;
    best->total = INFINITY;
    bool have = false;
    cand *seen = malloc(MAX_SEEN * sizeof *seen);
    cand_list *nb = malloc(sizeof *nb);
    if (!seen || !nb) {
        free(seen);
        free(nb);
        return false;
    }
    size_t nseen = 0, seed_at = 0, nb_at = 0;
    nb->count = 0;
    enum { TOP = 3 };
    cand top[TOP];
    result top_r[TOP];
    size_t ntop = 0;
    while (nseen < MAX_SEEN && elapsed(T) + expected_cost(T, direct) <= deadline(T)) {
        cand x;
        if (mode == SEEDS) {
            if (seed_at >= nseeds) {
                mode = have ? WALK_START : RANDOM;
                continue;
            }
            x = seeds[seed_at++];
            if (list_has(seen, nseen, &x) || !(direct ? dc_valid(T, &x) : xc_valid(T, &x)))
                continue;
        } else if (mode == WALK_START) {
            neighbours(T, direct, best_cand, seen, nseen, nb);
            nb_at = 0;
            mode = WALK;
            continue;
        } else if (mode == WALK) {
            if (nb_at >= nb->count) {
                mode = RANDOM;
                continue;
            }
            x = nb->items[nb_at++];
            if (list_has(seen, nseen, &x)) continue;
        } else if (!random_cand(T, direct, seen, nseen, &x)) {
            break;
        }
        seen[nseen++] = x;
        clmha__tuning t = base;
        if (direct)
            dc_params(&x, t.direct);
        else
            xc_params(&x, t.xgemm);
        result r;
        try_candidate(T, &t, direct, have ? best->total : 0, phase, &r);
        // A candidate that ran is timed again in turns with the best so far and judged on those
        // turns: its times become the best's times scaled by the ratios seen in turns. One cut
        // short as more than 2.5× slower gets its turns too (other work on the machine may have
        // slowed it), unless its first shape alone took more than 10× the best's.
        bool close = false;
        for (size_t i = 0; i < T->nshapes && have && r.ok; ++i)
            if (r.times[i] > 0) {
                close = isfinite(r.total) || r.times[i] <= 10 * best->times[i];
                break;
            }
        if (close) {
            double t0 = now_s(), tbest[MAX_SHAPES], tx[MAX_SHAPES];
            clmha__tuning tb = base;
            if (direct)
                dc_params(best_cand, tb.direct);
            else
                xc_params(best_cand, tb.xgemm);
            if (time_in_turns(T, &tb, &t, direct, tbest, tx)) {
                r.total = 0;
                for (size_t i = 0; i < T->nshapes; ++i) {
                    if (tx[i] > 0 && tbest[i] > 0) r.times[i] = best->times[i] * tx[i] / tbest[i];
                    r.total += r.times[i];
                }
                trace_turns(T, phase, tbest, tx);
            } else {
                r.ok = false;
                ++T->rejected;
            }
            r.cost += now_s() - t0;
            T->cost_sum += now_s() - t0;
        }
        T->phase_cost[direct] += r.cost;
        ++T->phase_tried[direct];
        if (r.ok && isfinite(r.total)) {  // keep the TOP fastest, fastest first
            size_t at = ntop < TOP ? ntop++ : TOP;
            if (at == TOP && r.total < top_r[TOP - 1].total) at = TOP - 1;
            if (at < TOP) {
                for (; at > 0 && top_r[at - 1].total > r.total; --at) {
                    top[at] = top[at - 1];
                    top_r[at] = top_r[at - 1];
                }
                top[at] = x;
                top_r[at] = r;
            }
        }
        if (r.ok && r.total < best->total) {
            bool moved = !have || r.total < 0.98 * best->total;
            *best = r;
            *best_cand = x;
            have = true;
            if (!direct && r.times[0] > 0)
                T->best_gflops = flops(&T->shapes[0]) / r.times[0] / 1e9;
            if (moved && mode != SEEDS) mode = WALK_START;
        }
    }
    free(seen);
    free(nb);
    // Timings on a busy machine are noisy: the leaders are timed again, in turns (their programs
    // are in CLBlast's cache: no build), and are judged on these turns alone (fastest of each).
    // Three rounds when they fit before the deadline (plus a little), else two.
    double again = 0;
    for (size_t i = 0; i < ntop; ++i) again += 3 * top_r[i].total;
    int rounds = elapsed(T) + 3 * again <= deadline(T) + 10 ? 3 : 2;
    if (ntop >= 2) {
        double fresh[TOP][MAX_SHAPES];
        bool timed[TOP] = {false};
        for (int round = 0; round < rounds; ++round)
            for (size_t i = 0; i < ntop; ++i) {
                clmha__tuning t = base;
                if (direct)
                    dc_params(&top[i], t.direct);
                else
                    xc_params(&top[i], t.xgemm);
                double times[MAX_SHAPES], total;
                if (override_all(T->ctx, &t) != CLMHA_SUCCESS ||
                    !time_kind(T, direct, 3, 0, times, &total))
                    continue;
                for (size_t k = 0; k < T->nshapes; ++k)
                    if (!timed[i] || (times[k] > 0 && times[k] < fresh[i][k]))
                        fresh[i][k] = times[k];
                timed[i] = true;
            }
        for (size_t i = 0; i < ntop; ++i) {
            if (!timed[i]) {
                top_r[i].total = INFINITY;
                continue;
            }
            top_r[i].total = 0;
            for (size_t k = 0; k < T->nshapes; ++k) {
                top_r[i].times[k] = fresh[i][k];
                top_r[i].total += fresh[i][k];
            }
        }
        size_t win = 0;
        for (size_t i = 1; i < ntop; ++i)
            if (top_r[i].total < top_r[win].total) win = i;
#ifdef CLMHA_TUNE_TRACE
        for (size_t i = 0; i < ntop; ++i)
            fprintf(stderr, "[tune %6.1fs] %s leader %zu timed again: %.4f s%s\n", elapsed(T),
                    phase, i, top_r[i].total, i == win ? " (chosen)" : "");
#endif
        *best_cand = top[win];
        *best = top_r[win];
        if (!direct && best->times[0] > 0)
            T->best_gflops = flops(&T->shapes[0]) / best->times[0] / 1e9;
    }
    return have;
}

// The phases' deadlines, from the costs seen so far. The final check builds both programs; the
// indirect timing of the attention products builds the batched one; the leaders of a phase are
// timed again (no build). XgemmDirect is searched only when two candidates fit in 20 % of the
// budget: on PoCL a direct kernel takes one to several minutes to build (and was not faster
// than the tuned indirect path on the attention products).
static bool any_batched_shape(const tuner *T) {
    for (size_t i = 0; i < T->nshapes; ++i)
        if (T->shapes[i].batch) return true;
    return false;
}

static bool direct_planned(const tuner *T) {
    return any_batched_shape(T) && 2 * expected_cost(T, true) <= 0.2 * T->budget;
}

static double deadline_xgemm(const tuner *T) {
    double xc = expected_cost(T, false);
    double reserve = xc;  // the final check's Sgemm build (small budgets overrun by the rest)
    if (T->budget >= 120) reserve += xc + 15 + (any_batched_shape(T) ? 1.5 * xc : 0);
    if (direct_planned(T)) reserve += 2 * expected_cost(T, true);
    return T->budget - reserve;
}

static double deadline_direct(const tuner *T) {
    return T->budget - 2 * expected_cost(T, false) - 15;
}

// Times every shape with the current parameters: 5 runs, median into before/after.
static bool time_all(tuner *T, bool after, double *plain_total, double *batched_total) {
    *plain_total = *batched_total = 0;
    for (size_t i = 0; i < T->nshapes; ++i) {
        gshape *s = &T->shapes[i];
        double best, median;
        if (!shape_time(T, s, 5, 0, &best, &median)) return false;
        double rel;
        if (shape_check(T, s, 256, &rel)) return false;
        if (!(rel <= CHECK_TOLERANCE)) {
            snprintf(T->msg, sizeof T->msg, "%s: wrong result (max rel error %.2e)", s->label, rel);
            return false;
        }
        if (after) {
            s->after = median;
        } else {
            s->before = median;
            s->before_best = best;
        }
        *(s->batch ? batched_total : plain_total) += best;
    }
    return true;
}

// Cube root of m·n·k (per batch item): CLBlast takes the direct path when it is below
// XGEMM_MIN_INDIRECT_SIZE.
static double side_of(const gshape *s) {
    return cbrt((double)s->m * (double)s->n * (double)s->k);
}

// True when both values send every shape the same way.
static bool same_paths(const tuner *T, size_t a, size_t b) {
    for (size_t i = 0; i < T->nshapes; ++i)
        if (goes_direct(&T->shapes[i], a) != goes_direct(&T->shapes[i], b)) return false;
    return true;
}

// A XGEMM_MIN_INDIRECT_SIZE that sends every batched shape direct and every plain one
// indirect, in the (geometric) middle of the gap; 0 when the sizes overlap.
static size_t split_guess(const tuner *T) {
    double lo = 0, hi = INFINITY;
    for (size_t i = 0; i < T->nshapes; ++i) {
        double side = side_of(&T->shapes[i]);
        if (T->shapes[i].batch) lo = fmax(lo, side);
        else hi = fmin(hi, side);
    }
    if (!(lo < hi) || !isfinite(hi)) return 0;
    for (size_t cut = (size_t)floor(sqrt(fmax(lo, 1) * hi)), tries = 0; tries < 4; ++cut, ++tries) {
        bool ok = cut > 0;
        for (size_t i = 0; i < T->nshapes && ok; ++i)
            ok = goes_direct(&T->shapes[i], cut) == (T->shapes[i].batch != 0);
        if (ok) return cut;
    }
    return 0;
}

static void trace_shapes(const tuner *T, const char *what, const double *times) {
#ifdef CLMHA_TUNE_TRACE
    fprintf(stderr, "[tune %6.1fs] %s:", elapsed(T), what);
    for (size_t i = 0; i < T->nshapes; ++i)
        if (times[i] > 0) fprintf(stderr, " %.1f", flops(&T->shapes[i]) / times[i] / 1e9);
    fprintf(stderr, " GFLOP/s\n");
#else
    (void)T, (void)what, (void)times;
#endif
}

// The XGEMM_MIN_INDIRECT_SIZE that minimises the summed time of the shapes, from their
// fastest direct and indirect times.
static size_t choose_min_indirect(const tuner *T, size_t fallback) {
    size_t cuts[2 * MAX_SHAPES + 2], ncuts = 0;
    cuts[ncuts++] = 0;
    cuts[ncuts++] = FORCE_DIRECT;
    for (size_t i = 0; i < T->nshapes; ++i) {
        const gshape *s = &T->shapes[i];
        double mnk = (double)s->m * (double)s->n * (double)s->k;
        size_t r = (size_t)floor(cbrt(mnk));
        while ((double)r * r * r > mnk) --r;
        while ((double)(r + 1) * (r + 1) * (r + 1) <= mnk) ++r;
        cuts[ncuts++] = r;      // r³ <= mnk: this shape indirect
        cuts[ncuts++] = r + 1;  // (r+1)³ > mnk: this shape direct
    }
    double best_total = INFINITY;
    size_t best_cut = fallback;
    for (size_t c = 0; c < ncuts; ++c) {
        double total = 0;
        for (size_t i = 0; i < T->nshapes && isfinite(total); ++i) {
            const gshape *s = &T->shapes[i];
            double mnk = (double)s->m * (double)s->n * (double)s->k;
            double cube = (double)cuts[c] * cuts[c] * cuts[c];
            double t = mnk < cube ? s->t_dir : s->t_ind;
            total += t > 0 ? t : INFINITY;
        }
        if (total < best_total * (1 - 1e-9)) best_total = total, best_cut = cuts[c];
    }
    if (!isfinite(best_total)) return fallback;
    // Put the cut in the middle (geometric) of the gap between the shapes it separates, so
    // that other shapes of similar size go the same way.
    double below = 0, above = (double)FORCE_DIRECT;
    for (size_t i = 0; i < T->nshapes; ++i) {
        const gshape *s = &T->shapes[i];
        double side = cbrt((double)s->m * (double)s->n * (double)s->k);
        if (side < (double)best_cut) below = fmax(below, side);
        else above = fmin(above, side);
    }
    // With every shape on one side, the cut is kept near them rather than at 0 or "never":
    // GEMMs far smaller than any timed one keep the direct path (below side 64, where the
    // indirect path's pad and transpose kernels cost more than the product), and GEMMs far
    // larger keep the indirect one.
    if (below == 0 && above < (double)FORCE_DIRECT) below = fmin(64.0, above / 2);
    if (above == (double)FORCE_DIRECT && below > 0) above = 4 * below;
    if (below > 0 && above < (double)FORCE_DIRECT) {
        size_t mid = (size_t)floor(sqrt(below * above));
        if ((double)mid > below && (double)mid <= above && same_paths(T, mid, best_cut))
            best_cut = mid;
    }
    return best_cut;
}

static void add_shape(tuner *T, const char *label, size_t m, size_t n, size_t k, size_t batch,
                      bool tb) {
    gshape *s = &T->shapes[T->nshapes++];
    memset(s, 0, sizeof *s);
    snprintf(s->label, sizeof s->label, "%s", label);
    s->m = m, s->n = n, s->k = k, s->batch = batch, s->tb = tb;
}

static clmha_status check_options(clmha_context *ctx, const clmha_tune_options *o) {
    if (!o) return CLMHA_SUCCESS;
    if (!(o->budget_seconds >= 0) || o->budget_seconds > 86400)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "budget_seconds must be from 0 (default) to 86400 (got %g)",
                           o->budget_seconds);
    if (o->num_shapes > MAX_LAYERS)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "num_shapes is %zu, at most %d are tuned",
                           o->num_shapes, MAX_LAYERS);
    if (o->num_shapes && !o->shapes)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "shapes is NULL, num_shapes %zu",
                           o->num_shapes);
    for (size_t i = 0; i < o->num_shapes; ++i) {
        const clmha_tune_shape *s = &o->shapes[i];
        if (!s->batch || !s->tgt_len || !s->embed_dim || !s->num_heads ||
            s->embed_dim % s->num_heads)
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                               "shapes[%zu] = (N %zu, L %zu, E %zu, H %zu): every size must be "
                               "positive and E a multiple of H",
                               i, s->batch, s->tgt_len, s->embed_dim, s->num_heads);
        // The largest tuning matrix: scores (N·H, L, L), and the projection (N·L, 3E).
        double scores = (double)s->batch * (double)s->num_heads * (double)s->tgt_len *
                        (double)s->tgt_len;
        double proj = (double)s->batch * (double)s->tgt_len * 3.0 * (double)s->embed_dim;
        if (scores > 128.0 * 1048576 || proj > 128.0 * 1048576 || s->embed_dim > 65536)
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                               "shapes[%zu] = (N %zu, L %zu, E %zu, H %zu) is too large to tune "
                               "on (at most 2^27 elements per matrix)",
                               i, s->batch, s->tgt_len, s->embed_dim, s->num_heads);
    }
    return CLMHA_SUCCESS;
}

// ---- fused attention tiles ------------------------------------------------------------------------

// What the fused-tile phase measured.
typedef struct fused_result {
    bool searched;                // the phase ran and its default passed the check
    bool improved;                // a candidate beat the default
    size_t best[CLMHA__FUSED_PARAMS];
    double default_ms, best_ms;   // medians of the fused stage (one profiled forward each)
    double flops;                 // 4·N·L·S·E of the shape
    size_t tried, rejected;
} fused_result;

// Times the fused stage of @p layer on the prepared call: one warm-up (builds, checks the
// output against @p ref within 1e-4·(1 + max|ref|)), then @p reps profiled forwards.
static bool fused_time(clmha_layer *layer, const clmha_forward_args *args, cl_mem out,
                       float *host_out, const double *ref, size_t count, double scale, int reps,
                       double *ms) {
    clmha_context *ctx = layer->ctx;
    if (clmha_layer_forward(layer, args, out, 0, NULL, 0, 0, NULL, NULL) ||
        clEnqueueReadBuffer(ctx->queue, out, CL_TRUE, 0, count * sizeof(float), host_out, 0,
                            NULL, NULL) != CL_SUCCESS)
        return false;
    for (size_t i = 0; i < count; ++i) {
        double e = fabs((double)host_out[i] - ref[i]);
        if (!(e <= 1e-4 * scale)) return false;  // NaN fails too
    }
    double t[9];
    if (reps > 9) reps = 9;
    for (int r = 0; r < reps; ++r) {
        double stages[CLMHA_STAGE_COUNT];
        if (clmha_layer_forward(layer, args, out, 0, NULL, 0, 0, NULL, NULL) ||
            clmha_layer_stage_times(layer, stages))
            return false;
        t[r] = stages[CLMHA_STAGE_FUSED];
    }
    qsort(t, (size_t)reps, sizeof t[0], cmp_double);
    *ms = t[reps / 2];
    return true;
}

// D. The fused attention kernel's tiles on the first layer shape (self-attention, random
// parameters and inputs): every candidate must reproduce the double-precision reference's
// output; the fastest fused stage wins. Work-group sizes 32 to 128 (within the device limit),
// keys per tile 16 to 64, one or two rows per work-item, the device class's default vector
// width (CPUs: the native float width) or scalar.
static void tune_fused(tuner *T, const clmha_tune_shape *shape, double deadline,
                       fused_result *res) {
    clmha_context *ctx = T->ctx;
    memset(res, 0, sizeof *res);
    size_t n = shape->batch, l = shape->tgt_len, e = shape->embed_dim, h = shape->num_heads;
    res->flops = 4.0 * (double)n * (double)l * (double)l * (double)e;
    size_t count = n * l * e, nparam = 4 * e * e + 4 * e;
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = e, .num_heads = h,
                             .bias = true};
    clmha_layer *layer = NULL;
    float *params = malloc(nparam * sizeof *params), *x = malloc(count * sizeof *x);
    float *y = malloc(count * sizeof *y);
    double *ref = malloc(count * sizeof *ref);
    cl_mem qbuf = NULL, obuf = NULL;
    if (!params || !x || !y || !ref || clmha_layer_create(&layer, ctx, &desc)) goto done;
    double bound = 1.0 / sqrt((double)e);
    for (size_t i = 0; i < nparam; ++i) params[i] = (float)(bound * rand_unit(&T->rng));
    for (size_t i = 0; i < count; ++i) x[i] = rand_unit(&T->rng);
    const float *w_in = params, *w_out = params + 3 * e * e, *b_in = params + 4 * e * e,
                *b_out = params + 4 * e * e + 3 * e;
    if (clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * e * e) ||
        clmha_layer_set_parameter(layer, "out_proj.weight", w_out, e * e) ||
        clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * e) ||
        clmha_layer_set_parameter(layer, "out_proj.bias", b_out, e))
        goto done;
    clmha_forward_args args = {.struct_size = sizeof args,
                               .query = {.ndim = 3, .shape = {l, n, e}, .data = x},
                               .impl = CLMHA_IMPL_FUSED};
    clmha_reference_params rp = {.struct_size = sizeof rp,
                                 .in_proj_weight = w_in, .in_proj_bias = b_in,
                                 .out_proj_weight = w_out, .out_proj_bias = b_out};
    char msg[256];
    if (clmha_reference_forward(&desc, &rp, &args, ref, count, NULL, 0, msg, sizeof msg))
        goto done;
    double scale = 1.0;
    for (size_t i = 0; i < count; ++i) scale = fmax(scale, 1.0 + fabs(ref[i]));
    cl_int err;
    qbuf = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                          count * sizeof(float), x, &err);
    clmha__held_new(CLMHA__HELD_MEM, qbuf);
    if (err == CL_SUCCESS) {
        obuf = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE, count * sizeof(float), NULL, &err);
        clmha__held_new(CLMHA__HELD_MEM, obuf);
    }
    if (err != CL_SUCCESS) goto done;
    args.query.buffer = qbuf;
    if (clmha_layer_set_profiling(layer, true)) goto done;

    // The default tiles first: the yardstick.
    clmha__fused_tiles def = clmha__fused_tiles_for(ctx, layer->d), used;
    if (clmha__layer_set_fused_tiles(layer, &def, &used) ||
        !fused_time(layer, &args, obuf, y, ref, count, scale, 5, &res->default_ms))
        goto done;
    res->searched = true;
    res->best_ms = res->default_ms;
    res->best[0] = used.bq, res->best[1] = used.bk, res->best[2] = used.rpw, res->best[3] = used.vw;
    size_t vw = clmha__fused_default_vw(ctx);
    static const size_t bqs[] = {64, 32, 128}, bks[] = {32, 64, 16}, rpws[] = {2, 1};
    size_t vws[2] = {vw > 16 ? 16 : vw, 1};
    for (size_t a = 0; a < 3; ++a)
        for (size_t b = 0; b < 3; ++b)
            for (size_t c = 0; c < 2; ++c)
                for (size_t v = 0; v < (vws[0] > 1 ? 2 : 1); ++v) {
                    if (now_s() > deadline) goto done;
                    clmha__fused_tiles cand = {.bq = bqs[a], .bk = bks[b], .rpw = rpws[c],
                                               .vw = vws[v]};
                    if (cand.bq > ctx->max_work_group) continue;
                    double ms;
                    if (clmha__layer_set_fused_tiles(layer, &cand, &used)) {
                        ++res->tried, ++res->rejected;
                        continue;
                    }
                    if (used.bq == def.bq && used.bk == def.bk && used.rpw == def.rpw &&
                        used.vw == def.vw)
                        continue;  // the default, timed above
                    ++res->tried;
                    if (!fused_time(layer, &args, obuf, y, ref, count, scale, 3, &ms)) {
                        ++res->rejected;
                        continue;
                    }
                    // A lead must hold in a second, longer timing.
                    if (ms < res->best_ms &&
                        fused_time(layer, &args, obuf, y, ref, count, scale, 5, &ms) &&
                        ms < 0.97 * res->best_ms) {
                        res->best_ms = ms;
                        res->best[0] = used.bq, res->best[1] = used.bk;
                        res->best[2] = used.rpw, res->best[3] = used.vw;
                        res->improved = true;
                    }
                }
done:
    clmha__release_mem(qbuf);
    clmha__release_mem(obuf);
    clmha_layer_release(layer);
    free(params), free(x), free(y), free(ref);
}

static void fill_report(const tuner *T, clmha_tune_report *rep) {
    const gshape *g = &T->shapes[0], *proj = &T->shapes[1];
    rep->default_gflops = g->before > 0 ? flops(g) / g->before / 1e9 : 0;
    rep->tuned_gflops = g->after > 0 ? flops(g) / g->after / 1e9 : rep->default_gflops;
    rep->default_layer_gflops = proj->before > 0 ? flops(proj) / proj->before / 1e9 : 0;
    rep->tuned_layer_gflops =
        proj->after > 0 ? flops(proj) / proj->after / 1e9 : rep->default_layer_gflops;
    double fb = 0, fa = 0, tb = 0, ta = 0;
    for (size_t i = 1; i < T->nshapes; ++i) {
        const gshape *s = &T->shapes[i];
        fb += flops(s), tb += s->before;
        fa += flops(s), ta += s->after > 0 ? s->after : s->before;
    }
    rep->default_forward_gemm_gflops = tb > 0 ? fb / tb / 1e9 : 0;
    rep->tuned_forward_gemm_gflops = ta > 0 ? fa / ta / 1e9 : 0;
    rep->candidates = T->tried;
    rep->rejected = T->rejected;
    rep->seconds = elapsed(T);
}

clmha_status clmha_context_tune(clmha_context *ctx, const clmha_tune_options *options,
                                clmha_tune_report *report) {
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    clmha_tune_options opts_in;  // the caller's options in this library's layout (docs/abi.md)
    char why[512];
    clmha_status st = options ? CLMHA__STRUCT_IN(clmha_tune_options, &opts_in, options,
                                                 "options", why, sizeof why)
                              : CLMHA_SUCCESS;
    if (!st && report)
        st = CLMHA__STRUCT_OUT_CHECK(clmha_tune_report, report, "report", why, sizeof why);
    if (st) return clmha__fail(ctx, st, "%s", why);
    if (options) options = &opts_in;
    st = check_options(ctx, options);
    if (st) return st;
    clmha_tune_report rep;
    memset(&rep, 0, sizeof rep);
    tuner *T = calloc(1, sizeof *T);
    if (!T) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    T->ctx = ctx;
    T->opts = options;
    T->start = now_s();
    double budget = options && options->budget_seconds > 0 ? options->budget_seconds : 300;
    // The GEMM phases get the budget but what the fused tiles take at the end (phase D).
    double fused_reserve = fmin(60.0, 0.2 * budget);
    T->budget = budget - fused_reserve;
    T->rng = 0x9E3779B97F4A7C15ull;

    // The tuning in effect before: the registry's, else CLBlast's generic parameters (what a
    // device without a database entry of its own gets; see the limitation in clmha.h).
    clmha__tuning before;
    clmha__tuning_meta before_meta;
    bool before_known = current_tuning(ctx->device, &before, &before_meta);
    clmha__tuning fallback = clmha__tuning_clblast_generic;
    if (before_known) {
        if (before.has_xgemm) memcpy(fallback.xgemm, before.xgemm, sizeof fallback.xgemm);
        if (before.has_direct) memcpy(fallback.direct, before.direct, sizeof fallback.direct);
        if (before.has_routine) fallback.min_indirect = before.min_indirect;
    }

    // The shapes: 1024³, then for each layer its packed QKV projection, output projection, QKᵀ
    // and A·V (the GEMMs of one self-attention forward pass).
    clmha_tune_shape layers[MAX_LAYERS];
    size_t nlayers = options && options->num_shapes ? options->num_shapes : 1;
    if (options && options->num_shapes)
        memcpy(layers, options->shapes, nlayers * sizeof layers[0]);
    else
        layers[0] = (clmha_tune_shape){.batch = 8, .tgt_len = 128, .embed_dim = 512,
                                       .num_heads = 8};
    add_shape(T, "sgemm 1024^3", 1024, 1024, 1024, 0, true);
    for (size_t i = 0; i < nlayers; ++i) {
        const clmha_tune_shape *l = &layers[i];
        size_t rows = l->batch * l->tgt_len, e = l->embed_dim, d = e / l->num_heads;
        size_t bh = l->batch * l->num_heads, L = l->tgt_len;
        char label[64];
        snprintf(label, sizeof label, "QKV projection (%zu, %zu, %zu)", rows, 3 * e, e);
        add_shape(T, label, rows, 3 * e, e, 0, true);
        snprintf(label, sizeof label, "output projection (%zu, %zu, %zu)", rows, e, e);
        add_shape(T, label, rows, e, e, 0, true);
        snprintf(label, sizeof label, "QK^T %zu x (%zu, %zu, %zu)", bh, L, L, d);
        add_shape(T, label, L, L, d, bh, true);
        snprintf(label, sizeof label, "AV %zu x (%zu, %zu, %zu)", bh, L, d, L);
        add_shape(T, label, L, d, L, bh, false);
    }
    snprintf(rep.layer, sizeof rep.layer, "%zu,%zu,%zu,%zu", layers[0].batch, layers[0].tgt_len,
             layers[0].embed_dim, layers[0].num_heads);
    T->checks[0] = (gshape){.label = "check sgemm NT (150, 97, 83)", .m = 150, .n = 97, .k = 83,
                            .tb = true};
    T->checks[1] = (gshape){.label = "check sgemm NN (75, 130, 61)", .m = 75, .n = 130, .k = 61};
    T->checks[2] = (gshape){.label = "check batched NT 3 x (37, 70, 19)", .m = 37, .n = 70,
                            .k = 19, .batch = 3, .tb = true};
    T->checks[3] = (gshape){.label = "check batched NN 3 x (70, 29, 45)", .m = 70, .n = 29,
                            .k = 45, .batch = 3};
    for (size_t i = 0; i < T->nshapes && !st; ++i) st = shape_alloc(T, &T->shapes[i]);
    T->nchecks = 4;
    for (size_t i = 0; i < T->nchecks && !st; ++i) st = shape_alloc(T, &T->checks[i]);
    if (st) goto done;

    // 0. Before.
    if (options && options->progress) options->progress(0, "timing the current parameters",
                                                        options->user_data);
    double plain_before, batched_before;
    if (!time_all(T, false, &plain_before, &batched_before)) {
        st = clmha__fail(ctx, CLMHA_BLAS_ERROR,
                         "clmha_context_tune: the GEMMs fail with the current parameters: %s",
                         T->msg);
        goto done;
    }
    T->best_gflops = flops(&T->shapes[0]) / T->shapes[0].before / 1e9;
#ifdef CLMHA_TUNE_TRACE
    fprintf(stderr, "[tune %6.1fs] before (medians):", elapsed(T));
    for (size_t i = 0; i < T->nshapes; ++i)
        fprintf(stderr, " %.1f", flops(&T->shapes[i]) / T->shapes[i].before / 1e9);
    fprintf(stderr, " GFLOP/s\n");
#endif

    // The split the search starts from: the batched (attention) products direct, the plain
    // (projection) ones indirect, cut between their sizes. Phase A times plain shapes only and
    // B batched ones only, so with this split they time the paths they tune, and the winner of
    // B is already built for the final set. When the sizes overlap each phase forces its path.
    size_t split = split_guess(T);
    size_t split_a = split ? split : 0, split_b = split ? split : FORCE_DIRECT;
    // The shapes that took the direct path before: their time is the direct path's with the
    // parameters in effect (what XgemmDirect keeps unless phase B finds better).
    for (size_t i = 0; i < T->nshapes; ++i)
        if (goes_direct(&T->shapes[i], fallback.min_indirect))
            T->shapes[i].t_dir = T->shapes[i].before_best;
    bool any_batched = false;
    for (size_t i = 0; i < T->nshapes; ++i) any_batched |= T->shapes[i].batch != 0;

    // A. Xgemm, leaving time for what follows (deadline_xgemm).
    // The set in effect (a stored tuning) first, then the CPU seeds.
    cand xseeds[XGEMM_SEEDS + 1];
    size_t nxseeds = 0;
    if (before_known && before.has_xgemm && xc_from_params(before.xgemm, &xseeds[nxseeds]))
        ++nxseeds;
    for (size_t i = 0; i < XGEMM_SEEDS; ++i)
        if (xc_from_params(xgemm_seeds[i], &xseeds[nxseeds])) ++nxseeds;
    cand best_x = {{0}}, best_d = {{0}};
    result res_x, res_d;
    // Every kernel not searched keeps `fallback` (what was in effect, as far as it is known).
    clmha__tuning final = fallback;
    bool have_x =
        search(T, false, final, split_a, xseeds, nxseeds, deadline_xgemm, &best_x, &res_x);
    if (have_x) {
        xc_params(&best_x, final.xgemm);
        for (size_t i = 0; i < T->nshapes; ++i)
            if (!T->shapes[i].batch) T->shapes[i].t_ind = res_x.times[i];
    }

    // C1. The tuned indirect path on the attention products (one build of the batched program;
    // on PoCL far cheaper than a direct candidate, whose kernel takes minutes to build).
    if (options && options->progress)
        options->progress(fmin(1.0, elapsed(T) / T->budget), "timing the indirect path on the "
                          "attention products", options->user_data);
    if (have_x && any_batched &&
        elapsed(T) + 2 * expected_cost(T, false) <= T->budget) {
        clmha__tuning t = final;
        double times[MAX_SHAPES], total;
        t.min_indirect = 0;
        T->overridden = true;
        if (override_all(ctx, &t) == CLMHA_SUCCESS && run_checks(T, false, true) &&
            time_kind(T, true, 5, 0, times, &total))
            for (size_t i = 0; i < T->nshapes; ++i)
                if (T->shapes[i].batch) T->shapes[i].t_ind = times[i];
        trace_shapes(T, "indirect on the batched shapes", times);
    }

    // B. XgemmDirect, with what is left but the final check's builds.
    const cand dseeds[] = {
        {{16, 8, 8, 2, 2, 2, 0, 0}},  // WGD, MDIMCD, NDIMCD, KWID, VWMD, VWND, PADA, PADB
        {{32, 8, 8, 2, 4, 4, 0, 0}},
        {{16, 4, 4, 2, 4, 4, 0, 0}},
    };
    bool have_d = false;
    if (any_batched && elapsed(T) + expected_cost(T, true) <= deadline_direct(T)) {
        have_d = search(T, true, final, split_b, dseeds, sizeof dseeds / sizeof dseeds[0],
                        deadline_direct, &best_d, &res_d);
        if (have_d) {
            bool better = false;  // than the direct path before, where it was timed
            for (size_t i = 0; i < T->nshapes; ++i)
                if (T->shapes[i].batch && (T->shapes[i].t_dir <= 0 ||
                                           res_d.times[i] < T->shapes[i].t_dir))
                    better = true;
            if (better) {
                dc_params(&best_d, final.direct);
                for (size_t i = 0; i < T->nshapes; ++i)
                    if (T->shapes[i].batch) T->shapes[i].t_dir = res_d.times[i];
            } else {
                have_d = false;
            }
        }
    }

    // C2. The split: per shape the faster path, one cut for all.
    final.min_indirect = choose_min_indirect(T, split ? split : fallback.min_indirect);
    if (have_d && split && same_paths(T, final.min_indirect, split))
        final.min_indirect = split;  // the winner of B is built with it
#ifdef CLMHA_TUNE_TRACE
    fprintf(stderr, "[tune %6.1fs] XGEMM_MIN_INDIRECT_SIZE %zu (split guess %zu)\n", elapsed(T),
            final.min_indirect, split);
#endif
    // Final: apply, check both routines (odd sizes on both sides of the split: padding and the
    // pad/transpose kernels of the indirect path), time everything.
    size_t cut = final.min_indirect;
    if (cut > 0 && cut <= 1500 && !st) {
        T->checks[4] = (gshape){.m = cut + 37, .n = cut + 53, .k = cut + 29, .tb = true};
        T->checks[5] = (gshape){.m = cut + 45, .n = cut + 31, .k = cut + 57};
        for (int i = 4; i < 6; ++i) {
            gshape *c = &T->checks[i];
            snprintf(c->label, sizeof c->label, "check sgemm %s (%zu, %zu, %zu)",
                     c->tb ? "NT" : "NN", c->m, c->n, c->k);
        }
        T->nchecks = 6;
        for (size_t i = 4; i < 6 && !st; ++i) st = shape_alloc(T, &T->checks[i]);
        if (st) goto done;
    }
    double plain_after = 0, batched_after = 0;
    // XgemmDirect untouched: the GEMMs on its path are what ran before (and, on PoCL, a direct
    // kernel takes long to build).
    T->skip_direct_below = have_d ? 0 : final.min_indirect;
    bool final_ok = (have_x || have_d) && override_all(ctx, &final) == CLMHA_SUCCESS &&
                    run_checks(T, true, true) &&
                    time_all(T, true, &plain_after, &batched_after);
    bool improved = final_ok && plain_after + batched_after < plain_before + batched_before;
#ifdef CLMHA_TUNE_TRACE
    fprintf(stderr, "[tune %6.1fs] final %s: %.3f s (before %.3f s)\n", elapsed(T),
            final_ok ? "ok" : T->msg, plain_after + batched_after, plain_before + batched_before);
#endif
    if (!improved) {
        for (size_t i = 0; i < T->nshapes; ++i) T->shapes[i].after = 0;
        if (T->overridden) {  // back to what was in effect
            override_all(ctx, &fallback);
            if (!before_known)
                set_note(ctx->device, "a tuning run found nothing faster; CLBlast's generic "
                                      "parameters are in effect");
        }
        snprintf(rep.message, sizeof rep.message, "%s%s%.400s",
                 !(have_x || have_d) ? "the budget ran out before a candidate was timed"
                 : !final_ok         ? "the chosen parameters failed the final check"
                                     : "no candidate was faster than the current parameters",
                 T->msg[0] && !final_ok ? ": " : "", T->msg[0] && !final_ok ? T->msg : "");
        if (before_known) clmha__tuning_format(&before, rep.parameters, sizeof rep.parameters);
    } else {
        rep.improved = true;
        fill_report(T, &rep);
        clmha__tuning_meta meta = {.default_gflops = rep.default_gflops,
                                   .tuned_gflops = rep.tuned_gflops,
                                   .default_layer_gflops = rep.default_layer_gflops,
                                   .tuned_layer_gflops = rep.tuned_layer_gflops,
                                   .seconds = rep.seconds,
                                   .candidates = T->tried};
        snprintf(meta.layer, sizeof meta.layer, "%s", rep.layer);
        utc_now(meta.date, sizeof meta.date);
        clmha__tuning_format(&final, rep.parameters, sizeof rep.parameters);
        char msg[1024];
        st = clmha__tuning_apply(ctx, &final, &meta, "tuned in this process (not stored)");
        if (!st && clmha__tuning_path(ctx, rep.path, sizeof rep.path, msg, sizeof msg)) {
            rep.path[0] = '\0';
            snprintf(rep.message, sizeof rep.message, "tuning applied but not stored: %.440s", msg);
        }
        if (!st && rep.path[0] && !(options && options->no_store)) {
            char *text = clmha__tuning_to_json(ctx, &final, &meta);
            if (!text) {
                st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
            } else if (clmha__tuning_write_file(rep.path, text, msg, sizeof msg)) {
                snprintf(rep.message, sizeof rep.message, "tuning applied but not stored: %.440s",
                         msg);
            } else {
                rep.stored = true;
                set_note(ctx->device, "tuned in this process, stored in %s", rep.path);
            }
            free(text);
        }
    }

    // D. The fused attention kernel's tiles, with what is left of the whole budget.
    if (!st) {
        if (options && options->progress)
            options->progress(fmin(1.0, elapsed(T) / budget), "timing fused attention tiles",
                              options->user_data);
        fused_result fr;
        tune_fused(T, &layers[0], T->start + budget, &fr);
        T->tried += fr.tried;
        T->rejected += fr.rejected;
        if (fr.searched) {
            rep.default_fused_gflops = fr.flops / fr.default_ms / 1e6;
            rep.tuned_fused_gflops = fr.flops / fr.best_ms / 1e6;
        }
        if (fr.improved) {
            clmha__tuning ft = {.has_fused = true}, now;
            memcpy(ft.fused, fr.best, sizeof ft.fused);
            clmha__tuning_meta meta = {0};
            current_tuning(ctx->device, &now, &meta);  // keeps the GEMM figures of the file
            if (!meta.date[0]) utc_now(meta.date, sizeof meta.date);
            st = clmha__tuning_apply(ctx, &ft, &meta, "tuned in this process (not stored)");
            char msg[1024];
            if (!st && current_tuning(ctx->device, &now, &meta)) {
                rep.improved = true;
                clmha__tuning_format(&now, rep.parameters, sizeof rep.parameters);
                if (clmha__tuning_path(ctx, rep.path, sizeof rep.path, msg, sizeof msg)) {
                    rep.path[0] = '\0';
                    snprintf(rep.message, sizeof rep.message,
                             "tuning applied but not stored: %.440s", msg);
                } else if (!(options && options->no_store)) {
                    char *text = clmha__tuning_to_json(ctx, &now, &meta);
                    if (!text) {
                        st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
                    } else if (clmha__tuning_write_file(rep.path, text, msg, sizeof msg)) {
                        rep.stored = false;
                        snprintf(rep.message, sizeof rep.message,
                                 "tuning applied but not stored: %.440s", msg);
                    } else {
                        rep.stored = true;
                        rep.message[0] = '\0';
                        set_note(ctx->device, "tuned in this process, stored in %s", rep.path);
                    }
                    free(text);
                }
            }
        }
    }
    fill_report(T, &rep);
    if (!rep.improved) {
        rep.tuned_gflops = rep.default_gflops;
        rep.tuned_layer_gflops = rep.default_layer_gflops;
        rep.tuned_forward_gemm_gflops = rep.default_forward_gemm_gflops;
    }
    if (options && options->progress) options->progress(1.0, "done", options->user_data);
done:
    for (size_t i = 0; i < T->nshapes; ++i) shape_free(&T->shapes[i]);
    for (size_t i = 0; i < T->nchecks; ++i) shape_free(&T->checks[i]);
    if (st && T->overridden) override_all(ctx, &fallback);  // failed half-way: undo
    free(T);
    if (report) clmha__struct_out(report, &rep, sizeof rep);  // no byte past its struct_size
    return st;
}
