// clmha's fuzz targets, shared by the libFuzzer harnesses (fuzz/fuzz_*.c) and the regression
// test that replays the seed corpora and every crash reproducer
// (tests/unit/test_fuzz_regressions.c).
// One file each: fuzz/target_safetensors.c, target_npy.c, target_forward_args.c,
// target_backward_args.c, target_kv_ops.c, target_variants.c (the last three run on the OpenCL
// device, sharing fuzz/device.c), compiled into a static library (clmha_fuzz_targets in
// fuzz/CMakeLists.txt, instrumented; and clmha_test_fuzz_targets in tests/CMakeLists.txt, for
// the test).
//
// Each target takes arbitrary bytes, must return for any input (no crash, no leak, no undefined
// behaviour under ASan and UBSan), checks the invariants its entry points promise and calls
// __builtin_trap() when one does not hold. It returns the status of the entry point it fuzzes, so
// that the test can also require known-valid seeds to succeed.
//
// The targets need the library's internals (libclmha.a, or the sources) and src/cli/npy.c.
#ifndef CLMHA_FUZZ_TARGETS_H
#define CLMHA_FUZZ_TARGETS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// clmha__safetensors_parse()'s status (then desc + to_float run too).
int clmha_fuzz_safetensors(const uint8_t *data, size_t size);

// clmha__npy_parse()'s status.
int clmha_fuzz_npy(const uint8_t *data, size_t size);

// clmha__desc_check()'s status when it fails, else clmha__dims_resolve()'s (then the CPU
// reference runs on small calls).
int clmha_fuzz_forward_args(const uint8_t *data, size_t size);

// The device targets need an OpenCL device: one context per process, made on first use. false
// when there is none (they then return CLMHA_UNSUPPORTED without checking anything).
bool clmha_fuzz_have_device(void);

// A small forward call with save, then clmha_layer_backward_host()'s status (or the forward
// call's when it refused): the gradients asked for within tolerance of
// clmha_reference_backward()'s; a call broken on purpose, or refused, must be refused with a
// message and leave every destination as it was.
int clmha_fuzz_backward_args(const uint8_t *data, size_t size);

// A sequence of KV-cache operations on a small layer (create contiguous or paged, append ragged,
// attend only, packed appends, truncate, reset, fork, calls the cache must refuse): after every
// call the lengths are those of a model kept here, every output within tolerance of
// clmha_reference_forward() over the tokens the model says each sequence holds, and every
// refusal leaves the lengths unchanged. The status of the last operation.
int clmha_fuzz_kv_ops(const uint8_t *data, size_t size);

// Attention variants (window bounds, soft-capping, ALiBi, sinks, grouped-query heads) and
// packed lengths (seq_lens, kv_seq_lens, num_seqs) from raw values: the layer and the call
// accepted or refused as clmha_reference_forward() accepts or refuses them, and an accepted
// small call's output within tolerance of the reference's. The forward call's status (or the
// layer's creation's).
int clmha_fuzz_variants(const uint8_t *data, size_t size);

#endif
