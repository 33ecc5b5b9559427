// ZeRO++'s groups and its hierarchical int4 gradient reduce-scatter (zeropp.h).
#include "src/comm/zeropp.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "strata/log.h"

namespace strata {

namespace {
float* scales_of(void* packed, int bits, size_t n) {
  return reinterpret_cast<float*>(static_cast<char*>(packed) +
                                  (quantized_bytes(bits, n) + 3) / 4 * 4);
}
}  // namespace

void quantize_packed(Device& dev, Stream& s, int bits, DType dt, void* packed, const void* x,
                     size_t n, int block) {
  dev.kernels().quantize(s, bits, dt, packed, scales_of(packed, bits, n), x, n, block);
}

void dequantize_packed(Device& dev, Stream& s, int bits, DType dt, void* x, const void* packed,
                       size_t n, int block, bool accumulate) {
  dev.kernels().dequantize(s, bits, dt, x, packed, scales_of(const_cast<void*>(packed), bits, n), n,
                           block, accumulate);
}

Result<RankGrid> RankGrid::make(Communicator& world, int ranks_per_node) {
  const int p = world.size();
  RankGrid g;
  std::vector<int32_t> node_ids(size_t(p), 0);
  if (ranks_per_node > 0) {
    if (p % ranks_per_node != 0) {
      return invalid_argument(fmt::format(
          "strata.comm.ranks_per_node: {} does not divide the {} ranks; set it to a divisor of "
          "the world size, or 0 to take the nodes from the hosts",
          ranks_per_node, p));
    }
    for (int r = 0; r < p; ++r) node_ids[size_t(r)] = r / ranks_per_node * ranks_per_node;
  } else {
    const int32_t mine = world.node();
    STRATA_RETURN_IF_ERROR(world.all_gather_bytes_blocking(&mine, node_ids.data(), 4),
                           "learning which node each rank is on");
  }
  std::map<int32_t, int> index;  // node id -> node index, in id order
  for (int32_t id : node_ids) index.emplace(id, 0);
  int n = 0;
  for (auto& [id, i] : index) i = n++;
  g.nodes = n;
  g.node_of.resize(size_t(p));
  g.local_of.resize(size_t(p));
  g.rank_at.assign(size_t(n), {});
  for (int r = 0; r < p; ++r) {
    const int ni = index[node_ids[size_t(r)]];
    g.node_of[size_t(r)] = ni;
    g.local_of[size_t(r)] = int(g.rank_at[size_t(ni)].size());
    g.rank_at[size_t(ni)].push_back(r);
  }
  g.per_node = int(g.rank_at[0].size());
  for (const auto& ranks : g.rank_at) {
    if (int(ranks.size()) != g.per_node) {
      return invalid_argument(fmt::format(
          "ZeRO++ needs the same number of ranks on every node, but node 0 has {} and another "
          "{}; launch as many ranks per host, or set strata.comm.ranks_per_node",
          g.per_node, ranks.size()));
    }
  }
  return g;
}

Result<std::unique_ptr<ZeroPP>> ZeroPP::create(const ZeroPPOptions& options,
                                               Communicator& param_comm, Communicator& grad_comm) {
  auto z = std::unique_ptr<ZeroPP>(new ZeroPP);
  z->opt_ = options;
  STRATA_ASSIGN_OR_RETURN(z->grid_, RankGrid::make(param_comm, options.ranks_per_node), "ZeRO++");
  const RankGrid& g = z->grid_;
  const int r = param_comm.rank();
  const int n = g.node_of[size_t(r)], l = g.local_of[size_t(r)];
  const int h = options.hpz_partition_size;
  if (h > 1) {
    if (g.per_node % h != 0) {
      return invalid_argument(fmt::format(
          "zero_optimization.zero_hpz_partition_size: {} must divide the {} ranks of a node "
          "({} node(s) of {}); set it to the ranks per node (or a divisor), or 1 for no "
          "secondary partition",
          h, g.per_node, g.nodes, g.per_node));
    }
    // Groups of h consecutive ranks of one node; the position in the group picks the chunk.
    STRATA_ASSIGN_OR_RETURN(z->hpz_comm_, param_comm.split(n * (g.per_node / h) + l / h, l),
                            "zero_optimization.zero_hpz_partition_size: forming the groups");
  }
  if (options.quantized_gradients) {
    STRATA_ASSIGN_OR_RETURN(z->node_comm_, grad_comm.split(n, l),
                            "zero_optimization.zero_quantized_gradients: the node groups");
    STRATA_ASSIGN_OR_RETURN(z->cross_comm_, grad_comm.split(l, n),
                            "zero_optimization.zero_quantized_gradients: the cross-node groups");
  }
  log_info("ZeRO++: {} node(s) of {} rank(s){}; qwZ {}, hpZ {}, qgZ {}", g.nodes, g.per_node,
           options.ranks_per_node > 0 ? " (strata.comm.ranks_per_node)" : "",
           options.quantized_weights ? "int8" : "off",
           h > 1 ? fmt::format("{} ranks", h) : std::string("off"),
           options.quantized_gradients ? "int4" : "off");
  return z;
}

ZeroPPTraffic zeropp_traffic(const ZeroPPOptions& o, int world, int per_node, double numel,
                             DType dt) {
  ZeroPPTraffic t;
  if (world <= 1) return t;
  const double P = world, L = per_node > 0 && world % per_node == 0 ? per_node : world;
  const double N = P / L, shard = numel / P;
  // Bytes per element of a gathered unit and of a qgZ chunk (the scales included).
  const double unit = o.quantized_weights ? 1.0 + 4.0 / kWeightBlock : double(dtype_size(dt));
  const double q4 = 0.5 + 4.0 / kGradBlock;
  t.gather_forward = (P - 1) * shard * unit;
  const int h = o.hpz_partition_size;
  if (h > 1) {
    t.gather_backward = (h - 1) * (P / h) * shard * unit;  // h-1 peers, a chunk of P/h units
  } else {
    t.gather_backward = t.gather_forward;
  }
  // qgZ: (L-1) node peers get N chunks each; (N-1) other nodes get one chunk.
  t.reduce = o.quantized_gradients ? ((L - 1) * N + (N - 1)) * shard * q4 : (P - 1) * shard * 4;
  return t;
}

ZeroPPShape ZeroPP::shape() const {
  ZeroPPShape s;
  s.quantized_weights = quantized_weights();
  s.hpz = hpz_size();
  s.quantized_gradients = quantized_gradients();
  s.world = int(grid_.node_of.size());
  s.nodes = grid_.nodes;
  s.per_node = grid_.per_node;
  return s;
}

Status ZeroPP::reduce_scatter(Device& dev, Stream& s, float* buf, float* out, size_t k,
                              void* scratch, bool reuse_buf) {
  STRATA_CHECK(node_comm_ != nullptr, "ZeroPP::reduce_scatter without qgZ");
  const size_t pc = packed_bytes(4, k, kGradBlock);
  const int L = grid_.per_node, N = grid_.nodes, P = L * N;
  // The layout of shape().qgz_scratch_bytes(k, reuse_buf).
  char* send1 = static_cast<char*>(scratch);
  char* recv1 = send1 + size_t(L) * N * pc;
  char* send2 = recv1 + size_t(L) * N * pc;
  char* recv2 = send2 + size_t(N) * pc;
  // The node's partial sums (several nodes): the scratch's, or N blocks of buf other than this
  // rank's, whose values are dead once quantized (P >= 2N).
  float* acc = reinterpret_cast<float*>(recv2 + size_t(N) * pc);
  if (reuse_buf && L > 1) {
    const int rank = grid_.rank_at[size_t(cross_comm_->rank())][size_t(node_comm_->rank())];
    acc = buf + size_t(rank < N ? P - N : 0) * k;
  }
  // 1. Quantize every rank's block, grouped by the node peer that reduces it: peer l' gets the
  //    blocks of the ranks with local index l' on every node, in node order.
  for (int lp = 0; lp < L; ++lp) {
    for (int np = 0; np < N; ++np) {
      const int dst = grid_.rank_at[size_t(np)][size_t(lp)];
      quantize_packed(dev, s, 4, DType::kF32, send1 + (size_t(lp) * N + np) * pc,
                      buf + size_t(dst) * k, k, kGradBlock);
    }
  }
  // 2. Within the node; then reduce in fp32 over the node's ranks, in local order.
  STRATA_RETURN_IF_ERROR(node_comm_->all_to_all_bytes(s, send1, recv1, size_t(N) * pc),
                         "qgZ: all-to-all within the node");
  float* stage = N == 1 ? out : acc;  // one node: the node's sum is the result
  for (int np = 0; np < N; ++np) {
    for (int lq = 0; lq < L; ++lq) {
      dequantize_packed(dev, s, 4, DType::kF32, stage + size_t(np) * k,
                        recv1 + (size_t(lq) * N + np) * pc, k, kGradBlock, lq > 0);
    }
  }
  if (N == 1) return Status::ok();
  // 3. Re-quantize the node's partial sums; across the nodes; reduce in fp32 in node order.
  for (int np = 0; np < N; ++np) {
    quantize_packed(dev, s, 4, DType::kF32, send2 + size_t(np) * pc, acc + size_t(np) * k, k,
                    kGradBlock);
  }
  STRATA_RETURN_IF_ERROR(cross_comm_->all_to_all_bytes(s, send2, recv2, pc),
                         "qgZ: all-to-all across nodes");
  for (int nq = 0; nq < N; ++nq) {
    dequantize_packed(dev, s, 4, DType::kF32, out, recv2 + size_t(nq) * pc, k, kGradBlock, nq > 0);
  }
  return Status::ok();
}

Status ZeroPP::health() const {
  for (const auto* c : {&hpz_comm_, &node_comm_, &cross_comm_}) {
    if (*c) STRATA_RETURN_IF_ERROR((*c)->health(), "ZeRO++");
  }
  return Status::ok();
}

uint64_t ZeroPP::bytes_sent(bool param) const {
  if (param) return hpz_comm_ ? hpz_comm_->bytes_sent() : 0;
  return (node_comm_ ? node_comm_->bytes_sent() : 0) +
         (cross_comm_ ? cross_comm_->bytes_sent() : 0);
}

double ZeroPP::busy_seconds() {
  double t = 0;
  for (auto* c : {&hpz_comm_, &node_comm_, &cross_comm_}) {
    if (*c) t += (*c)->busy_seconds();
  }
  return t;
}

}  // namespace strata
