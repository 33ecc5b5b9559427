// The CUDA stand-in's device memory (tests/cuda_emu/runtime.cc allocates through it): each
// allocation between guard pages, its body poisoned lazily (0xFF, a chunk at a time, on first
// touch) by a SIGSEGV handler, which aborts naming the allocation on an access outside it.
// Test-only.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::emu {

constexpr size_t kChunk = 64 << 10;

// A device allocation: [guard page][body: chunks][guard page]. The body is a memfd mapped twice:
// `user` is what kernels see, inaccessible until a chunk is first touched, when the fault
// handler fills the chunk with 0xFF through `alias` and opens it (lazy poisoning: a large arena
// costs memory only where it is used). `ptr` is placed so that the allocation ends as close to
// the trailing guard page as 256-byte alignment allows.
struct Region {
  std::atomic<bool> live{false};
  char* map = nullptr;  // the reservation, guard pages included
  size_t map_bytes = 0;
  char* user = nullptr;   // body start
  char* alias = nullptr;  // the same body, always writable
  size_t body = 0;
  char* ptr = nullptr;  // what cudaMalloc returned
  size_t bytes = 0;
  std::atomic<uint8_t>* chunks = nullptr;  // 0 untouched, 1 being filled, 2 open
};

// The bytes of device memory an allocation of `size` takes (its body, whole pages).
size_t region_bytes(size_t size);
// A live region for `size` bytes (the fault handler installed first), or nullptr when the
// mappings fail or every region slot is taken.
Region* new_region(size_t size);
// The live region whose allocation starts at ptr; the live region holding [p, p + bytes).
Region* region_at(const void* ptr);
Region* find_region(const void* p, size_t bytes);
// Unmaps a live region and frees its slot.
void free_region(Region* r);
// "" or what wrote outside the allocation: its slack bytes (around it, inside the guard
// pages) are no longer 0xFF. For one region, or every live one.
std::string check_slack(const Region& r);
std::string check_all_slack();

}  // namespace strata::emu
