# trn_add_programs(<dir> LIBS ...): each <dir>/<name>.cc becomes one program, named with dashes
# (trn_collbench.cc -> trn-collbench), linked with LIBS.
function(trn_add_programs dir)
  cmake_parse_arguments(P "" "" "LIBS" ${ARGN})
  file(GLOB sources CONFIGURE_DEPENDS ${dir}/*.cc)
  foreach(src IN LISTS sources)
    get_filename_component(stem ${src} NAME_WE)
    string(REPLACE "_" "-" exe ${stem})
    add_executable(${exe} ${src})
    target_link_libraries(${exe} PRIVATE ${P_LIBS})
  endforeach()
endfunction()
