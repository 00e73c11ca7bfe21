# tests/sanitizers/oclgrind_driver.c: small forward passes that reach every kernel branch, for
# tools/oclgrind-check.sh (every kernel run under the Oclgrind simulator). Not a CTest test:
# run `tools/oclgrind-check.sh <build>/oclgrind_driver` (needs the oclgrind package). Linked with
# libclmha.a for its test hook (the largest allocation, to reach the chunked unfused core).
# Included from tests/CMakeLists.txt.
add_executable(oclgrind_driver ${CMAKE_CURRENT_LIST_DIR}/oclgrind_driver.c)
set_target_properties(oclgrind_driver PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR})
target_link_libraries(oclgrind_driver PRIVATE clmha_static m)
target_include_directories(oclgrind_driver PRIVATE ${PROJECT_SOURCE_DIR}/src)  # base/half.h
target_compile_options(oclgrind_driver PRIVATE ${CLMHA_WARNINGS})
