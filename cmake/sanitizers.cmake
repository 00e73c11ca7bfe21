# Sanitizer builds: -DCLMHA_SANITIZE=<list> compiles and links every target of the project with
# -fsanitize=<list>, e.g.
#   cmake -B build-asan -DCLMHA_SANITIZE=address,undefined
#   cmake -B build-tsan -DCLMHA_SANITIZE=thread -DCMAKE_C_COMPILER=clang
# Include this file before any target is defined (it uses add_compile_options/add_link_options,
# which apply to the targets defined after it, in this directory and below).
#
# The OpenCL driver (PoCL, the ICD loader, CLBlast, LLVM) is not instrumented. Its own leaks and
# races are suppressed by library name in tests/sanitizers/lsan.supp and
# tests/sanitizers/tsan.supp, which the test suite passes to the sanitizers through the
# environment (see tests/CMakeLists.txt).
set(CLMHA_SANITIZE "" CACHE STRING
    "Comma-separated sanitizers to build with (address, undefined, leak, thread), empty for none")

if(CLMHA_SANITIZE)
  string(REPLACE " " "" _clmha_san "${CLMHA_SANITIZE}")
  string(REPLACE "," ";" _clmha_san_list "${_clmha_san}")
  if("thread" IN_LIST _clmha_san_list AND ("address" IN_LIST _clmha_san_list OR
                                           "leak" IN_LIST _clmha_san_list))
    message(FATAL_ERROR "CLMHA_SANITIZE: thread cannot be combined with address or leak")
  endif()

  set(_clmha_san_flags -fsanitize=${_clmha_san} -fno-omit-frame-pointer)
  if("undefined" IN_LIST _clmha_san_list)
    # Every UBSan finding is fatal, so a test that triggers one fails.
    list(APPEND _clmha_san_flags -fno-sanitize-recover=all)
  endif()
  add_compile_options(${_clmha_san_flags})
  add_link_options(-fsanitize=${_clmha_san})
  set(CLMHA_SANITIZE_LIST ${_clmha_san_list})
  message(STATUS "clmha: building with -fsanitize=${_clmha_san}")
else()
  set(CLMHA_SANITIZE_LIST "")
endif()
