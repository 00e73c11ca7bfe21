// The tuning parameter model (see params.h): names, CLBlast 1.5.3's constraints, the text form,
// CLBlast's generic values.
#define _POSIX_C_SOURCE 200809L

#include "tuning_store/params.h"

#include "tuning_store/param_index.h"

#include "base/message.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *const clmha__xgemm_names[CLMHA__XGEMM_PARAMS] = {
    "GEMMK", "KREG", "KWG",  "KWI", "MDIMA", "MDIMC", "MWG",  "NDIMB",
    "NDIMC", "NWG",  "SA",   "SB",  "STRM",  "STRN",  "VWM",  "VWN"};
const char *const clmha__fused_names[CLMHA__FUSED_PARAMS] = {"BQ", "BK", "RPW", "VW"};
const char *const clmha__decode_names[CLMHA__DECODE_PARAMS] = {"ITEMS_PER_CU", "MIN_KEYS"};

const char *const clmha__direct_names[CLMHA__DIRECT_PARAMS] = {
    "KWID", "MDIMAD", "MDIMCD", "NDIMBD", "NDIMCD", "PADA", "PADB", "VWMD", "VWND", "WGD"};

const char *const clmha__routine_names[1] = {"XGEMM_MIN_INDIRECT_SIZE"};

const clmha__tuning clmha__tuning_clblast_generic = {
    .has_xgemm = true,
    .has_direct = true,
    .has_routine = true,
    .xgemm = {0, 1, 32, 2, 8, 8, 32, 16, 16, 32, 1, 1, 0, 0, 4, 2},
    .direct = {2, 8, 8, 8, 8, 1, 1, 1, 1, 16},
    .min_indirect = 896,
};

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
bool clmha__tuning_check_xgemm(const size_t *p, size_t local_mem, size_t max_wg, char *msg,
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
bool clmha__tuning_check_direct(const size_t *p, size_t local_mem, size_t max_wg, char *msg,
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
// up to 256, RPW 1 to 4 (the tiled mapping) or a power of two up to 128 (the lanes mapping's
// rows per work-item), VW 1, 2, 4, 8 or 16 dividing BK. (Whether a tile fits in local memory
// and VW divides head_dim depend on the layer; clmha__fused_tiles_for() adjusts those.)
static bool check_fused(const size_t *p, size_t max_wg, char *msg, size_t msg_size) {
    size_t bq = p[0], bk = p[1], rpw = p[2], vw = p[3];
    const char *why = !bq || (bq & (bq - 1)) || bq > max_wg ? "BQ must be a power of two within "
                                                              "the device's work-group limit"
                      : !bk || (bk & (bk - 1)) || bk > 256 ? "BK must be a power of two up to 256"
                      : !rpw || (rpw > 4 && ((rpw & (rpw - 1)) || rpw > 128))
                          ? "RPW must be 1 to 4 or a power of two up to 128"
                      : !vw || vw > 16 || (vw & (vw - 1)) || bk % vw
                          ? "VW must be 1, 2, 4, 8 or 16 and divide BK"
                          : NULL;
    if (why)
        clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                   "FusedAttention BQ=%zu BK=%zu RPW=%zu VW=%zu: %s (work-group limit %zu)", bq,
                   bk, rpw, vw, why, max_wg);
    return !why;
}

// The decode split: ITEMS_PER_CU 1 to CLMHA__DECODE_ITEMS_MAX work-items per compute unit,
// MIN_KEYS 1 to CLMHA__DECODE_KEYS_MAX keys per range.
static bool check_decode(const size_t *p, char *msg, size_t msg_size) {
    const char *why = !p[0] || p[0] > CLMHA__DECODE_ITEMS_MAX
                          ? "ITEMS_PER_CU must be 1 to " CLMHA__STR(CLMHA__DECODE_ITEMS_MAX)
                      : !p[1] || p[1] > CLMHA__DECODE_KEYS_MAX
                          ? "MIN_KEYS must be 1 to " CLMHA__STR(CLMHA__DECODE_KEYS_MAX)
                          : NULL;
    if (why)
        clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                   "DecodeSplit ITEMS_PER_CU=%zu MIN_KEYS=%zu: %s", p[0], p[1], why);
    return !why;
}

bool clmha__tuning_check(const clmha__tuning *t, size_t local_mem, size_t max_wg, char *msg,
                         size_t msg_size) {
    if (!t->has_xgemm && !t->has_direct && !t->has_routine && !t->has_fused && !t->has_decode) {
        clmha__msg(msg, msg_size, CLMHA_INVALID_FILE, "the tuning names no kernel");
        return false;
    }
    if (t->has_xgemm &&
        !clmha__tuning_check_xgemm(t->xgemm, local_mem, max_wg, msg, msg_size))
        return false;
    if (t->has_direct &&
        !clmha__tuning_check_direct(t->direct, local_mem, max_wg, msg, msg_size))
        return false;
    if (t->has_fused && !check_fused(t->fused, max_wg, msg, msg_size)) return false;
    if (t->has_decode && !check_decode(t->decode, msg, msg_size)) return false;
    if (t->has_routine && t->min_indirect > (size_t)CLMHA__TUNING_PARAM_MAX) {
        clmha__msg(msg, msg_size, CLMHA_INVALID_FILE,
                   "GemmRoutine XGEMM_MIN_INDIRECT_SIZE %zu is above %.0f", t->min_indirect,
                   CLMHA__TUNING_PARAM_MAX);
        return false;
    }
    return true;
}

size_t clmha__tuning_append(char *buf, size_t size, size_t used, const char *fmt, ...) {
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
        used = clmha__tuning_append(buf, size, used, "Xgemm:");
        for (int i = 0; i < CLMHA__XGEMM_PARAMS; ++i)
            used = clmha__tuning_append(buf, size, used, " %s=%zu", clmha__xgemm_names[i],
                                        t->xgemm[i]);
    }
    if (t->has_direct) {
        used = clmha__tuning_append(buf, size, used, "%sXgemmDirect:", used ? "; " : "");
        for (int i = 0; i < CLMHA__DIRECT_PARAMS; ++i)
            used = clmha__tuning_append(buf, size, used, " %s=%zu", clmha__direct_names[i],
                                        t->direct[i]);
    }
    if (t->has_routine)
        used = clmha__tuning_append(buf, size, used,
                                    "%sGemmRoutine: XGEMM_MIN_INDIRECT_SIZE=%zu",
                                    used ? "; " : "", t->min_indirect);
    if (t->has_fused) {
        used = clmha__tuning_append(buf, size, used, "%sFusedAttention:", used ? "; " : "");
        for (int i = 0; i < CLMHA__FUSED_PARAMS; ++i)
            used = clmha__tuning_append(buf, size, used, " %s=%zu", clmha__fused_names[i],
                                        t->fused[i]);
    }
    if (t->has_decode) {
        used = clmha__tuning_append(buf, size, used, "%sDecodeSplit:", used ? "; " : "");
        for (int i = 0; i < CLMHA__DECODE_PARAMS; ++i)
            used = clmha__tuning_append(buf, size, used, " %s=%zu", clmha__decode_names[i],
                                        t->decode[i]);
    }
}
