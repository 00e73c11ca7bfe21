// Profiling of forward calls: the public switch, the stage times read from the markers that
// the forward pass and the cores record (clmha__layer_mark(), src/layer/layer.c), and the stage
// names.
#include "layer/layer.h"

clmha_status clmha_layer_set_profiling(clmha_layer *layer, bool on) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    cl_command_queue_properties props = 0;
    clGetCommandQueueInfo(layer->ctx->queue, CL_QUEUE_PROPERTIES, sizeof props, &props, NULL);
    if (on && !(props & CL_QUEUE_PROFILING_ENABLE))
        return clmha__fail(layer->ctx, CLMHA_UNSUPPORTED,
                           "profiling needs a queue created with CL_QUEUE_PROFILING_ENABLE");
    clmha__layer_marks_release(layer);
    layer->profiling = on;
    return CLMHA_SUCCESS;
}

clmha_status clmha_layer_stage_times(clmha_layer *layer, double ms[CLMHA_STAGE_COUNT]) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    if (!ms) return clmha__fail(layer->ctx, CLMHA_INVALID_ARGUMENT, "ms is NULL");
    if (!layer->profiling)
        return clmha__fail(layer->ctx, CLMHA_INVALID_ARGUMENT,
                           "profiling is off: call clmha_layer_set_profiling(layer, true) before "
                           "the forward call");
    if (!layer->marks[0])
        return clmha__fail(layer->ctx, CLMHA_INVALID_ARGUMENT,
                           "no stage times: the last forward call failed, or no forward call "
                           "was made since clmha_layer_set_profiling(layer, true)");
    cl_ulong prev = 0;
    for (int i = 0; i <= CLMHA_STAGE_COUNT; ++i) {
        if (i > 0) ms[i - 1] = 0.0;
        cl_event m = layer->marks[i];
        if (!m) continue;
        cl_int err = clWaitForEvents(1, &m);
        cl_ulong end = 0;
        if (err == CL_SUCCESS)
            err = clGetEventProfilingInfo(m, CL_PROFILING_COMMAND_END, sizeof end, &end, NULL);
        if (err != CL_SUCCESS) return clmha__cl_fail(layer->ctx, err, "stage timing");
        if (i > 0) ms[i - 1] = end > prev ? (double)(end - prev) / 1e6 : 0.0;
        prev = end;
    }
    return CLMHA_SUCCESS;
}

const char *clmha_stage_name(clmha_stage stage) {
    static const char *const names[CLMHA_STAGE_COUNT] = {
        "project", "split", "scores", "softmax", "av", "fused", "merge", "out_proj", "weights"};
    return stage >= 0 && stage < CLMHA_STAGE_COUNT ? names[stage] : "?";
}
