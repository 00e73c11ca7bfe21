# Install rules and package files for clmha. Included at the end of the top-level
# CMakeLists.txt, after the targets clmha, clmha_static and clmha_cli are defined:
#
#   <prefix>/bin/clmha                                   the program (RPATH to the library)
#   <prefix>/<libdir>/libclmha.so.<version>, .so.<soversion>, .so, libclmha.a
#                                  (soversion: MAJOR.MINOR before 1.0, then MAJOR; docs/abi.md)
#   <prefix>/include/clmha.h, clmha_version.h
#   <prefix>/<libdir>/cmake/clmha/clmhaConfig.cmake      find_package(clmha): clmha::clmha (shared),
#                                  clmhaConfigVersion.cmake  clmha::clmha_static, clmha::clmha_cli
#                                  clmhaTargets*.cmake
#   <prefix>/<libdir>/pkgconfig/clmha.pc                 pkg-config clmha [--static]
#
# Components: "runtime" (program and shared library) and "development" (everything else).

option(CLMHA_INSTALL "Generate clmha's install rules" ON)
if(NOT CLMHA_INSTALL)
  return()
endif()

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(CLMHA_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/clmha"
    CACHE STRING "Where clmhaConfig.cmake is installed (relative to the prefix)")
set(CLMHA_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_LIBDIR}/pkgconfig"
    CACHE STRING "Where clmha.pc is installed (relative to the prefix)")

# ---- target properties for the installed (exported) targets -----------------------------------

# Installed consumers find clmha.h and clmha_version.h under <prefix>/include. (The build-tree
# include directories are BUILD_INTERFACE entries set in CMakeLists.txt.)
foreach(_clmha_lib clmha clmha_static)
  target_include_directories(${_clmha_lib} PUBLIC
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
endforeach()

# Names in the clmha:: namespace: clmha::clmha is the shared library (as the build tree's ALIAS),
# clmha::clmha_static the static one, clmha::clmha_cli the program.
set_target_properties(clmha PROPERTIES EXPORT_NAME clmha)
set_target_properties(clmha_static PROPERTIES EXPORT_NAME clmha_static)
if(TARGET clmha_cli)  # CLMHA_BUILD_CLI
  set_target_properties(clmha_cli PROPERTIES EXPORT_NAME clmha_cli)
  set(_clmha_install_targets clmha clmha_static clmha_cli)
else()
  set(_clmha_install_targets clmha clmha_static)
endif()

# The installed program finds the installed shared library next to it, wherever the prefix is.
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_BINDIR}")
  set(_clmha_rpath "${CMAKE_INSTALL_FULL_LIBDIR}")
else()
  file(RELATIVE_PATH _clmha_rel "/prefix/${CMAKE_INSTALL_BINDIR}"
       "/prefix/${CMAKE_INSTALL_LIBDIR}")
  if(APPLE)
    set(_clmha_rpath "@loader_path/${_clmha_rel}")
  else()
    set(_clmha_rpath "$ORIGIN/${_clmha_rel}")
  endif()
endif()
if(TARGET clmha_cli)
  set_target_properties(clmha_cli PROPERTIES INSTALL_RPATH "${_clmha_rpath}")
endif()

# clmha_objects (the OBJECT library both libraries are linked from) is not installed or exported:
# the libraries take its objects through $<TARGET_OBJECTS:clmha_objects>, which is not a link
# dependency, and they carry its usage requirements (include directories, CL_TARGET_OPENCL_VERSION,
# OpenCL, CLBlast, cJSON) themselves in CMakeLists.txt.

# ---- targets, headers, CMake package -----------------------------------------------------------

install(TARGETS ${_clmha_install_targets}
  EXPORT clmhaTargets
  RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT runtime
  LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT runtime
          NAMELINK_COMPONENT development
  ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT development)

install(FILES "${PROJECT_SOURCE_DIR}/LICENSE"
  DESTINATION "${CMAKE_INSTALL_DOCDIR}" COMPONENT runtime)

install(FILES
  "${PROJECT_SOURCE_DIR}/include/clmha.h"
  "${PROJECT_BINARY_DIR}/include/clmha_version.h"
  DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}" COMPONENT development)

install(EXPORT clmhaTargets
  NAMESPACE clmha::
  FILE clmhaTargets.cmake
  DESTINATION "${CLMHA_INSTALL_CMAKEDIR}"
  COMPONENT development)

configure_package_config_file(
  "${PROJECT_SOURCE_DIR}/cmake/clmhaConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/cmake/clmhaConfig.cmake"
  INSTALL_DESTINATION "${CLMHA_INSTALL_CMAKEDIR}")
# As the soname (docs/abi.md): before 1.0 only the same MAJOR.MINOR is compatible.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(_clmha_compat SameMinorVersion)
else()
  set(_clmha_compat SameMajorVersion)
endif()
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/cmake/clmhaConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY ${_clmha_compat})
install(FILES
  "${PROJECT_BINARY_DIR}/cmake/clmhaConfig.cmake"
  "${PROJECT_BINARY_DIR}/cmake/clmhaConfigVersion.cmake"
  DESTINATION "${CLMHA_INSTALL_CMAKEDIR}"
  COMPONENT development)

# ---- pkg-config ----------------------------------------------------------------------------------

# Dependencies go into Requires(.private) when they have a .pc file here, else into Libs(.private)
# as plain -l flags. OpenCL is public: clmha.h includes CL/cl.h and its API takes OpenCL types.
find_package(PkgConfig QUIET)
set(CLMHA_PC_REQUIRES "")
set(CLMHA_PC_REQUIRES_PRIVATE "")
set(CLMHA_PC_LIBS_PUBLIC "")
set(CLMHA_PC_LIBS_PRIVATE "")
if(PKG_CONFIG_FOUND)
  pkg_check_modules(_CLMHA_PC_OPENCL QUIET OpenCL)
  pkg_check_modules(_CLMHA_PC_CLBLAST QUIET clblast)
  pkg_check_modules(_CLMHA_PC_CJSON QUIET libcjson)
endif()
if(_CLMHA_PC_OPENCL_FOUND)
  string(APPEND CLMHA_PC_REQUIRES "OpenCL")
else()
  string(APPEND CLMHA_PC_LIBS_PUBLIC " -lOpenCL")
endif()
if(_CLMHA_PC_CLBLAST_FOUND)
  string(APPEND CLMHA_PC_REQUIRES_PRIVATE "clblast")
else()
  string(APPEND CLMHA_PC_LIBS_PRIVATE " -lclblast")
endif()
if(_CLMHA_PC_CJSON_FOUND)
  string(APPEND CLMHA_PC_REQUIRES_PRIVATE " libcjson")
else()
  string(APPEND CLMHA_PC_LIBS_PRIVATE " -lcjson")
endif()
string(STRIP "${CLMHA_PC_REQUIRES_PRIVATE}" CLMHA_PC_REQUIRES_PRIVATE)
string(APPEND CLMHA_PC_LIBS_PRIVATE " -lpthread -lm")

foreach(_clmha_dir LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${_clmha_dir}}")
    set(CLMHA_PC_${_clmha_dir} "${CMAKE_INSTALL_${_clmha_dir}}")
  else()
    set(CLMHA_PC_${_clmha_dir} "\${prefix}/${CMAKE_INSTALL_${_clmha_dir}}")
  endif()
endforeach()

# Two steps, so that `prefix=` is the prefix given at install time (`cmake --install --prefix P`),
# not the one configured: first everything but the prefix now, then the prefix when installing.
set(CLMHA_PC_PREFIX "@CLMHA_PC_PREFIX@")
configure_file("${PROJECT_SOURCE_DIR}/cmake/clmha.pc.in"
               "${PROJECT_BINARY_DIR}/cmake/clmha.pc.stage" @ONLY)
unset(CLMHA_PC_PREFIX)
install(CODE "
  set(CLMHA_PC_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
  configure_file(\"${PROJECT_BINARY_DIR}/cmake/clmha.pc.stage\"
                 \"${PROJECT_BINARY_DIR}/cmake/install/clmha.pc\" @ONLY)
  " COMPONENT development)
install(FILES "${PROJECT_BINARY_DIR}/cmake/install/clmha.pc"
  DESTINATION "${CLMHA_INSTALL_PKGCONFIGDIR}"
  COMPONENT development)

unset(_clmha_lib)
unset(_clmha_rel)
unset(_clmha_rpath)
unset(_clmha_dir)
unset(_clmha_compat)
