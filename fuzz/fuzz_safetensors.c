// libFuzzer harness: see clmha_fuzz_safetensors() in targets.h. Built by fuzz/CMakeLists.txt
// (-DCLMHA_FUZZ=ON with clang), run by tools/fuzz.sh.
#include "targets.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    (void)clmha_fuzz_safetensors(data, size);
    return 0;
}
