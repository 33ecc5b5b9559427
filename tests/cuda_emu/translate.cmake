# cmake -DIN=kernels/cuda/x.cu -DOUT=x.cc -P translate.cmake: a .cu file as C++ for the CPU
# emulation of CUDA (tests/cuda_emu.h). Test-only; the .cu file itself is not changed. Two
# rewrites, nothing else:
#   k<<<grid, block, smem, stream>>>(args)  ->  k | ::strata::emu::Launch(grid, block, smem,
#                                                  stream)(args)       (tests/cuda_emu/launch.h)
#   __shared__ T a[8][33], b;               ->  auto& a = ::strata::emu::block_shared<T[8][33]>(
#                                                  key); auto& b = ...  (one per block, poisoned)
# A `__shared__` declaration must sit on one line and name one type (the translation stops with
# an error otherwise, rather than emulate something else).
file(READ "${IN}" src)
string(REPLACE "<<<" " | ::strata::emu::Launch(" src "${src}")
string(REPLACE ">>>" ")" src "${src}")
string(REGEX MATCHALL "\n[ ]*__shared__ [^;\n]*" decls "${src}")
foreach(d IN LISTS decls)
  if(NOT d MATCHES "^\n([ ]*)__shared__ ([A-Za-z_][A-Za-z0-9_]*) ([^;]*)$")
    message(FATAL_ERROR "${IN}: cannot translate the __shared__ declaration '${d}'")
  endif()
  set(indent "${CMAKE_MATCH_1}")
  set(type "${CMAKE_MATCH_2}")
  string(REPLACE "," ";" declarators "${CMAKE_MATCH_3}")
  set(out "\n${indent}")
  set(k 0)
  foreach(dcl IN LISTS declarators)
    string(STRIP "${dcl}" dcl)
    if(NOT dcl MATCHES "^([A-Za-z_][A-Za-z0-9_]*)((\\[[A-Za-z0-9_ ]+\\])*)$")
      message(FATAL_ERROR "${IN}: cannot translate the __shared__ declarator '${dcl}'")
    endif()
    if(k GREATER 0)
      string(APPEND out "; ")
    endif()
    string(APPEND out
           "auto& ${CMAKE_MATCH_1} = ::strata::emu::block_shared<${type}${CMAKE_MATCH_2}>("
           "__LINE__ * 8 + ${k})")
    math(EXPR k "${k} + 1")
  endforeach()
  string(REPLACE "${d}" "${out}" src "${src}")
endforeach()
set(text "// Generated from ${IN} by tests/cuda_emu/translate.cmake: do not edit.\n")
string(APPEND text "#include \"tests/cuda_emu/launch.h\"\n#line 1 \"${IN}\"\n${src}")
file(WRITE "${OUT}" "${text}")
