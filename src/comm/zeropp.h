// ZeRO++ (Wang et al., 2023): the communication-volume reductions of ZeRO-3, over a world
// communicator and its sub-groups within and across nodes.
//
//   qwZ  zero_optimization.zero_quantized_weights: parameter all-gathers move int8 values with
//        one fp32 scale per block of kWeightBlock elements (Kernels::quantize), dequantized on
//        arrival into the model dtype. Every rank dequantizes every shard, its own included, so
//        all ranks compute with the same weights; the homes (and the fp32 master) are untouched,
//        so the quantization error does not accumulate over steps.
//   hpZ  zero_optimization.zero_hpz_partition_size = h > 1: the first gather of a module in a
//        phase (forward) keeps a secondary shard, 1/h of the group, partitioned over h ranks of
//        one node; the module's later gathers in that phase (backward, later micro-batches) are
//        all-gathers of the secondary shards within those h ranks only. With qwZ the secondary
//        shard is the received quantized bytes, so both gathers give the same weights bit for
//        bit. Costs 1/h of every module's gathered bytes on the device until the phase's end.
//   qgZ  zero_optimization.zero_quantized_gradients: a gradient reduce-scatter becomes
//        hierarchical and int4 (one fp32 scale per kGradBlock elements): quantize, all-to-all
//        within the node, dequantize and reduce in fp32, re-quantize, all-to-all across nodes,
//        dequantize and reduce in fp32. Quantized values are never summed, and each gradient
//        is quantized twice (once per level) whatever the number of ranks.
//
// Nodes: the ranks sharing a host (Communicator::node(), MPI's shared-memory split), or, when
// strata.comm.ranks_per_node = L > 0, ranks [n*L, (n+1)*L) form node n (to test the hierarchy
// on one machine). Every node must have the same number of ranks.
//
// Thread safety: a ZeroPP is built once on the main thread (every rank must build it, in the
// same order as its other collectives: the splits are collectives); afterwards its
// communicators follow Communicator's rules (the hpZ group is used on the parameter stream, the
// node and cross groups on the gradient stream).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "strata/comm.h"
#include "strata/device.h"
#include "strata/kernels.h"

namespace strata {

// Elements per quantization block (one fp32 scale each).
inline constexpr int kWeightBlock = 256;  // qwZ, int8
inline constexpr int kGradBlock = 128;    // qgZ, int4

// A packed quantized chunk of n elements: the q bytes (Kernels::quantize's layout), padded to
// a multiple of 4, then the fp32 scales. Chunks are quantized on their own, so a chunk's blocks
// start at its first element.
inline size_t packed_bytes(int bits, size_t n, int block) {
  return (quantized_bytes(bits, n) + 3) / 4 * 4 + 4 * quantize_blocks(n, block);
}
// Enqueue on `s`: packs x (n elements of dt) into `packed`, or unpacks it into x (accumulate:
// x += the dequantized values).
void quantize_packed(Device& dev, Stream& s, int bits, DType dt, void* packed, const void* x,
                     size_t n, int block);
void dequantize_packed(Device& dev, Stream& s, int bits, DType dt, void* x, const void* packed,
                       size_t n, int block, bool accumulate);

// Which node each rank of a communicator is on.
struct RankGrid {
  int nodes = 1, per_node = 1;            // N nodes of L ranks
  std::vector<int> node_of, local_of;     // by rank: node index 0..N-1, index within it 0..L-1
  std::vector<std::vector<int>> rank_at;  // [node][local] -> rank

  // From world.node() of every rank (an all-gather), or rank / ranks_per_node when it is > 0.
  // kInvalidArgument when the nodes differ in size or ranks_per_node does not divide the world
  // size (naming strata.comm.ranks_per_node).
  static Result<RankGrid> make(Communicator& world, int ranks_per_node);
};

struct ZeroPPOptions {
  bool quantized_weights = false;    // zero_optimization.zero_quantized_weights
  int hpz_partition_size = 1;        // zero_optimization.zero_hpz_partition_size (0, 1: off)
  bool quantized_gradients = false;  // zero_optimization.zero_quantized_gradients
  int ranks_per_node = 0;            // strata.comm.ranks_per_node (0: from the hosts)
  bool any() const { return quantized_weights || hpz_partition_size > 1 || quantized_gradients; }
};

// ZeRO++'s device memory on one rank, from the switches and the node grid alone: what
// DeviceCache::gather_zeropp and GradBuckets allocate, and what the memory model
// (tier_needs) counts, so the preflight, the planner and the allocations cannot drift.
// ZeroPP::shape() gives the engine's; the planner builds one from its request.
struct ZeroPPShape {
  bool quantized_weights = false;    // qwZ
  int hpz = 1;                       // ranks per hpZ secondary partition (1: no hpZ)
  bool quantized_gradients = false;  // qgZ
  int world = 1, nodes = 1, per_node = 1;

  // The device buffers of one gather of a group whose shards hold `shard_numel` elements of
  // `dt`: one rank's unit (its packed int8 chunk with qwZ, else its shard), the P units a qwZ
  // gather receives before dequantizing (0 without qwZ), and the secondary chunk of P/h units
  // that hpZ keeps until the phase ends (0 without hpZ).
  size_t unit_bytes(size_t shard_numel, DType dt) const {
    return quantized_weights ? packed_bytes(8, shard_numel, kWeightBlock)
                             : shard_numel * dtype_size(dt);
  }
  size_t qwz_buffer_bytes(size_t shard_numel, DType dt) const {
    return quantized_weights ? size_t(world) * unit_bytes(shard_numel, dt) : 0;
  }
  size_t secondary_bytes(size_t shard_numel, DType dt) const {
    return hpz > 1 ? size_t(world / hpz) * unit_bytes(shard_numel, dt) : 0;
  }
  // qgZ's scratch for one reduce-scatter of k elements per rank (ZeroPP::reduce_scatter): the
  // packed chunks sent and received within the node (P each); with several nodes the
  // re-quantized chunks sent and received across them (N each) and the node's fp32 partial
  // sums (N * k), unless `reuse_buf` lets them overwrite the gradient buffer's blocks of other
  // ranks (possible with more than one rank per node). 0 without qgZ.
  size_t qgz_scratch_bytes(size_t k, bool reuse_buf) const {
    if (!quantized_gradients) return 0;
    const size_t pc = packed_bytes(4, k, kGradBlock);
    const size_t L = size_t(per_node), N = size_t(nodes);
    if (N == 1) return 2 * L * pc;
    return 2 * L * N * pc + 2 * N * pc + (reuse_buf && L > 1 ? 0 : N * k * 4);
  }
};

// The bytes one rank sends for one group of `numel` elements (model dtype `dt`) over `world`
// ranks in nodes of `per_node`: its forward gather, its backward gather and its gradient
// reduce-scatter, as the engine moves them (mpi: every rank sends its unit to each peer). The
// planner's model of ZeRO++'s traffic (and of plain ZeRO-3 when the options are all off); the
// engine's comm_bytes measures the same quantities. Its device memory is ZeroPPShape's.
struct ZeroPPTraffic {
  double gather_forward = 0, gather_backward = 0, reduce = 0;  // bytes sent
};
ZeroPPTraffic zeropp_traffic(const ZeroPPOptions& options, int world, int per_node, double numel,
                             DType dt);

class ZeroPP {
 public:
  // Builds the groups the options need from the parameter and gradient communicators (the
  // same ranks). kInvalidArgument naming the key when zero_hpz_partition_size does not divide
  // the ranks per node; kUnavailable from a backend that cannot split (nccl).
  static Result<std::unique_ptr<ZeroPP>> create(const ZeroPPOptions& options,
                                                Communicator& param_comm, Communicator& grad_comm);

  const ZeroPPOptions& options() const { return opt_; }
  const RankGrid& grid() const { return grid_; }
  bool quantized_weights() const { return opt_.quantized_weights; }
  bool hpz() const { return hpz_comm_ != nullptr; }
  bool quantized_gradients() const { return node_comm_ != nullptr; }
  int hpz_size() const { return hpz_comm_ ? hpz_comm_->size() : 1; }
  int hpz_index() const { return hpz_comm_ ? hpz_comm_->rank() : 0; }  // which secondary chunk
  Communicator* hpz_comm() const { return hpz_comm_.get(); }

  // The device memory the switches take on this rank's grid (ZeroPPShape).
  ZeroPPShape shape() const;

  // The qgZ reduce-scatter, enqueued on `s`: buf holds P*k fp32 gradients laid out as
  // Communicator::reduce_scatter's send (block r for rank r); `out` (k floats: this rank's
  // block of buf, or memory apart from it) gets this rank's block summed over the ranks.
  // `scratch` is device memory of at least shape().qgz_scratch_bytes(k, reuse_buf) that stays
  // untouched until the stream has run the call. With `reuse_buf` the blocks of buf other than
  // this rank's may be overwritten (the engine's gradient buckets; not the probe's buffer, which
  // it sends again). Failures of the collectives are kept by the node and cross communicators
  // (health()).
  Status reduce_scatter(Device& dev, Stream& s, float* buf, float* out, size_t k, void* scratch,
                        bool reuse_buf);
  Status health() const;

  // Over the sub-communicators (the trainer adds them to comm_s and comm_bytes); `param` picks
  // the hpZ group, else the gradient groups.
  uint64_t bytes_sent(bool param) const;
  double busy_seconds();

 private:
  ZeroPPOptions opt_;
  RankGrid grid_;
  std::unique_ptr<Communicator> hpz_comm_, node_comm_, cross_comm_;
};

}  // namespace strata
