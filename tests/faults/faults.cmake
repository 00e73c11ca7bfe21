# tests/faults/: fault injection. inject.c is preloaded into each child process of
# fault_sweep.c and fails the n-th call of one kind libclmha makes (OpenCL calls; with --kind
# alloc the n-th malloc, calloc or realloc; io, file calls; blas, CLBlast's or the host BLAS's
# GEMMs), and counts what libclmha holds for the leak check; fault_sweep runs each scenario once
# per injection point and checks the outcome (see its header). CTest runs a sample (every 31st
# OpenCL point, every 6th allocation and GEMM, every 3rd file call of saving and loading and of
# the program; of the tuning scenario, 13, whose 8000 OpenCL points repeat the same few calls per
# candidate, every 277th OpenCL point and every file call; the first and the last always);
# the whole sweeps, every kind, with tools/fault-sweep.sh [BUILD-DIR], or one kind with
#   build/tests/fault_sweep build/tests/libclmha_faults.so [--kind alloc|io|blas] \
#       --program build/clmha --case tests/cli/grad_self
#   CLMHA_GEMM=clblast build/tests/fault_sweep build/tests/libclmha_faults.so --kind blas
# Not in sanitizer builds: their runtime must be the first library a process loads, which a
# preloaded library would not let it be. Included from tests/CMakeLists.txt.
add_library(clmha_faults MODULE ${CMAKE_CURRENT_LIST_DIR}/inject.c)
target_link_libraries(clmha_faults PRIVATE ${CMAKE_DL_LIBS})
target_include_directories(clmha_faults PRIVATE ${OpenCL_INCLUDE_DIRS})
set_target_properties(clmha_faults PROPERTIES C_VISIBILITY_PRESET default PREFIX "lib")
target_compile_options(clmha_faults PRIVATE ${CLMHA_WARNINGS})
# Linked with libclmha.so: the preloaded library fails the calls made from it.
add_executable(fault_sweep ${CMAKE_CURRENT_LIST_DIR}/fault_sweep.c
                           ${CMAKE_CURRENT_LIST_DIR}/sweep_cli.c)
target_link_libraries(fault_sweep PRIVATE clmha OpenCL::OpenCL ${CMAKE_DL_LIBS} m)
target_compile_options(fault_sweep PRIVATE ${CLMHA_WARNINGS})
add_dependencies(fault_sweep clmha_faults)
# The program's scenario: `clmha run` on the PyTorch case tests/cli/grad_self.
set(CLMHA_SWEEP_PROGRAM)
if(TARGET clmha_cli)
  add_dependencies(fault_sweep clmha_cli)
  set(CLMHA_SWEEP_PROGRAM --program $<TARGET_FILE:clmha_cli>
                          --case ${PROJECT_SOURCE_DIR}/tests/cli/grad_self)
endif()
if(NOT CLMHA_SANITIZE)
  set(scenarios 1 2 3 4 5 6 7 8 9 10 11 12)  # all but the tuning (13: fault_sweep_tune)
  add_test(NAME fault_sweep_opencl
           COMMAND fault_sweep $<TARGET_FILE:clmha_faults> ${scenarios} --stride 31
                   ${CLMHA_SWEEP_PROGRAM})
  add_test(NAME fault_sweep_alloc
           COMMAND fault_sweep $<TARGET_FILE:clmha_faults> ${scenarios} --kind alloc --stride 6
                   ${CLMHA_SWEEP_PROGRAM})
  add_test(NAME fault_sweep_tune
           COMMAND fault_sweep $<TARGET_FILE:clmha_faults> 13 --stride 277)
  add_test(NAME fault_sweep_tune_io
           COMMAND fault_sweep $<TARGET_FILE:clmha_faults> 13 --kind io)
  add_test(NAME fault_sweep_io  # the file calls of saving and loading, and of the program
           COMMAND fault_sweep $<TARGET_FILE:clmha_faults> 10 12 --kind io --stride 3
                   ${CLMHA_SWEEP_PROGRAM})
  add_test(NAME fault_sweep_blas
           COMMAND fault_sweep $<TARGET_FILE:clmha_faults> ${scenarios} --kind blas --stride 6)
  set_tests_properties(fault_sweep_opencl fault_sweep_alloc fault_sweep_io fault_sweep_blas
                       fault_sweep_tune fault_sweep_tune_io PROPERTIES TIMEOUT 900)
endif()
