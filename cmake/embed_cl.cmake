# Turns OpenCL C sources into byte arrays in a generated C file.
# Usage: cmake -DOUTPUT=out.c -DSOURCES="a.cl|b.cl" -P embed_cl.cmake
# Each file cl/.../NAME.cl becomes a NUL-terminated byte array and a row of the table
# `clmha__cl_sources` (src/context/programs.h): {"NAME", "cl/.../NAME.cl", bytes, size without
# the NUL}, which the program cache searches by NAME (the kernel family); names are unique.
# Byte arrays avoid C's limits on the length of string literals.
string(REPLACE "|" ";" SOURCES "${SOURCES}")
get_filename_component(root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
set(body "// Generated from cl/*.cl by cmake/embed_cl.cmake. Do not edit.\n#include \"context/programs.h\"\n\n")
set(table "")
set(names "")
set(count 0)
foreach(src IN LISTS SOURCES)
  get_filename_component(name "${src}" NAME_WE)
  list(FIND names "${name}" seen)
  if(NOT seen EQUAL -1)
    message(FATAL_ERROR "embed_cl: two kernel files named ${name}.cl (families are file names)")
  endif()
  list(APPEND names "${name}")
  file(RELATIVE_PATH path "${root}" "${src}")
  file(READ "${src}" hex HEX)
  string(LENGTH "${hex}" hex_len)
  math(EXPR size "${hex_len} / 2")
  string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
  string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n  " bytes "${bytes}")
  string(APPEND body "static const char text_${name}[] = {\n  ${bytes}0x00};\n\n")
  string(APPEND table "    {\"${name}\", \"${path}\", text_${name}, ${size}},\n")
  math(EXPR count "${count} + 1")
endforeach()
string(APPEND body "const clmha__cl_source clmha__cl_sources[] = {\n${table}};\n")
string(APPEND body "const size_t clmha__cl_sources_count = ${count};\n")
file(WRITE "${OUTPUT}.tmp" "${body}")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different "${OUTPUT}.tmp" "${OUTPUT}")
file(REMOVE "${OUTPUT}.tmp")
