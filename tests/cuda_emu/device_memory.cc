// The CUDA stand-in's device memory: guard pages, lazy poisoning, the fault handler
// (device_memory.h).
#include "tests/cuda_emu/device_memory.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace strata::emu {
namespace {

constexpr size_t kPage = 4096, kAlign = 256;
constexpr size_t kMaxRegions = 4096;
Region g_regions[kMaxRegions];
std::mutex g_slots_mu;  // claiming and freeing region slots

struct sigaction g_previous_segv;

void write_str(const char* s) {
  ssize_t r = write(2, s, std::strlen(s));
  static_cast<void>(r);
}
void write_num(uintptr_t v) {
  char buf[32];
  int n = 0;
  do {
    buf[n++] = char('0' + v % 10);
    v /= 10;
  } while (v);
  char out[32];
  for (int i = 0; i < n; ++i) out[i] = buf[n - 1 - i];
  out[n] = 0;
  write_str(out);
}

void on_segv(int sig, siginfo_t* info, void* ctx) {
  char* a = static_cast<char*>(info->si_addr);
  for (Region& r : g_regions) {
    if (!r.live.load(std::memory_order_acquire)) continue;
    if (a < r.map || a >= r.map + r.map_bytes) continue;
    if (a >= r.user && a < r.user + r.body) {
      const size_t c = size_t(a - r.user) / kChunk;
      uint8_t expect = 0;
      if (r.chunks[c].compare_exchange_strong(expect, 1)) {
        const size_t n = std::min(kChunk, r.body - c * kChunk);
        std::memset(r.alias + c * kChunk, 0xFF, n);
        mprotect(r.user + c * kChunk, n, PROT_READ | PROT_WRITE);
        r.chunks[c].store(2, std::memory_order_release);
      } else {
        while (r.chunks[c].load(std::memory_order_acquire) != 2) {
        }
      }
      return;  // the access is retried
    }
    write_str("cuda_emu: out-of-bounds access to device memory: address ");
    if (a < r.ptr) {
      write_num(uintptr_t(r.ptr - a));
      write_str(" bytes before");
    } else {
      write_num(uintptr_t(a - (r.ptr + r.bytes)));
      write_str(" bytes past the end of");
    }
    write_str(" an allocation of ");
    write_num(r.bytes);
    write_str(" bytes\n");
    std::abort();
  }
  // Not ours: the previous handler (or the default action).
  if (g_previous_segv.sa_flags & SA_SIGINFO) {
    g_previous_segv.sa_sigaction(sig, info, ctx);
  } else if (g_previous_segv.sa_handler != SIG_DFL && g_previous_segv.sa_handler != SIG_IGN) {
    g_previous_segv.sa_handler(sig);
  } else {
    signal(SIGSEGV, SIG_DFL);
    raise(SIGSEGV);
  }
}

void install_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
  });
}

}  // namespace

Region* find_region(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (Region& r : g_regions) {
    if (!r.live.load(std::memory_order_acquire)) continue;
    if (c >= r.ptr && c + bytes <= r.ptr + r.bytes) return &r;
  }
  return nullptr;
}

// The slack bytes around an allocation that the guard pages do not cover must still be 0xFF
// (checked through the alias, only in chunks already opened).
std::string check_slack(const Region& r) {
  auto check = [&](size_t from, size_t to) -> bool {
    for (size_t i = from; i < to; ++i) {
      if (r.chunks[i / kChunk].load(std::memory_order_acquire) != 2) {
        i = (i / kChunk + 1) * kChunk - 1;
        continue;
      }
      if (static_cast<unsigned char>(r.alias[i]) != 0xFF) return false;
    }
    return true;
  };
  const size_t start = size_t(r.ptr - r.user), end = start + r.bytes;
  if (!check(0, start) || !check(end, r.body)) {
    return "a write outside an allocation of " + std::to_string(r.bytes) +
           " bytes (its guard zone was overwritten)";
  }
  return "";
}
std::string check_all_slack() {
  for (Region& r : g_regions) {
    if (!r.live.load(std::memory_order_acquire)) continue;
    std::string bad = check_slack(r);
    if (!bad.empty()) return bad;
  }
  return "";
}

size_t region_bytes(size_t size) {
  const size_t body = (std::max<size_t>(size, 1) + kAlign - 1) / kAlign * kAlign;
  return (body + kPage - 1) / kPage * kPage;
}

Region* new_region(size_t size) {
  install_handler();
  const size_t bytes = std::max<size_t>(size, 1);
  const size_t body = (bytes + kAlign - 1) / kAlign * kAlign;
  const size_t body_pages = region_bytes(size);
  const size_t map_bytes = body_pages + 2 * kPage;
  char* map = static_cast<char*>(
      mmap(nullptr, map_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  const int fd = memfd_create("cuda_emu", MFD_CLOEXEC);
  if (map == MAP_FAILED || fd < 0 || ftruncate(fd, off_t(body_pages)) != 0) {
    if (fd >= 0) close(fd);
    return nullptr;
  }
  char* user =
      static_cast<char*>(mmap(map + kPage, body_pages, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, 0));
  char* alias = static_cast<char*>(
      mmap(nullptr, body_pages, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0));
  close(fd);
  if (user == MAP_FAILED || alias == MAP_FAILED) return nullptr;
  const size_t nchunks = (body_pages + kChunk - 1) / kChunk;
  std::lock_guard<std::mutex> lock(g_slots_mu);
  for (Region& r : g_regions) {
    if (r.live.load()) continue;
    r.map = map;
    r.map_bytes = map_bytes;
    r.user = user;
    r.alias = alias;
    r.body = body_pages;
    r.ptr = user + (body_pages - body);
    r.bytes = bytes;
    r.chunks = new std::atomic<uint8_t>[nchunks];
    for (size_t i = 0; i < nchunks; ++i) r.chunks[i] = 0;
    r.live.store(true, std::memory_order_release);
    return &r;
  }
  return nullptr;
}

Region* region_at(const void* ptr) {
  for (Region& x : g_regions) {
    if (x.live.load() && x.ptr == ptr) return &x;
  }
  return nullptr;
}

void free_region(Region* r) {
  {
    std::lock_guard<std::mutex> lock(g_slots_mu);
    r->live.store(false, std::memory_order_release);
  }
  munmap(r->alias, r->body);
  munmap(r->map, r->map_bytes);
  delete[] r->chunks;
  r->chunks = nullptr;
}

}  // namespace strata::emu
