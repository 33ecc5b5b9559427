// The avx2 copy of the fp32 GEMM (compile flags set in kernels/cpu/CMakeLists.txt).
#define STRATA_GEMM_ISA avx2
#define STRATA_EIGEN_NAMESPACE Eigen_strata_avx2
#include "kernels/cpu/gemm_isa.inc"
