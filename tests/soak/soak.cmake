# tests/soak/: the bounded soak (issue 37). soak.c runs 4 threads over 2 contexts on random
# mixed calls, valid ones checked against the CPU reference and invalid ones against their
# documented status, and checks that the resident memory stays flat after the warm-up (see its
# header). A plain program, so that it runs in every build, ThreadSanitizer's included (where
# Criterion cannot start). CTest runs 20 s of it; the whole soak, 10 minutes:
#   build/tests/soak --seconds 600
# Included from tests/CMakeLists.txt.
add_executable(soak ${CMAKE_CURRENT_LIST_DIR}/soak.c)
target_link_libraries(soak PRIVATE clmha OpenCL::OpenCL Threads::Threads m)
target_compile_options(soak PRIVATE ${CLMHA_WARNINGS})
add_test(NAME soak COMMAND soak --seconds 20)
set_tests_properties(soak PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77)
if(CLMHA_SANITIZE)
  set_tests_properties(soak PROPERTIES ENVIRONMENT "${CLMHA_SANITIZER_ENV}")
endif()
