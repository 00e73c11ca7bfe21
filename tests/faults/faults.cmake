# tests/faults/: fault injection. inject.c is preloaded into each child process of
# fault_sweep.c and fails the n-th OpenCL call (or, with --kind alloc, the n-th malloc, calloc
# or realloc) libclmha makes; fault_sweep runs each scenario once per injection point and
# checks the outcome (see its header). CTest runs a sample (every 11th OpenCL point, every 3rd
# allocation, the first and the last always); the whole sweeps:
#   build/tests/fault_sweep build/tests/libclmha_faults.so
#   build/tests/fault_sweep build/tests/libclmha_faults.so --kind alloc
# Not in sanitizer builds: their runtime must be the first library a process loads, which a
# preloaded library would not let it be. Included from tests/CMakeLists.txt.
add_library(clmha_faults MODULE ${CMAKE_CURRENT_LIST_DIR}/inject.c)
target_link_libraries(clmha_faults PRIVATE ${CMAKE_DL_LIBS})
target_include_directories(clmha_faults PRIVATE ${OpenCL_INCLUDE_DIRS})
set_target_properties(clmha_faults PROPERTIES C_VISIBILITY_PRESET default PREFIX "lib")
target_compile_options(clmha_faults PRIVATE ${CLMHA_WARNINGS})
# Linked with libclmha.so: the preloaded library fails the calls made from it.
add_executable(fault_sweep ${CMAKE_CURRENT_LIST_DIR}/fault_sweep.c)
target_link_libraries(fault_sweep PRIVATE clmha OpenCL::OpenCL ${CMAKE_DL_LIBS} m)
target_compile_options(fault_sweep PRIVATE ${CLMHA_WARNINGS})
add_dependencies(fault_sweep clmha_faults)
if(NOT CLMHA_SANITIZE)
  add_test(NAME fault_sweep_opencl
           COMMAND fault_sweep $<TARGET_FILE:clmha_faults> --stride 11)
  add_test(NAME fault_sweep_alloc
           COMMAND fault_sweep $<TARGET_FILE:clmha_faults> --kind alloc --stride 3)
  set_tests_properties(fault_sweep_opencl fault_sweep_alloc PROPERTIES TIMEOUT 900)
endif()
