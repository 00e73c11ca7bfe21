// What the fused core's forward and backward both use (fused_shared.h).
#include "cores/fused_shared.h"

#include "device/device_class.h"

#include <math.h>

size_t clmha__fused_default_vw(const clmha_context *ctx) {
    if (ctx->cls->vw) return ctx->cls->vw;
    // The native width, not the preferred one: Intel's oneAPI CPU runtime prefers 1 but is
    // native 16 (5.5x faster with 16); PoCL on AVX-512 reports 16 for both.
    cl_uint native = 1;
    clGetDeviceInfo(ctx->device, CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT, sizeof native, &native,
                    NULL);
    return native ? native : 1;
}

size_t clmha__fused_row_vw(const clmha_context *ctx, size_t hd) {
    size_t want = clmha__fused_default_vw(ctx), vw = 16;
    while (vw > 1 && (vw > want || hd % vw)) vw /= 2;
    return ctx->quirks.no_vload ? 1 : vw;
}

static size_t test_loop_limit;

void clmha__test_set_loop_limit(size_t limit) { test_loop_limit = limit; }

size_t clmha__fused_loop_limit(const clmha_layer *l) {
    return test_loop_limit ? test_loop_limit : l->ctx->quirks.loop_limit;
}

double clmha__window_tiles(const clmha__dims *d, bool causal, double rows, double tile,
                           double all) {
    if (d->win_left < 0 || (d->win_right < 0 && !causal)) return all;
    double right = causal ? 0.0 : (double)d->win_right;  // causal: nothing right of the row
    double bound = ceil((rows + (double)d->win_left + right) / tile) + 3;
    return bound < all ? bound : all;
}
