// Storage engine tests: one suite over every backend (io_uring, libaio, posix) with and without
// the fault-injecting wrapper, plus the pinned buffer pool, swap space, nvme_path preflight and
// the probe profile (the extent allocator: extent_allocator_test.cc, in the same binary). Data is
// random per run (seed printed on failure).
#include "strata/storage.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "strata/buffer_pool.h"
#include "strata/checksum.h"
#include "strata/io_probe.h"
#include "strata/storage_faults.h"
#include "strata/swap_space.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
constexpr size_t kA = kStorageAlignment;

// A fresh directory on a real file system (O_DIRECT needs one; /tmp here is ext4). Set
// STRATA_TEST_DIR to put it elsewhere.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("STRATA_TEST_DIR");
    std::string tmpl = std::string(base ? base : "/tmp") + "/strata-io-test-XXXXXX";
    STRATA_CHECK(mkdtemp(tmpl.data()) != nullptr, "mkdtemp");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const {
    fs::create_directories(path_ + "/" + name);
    return path_ + "/" + name;
  }

 private:
  std::string path_;
};

uint64_t fresh_seed() { return std::random_device{}(); }

// An aligned heap buffer (for tests that do not need a pool).
struct AlignedBuf {
  explicit AlignedBuf(size_t n) : size(n), p(static_cast<char*>(std::aligned_alloc(kA, n))) {}
  ~AlignedBuf() { std::free(p); }
  size_t size;
  char* p;
};

void fill_random(char* p, size_t n, std::mt19937_64& rng) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<char>(rng());
}

struct BackendParam {
  std::string backend;
  bool faults;  // random transient errors, short transfers and delays under the engine
};

std::string param_name(const testing::TestParamInfo<BackendParam>& info) {
  return info.param.backend + (info.param.faults ? "_faults" : "");
}

class StorageTest : public testing::TestWithParam<BackendParam> {
 protected:
  void SetUp() override {
    std::string why;
    if (!storage_backend_available(GetParam().backend, &why))
      GTEST_SKIP() << GetParam().backend << " cannot run on this machine: " << why;
    seed_ = fresh_seed();
    rng_.seed(seed_);
    RecordProperty("seed", std::to_string(seed_));
  }

  // A Storage on the parameter's backend; `plan` replaces the default fault plan.
  std::unique_ptr<Storage> make(size_t block_size = 256 << 10, int qd = 16, bool checksum = false,
                                std::shared_ptr<FaultPlan> plan = nullptr) {
    StorageOptions o;
    o.backend = GetParam().backend;
    o.block_size = block_size;
    o.queue_depth = qd;
    o.checksum = checksum;
    if (plan) {
      o.faults = plan;
    } else if (GetParam().faults) {
      plan_ = std::make_shared<FaultPlan>();
      plan_->p_transient = 0.05;
      plan_->p_short = 0.2;
      plan_->p_delay = 0.02;
      plan_->delay_us = 100;
      plan_->seed = seed_;
      o.faults = plan_;
    }
    auto s = open_storage(o);
    STRATA_CHECK(s.is_ok(), s.status().to_string());
    return std::move(s).value();
  }

  FileId open_file(Storage& s, const std::string& name) {
    auto f = s.open(dir_.path() + "/" + name, {.create = true});
    EXPECT_TRUE(f.is_ok()) << f.status().to_string();
    return f.is_ok() ? *f : -1;
  }

  // Waits for every pending completion; returns them by cookie.
  std::map<uint64_t, Status> reap_all(Storage& s) {
    std::map<uint64_t, Status> out;
    std::vector<IoCompletion> c(64);
    while (s.pending() > 0) {
      size_t n = s.reap(c, 1);
      for (size_t i = 0; i < n; ++i) {
        EXPECT_EQ(out.count(c[i].cookie), 0u) << "two completions for cookie " << c[i].cookie;
        out[c[i].cookie] = c[i].status;
      }
    }
    return out;
  }

  TempDir dir_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  std::shared_ptr<FaultPlan> plan_;
};

// Random aligned extents, all in flight at once, written then read back and compared.
TEST_P(StorageTest, RoundTripRandomExtentsHundredsInFlight) {
  auto s = make();
  FileId f = open_file(*s, "data.bin");
  constexpr int kRequests = 300;
  std::vector<uint64_t> off(kRequests), len(kRequests);
  uint64_t pos = 0;
  for (int i = 0; i < kRequests; ++i) {
    pos += (rng_() % 3) * kA;          // random gaps
    len[i] = (1 + rng_() % 200) * kA;  // 4 KiB .. 800 KiB: many split into pieces
    off[i] = pos;
    pos += len[i];
  }
  AlignedBuf src(pos), dst(pos);
  fill_random(src.p, pos, rng_);
  std::memset(dst.p, 0, pos);
  std::vector<IoRequest> w(kRequests), r(kRequests);
  for (int i = 0; i < kRequests; ++i) {
    w[i] = {IoOp::kWrite, f, off[i], len[i], src.p + off[i], uint64_t(i)};
    r[i] = {IoOp::kRead, f, off[i], len[i], dst.p + off[i], uint64_t(1000 + i)};
  }
  ASSERT_TRUE(s->submit(w).is_ok());
  EXPECT_EQ(s->pending(), size_t(kRequests));
  auto wc = reap_all(*s);
  ASSERT_EQ(wc.size(), size_t(kRequests));
  for (auto& [c, st] : wc) ASSERT_TRUE(st.is_ok()) << "write " << c << ": " << st.to_string();
  ASSERT_TRUE(s->submit(r).is_ok());
  auto rc = reap_all(*s);
  ASSERT_EQ(rc.size(), size_t(kRequests));
  for (auto& [c, st] : rc) ASSERT_TRUE(st.is_ok()) << "read " << c << ": " << st.to_string();
  for (int i = 0; i < kRequests; ++i)
    ASSERT_EQ(std::memcmp(src.p + off[i], dst.p + off[i], len[i]), 0)
        << "extent " << i << " offset " << off[i] << " length " << len[i] << " seed " << seed_;
  const StorageStats st = s->stats();
  EXPECT_EQ(st.requests, uint64_t(2 * kRequests));
  EXPECT_GT(st.pieces, uint64_t(2 * kRequests));  // large requests were split
  if (GetParam().faults) {
    EXPECT_GT(plan_->injected_short.load() + plan_->injected_transient.load(), 0u);
    EXPECT_GT(st.short_resubmits + st.retries, 0u);
  }
}

// Reads of one region race writes to another region in the same batches.
TEST_P(StorageTest, ReadsRaceWritesToDifferentExtents) {
  auto s = make(64 << 10, 8);
  FileId f = open_file(*s, "race.bin");
  constexpr size_t kExt = 256 << 10;
  constexpr int kN = 64;  // region A: extents [0, kN), region B: [kN, 2kN)
  AlignedBuf a(kN * kExt), b(kN * kExt), got_a(kN * kExt), got_b(kN * kExt);
  fill_random(a.p, a.size, rng_);
  fill_random(b.p, b.size, rng_);
  std::vector<IoRequest> pre;
  for (int i = 0; i < kN; ++i) pre.push_back({IoOp::kWrite, f, i * kExt, kExt, a.p + i * kExt, 0});
  ASSERT_TRUE(s->run(pre).is_ok());
  std::vector<IoRequest> mixed;
  for (int i = 0; i < kN; ++i) {
    mixed.push_back({IoOp::kRead, f, i * kExt, kExt, got_a.p + i * kExt, uint64_t(i)});
    mixed.push_back({IoOp::kWrite, f, (kN + i) * kExt, kExt, b.p + i * kExt, uint64_t(kN + i)});
  }
  std::shuffle(mixed.begin(), mixed.end(), rng_);
  ASSERT_TRUE(s->submit(mixed).is_ok());
  auto done = reap_all(*s);
  ASSERT_EQ(done.size(), size_t(2 * kN));
  for (auto& [c, st] : done) ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(std::memcmp(a.p, got_a.p, a.size), 0) << "seed " << seed_;
  std::vector<IoRequest> rb;
  for (int i = 0; i < kN; ++i)
    rb.push_back({IoOp::kRead, f, (kN + i) * kExt, kExt, got_b.p + i * kExt, 0});
  ASSERT_TRUE(s->run(rb).is_ok());
  EXPECT_EQ(std::memcmp(b.p, got_b.p, b.size), 0) << "seed " << seed_;
}

// Swap space striped over three directories: random extents round-trip, large ones use all.
TEST_P(StorageTest, SwapSpaceStripedOverThreeDirectories) {
  auto s = make(64 << 10, 16);
  SwapOptions so;
  so.paths = {dir_.sub("d0"), dir_.sub("d1"), dir_.sub("d2")};
  so.bytes_per_path = 16 << 20;
  so.stripe_size = 128 << 10;
  auto sw = SwapSpace::create(s.get(), so);
  ASSERT_TRUE(sw.is_ok()) << sw.status().to_string();
  for (const auto& f : (*sw)->files()) EXPECT_TRUE(fs::exists(f)) << f;
  std::vector<SwapExtent> ext;
  std::vector<std::unique_ptr<AlignedBuf>> data;
  for (int i = 0; i < 12; ++i) {
    const uint64_t bytes = (1 + rng_() % 300) * kA;  // up to 1.2 MiB, most striped
    auto e = (*sw)->allocate(bytes);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    if (e->bytes > so.stripe_size * 2) {
      EXPECT_TRUE(e->striped);
      EXPECT_EQ(e->parts.size(), 3u);
    }
    data.push_back(std::make_unique<AlignedBuf>(e->bytes));
    fill_random(data.back()->p, e->bytes, rng_);
    ext.push_back(*e);
  }
  // All writes in flight together, then all reads.
  std::vector<IoRequest> reqs;
  for (size_t i = 0; i < ext.size(); ++i)
    (*sw)->requests(ext[i], IoOp::kWrite, data[i]->p, i, &reqs);
  ASSERT_TRUE(s->run(reqs).is_ok());
  for (size_t i = 0; i < ext.size(); ++i) {
    AlignedBuf back(ext[i].bytes);
    ASSERT_TRUE((*sw)->read(ext[i], back.p).is_ok());
    ASSERT_EQ(std::memcmp(back.p, data[i]->p, ext[i].bytes), 0) << "extent " << i;
  }
  // Free everything: the allocators coalesce back to full capacity.
  for (const auto& e : ext) (*sw)->free(e);
  EXPECT_EQ((*sw)->free_bytes(), (*sw)->capacity());
  const auto files = (*sw)->files();
  sw->reset();  // clean exit removes the swap files
  for (const auto& f : files) EXPECT_FALSE(fs::exists(f)) << f;
}

// Every injected hard fault ends as a clear error on exactly the affected request; the others
// complete with correct data.
TEST_P(StorageTest, InjectedHardFaultsAreClearErrorsNeverWrongData) {
  struct Case {
    int err;
    int kind;  // 1 read, 2 write
    StatusCode code;
    const char* text;
  };
  for (const Case& k : {Case{EIO, 2, StatusCode::kIoError, "Input/output error"},
                        Case{ENOSPC, 2, StatusCode::kNoSpace, "No space left"},
                        Case{EIO, 1, StatusCode::kIoError, "Input/output error"}}) {
    SCOPED_TRACE(k.text + std::string(k.kind == 1 ? " on read" : " on write"));
    auto plan = std::make_shared<FaultPlan>();
    plan->fail_nth = 5;
    plan->fail_nth_errno = k.err;
    plan->fail_nth_kind = k.kind;
    plan->p_short = GetParam().faults ? 0.2 : 0.0;
    plan->seed = seed_;
    auto s = make(64 << 10, 4, false, plan);
    FileId f = open_file(*s, "faults.bin");
    constexpr int kN = 10;
    constexpr size_t kExt = 64 << 10;  // one piece per request: the 5th piece is request 4
    AlignedBuf src(kN * kExt), dst(kN * kExt);
    fill_random(src.p, src.size, rng_);
    std::vector<IoRequest> w, r;
    for (int i = 0; i < kN; ++i) {
      w.push_back({IoOp::kWrite, f, i * kExt, kExt, src.p + i * kExt, uint64_t(i)});
      r.push_back({IoOp::kRead, f, i * kExt, kExt, dst.p + i * kExt, uint64_t(i)});
    }
    ASSERT_TRUE(s->submit(w).is_ok());
    auto wd = reap_all(*s);
    ASSERT_TRUE(s->submit(r).is_ok());
    auto rd = reap_all(*s);
    auto& failed = k.kind == 2 ? wd : rd;
    int failures = 0;
    for (auto& [c, st] : failed) {
      if (st.is_ok()) continue;
      ++failures;
      EXPECT_EQ(st.code(), k.code) << st.to_string();
      const std::string m = st.message();
      EXPECT_NE(m.find(dir_.path() + "/faults.bin"), std::string::npos) << m;
      EXPECT_NE(m.find(fmt::format("offset {}", c * kExt)), std::string::npos) << m;
      EXPECT_NE(m.find(fmt::format("length {}", kExt)), std::string::npos) << m;
      EXPECT_NE(m.find(k.text), std::string::npos) << m;
    }
    EXPECT_EQ(failures, 1);
    EXPECT_EQ(plan->injected_errors.load(), 1u);
    // Every read that succeeded returned the right bytes; a failed write's extent is read but
    // not compared (its content is whatever the file had).
    for (int i = 0; i < kN; ++i) {
      if (!rd[i].is_ok() || !wd[i].is_ok()) continue;
      EXPECT_EQ(std::memcmp(src.p + i * kExt, dst.p + i * kExt, kExt), 0) << "extent " << i;
    }
  }
}

// Only transient errors and short transfers, at high rates: all retried, data intact.
TEST_P(StorageTest, TransientAndShortFaultsAreRetried) {
  auto plan = std::make_shared<FaultPlan>();
  plan->p_transient = 0.3;
  plan->p_short = 0.5;
  plan->p_delay = 0.05;
  plan->delay_us = 50;
  plan->seed = seed_;
  auto s = make(128 << 10, 8, false, plan);
  FileId f = open_file(*s, "retry.bin");
  constexpr size_t kBytes = 8 << 20;
  AlignedBuf src(kBytes), dst(kBytes);
  fill_random(src.p, kBytes, rng_);
  IoRequest w{IoOp::kWrite, f, 0, kBytes, src.p, 1};
  IoRequest r{IoOp::kRead, f, 0, kBytes, dst.p, 2};
  ASSERT_TRUE(s->run({&w, 1}).is_ok());
  ASSERT_TRUE(s->run({&r, 1}).is_ok());
  EXPECT_EQ(std::memcmp(src.p, dst.p, kBytes), 0) << "seed " << seed_;
  EXPECT_GT(s->stats().retries, 0u);
  EXPECT_GT(s->stats().short_resubmits, 0u);
  EXPECT_EQ(s->stats().retries, plan->injected_transient.load());
}

// A read past the end of the file is an error, not zeros.
TEST_P(StorageTest, ReadPastEndOfFileIsAnError) {
  auto s = make();
  FileId f = open_file(*s, "short.bin");
  AlignedBuf b(64 << 10);
  fill_random(b.p, b.size, rng_);
  IoRequest w{IoOp::kWrite, f, 0, 16 << 10, b.p, 0};
  ASSERT_TRUE(s->run({&w, 1}).is_ok());
  IoRequest r{IoOp::kRead, f, 0, 64 << 10, b.p, 0};
  Status st = s->run({&r, 1});
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("end of file"), std::string::npos) << st.to_string();
}

// With checksums on, a byte changed on disk behind the engine's back is caught.
TEST_P(StorageTest, ChecksumMismatchDetected) {
  auto s = make(64 << 10, 8, /*checksum=*/true);
  FileId f = open_file(*s, "crc.bin");
  constexpr size_t kExt = 256 << 10;
  AlignedBuf src(2 * kExt), dst(2 * kExt);
  fill_random(src.p, src.size, rng_);
  IoRequest w[2] = {{IoOp::kWrite, f, 0, kExt, src.p, 0},
                    {IoOp::kWrite, f, kExt, kExt, src.p + kExt, 1}};
  ASSERT_TRUE(s->run(w).is_ok());
  // Corrupt one byte of the second extent through a separate descriptor.
  const uint64_t where = kExt + rng_() % kExt;
  {
    int fd = ::open(s->path(f).c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    char c = static_cast<char>(src.p[where] ^ 0x5a);
    ASSERT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>(where)), 1);
    ::fsync(fd);
    ::close(fd);
  }
  IoRequest r0{IoOp::kRead, f, 0, kExt, dst.p, 0};
  ASSERT_TRUE(s->run({&r0, 1}).is_ok());
  EXPECT_EQ(std::memcmp(src.p, dst.p, kExt), 0);
  IoRequest r1{IoOp::kRead, f, kExt, kExt, dst.p + kExt, 1};
  Status st = s->run({&r1, 1});
  ASSERT_FALSE(st.is_ok()) << "corruption at byte " << where << " not detected";
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.to_string();
  EXPECT_NE(st.message().find("CRC32C mismatch"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find(s->path(f)), std::string::npos) << st.to_string();
  EXPECT_EQ(s->stats().checksums_verified, 2u);
}

// Misaligned requests are refused up front on O_DIRECT backends, and nothing is queued.
TEST_P(StorageTest, MisalignedRequestRejectedForDirectIo) {
  auto s = make();
  if (!s->capabilities().direct_io)
    GTEST_SKIP() << GetParam().backend << " is buffered: no alignment rule to check";
  FileId f = open_file(*s, "align.bin");
  AlignedBuf b(3 * kA);
  IoRequest bad[2] = {{IoOp::kWrite, f, 0, kA, b.p, 0}, {IoOp::kWrite, f, 100, kA, b.p, 1}};
  Status st = s->submit(bad);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("aligned"), std::string::npos) << st.to_string();
  EXPECT_EQ(s->pending(), 0u);
  IoRequest unknown{IoOp::kRead, 77, 0, kA, b.p, 0};
  EXPECT_FALSE(s->submit({&unknown, 1}).is_ok());
}

// Buffers from a BufferPool registered with the engine (io_uring: fixed buffers, the
// read_fixed/write_fixed path) round-trip like any others.
TEST_P(StorageTest, RegisteredPoolBuffersRoundTrip) {
  auto pool = BufferPool::create(4 << 20);  // outlives the Storage it is registered with
  ASSERT_TRUE(pool.is_ok());
  auto s = make(128 << 10, 8);
  ASSERT_TRUE(s->register_buffer((*pool)->base(), (*pool)->capacity()).is_ok());
  if (GetParam().backend == "io_uring" && !s->capabilities().registered_buffers)
    std::printf("note: the kernel refused io_uring buffer registration; plain path tested\n");
  if (GetParam().backend != "io_uring") {
    EXPECT_FALSE(s->capabilities().registered_buffers);
  }
  FileId f = open_file(*s, "pool.bin");
  auto src = (*pool)->acquire(1 << 20);
  auto dst = (*pool)->acquire(1 << 20);
  ASSERT_TRUE(src.is_ok() && dst.is_ok());
  fill_random(src->as<char>(), src->size(), rng_);
  std::memset(dst->data(), 0, dst->size());
  IoRequest w{IoOp::kWrite, f, 8 * kA, src->size(), src->data(), 0};
  IoRequest r{IoOp::kRead, f, 8 * kA, dst->size(), dst->data(), 1};
  ASSERT_TRUE(s->run({&w, 1}).is_ok());
  ASSERT_TRUE(s->run({&r, 1}).is_ok());
  EXPECT_EQ(std::memcmp(src->data(), dst->data(), src->size()), 0) << "seed " << seed_;
  // A heap buffer outside the registered region still works (plain read/write).
  AlignedBuf heap(1 << 20);
  IoRequest r2{IoOp::kRead, f, 8 * kA, heap.size, heap.p, 2};
  ASSERT_TRUE(s->run({&r2, 1}).is_ok());
  EXPECT_EQ(std::memcmp(src->data(), heap.p, heap.size), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, StorageTest,
                         testing::Values(BackendParam{"io_uring", false},
                                         BackendParam{"libaio", false},
                                         BackendParam{"posix", false},
                                         BackendParam{"io_uring", true},
                                         BackendParam{"libaio", true}, BackendParam{"posix", true}),
                         param_name);

TEST(StorageSelect, AutoPicksAWorkingBackendAndSaysWhich) {
  StorageOptions o;
  o.backend = "auto";
  auto s = open_storage(o);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  const std::string b = (*s)->capabilities().backend;
  EXPECT_TRUE(b == "io_uring" || b == "libaio" || b == "posix") << b;
  std::string why;
  if (storage_backend_available("io_uring", &why)) {
    EXPECT_EQ(b, "io_uring");
    EXPECT_EQ((*s)->capabilities().note, "");
  } else {
    EXPECT_NE((*s)->capabilities().note.find("io_uring refused"), std::string::npos);
  }
  o.backend = "spdk";
  auto bad = open_storage(o);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("auto, io_uring, libaio, posix"), std::string::npos);
  o.backend = "posix";
  o.block_size = 1000;
  EXPECT_FALSE(open_storage(o).is_ok());
}

TEST(BufferPoolTest, AlignedBudgetEnforcedAndReused) {
  auto pool = BufferPool::create(4 << 20);
  ASSERT_TRUE(pool.is_ok());
  std::vector<PinnedBuffer> bufs;
  for (int i = 0; i < 3; ++i) {
    auto b = (*pool)->acquire((1 << 20) - 100);
    ASSERT_TRUE(b.is_ok()) << b.status().to_string();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % kA, 0u);
    std::memset(b->data(), i + 1, b->size());
    bufs.push_back(std::move(b).value());
  }
  for (int i = 0; i < 3; ++i)  // no overlap: each still holds its own byte
    EXPECT_EQ(bufs[i].as<unsigned char>()[bufs[i].size() - 1], i + 1);
  auto big = (*pool)->acquire(2 << 20);  // only 1 MiB left: refused at once, no wait
  ASSERT_FALSE(big.is_ok());
  EXPECT_EQ(big.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(big.status().message().find("budget"), std::string::npos);
  bufs[1].reset();
  bufs[2].reset();  // frees coalesce with the tail
  auto again = (*pool)->acquire(2 << 20);
  EXPECT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ((*pool)->peak_in_use(), size_t(3) << 20);
}

// Drops CAP_IPC_LOCK from this process's effective set so RLIMIT_MEMLOCK applies even to root.
bool drop_ipc_lock_capability() {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (syscall(SYS_capget, &hdr, data) != 0) return false;
  data[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  return syscall(SYS_capset, &hdr, data) == 0;
}

// Runs in a child (death-test style): a pool over RLIMIT_MEMLOCK must still work, unlocked,
// after one warning naming `ulimit -l`; a small pool under the limit is locked.
void pool_over_memlock_limit() {
  if (!drop_ipc_lock_capability()) _exit(10);
  rlimit rl{};
  getrlimit(RLIMIT_MEMLOCK, &rl);
  if (rl.rlim_cur == RLIM_INFINITY) _exit(11);
  auto pool = BufferPool::create(rl.rlim_cur + (64 << 20));
  if (!pool.is_ok()) _exit(12);
  if ((*pool)->locked()) _exit(13);
  auto b = (*pool)->acquire(1 << 20);
  if (!b.is_ok()) _exit(14);
  std::memset(b->data(), 7, b->size());
  b->reset();
  auto small = BufferPool::create(64 << 10);
  if (!small.is_ok() || !(*small)->locked()) _exit(15);
  _exit(0);
}

// Arenas of 2 MiB or more start on a huge-page boundary and are advised MADV_HUGEPAGE, so a
// 1 MiB I/O piece is one contiguous segment and a virtio disk's 254-segment limit does not split
// it in two (docs/BENCHMARKS.md, storage). The advice is accepted unless THP is "never"/absent.
TEST(BufferPoolTest, LargeArenaIsHugePageAlignedAndAdvised) {
  std::string thp;
  std::getline(std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled"), thp);
  auto pool = BufferPool::create(8 << 20);
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*pool)->base()) % BufferPool::kHugePage, 0u);
  const bool thp_usable = !thp.empty() && thp.find("[never]") == std::string::npos;
  EXPECT_EQ((*pool)->huge_pages(), thp_usable) << "THP setting: \"" << thp << "\"";
  auto b = (*pool)->acquire(8 << 20);  // the whole budget, still exactly the budget
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  std::memset(b->data(), 3, b->size());
  EXPECT_FALSE((*pool)->acquire(4096).is_ok());
  auto small = BufferPool::create(1 << 20);  // under one huge page: 4 KiB pages, no advice
  ASSERT_TRUE(small.is_ok());
  EXPECT_FALSE((*small)->huge_pages());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*small)->base()) % kA, 0u);
}

TEST(BufferPoolTest, LockFallbackWhenOverMemlockLimit) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)  // gcc, and clang >= 17
#define STRATA_MLOCK_IS_A_NOOP 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define STRATA_MLOCK_IS_A_NOOP 1
#endif
#endif
#ifdef STRATA_MLOCK_IS_A_NOOP
  GTEST_SKIP() << "the sanitizers (ASan, TSan) intercept mlock as a no-op that succeeds: locking "
                  "cannot fail";
#endif
  rlimit rl{};
  getrlimit(RLIMIT_MEMLOCK, &rl);
  if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (size_t(1) << 30))
    GTEST_SKIP() << "RLIMIT_MEMLOCK is unlimited or > 1 GiB here: locking cannot fail";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(pool_over_memlock_limit(), testing::ExitedWithCode(0),
              "could not lock .*ulimit -l unlimited");
}

TEST(NvmePathTest, MissingPath) {
  TempDir d;
  const std::string p = d.path() + "/no/such/dir";
  Status s = check_nvme_path(p, 4096, true);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find(p), std::string::npos);
  EXPECT_NE(s.message().find("mkdir -p"), std::string::npos) << s.message();
}

// A missing nvme_path is created with its parents (as DeepSpeed creates its swap folder); an
// existing one is left as it is.
TEST(NvmePathTest, CreatedWhenMissing) {
  TempDir d;
  const std::string p = d.path() + "/no/such/dir";
  Result<bool> made = create_nvme_path(p);
  ASSERT_TRUE(made.is_ok()) << made.status().to_string();
  EXPECT_TRUE(*made);
  struct stat st {};
  ASSERT_EQ(::lstat(p.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_TRUE(check_nvme_path(p, 4096, false).is_ok());
  made = create_nvme_path(p + "/");
  ASSERT_TRUE(made.is_ok()) << made.status().to_string();
  EXPECT_FALSE(*made);
  // Through a link the user made to an existing directory: followed, as mkdir -p does.
  ASSERT_EQ(::symlink(p.c_str(), (d.path() + "/mnt").c_str()), 0);
  made = create_nvme_path(d.path() + "/mnt/swap");
  ASSERT_TRUE(made.is_ok()) << made.status().to_string();
  EXPECT_EQ(::lstat((p + "/swap").c_str(), &st), 0);
}

// A file in the way, and a dangling link (strata never creates through a link it did not
// make), are errors naming the part of the path; nothing is created.
TEST(NvmePathTest, CreateRefusesAFileOrADanglingLink) {
  TempDir d;
  std::ofstream(d.path() + "/file") << "x";
  Result<bool> made = create_nvme_path(d.path() + "/file/swap");
  ASSERT_FALSE(made.is_ok());
  EXPECT_NE(made.status().message().find(d.path() + "/file is a file"), std::string::npos)
      << made.status().message();
  ASSERT_EQ(::symlink((d.path() + "/elsewhere").c_str(), (d.path() + "/link").c_str()), 0);
  made = create_nvme_path(d.path() + "/link/swap");
  ASSERT_FALSE(made.is_ok());
  EXPECT_NE(made.status().message().find(d.path() + "/link is a link"), std::string::npos)
      << made.status().message();
  struct stat st {};
  EXPECT_NE(::lstat((d.path() + "/elsewhere").c_str(), &st), 0) << "created through the link";
}

TEST(NvmePathTest, NotADirectory) {
  TempDir d;
  const std::string p = d.path() + "/file";
  std::ofstream(p) << "x";
  Status s = check_nvme_path(p, 4096, true);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find(p + " is not a directory"), std::string::npos) << s.message();
}

TEST(NvmePathTest, NotWritable) {
  TempDir d;
  const std::string p = d.sub("ro");
  ASSERT_EQ(::chmod(p.c_str(), 0500), 0);
  if (::access(p.c_str(), W_OK) == 0) {
    // root ignores permission bits; /proc/self is a directory nobody can create files in.
    Status s = check_nvme_path("/proc/self", 4096, false);
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("/proc/self is not writable"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("permissions"), std::string::npos) << s.message();
    return;
  }
  Status s = check_nvme_path(p, 4096, false);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find(p + " is not writable"), std::string::npos) << s.message();
}

TEST(NvmePathTest, NoODirect) {
  // Find a writable directory whose file system refuses O_DIRECT (tmpfs before Linux 6.6).
  std::ifstream mounts("/proc/mounts");
  std::string dev, mnt, type, rest;
  while (mounts >> dev >> mnt >> type && std::getline(mounts, rest)) {
    if (type != "tmpfs" && type != "ramfs") continue;
    if (::access(mnt.c_str(), W_OK) != 0) continue;
    const std::string f = mnt + "/.strata-odirect-" + std::to_string(getpid());
    int fd = ::open(f.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0) continue;
    ::close(fd);
    fd = ::open(f.c_str(), O_RDWR | O_DIRECT);
    ::unlink(f.c_str());
    if (fd >= 0) {
      ::close(fd);
      continue;
    }
    Status s = check_nvme_path(mnt, 4096, true);
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find(mnt), std::string::npos);
    EXPECT_NE(s.message().find("O_DIRECT"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("posix"), std::string::npos) << s.message();
    return;
  }
  GTEST_SKIP() << "no writable file system here refuses O_DIRECT (tmpfs accepts it since "
                  "Linux 6.6); the refusal path is not exercised";
}

TEST(NvmePathTest, TooLittleSpaceNamesNeedAndFree) {
  TempDir d;
  Status s = check_nvme_path(d.path(), uint64_t{1} << 50, true);  // 1 PiB
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_NE(s.message().find("nvme_path " + d.path() + " needs 1048576.00 GiB, has "),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("GiB free"), std::string::npos);
  // And swap space creation fails the same way before writing anything.
  auto st = open_storage({});
  ASSERT_TRUE(st.is_ok());
  SwapOptions so;
  so.paths = {d.path()};
  so.bytes_per_path = uint64_t{1} << 50;
  auto sw = SwapSpace::create(st->get(), so);
  ASSERT_FALSE(sw.is_ok());
  EXPECT_NE(sw.status().message().find("preflight"), std::string::npos);
  EXPECT_FALSE(fs::exists(swap_file_path(d.path(), 0)));
}

TEST(SwapSpaceTest, HeaderReclaimAfterCrashAndForeignFiles) {
  TempDir d;
  auto st = open_storage({});
  ASSERT_TRUE(st.is_ok());
  SwapOptions so;
  so.paths = {d.path()};
  so.rank = 3;
  so.bytes_per_path = 1 << 20;
  const std::string file = swap_file_path(d.path(), 3);
  std::string header;
  {
    auto sw = SwapSpace::create(st->get(), so);
    ASSERT_TRUE(sw.is_ok()) << sw.status().to_string();
    EXPECT_FALSE((*sw)->reclaimed());
    EXPECT_EQ(fs::file_size(file), kSwapHeaderBytes + so.bytes_per_path);
    std::ifstream in(file, std::ios::binary);
    header.resize(kSwapHeaderBytes);
    in.read(header.data(), kSwapHeaderBytes);
    EXPECT_EQ(header.substr(0, 8), "STRSWAP1");
    uint32_t version;
    std::memcpy(&version, header.data() + 8, 4);
    EXPECT_EQ(version, kSwapFormatVersion);
    int32_t rank;
    std::memcpy(&rank, header.data() + 16, 4);
    EXPECT_EQ(rank, 3);
  }
  EXPECT_FALSE(fs::exists(file)) << "clean exit must remove the swap file";

  // A crashed run: the same header, owned by a pid that is gone.
  pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  auto write_header_with_pid = [&](int32_t pid) {
    std::string h = header;
    std::memcpy(h.data() + 20, &pid, 4);
    const uint32_t v1 = 1;  // a version-1 header: the pid alone names the owner
    std::memcpy(h.data() + 8, &v1, 4);
    const uint32_t crc_at = 8 + 4 * 6 + 8 * 4 + 64;
    uint32_t crc = crc32c(0, h.data(), crc_at);
    std::memcpy(h.data() + crc_at, &crc, 4);
    std::ofstream(file, std::ios::binary) << h;
  };
  write_header_with_pid(child);
  {
    auto sw = SwapSpace::create(st->get(), so);
    ASSERT_TRUE(sw.is_ok()) << sw.status().to_string();
    EXPECT_TRUE((*sw)->reclaimed());
  }
  EXPECT_FALSE(fs::exists(file));

  // Owned by a live process (our parent): refused, naming the pid.
  write_header_with_pid(getppid());
  auto busy = SwapSpace::create(st->get(), so);
  ASSERT_FALSE(busy.is_ok());
  EXPECT_NE(busy.status().message().find(fmt::format("running process {}", getppid())),
            std::string::npos)
      << busy.status().message();
  EXPECT_TRUE(fs::exists(file));

  // Owned by this very process (a second SwapSpace on the same path and rank): refused too.
  ::unlink(file.c_str());
  {
    auto first = SwapSpace::create(st->get(), so);
    ASSERT_TRUE(first.is_ok());
    auto second = SwapSpace::create(st->get(), so);
    ASSERT_FALSE(second.is_ok());
    EXPECT_NE(second.status().message().find(fmt::format("running process {}", getpid())),
              std::string::npos);
  }
  ASSERT_FALSE(fs::exists(file));

  // Not a strata file: left alone, reported.
  std::ofstream(file, std::ios::binary) << "user data, not ours";
  auto foreign = SwapSpace::create(st->get(), so);
  ASSERT_FALSE(foreign.is_ok());
  EXPECT_NE(foreign.status().message().find("not a strata swap file"), std::string::npos);
  EXPECT_EQ(fs::file_size(file), 19u);
}

TEST(IoProbeTest, SmallSweepAndProfileRoundTrip) {
  TempDir d;
  IoProbeOptions o;
  o.paths = {d.sub("a"), d.sub("b")};
  o.file_bytes = 4 << 20;
  o.backends = {"posix", "io_uring"};
  o.block_sizes = {256 << 10, 1 << 20};
  o.queue_depths = {2, 4};
  o.repeats = 2;
  int seen = 0;
  auto r = run_io_probe(o, [&](const IoProbeCase&) { ++seen; });
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(seen, int(r->cases.size()));
  EXPECT_GE(r->cases.size() + r->skipped.size() * 8, 16u);
  for (const auto& c : r->cases) {
    EXPECT_EQ(c.gbps.size(), 2u);
    EXPECT_GT(c.median, 0.0);
    EXPECT_LE(c.min, c.median);
    EXPECT_GE(c.max, c.median);
  }
  EXPECT_FALSE(r->rec_backend.empty());
  const std::string j = io_probe_json(*r);
  EXPECT_NE(j.find("\"magic\": \"strata-io-probe\""), std::string::npos);
  auto back = parse_io_probe_json(j, "mem");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->cases.size(), r->cases.size());
  EXPECT_EQ(back->rec_block_size, r->rec_block_size);
  EXPECT_FALSE(parse_io_probe_json("{\"magic\": \"other\"}", "mem").is_ok());
  EXPECT_FALSE(fs::exists(o.paths[0] + "/strata-probe-io.dat"));
}

}  // namespace
}  // namespace strata
