# clmha_embed_kernels(OUTPUT <file.c> SOURCES <a.cl> ... [COMMENT <text>])
#
# Adds the build step that turns OpenCL C sources into byte arrays in the generated C file
# OUTPUT (cmake/embed_cl.cmake, run with cmake -P at build time): each cl/NAME.cl becomes
# `clmha__cl_NAME[]` and `clmha__cl_NAME_size`. OUTPUT must be a source of a target of the
# directory that calls this (a generated file of another directory cannot be). Used by the
# top-level CMakeLists.txt and by fuzz/CMakeLists.txt.
set(_clmha_embed_script "${CMAKE_CURRENT_LIST_DIR}/embed_cl.cmake")

function(clmha_embed_kernels)
  cmake_parse_arguments(ARG "" "OUTPUT;COMMENT" "SOURCES" ${ARGN})
  if(NOT ARG_OUTPUT OR NOT ARG_SOURCES)
    message(FATAL_ERROR "clmha_embed_kernels: OUTPUT and SOURCES are required")
  endif()
  if(NOT ARG_COMMENT)
    set(ARG_COMMENT "Embedding OpenCL kernels")
  endif()
  string(REPLACE ";" "|" _sources_arg "${ARG_SOURCES}")
  add_custom_command(
    OUTPUT ${ARG_OUTPUT}
    COMMAND ${CMAKE_COMMAND} -DOUTPUT=${ARG_OUTPUT} -DSOURCES=${_sources_arg}
            -P ${_clmha_embed_script}
    VERBATIM
    DEPENDS ${ARG_SOURCES} ${_clmha_embed_script}
    COMMENT "${ARG_COMMENT}")
endfunction()
