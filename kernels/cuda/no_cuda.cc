// Device factory entry points when strata is built without the CUDA backend.
#include "strata/device.h"

namespace strata {

Result<std::unique_ptr<Device>> create_cuda_device(const CudaDeviceOptions&) {
  return unavailable(
      "device.backend=cuda: this strata was built without CUDA (no CUDA toolkit found at "
      "configure time); install the CUDA toolkit and rebuild, or set device.backend=cpu");
}

bool cuda_device_available(std::string* why) {
  if (why) *why = "strata was built without CUDA";
  return false;
}

}  // namespace strata
