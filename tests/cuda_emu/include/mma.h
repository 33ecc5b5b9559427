// Device-side CUDA for the emulated kernels: tests/cuda_emu.h (test-only; see cuda_runtime.h here).
#pragma once
#include "tests/cuda_emu.h"
