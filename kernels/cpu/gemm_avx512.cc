// The avx512 copy of the fp32 GEMM (compile flags set in kernels/cpu/CMakeLists.txt).
#define STRATA_GEMM_ISA avx512
#define STRATA_EIGEN_NAMESPACE Eigen_strata_avx512
#include "kernels/cpu/gemm_isa.inc"
