# Turns OpenCL C sources into byte arrays in a generated C file.
# Usage: cmake -DOUTPUT=out.c -DSOURCES="a.cl|b.cl" -P embed_cl.cmake
# Each file cl/NAME.cl becomes `const char clmha__cl_NAME[]` (NUL-terminated) and
# `const size_t clmha__cl_NAME_size` (without the NUL). Byte arrays avoid C's limits on the
# length of string literals.
string(REPLACE "|" ";" SOURCES "${SOURCES}")
set(body "// Generated from cl/*.cl by cmake/embed_cl.cmake. Do not edit.\n#include <stddef.h>\n\n")
foreach(src IN LISTS SOURCES)
  get_filename_component(name "${src}" NAME_WE)
  file(READ "${src}" hex HEX)
  string(LENGTH "${hex}" hex_len)
  math(EXPR size "${hex_len} / 2")
  string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
  string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n  " bytes "${bytes}")
  string(APPEND body "__attribute__((visibility(\"hidden\"))) extern const char clmha__cl_${name}[];\n")
  string(APPEND body "__attribute__((visibility(\"hidden\"))) extern const size_t clmha__cl_${name}_size;\n")
  string(APPEND body "const char clmha__cl_${name}[] = {\n  ${bytes}0x00};\n")
  string(APPEND body "const size_t clmha__cl_${name}_size = ${size};\n\n")
endforeach()
file(WRITE "${OUTPUT}.tmp" "${body}")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different "${OUTPUT}.tmp" "${OUTPUT}")
file(REMOVE "${OUTPUT}.tmp")
