// libFuzzer harness: see clmha_fuzz_backward_args() in targets.h. Built by fuzz/CMakeLists.txt
// (-DCMAKE_C_COMPILER=clang -DCLMHA_FUZZ=ON), run by tools/fuzz.sh.
#include "targets.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    (void)clmha_fuzz_backward_args(data, size);
    return 0;
}
