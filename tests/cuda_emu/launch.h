// What a translated kernel file (translate.cmake) starts with: the stand-in's CUDA headers and
// the launch operator its launches become. `k<<<grid, block, smem, stream>>>(args...)` reads
// `k | Launch(grid, block, smem, stream)(args...)`: the arguments are converted to the kernel's
// parameter types and copied (as CUDA does at the launch), pointer arguments are checked to be
// device memory, and the launch is enqueued on the stream. Test-only.
#pragma once

#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_runtime.h"
#include "tests/cuda_emu.h"
#include "tests/cuda_emu/control.h"

namespace strata::emu {

template <typename... A>
struct PendingLaunch {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  std::tuple<std::decay_t<A>...> args;
};

struct Launch {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  Launch(dim3 g, dim3 b, size_t s = 0, cudaStream_t st = nullptr)
      : grid(g), block(b), smem(s), stream(st) {}
  template <typename... A>
  PendingLaunch<A...> operator()(A&&... a) const {
    return {grid, block, smem, stream, std::tuple<std::decay_t<A>...>(std::forward<A>(a)...)};
  }
};

// "" if every pointer argument is null or device memory, else which one is not.
template <typename Tuple, size_t... I>
std::string bad_pointer(const Tuple& t, std::index_sequence<I...>) {
  std::string bad;
  auto one = [&](size_t i, const auto& v) {
    using V = std::decay_t<decltype(v)>;
    if constexpr (std::is_pointer_v<V>) {
      if (bad.empty() && v != nullptr && !is_device_memory(v, 1)) {
        bad = "argument " + std::to_string(i) + " is not device memory";
      }
    }
  };
  (one(I, std::get<I>(t)), ...);
  return bad;
}

template <typename... P, typename... A>
void operator|(void (*kernel)(P...), PendingLaunch<A...>&& l) {
  static_assert(sizeof...(P) == sizeof...(A), "cuda_emu: wrong number of kernel arguments");
  auto params =
      std::apply([](auto&&... a) { return std::tuple<std::decay_t<P>...>(std::move(a)...); },
                 std::move(l.args));
  std::string bad = bad_pointer(params, std::index_sequence_for<P...>{});
  enqueue_kernel(
      l.grid, l.block, l.smem, l.stream, reinterpret_cast<const void*>(kernel),
      [kernel, params] { std::apply(kernel, params); }, std::move(bad));
}

}  // namespace strata::emu
