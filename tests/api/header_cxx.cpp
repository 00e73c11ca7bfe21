// The public header compiles as C++ and every function it declares links. Built only when a C++
// compiler is available; the list below must name every function of include/clmha.h (the test
// "header_symbols" checks that).
#include <clmha.h>

#include <cstdio>

int main() {
    const void *symbols[] = {
        reinterpret_cast<const void *>(&clmha_context_cl_context),
        reinterpret_cast<const void *>(&clmha_context_cl_device),
        reinterpret_cast<const void *>(&clmha_context_cl_queue),
        reinterpret_cast<const void *>(&clmha_context_create),
        reinterpret_cast<const void *>(&clmha_context_create_from_cl),
        reinterpret_cast<const void *>(&clmha_context_create_from_env),
        reinterpret_cast<const void *>(&clmha_context_device_name),
        reinterpret_cast<const void *>(&clmha_context_last_error),
        reinterpret_cast<const void *>(&clmha_context_release),
        reinterpret_cast<const void *>(&clmha_context_retain),
        reinterpret_cast<const void *>(&clmha_context_tune),
        reinterpret_cast<const void *>(&clmha_context_tuning_export),
        reinterpret_cast<const void *>(&clmha_context_tuning_import),
        reinterpret_cast<const void *>(&clmha_context_tuning_note),
        reinterpret_cast<const void *>(&clmha_context_set_gemm),
        reinterpret_cast<const void *>(&clmha_context_gemm),
        reinterpret_cast<const void *>(&clmha_context_gemm_note),
        reinterpret_cast<const void *>(&clmha_context_tuning_source),
        reinterpret_cast<const void *>(&clmha_device_select),
        reinterpret_cast<const void *>(&clmha_device_count),
        reinterpret_cast<const void *>(&clmha_device_describe),
        reinterpret_cast<const void *>(&clmha_device_note),
        reinterpret_cast<const void *>(&clmha_last_create_error),
        reinterpret_cast<const void *>(&clmha_layer_bake),
        reinterpret_cast<const void *>(&clmha_layer_context),
        reinterpret_cast<const void *>(&clmha_layer_create),
        reinterpret_cast<const void *>(&clmha_layer_forward),
        reinterpret_cast<const void *>(&clmha_layer_forward_host),
        reinterpret_cast<const void *>(&clmha_layer_forward_host_f64),
        reinterpret_cast<const void *>(&clmha_saved_create),
        reinterpret_cast<const void *>(&clmha_saved_release),
        reinterpret_cast<const void *>(&clmha_saved_bytes),
        reinterpret_cast<const void *>(&clmha_layer_attend),
        reinterpret_cast<const void *>(&clmha_alibi_slopes),
        reinterpret_cast<const void *>(&clmha_layer_set_mod_params),
        reinterpret_cast<const void *>(&clmha_layer_get_mod_params),
        reinterpret_cast<const void *>(&clmha_attention_merge),
        reinterpret_cast<const void *>(&clmha_attention_merge_f64),
        reinterpret_cast<const void *>(&clmha_attention_output_counts),
        reinterpret_cast<const void *>(&clmha_attention_forward),
        reinterpret_cast<const void *>(&clmha_attention_forward_host),
        reinterpret_cast<const void *>(&clmha_attention_forward_host_f64),
        reinterpret_cast<const void *>(&clmha_attention_backward),
        reinterpret_cast<const void *>(&clmha_attention_backward_host),
        reinterpret_cast<const void *>(&clmha_attention_backward_host_f64),
        reinterpret_cast<const void *>(&clmha_layer_project_heads),
        reinterpret_cast<const void *>(&clmha_kv_cache_create),
        reinterpret_cast<const void *>(&clmha_kv_cache_create_for),
        reinterpret_cast<const void *>(&clmha_kv_cache_release),
        reinterpret_cast<const void *>(&clmha_kv_cache_reset),
        reinterpret_cast<const void *>(&clmha_kv_cache_truncate),
        reinterpret_cast<const void *>(&clmha_kv_cache_lengths),
        reinterpret_cast<const void *>(&clmha_kv_cache_size),
        reinterpret_cast<const void *>(&clmha_kv_cache_create_with),
        reinterpret_cast<const void *>(&clmha_kv_cache_create_for_with),
        reinterpret_cast<const void *>(&clmha_kv_cache_fork),
        reinterpret_cast<const void *>(&clmha_kv_cache_pages),
        reinterpret_cast<const void *>(&clmha_layer_backward),
        reinterpret_cast<const void *>(&clmha_layer_backward_host),
        reinterpret_cast<const void *>(&clmha_layer_backward_host_f64),
        reinterpret_cast<const void *>(&clmha_layer_get_desc),
        reinterpret_cast<const void *>(&clmha_layer_get_parameter),
        reinterpret_cast<const void *>(&clmha_layer_set_parameter_f64),
        reinterpret_cast<const void *>(&clmha_layer_get_parameter_f64),
        reinterpret_cast<const void *>(&clmha_layer_load),
        reinterpret_cast<const void *>(&clmha_layer_load_as),
        reinterpret_cast<const void *>(&clmha_layer_load_prefixed),
        reinterpret_cast<const void *>(&clmha_layer_output_counts),
        reinterpret_cast<const void *>(&clmha_layer_parameter_count),
        reinterpret_cast<const void *>(&clmha_layer_release),
        reinterpret_cast<const void *>(&clmha_layer_save),
        reinterpret_cast<const void *>(&clmha_layer_scratch_bytes),
        reinterpret_cast<const void *>(&clmha_layer_set_attention),
        reinterpret_cast<const void *>(&clmha_layer_set_impl),
        reinterpret_cast<const void *>(&clmha_impl_name),
        reinterpret_cast<const void *>(&clmha_layer_set_parameter),
        reinterpret_cast<const void *>(&clmha_layer_set_profiling),
        reinterpret_cast<const void *>(&clmha_layer_stage_times),
        reinterpret_cast<const void *>(&clmha_stage_name),
        reinterpret_cast<const void *>(&clmha_reference_forward),
        reinterpret_cast<const void *>(&clmha_reference_attention),
        reinterpret_cast<const void *>(&clmha_reference_attention_backward),
        reinterpret_cast<const void *>(&clmha_reference_backward),
        reinterpret_cast<const void *>(&clmha_status_string),
        reinterpret_cast<const void *>(&clmha_version),
    };
    for (const void *s : symbols)
        if (!s) return 1;
    std::printf("header_cxx: %zu public functions link from C++\n",
                sizeof symbols / sizeof symbols[0]);
    // CLMHA_STRUCT_INIT works in C++ too: zeroes and the size.
    clmha_layer_desc desc = CLMHA_STRUCT_INIT(clmha_layer_desc);
    clmha_forward_args args = CLMHA_STRUCT_INIT(clmha_forward_args);
    clmha_backward_args bargs = CLMHA_STRUCT_INIT(clmha_backward_args);
    clmha_reference_grads rgrads = CLMHA_STRUCT_INIT(clmha_reference_grads);
    if (desc.struct_size != sizeof desc || desc.embed_dim != 0 || args.struct_size != sizeof args ||
        args.query.ndim != 0 || bargs.struct_size != sizeof bargs || bargs.saved != nullptr ||
        rgrads.struct_size != sizeof rgrads || rgrads.query != nullptr)
        return 1;
    clmha_context_release(nullptr);
    clmha_layer_release(nullptr);
    return clmha_status_string(CLMHA_SUCCESS)[0] ? 0 : 1;
}
