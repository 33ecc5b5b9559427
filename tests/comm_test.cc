// Communicator tests that run in one process: the single backend (blocking and stream-ordered),
// the factory, ShardLayout, the rank-order reduction against a scalar loop, the probe and its
// JSON, the nccl backend on a GPU (skipped without one), and the dead/hung-rank tests, which
// launch comm_mpi_test under mpirun and check how the survivors end.
#include "strata/comm.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "src/comm/comm_internal.h"
#include "src/comm/zeropp.h"

namespace strata {
namespace {

std::vector<uint8_t> random_input(std::mt19937_64& rng, size_t n, DType t) {
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<uint8_t> v(n * dtype_size(t));
  for (size_t i = 0; i < n; ++i) store_f32(v.data(), t, i, dist(rng));
  return v;
}

std::unique_ptr<Device> cpu_device() {
  auto d = create_cpu_device({.capacity = size_t{16} << 20, .threads = 1});
  EXPECT_TRUE(d.is_ok()) << d.status().to_string();
  return std::move(d).value();
}

TEST(ShardLayout, ShardsAreAlignedMinimalAndCoverTheGroup) {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t numel = rng() % 100000;
    const int ws = 1 + static_cast<int>(rng() % 8);
    const DType t = trial % 2 ? DType::kBF16 : DType::kF32;
    const size_t align = size_t{1} << (2 + rng() % 11);  // 4 B .. 4 KiB
    auto l = ShardLayout::make(numel, ws, align, t);
    ASSERT_TRUE(l.is_ok()) << l.status().to_string();
    const size_t ae = align / dtype_size(t);
    EXPECT_EQ(l->shard_bytes(t) % align, 0u);
    EXPECT_EQ(l->padded_numel, l->shard_numel * ws);
    EXPECT_GE(l->padded_numel, numel);
    // Minimal: one alignment unit less per shard would not hold the group.
    if (l->shard_numel > 0) {
      EXPECT_LT((l->shard_numel - ae) * ws, std::max<size_t>(numel, 1));
    }
    size_t covered = 0;
    for (int r = 0; r < ws; ++r) {
      EXPECT_EQ(l->offset(r), r * l->shard_numel);
      const size_t want = numel > l->offset(r) ? std::min(l->shard_numel, numel - l->offset(r)) : 0;
      EXPECT_EQ(l->valid(r), want);
      covered += l->valid(r);
    }
    EXPECT_EQ(covered, numel);
  }
}

TEST(ShardLayout, RejectsBadArguments) {
  EXPECT_EQ(ShardLayout::make(10, 0, 4096, DType::kF32).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ShardLayout::make(10, 2, 0, DType::kF32).status().code(), StatusCode::kInvalidArgument);
  auto odd = ShardLayout::make(10, 2, 6, DType::kF32);
  ASSERT_FALSE(odd.is_ok());
  EXPECT_NE(odd.status().message().find("alignment 6"), std::string::npos);
  auto example = ShardLayout::make(10000, 3, 4096, DType::kBF16);  // 2048 bf16 per 4 KiB
  ASSERT_TRUE(example.is_ok());
  EXPECT_EQ(example->shard_numel, 4096u);
  EXPECT_EQ(example->padded_numel, 12288u);
  EXPECT_EQ(example->valid(2), 10000u - 8192u);
}

TEST(RankOrderReduction, MatchesAScalarLoopBitForBit) {
  std::mt19937_64 rng(7);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      for (int n : {1, 2, 3, 5}) {
        const size_t count = 1 + rng() % 10000;
        std::vector<std::vector<uint8_t>> in;
        std::vector<const void*> ptrs;
        for (int q = 0; q < n; ++q) in.push_back(random_input(rng, count, t));
        for (auto& v : in) ptrs.push_back(v.data());
        std::vector<uint8_t> out(count * dtype_size(t));
        comm_internal::reduce_rank_order(ptrs.data(), n, out.data(), count, t, op);
        for (size_t i = 0; i < count; ++i) {
          float acc = load_f32(in[0].data(), t, i);
          for (int q = 1; q < n; ++q) {
            const float x = load_f32(in[q].data(), t, i);
            acc = op == ReduceOp::kSum ? acc + x : std::max(acc, x);
          }
          std::vector<uint8_t> want(dtype_size(t));
          store_f32(want.data(), t, 0, acc);
          ASSERT_EQ(0, std::memcmp(want.data(), out.data() + i * dtype_size(t), dtype_size(t)))
              << dtype_name(t) << " " << reduce_op_name(op) << " n=" << n << " i=" << i;
        }
      }
    }
  }
}

TEST(RankOrderReduction, RoundsOnceNotPerStep) {
  // bf16 has 8 significant bits: 256 + 1 + 1 rounds to 256 if rounded after each add, but the
  // fp32 sum 258 is representable in bf16 (258 = 129 * 2).
  uint16_t a = f32_to_bf16(256.0f), b = f32_to_bf16(1.0f), c = f32_to_bf16(1.0f), out = 0;
  const void* in[] = {&a, &b, &c};
  comm_internal::reduce_rank_order(in, 3, &out, 1, DType::kBF16, ReduceOp::kSum);
  EXPECT_EQ(bf16_to_f32(out), 258.0f);
}

TEST(SingleComm, BlockingCollectivesAreCopies) {
  auto comm = create_communicator("single", nullptr);
  ASSERT_TRUE(comm.is_ok()) << comm.status().to_string();
  Communicator& c = **comm;
  EXPECT_STREQ(c.backend(), "single");
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.size(), 1);
  EXPECT_EQ(c.local_rank(), 0);
  EXPECT_EQ(c.buffer_space(), BufferSpace::kHost);
  std::mt19937_64 rng(1);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    const size_t n = 1 + rng() % 5000;
    auto in = random_input(rng, n, t);
    std::vector<uint8_t> out(in.size(), 0);
    ASSERT_TRUE(c.all_reduce_blocking(in.data(), out.data(), n, t, ReduceOp::kSum).is_ok());
    EXPECT_EQ(out, in);
    std::fill(out.begin(), out.end(), 0);
    ASSERT_TRUE(c.all_gather_blocking(in.data(), out.data(), n, t).is_ok());
    EXPECT_EQ(out, in);
    std::fill(out.begin(), out.end(), 0);
    ASSERT_TRUE(c.reduce_scatter_blocking(in.data(), out.data(), n, t, ReduceOp::kMax).is_ok());
    EXPECT_EQ(out, in);
    auto copy = in;
    ASSERT_TRUE(c.broadcast_blocking(copy.data(), n, t, 0).is_ok());
    EXPECT_EQ(copy, in);
  }
  EXPECT_TRUE(c.barrier_blocking().is_ok());
  float x = 0;
  Status bad = c.broadcast_blocking(&x, 1, DType::kF32, 1);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("root 1"), std::string::npos) << bad.to_string();
  Status null_buf = c.all_reduce_blocking(nullptr, &x, 1, DType::kF32, ReduceOp::kSum);
  EXPECT_EQ(null_buf.code(), StatusCode::kInvalidArgument);
}

TEST(SingleComm, StreamOrderedCollectivesWaitForEarlierWork) {
  auto dev = cpu_device();
  auto comm = create_communicator("single", dev.get());
  ASSERT_TRUE(comm.is_ok());
  Stream& s = dev->compute_stream();
  std::vector<float> a(1000, 0.0f), b(1000, -1.0f), seen;
  dev->host_fn(s, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    for (size_t i = 0; i < a.size(); ++i) a[i] = float(i);
  });
  ASSERT_TRUE(
      (*comm)->all_reduce(s, a.data(), b.data(), a.size(), DType::kF32, ReduceOp::kSum).is_ok());
  dev->host_fn(s, [&] { seen = b; });
  ASSERT_TRUE((*comm)->synchronize(s).is_ok());
  EXPECT_EQ(seen, a);
}

TEST(SingleComm, StreamOrderedWithoutADeviceIsAnError) {
  auto dev = cpu_device();
  auto comm = create_communicator("single", nullptr);
  ASSERT_TRUE(comm.is_ok());
  Status s = (*comm)->barrier(dev->compute_stream());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("barrier_blocking"), std::string::npos) << s.to_string();
}

TEST(CreateCommunicator, NamesAndAuto) {
  auto bad = create_communicator("gloo", nullptr);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'gloo'"), std::string::npos);
  if (!launched_with_multiple_ranks()) {
    auto a = create_communicator("auto", nullptr);
    ASSERT_TRUE(a.is_ok()) << a.status().to_string();
    EXPECT_STREQ((*a)->backend(), "single");
  }
#if !defined(STRATA_HAVE_NCCL)
  auto n = create_communicator("nccl", nullptr);
  ASSERT_FALSE(n.is_ok());
  EXPECT_EQ(n.status().code(), StatusCode::kUnavailable);
#endif
  ::setenv("STRATA_COMM_TIMEOUT_S", "7.5", 1);
  auto t = create_communicator("single", nullptr);
  ::unsetenv("STRATA_COMM_TIMEOUT_S");
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ((*t)->timeout_s(), 7.5);
  ::setenv("STRATA_COMM_TIMEOUT_S", "soon", 1);
  auto u = create_communicator("single", nullptr);
  ::unsetenv("STRATA_COMM_TIMEOUT_S");
  EXPECT_EQ(u.status().code(), StatusCode::kInvalidArgument);
}

TEST(CommProbe, RunsOnSingleAndRoundTripsItsJson) {
  auto comm = create_communicator("single", nullptr);
  ASSERT_TRUE(comm.is_ok());
  CommProbeOptions o;
  o.min_bytes = 1024;
  o.max_bytes = 16384;
  o.repeats = 3;
  o.target_seconds = 0.001;
  auto r = run_comm_probe(o, **comm, nullptr, nullptr);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->cases.size(), 4u * 5u);  // 4 ops x {1, 2, 4, 8, 16} KiB
  for (const auto& c : r->cases) {
    EXPECT_EQ(c.time_us.size(), 3u);
    EXPECT_LE(c.min_us, c.median_us);
    EXPECT_LE(c.median_us, c.max_us);
    EXPECT_EQ(c.busbw, c.op == "broadcast" ? c.algbw : 0.0);  // (P-1)/P = 0 with one rank
  }
  const std::string json = comm_probe_json(*r);
  auto back = parse_comm_probe_json(json, "probe.json");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  ASSERT_EQ(back->cases.size(), r->cases.size());
  EXPECT_EQ(back->cases[3].bytes, r->cases[3].bytes);
  EXPECT_EQ(back->cases[3].time_us, r->cases[3].time_us);
  EXPECT_EQ(back->backend, "single");
  auto wrong = parse_comm_probe_json(R"({"magic": "strata-io-probe", "version": 1})", "x.json");
  EXPECT_EQ(wrong.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(wrong.status().message().find("x.json"), std::string::npos);
  std::string newer = json;
  newer.replace(newer.find("\"version\": 1"), 12, "\"version\": 9");
  EXPECT_EQ(parse_comm_probe_json(newer, "y.json").status().code(), StatusCode::kCorrupt);
}

// The quantized collectives run through the probe on one rank with a CPU device: the qwZ
// gather's round trip lands within a block's scale of the input, and the qgZ reduce-scatter
// (one node of one rank: quantize, dequantize) within an int4 step of it.
TEST(CommProbe, QuantizedCollectivesOnSingle) {
  auto dev = create_cpu_device({.capacity = 64 << 20, .threads = 1});
  ASSERT_TRUE(dev.is_ok());
  auto comm = create_communicator("single", dev->get());
  ASSERT_TRUE(comm.is_ok());
  Communicator& c = **comm;
  EXPECT_EQ(c.node(), 0);
  EXPECT_EQ(c.bytes_sent(), 0u);
  auto sub = c.split(0, 0);
  ASSERT_TRUE(sub.is_ok());
  EXPECT_EQ((*sub)->size(), 1);
  std::vector<uint8_t> in = {1, 2, 3, 4, 5}, out(5);
  ASSERT_TRUE(c.all_to_all_bytes_blocking(in.data(), out.data(), 5).is_ok());
  EXPECT_EQ(out, in);
  CommProbeOptions o;
  o.min_bytes = 4096;
  o.max_bytes = 8192;
  o.repeats = 1;
  o.target_seconds = 0.001;
  o.ops = {"all_gather_q8", "reduce_scatter_q4"};
  auto r = run_comm_probe(o, c, dev->get(), nullptr);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->cases.size(), 4u);
  EXPECT_EQ(r->cases[0].op, "all_gather_q8");
  EXPECT_EQ(r->cases[3].op, "reduce_scatter_q4");
  o.ops = {"all_gather_q8"};
  EXPECT_EQ(run_comm_probe(o, c, nullptr, nullptr).status().code(), StatusCode::kInvalidArgument);
  // ZeroPP::reduce_scatter on one rank: |out - in| <= max|block| / 14 per element.
  ZeroPPOptions zo;
  zo.quantized_gradients = true;
  auto z = ZeroPP::create(zo, c, c);
  ASSERT_TRUE(z.is_ok()) << z.status().to_string();
  const size_t k = 1000;
  std::vector<float> g(k), res(k);
  std::mt19937_64 rng(3);
  for (float& v : g) v = std::uniform_real_distribution<float>(-1, 1)(rng);
  auto scratch = (*dev)->allocate((*z)->shape().qgz_scratch_bytes(k, false), "test");
  ASSERT_TRUE(scratch.is_ok());
  Stream& s = (*dev)->compute_stream();
  ASSERT_TRUE((*z)->reduce_scatter(**dev, s, g.data(), res.data(), k, *scratch, false).is_ok());
  ASSERT_TRUE(c.synchronize(s).is_ok());
  for (size_t i = 0; i < k; ++i) {
    float amax = 0;
    for (size_t j = i / kGradBlock * kGradBlock; j < std::min(k, (i / kGradBlock + 1) * kGradBlock);
         ++j) {
      amax = std::max(amax, std::fabs(g[j]));
    }
    ASSERT_LE(std::fabs(res[i] - g[i]), amax / 14 * 1.0001f) << i;
  }
  (*dev)->release(*scratch);
}

// --- nccl ------------------------------------------------------------------------------------
TEST(NcclComm, SingleRankCollectivesOnTheGpu) {
#if !defined(STRATA_HAVE_NCCL)
  GTEST_SKIP() << "built without CUDA/NCCL (STRATA_WITH_CUDA=OFF or NCCL not found)";
#else
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << "no GPU: " << why;
  auto dev = create_cuda_device({});
  ASSERT_TRUE(dev.is_ok()) << dev.status().to_string();
  auto comm = create_communicator("nccl", dev->get());
  ASSERT_TRUE(comm.is_ok()) << comm.status().to_string();
  Device& d = **dev;
  Communicator& c = **comm;
  EXPECT_EQ(c.buffer_space(), BufferSpace::kDevice);
  std::mt19937_64 rng(3);
  Stream& s = d.compute_stream();
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    const size_t n = 4099;
    auto in = random_input(rng, n, t);
    auto dsend = d.allocate(in.size(), "test");
    auto drecv = d.allocate(in.size(), "test");
    ASSERT_TRUE(dsend.is_ok() && drecv.is_ok());
    d.copy_h2d(s, *dsend, in.data(), in.size());
    ASSERT_TRUE(c.all_reduce(s, *dsend, *drecv, n, t, ReduceOp::kSum).is_ok());
    std::vector<uint8_t> out(in.size());
    d.copy_d2h(s, out.data(), *drecv, out.size());
    ASSERT_TRUE(c.synchronize(s).is_ok());
    EXPECT_EQ(out, in) << "one-rank all_reduce is the identity, " << dtype_name(t);
    ASSERT_TRUE(c.all_gather_blocking(*dsend, *drecv, n, t).is_ok());
    ASSERT_TRUE(c.broadcast_blocking(*drecv, n, t, 0).is_ok());
    ASSERT_TRUE(c.reduce_scatter_blocking(*dsend, *drecv, n, t, ReduceOp::kMax).is_ok());
    c.group_begin();
    ASSERT_TRUE(c.all_reduce(s, *dsend, *drecv, n / 2, t, ReduceOp::kSum).is_ok());
    ASSERT_TRUE(c.all_reduce(s, *dsend, *drecv, n / 3, t, ReduceOp::kMax).is_ok());
    ASSERT_TRUE(c.group_end().is_ok());
    d.copy_d2h(s, out.data(), *drecv, out.size());
    ASSERT_TRUE(c.synchronize(s).is_ok());
    EXPECT_EQ(out, in) << dtype_name(t);
    d.release(*dsend);
    d.release(*drecv);
  }
#endif
}

// --- a rank that hangs or dies ----------------------------------------------------------------
#if defined(STRATA_MPIEXEC)
struct Launch {
  int exit_code = -1;
  double seconds = 0;
  std::string output;
};

Launch launch(int np, const std::string& fault, double timeout_s) {
  const std::string cmd = fmt::format(
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 {} --allow-run-as-root "
      "--oversubscribe -np {} -x STRATA_COMM_TIMEOUT_S={} {} --fault={} 2>&1",
      STRATA_MPIEXEC, np, timeout_s, STRATA_COMM_MPI_TEST, fault);
  Launch l;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return l;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) l.output.append(buf, n);
  const int st = ::pclose(p);
  l.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  l.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return l;
}

TEST(MpiFault, HungRankMakesTheOthersTimeOutNamingIt) {
  // Rank 1 never joins; ranks 0 and 2 wait 3 s, then fail with a message naming rank 1, and
  // exit non-zero; mpirun then ends rank 1. 60 s is far beyond 3 s plus start-up: a hang.
  Launch l = launch(3, "hang", 3.0);
  EXPECT_NE(l.exit_code, 0) << l.output;
  EXPECT_LT(l.seconds, 60.0) << l.output;
  EXPECT_NE(l.output.find("rank 0: all_reduce of 4000 bytes"), std::string::npos) << l.output;
  EXPECT_NE(l.output.find("timed out after"), std::string::npos) << l.output;
  EXPECT_NE(l.output.find("waiting for rank(s) 1"), std::string::npos) << l.output;
  EXPECT_NE(l.output.find("rank 2: all_reduce"), std::string::npos) << l.output;
  // A later call on the broken communicator returns the same failure, naming the rank once.
  EXPECT_NE(l.output.find("later call: rank 0: all_reduce of 4000 bytes"), std::string::npos)
      << l.output;
  EXPECT_EQ(l.output.find("rank 0: rank 0"), std::string::npos) << l.output;
  EXPECT_EQ(l.output.find("rank 2: rank 2"), std::string::npos) << l.output;
}

TEST(MpiFault, HungRankFailsAStreamOrderedCollectiveAtSynchronize) {
  Launch l = launch(2, "hang-stream", 3.0);
  EXPECT_NE(l.exit_code, 0) << l.output;
  EXPECT_LT(l.seconds, 60.0) << l.output;
  EXPECT_NE(l.output.find("rank 0: all_reduce of 4000 bytes"), std::string::npos) << l.output;
  EXPECT_NE(l.output.find("waiting for rank(s) 1"), std::string::npos) << l.output;
}

TEST(MpiFault, KilledRankEndsTheJob) {
  // Rank 1 is SIGKILLed before the all_reduce. Open MPI notices the dead process and ends the
  // job; if it did not, the 20 s collective timeout would. Either way the job ends non-zero;
  // 90 s would mean something hung.
  Launch l = launch(2, "kill", 20.0);
  EXPECT_NE(l.exit_code, 0) << l.output;
  EXPECT_LT(l.seconds, 90.0) << l.output;
  const bool mpirun_says = l.output.find("rank 1") != std::string::npos &&
                           (l.output.find("signal 9") != std::string::npos ||
                            l.output.find("Killed") != std::string::npos);
  const bool we_say = l.output.find("waiting for rank(s) 1") != std::string::npos;
  EXPECT_TRUE(mpirun_says || we_say) << l.output;
}
#else
TEST(MpiFault, HungRankMakesTheOthersTimeOutNamingIt) {
  GTEST_SKIP() << "built without MPI (STRATA_WITH_MPI=OFF or Open MPI not found)";
}
#endif

}  // namespace
}  // namespace strata
