#include "src/train/data.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "src/base/rng.h"

namespace strata {
namespace {

constexpr int32_t kLlmcMagic = 20240520;     // version 1: uint16 tokens (GPT-2)
constexpr int32_t kLlmcMagicU32 = 20240801;  // version 7: uint32 tokens (Llama 3)

Result<std::vector<char>> read_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return errno_status(errno, fmt::format("data.source: cannot open '{}' (give a token file, "
                                           "or \"synthetic\")",
                                           path));
  }
  std::vector<char> bytes;
  struct stat st {};
  Status err;
  if (::fstat(fd, &st) != 0) {
    err = errno_status(errno, fmt::format("data.source: stat '{}'", path));
  } else if (S_ISDIR(st.st_mode)) {
    err = invalid_argument(fmt::format(
        "data.source: '{}' is a directory; give a token file in it (.bin from llm.c, .u16, .u32, "
        "or text)",
        path));
  } else {
    bytes.reserve(S_ISREG(st.st_mode) ? size_t(st.st_size) : 0);
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        err = errno_status(errno,
                           fmt::format("data.source: reading '{}' at byte {}", path, bytes.size()));
        break;
      }
      if (n == 0) break;
      bytes.insert(bytes.end(), buf, buf + n);
    }
  }
  ::close(fd);
  if (!err.is_ok()) return err;
  return bytes;
}

std::vector<int32_t> synthetic_corpus(size_t n, int V, uint64_t seed) {
  // A sparse random Markov chain: after token a comes one of 4 successors of a, with
  // probabilities 0.5, 0.25, 0.15, 0.1 (entropy 1.24 nats), except that every 8th position
  // copies the token 4 back, which only attention can predict. A small model drives the loss
  // from ln(V) towards ~1.3 nats.
  Rng rng(seed, 0x5e7);
  const int K = 4;
  std::vector<int32_t> succ(size_t(V) * K);
  for (auto& s : succ) s = static_cast<int32_t>(rng.below(V));
  std::vector<int32_t> out(n);
  int32_t prev = 0;
  for (size_t i = 0; i < n; ++i) {
    int32_t t;
    if (i >= 4 && i % 8 == 7) {
      t = out[i - 4];
    } else {
      double u = rng.uniform();
      int pick = u < 0.5 ? 0 : (u < 0.75 ? 1 : (u < 0.9 ? 2 : 3));
      t = succ[size_t(prev) * K + pick];
    }
    out[i] = t;
    prev = t;
  }
  return out;
}

}  // namespace

Result<Dataset> Dataset::load(const DataConfig& cfg, int vocab_size, uint64_t seed) {
  Dataset d;
  std::string fmt_name = cfg.format;
  if (cfg.source == "synthetic") {
    d.tokens_ = synthetic_corpus(cfg.synthetic_tokens, vocab_size, seed);
    d.description_ =
        fmt::format("synthetic Markov corpus, {} tokens, vocab {}", d.tokens_.size(), vocab_size);
  } else {
    STRATA_ASSIGN_OR_RETURN(std::vector<char> bytes, read_file(cfg.source), "loading data");
    if (fmt_name == "auto") {
      int32_t magic = 0;
      if (bytes.size() >= 1024) std::memcpy(&magic, bytes.data(), 4);
      auto ends_with = [&](const char* suf) {
        size_t n = std::strlen(suf);
        return cfg.source.size() >= n && cfg.source.compare(cfg.source.size() - n, n, suf) == 0;
      };
      if (magic == kLlmcMagic || magic == kLlmcMagicU32) {
        fmt_name = "llmc";
      } else if (ends_with(".u16")) {
        fmt_name = "uint16";
      } else if (ends_with(".u32")) {
        fmt_name = "uint32";
      } else {
        fmt_name = "text";
      }
    }
    if (fmt_name == "llmc") {
      if (bytes.size() < 1024) {
        return corrupt(fmt::format("{}: llm.c .bin needs a 1024-byte header, file has {} bytes",
                                   cfg.source, bytes.size()));
      }
      int32_t header[256];
      std::memcpy(header, bytes.data(), sizeof(header));
      const bool u32 = header[0] == kLlmcMagicU32 && header[1] == 7;
      if (!u32 && (header[0] != kLlmcMagic || header[1] != 1)) {
        return corrupt(
            fmt::format("{}: not an llm.c token file (magic {} version {}, expected "
                        "{} version 1 for uint16 tokens or {} version 7 for uint32)",
                        cfg.source, header[0], header[1], kLlmcMagic, kLlmcMagicU32));
      }
      const size_t w = u32 ? 4 : 2;
      size_t n = static_cast<uint32_t>(header[2]);
      if (bytes.size() != 1024 + w * n) {
        return corrupt(fmt::format(
            "{}: the llm.c header says {} tokens but the file holds {} bytes of tokens ({} "
            "tokens{}); the file is {} (rewrite it, or fix the header's token count)",
            cfg.source, n, bytes.size() - 1024, (bytes.size() - 1024) / w,
            (bytes.size() - 1024) % w ? " and stray bytes" : "",
            bytes.size() < 1024 + w * n ? "truncated" : "longer than its header says"));
      }
      d.tokens_.resize(n);
      for (size_t i = 0; i < n; ++i) {
        uint32_t t = 0;
        std::memcpy(&t, bytes.data() + 1024 + w * i, w);  // little-endian
        d.tokens_[i] = int32_t(t);
      }
    } else if (fmt_name == "uint16" || fmt_name == "uint32") {
      size_t w = fmt_name == "uint16" ? 2 : 4;
      if (bytes.size() % w) {
        return corrupt(fmt::format("{}: size {} is not a multiple of {} bytes ({} tokens)",
                                   cfg.source, bytes.size(), w, fmt_name));
      }
      d.tokens_.resize(bytes.size() / w);
      for (size_t i = 0; i < d.tokens_.size(); ++i) {
        uint32_t t = 0;
        std::memcpy(&t, bytes.data() + w * i, w);
        d.tokens_[i] = static_cast<int32_t>(t);
      }
    } else if (fmt_name == "text") {
      d.tokens_.resize(bytes.size());
      for (size_t i = 0; i < bytes.size(); ++i) d.tokens_[i] = static_cast<uint8_t>(bytes[i]);
    } else {
      return invalid_argument(fmt::format(
          "data.format: '{}' is not one of auto, uint16, uint32, llmc, text", fmt_name));
    }
    d.description_ = fmt::format("{} ({}, {} tokens)", cfg.source, fmt_name, d.tokens_.size());
  }
  // Every file's tokens are unsigned (a uint32 past 2^31 is stored negative): compared and
  // named as the file holds them.
  for (size_t i = 0; i < d.tokens_.size(); ++i) {
    const uint32_t t = static_cast<uint32_t>(d.tokens_[i]);
    if (t >= static_cast<uint32_t>(vocab_size)) {
      return invalid_argument(fmt::format(
          "{}: token {} at index {} is outside model.vocab_size {} (a byte-level text file "
          "needs vocab_size >= 256)",
          cfg.source, t, i, vocab_size));
    }
  }
  size_t eval = static_cast<size_t>(double(d.tokens_.size()) * cfg.eval_fraction);
  d.split_ = d.tokens_.size() - eval;
  return d;
}

void Dataset::train_batch(uint64_t seed, int64_t step, int micro, int rank, int B, int T,
                          int32_t* tokens, int32_t* targets) const {
  const size_t span = split_ - size_t(T) - 1;
  for (int b = 0; b < B; ++b) {
    const uint64_t row = uint64_t(rank) * uint64_t(B) + uint64_t(b);
    Rng rng(seed ^ 0xda7a, (static_cast<uint64_t>(step) << 32) ^ (uint64_t(micro) << 20) ^ row);
    size_t off = rng.below(span + 1);
    for (int t = 0; t < T; ++t) {
      tokens[size_t(b) * T + t] = tokens_[off + t];
      targets[size_t(b) * T + t] = tokens_[off + t + 1];
    }
  }
}

void Dataset::eval_batch(int i, int B, int T, int32_t* tokens, int32_t* targets, int rank,
                         int world) const {
  const size_t n = eval_tokens();
  const size_t windows = (n - 1) / size_t(T);
  for (int b = 0; b < B; ++b) {
    size_t w = (size_t(i) * B * world + size_t(rank) * B + b) % windows;
    size_t off = split_ + w * T;
    for (int t = 0; t < T; ++t) {
      tokens[size_t(b) * T + t] = tokens_[off + t];
      targets[size_t(b) * T + t] = tokens_[off + t + 1];
    }
  }
}

}  // namespace strata
