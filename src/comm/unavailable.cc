// Factories of the backends this build lacks: they say what is missing and how to get it.
#include "src/comm/comm_internal.h"

namespace strata::comm_internal {

#if !defined(STRATA_HAVE_MPI)
Result<std::unique_ptr<Communicator>> create_mpi(Device*, double) {
  return unavailable(
      "strata.comm.backend mpi: this strata was built without MPI; install Open MPI "
      "(libopenmpi-dev) and rebuild with -DSTRATA_WITH_MPI=ON");
}
#endif

#if !defined(STRATA_HAVE_CUDA) || !defined(STRATA_HAVE_NCCL)
Result<std::unique_ptr<Communicator>> create_nccl(Device*, double) {
  return unavailable(
      "strata.comm.backend nccl: this strata was built without CUDA and NCCL; rebuild with "
      "-DSTRATA_WITH_CUDA=ON on a machine with the CUDA toolkit and NCCL, or use mpi");
}
#endif

}  // namespace strata::comm_internal
