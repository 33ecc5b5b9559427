// The single-rank communicator: every collective of one rank is a copy (or nothing).
// It is also the test double for code written against Communicator on one process.
#include <cstring>

#include "src/comm/comm_internal.h"

namespace strata::comm_internal {
namespace {

class SingleCommunicator final : public HostCommunicator {
 public:
  SingleCommunicator(Device* device, double timeout_s) : HostCommunicator(device, timeout_s) {}
  const char* backend() const override { return "single"; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int local_rank() const override { return 0; }
  int node() const override { return 0; }
  Result<std::unique_ptr<Communicator>> split(int /*color*/, int /*key*/) override {
    return create_single(device_, timeout_s());
  }

 protected:
  Status run(const Op& op) override {
    // With one rank every collective is the identity: all_gather, reduce_scatter and
    // all_reduce copy send to recv (a reduction over one rank rounds nothing); broadcast and
    // barrier have nothing to do; all_to_all is the identity too.
    if (op.kind == Kind::kBroadcast || op.kind == Kind::kBarrier) return Status::ok();
    const size_t bytes = op.count * op.elem_size();
    if (bytes > 0 && op.send != op.recv) std::memmove(op.recv, op.send, bytes);
    return Status::ok();
  }
};

}  // namespace

Result<std::unique_ptr<Communicator>> create_single(Device* device, double timeout_s) {
  return std::unique_ptr<Communicator>(new SingleCommunicator(device, timeout_s));
}

}  // namespace strata::comm_internal
