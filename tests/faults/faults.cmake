# tests/faults/: fault injection. cl_faults.c is preloaded into each child process of
# fault_sweep.c and fails the n-th OpenCL call libclmha makes; fault_sweep runs each scenario
# once per injection point and checks the outcome (see its header). CTest runs a sample (every
# 7th point, the first and the last); the whole sweep:
#   build/tests/fault_sweep build/tests/libclmha_cl_faults.so
# Not in sanitizer builds: their runtime must be the first library a process loads, which a
# preloaded library would not let it be. Included from tests/CMakeLists.txt.
add_library(clmha_cl_faults MODULE ${CMAKE_CURRENT_LIST_DIR}/cl_faults.c)
target_link_libraries(clmha_cl_faults PRIVATE ${CMAKE_DL_LIBS})
target_include_directories(clmha_cl_faults PRIVATE ${OpenCL_INCLUDE_DIRS})
set_target_properties(clmha_cl_faults PROPERTIES C_VISIBILITY_PRESET default PREFIX "lib")
target_compile_options(clmha_cl_faults PRIVATE ${CLMHA_WARNINGS})
# Linked with libclmha.so: the preloaded library fails the calls made from it.
add_executable(fault_sweep ${CMAKE_CURRENT_LIST_DIR}/fault_sweep.c)
target_link_libraries(fault_sweep PRIVATE clmha ${CMAKE_DL_LIBS} m)
target_compile_options(fault_sweep PRIVATE ${CLMHA_WARNINGS})
add_dependencies(fault_sweep clmha_cl_faults)
if(NOT CLMHA_SANITIZE)
  add_test(NAME fault_sweep COMMAND fault_sweep $<TARGET_FILE:clmha_cl_faults> --stride 7)
  set_tests_properties(fault_sweep PROPERTIES TIMEOUT 900)
endif()
