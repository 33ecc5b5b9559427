// The baseline copy of the fp32 GEMM (compile flags set in kernels/cpu/CMakeLists.txt).
#define STRATA_GEMM_ISA baseline
#define STRATA_EIGEN_NAMESPACE Eigen_strata_baseline
#include "kernels/cpu/gemm_isa.inc"
