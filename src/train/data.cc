#include "src/train/data.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <new>

#include "src/base/rng.h"
#include "strata/checksum.h"
#include "strata/log.h"

namespace strata {
namespace {

constexpr int32_t kLlmcMagic = 20240520;     // version 1: uint16 tokens (GPT-2)
constexpr int32_t kLlmcMagicU32 = 20240801;  // version 7: uint32 tokens (Llama 3)

// `key`: the config key that names `path`, for the messages.
Result<std::vector<char>> read_file(const std::string& path, const std::string& key) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return errno_status(errno, fmt::format("{}: cannot open '{}' (give a token file{})", key, path,
                                           key == "data.source" ? ", or \"synthetic\"" : ""));
  }
  std::vector<char> bytes;
  struct stat st {};
  Status err;
  if (::fstat(fd, &st) != 0) {
    err = errno_status(errno, fmt::format("{}: stat '{}'", key, path));
  } else if (S_ISDIR(st.st_mode)) {
    err = invalid_argument(fmt::format(
        "{}: '{}' is a directory; give a token file in it (.bin from llm.c, .u16, .u32, or text)",
        key, path));
  } else if (!S_ISREG(st.st_mode)) {
    // A device or a pipe may never end (/dev/zero): the file is read whole into memory.
    err = invalid_argument(fmt::format(
        "{}: '{}' is not a regular file (a device, a pipe or a socket); give a token file (.bin "
        "from llm.c, .u16, .u32, or text)",
        key, path));
  } else {
    bytes.reserve(size_t(st.st_size));
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        err = errno_status(errno,
                           fmt::format("{}: reading '{}' at byte {}", key, path, bytes.size()));
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

// One token file: its tokens (checked against vocab_size), its loss mask when data.loss_mask
// is "auto" and <path>.mask exists (else empty), and a description. `key` names it.
struct TokenFile {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  bool preference = false;  // the mask's conversations are (chosen, rejected) pairs
  std::string description;
};

Result<TokenFile> read_tokens(const std::string& path, const std::string& key,
                              const DataConfig& cfg, int vocab_size) {
  TokenFile d;
  std::string fmt_name = cfg.format;
  // tools/prepare_data.py's journal: a run killed while moving this file and its mask into
  // place (the pair may be mixed until the move is finished).
  if (struct stat js{}; ::lstat((path + ".commit").c_str(), &js) == 0) {
    return invalid_argument(fmt::format(
        "{}: '{}.commit' is there: tools/prepare_data.py was killed while moving '{}' and its "
        "mask into place; run prepare_data.py again with --out '{}' (it finishes the move first)",
        key, path, path, path));
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<char> bytes, read_file(path, key), "loading data");
  if (fmt_name == "auto") {
    int32_t magic = 0;
    if (bytes.size() >= 1024) std::memcpy(&magic, bytes.data(), 4);
    auto ends_with = [&](const char* suf) {
      size_t n = std::strlen(suf);
      return path.size() >= n && path.compare(path.size() - n, n, suf) == 0;
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
  size_t header = 0;  // bytes before the tokens
  if (fmt_name == "llmc") {
    if (bytes.size() < 1024) {
      return corrupt(fmt::format("{}: llm.c .bin needs a 1024-byte header, file has {} bytes", path,
                                 bytes.size()));
    }
    int32_t h[256];
    std::memcpy(h, bytes.data(), sizeof(h));
    const bool u32 = h[0] == kLlmcMagicU32 && h[1] == 7;
    if (!u32 && (h[0] != kLlmcMagic || h[1] != 1)) {
      return corrupt(
          fmt::format("{}: not an llm.c token file (magic {} version {}, expected "
                      "{} version 1 for uint16 tokens or {} version 7 for uint32)",
                      path, h[0], h[1], kLlmcMagic, kLlmcMagicU32));
    }
    const size_t w = u32 ? 4 : 2;
    size_t n = static_cast<uint32_t>(h[2]);
    if (bytes.size() != 1024 + w * n) {
      return corrupt(fmt::format(
          "{}: the llm.c header says {} tokens but the file holds {} bytes of tokens ({} "
          "tokens{}); the file is {} (rewrite it, or fix the header's token count)",
          path, n, bytes.size() - 1024, (bytes.size() - 1024) / w,
          (bytes.size() - 1024) % w ? " and stray bytes" : "",
          bytes.size() < 1024 + w * n ? "truncated" : "longer than its header says"));
    }
    header = 1024;
    d.tokens.resize(n);
    for (size_t i = 0; i < n; ++i) {
      uint32_t t = 0;
      std::memcpy(&t, bytes.data() + 1024 + w * i, w);  // little-endian
      d.tokens[i] = int32_t(t);
    }
  } else if (fmt_name == "uint16" || fmt_name == "uint32") {
    size_t w = fmt_name == "uint16" ? 2 : 4;
    if (bytes.size() % w) {
      return corrupt(fmt::format("{}: size {} is not a multiple of {} bytes ({} tokens)", path,
                                 bytes.size(), w, fmt_name));
    }
    d.tokens.resize(bytes.size() / w);
    for (size_t i = 0; i < d.tokens.size(); ++i) {
      uint32_t t = 0;
      std::memcpy(&t, bytes.data() + w * i, w);
      d.tokens[i] = static_cast<int32_t>(t);
    }
  } else if (fmt_name == "text") {
    d.tokens.resize(bytes.size());
    for (size_t i = 0; i < bytes.size(); ++i) d.tokens[i] = static_cast<uint8_t>(bytes[i]);
  } else {
    return invalid_argument(
        fmt::format("data.format: '{}' is not one of auto, uint16, uint32, llmc, text", fmt_name));
  }
  d.description = fmt::format("{} ({}, {} tokens)", path, fmt_name, d.tokens.size());
  // Every file's tokens are unsigned (a uint32 past 2^31 is stored negative): compared and
  // named as the file holds them.
  for (size_t i = 0; i < d.tokens.size(); ++i) {
    const uint32_t t = static_cast<uint32_t>(d.tokens[i]);
    if (t >= static_cast<uint32_t>(vocab_size)) {
      return invalid_argument(fmt::format(
          "{}: token {} at index {} is outside model.vocab_size {} (a byte-level text file "
          "needs vocab_size >= 256)",
          path, t, i, vocab_size));
    }
  }
  const std::string mask_path = path + ".mask";
  struct stat st {};
  const bool has_mask = ::stat(mask_path.c_str(), &st) == 0;
  if (has_mask && cfg.loss_mask == "none") {
    d.description += fmt::format(", loss mask {} not read (data.loss_mask = \"none\")", mask_path);
    // A preference file read so trains next-token loss on every token of both answers, not
    // DPO: said where it is read (a mask too short for its header is just not read).
    int32_t head[7] = {};
    const int fd = ::open(mask_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      const bool whole = ::read(fd, head, sizeof head) == ssize_t(sizeof head);
      ::close(fd);
      if (whole && head[0] == kMaskMagic && head[6] == kMaskPreference) {
        d.description +=
            ": a preference file trained as plain text (next-token loss on every token of both "
            "answers, no DPO); data.loss_mask \"auto\" trains DPO on its pairs";
      }
    }
  }
  if (has_mask && cfg.loss_mask == "auto") {
    STRATA_ASSIGN_OR_RETURN(std::vector<char> mb, read_file(mask_path, key + "'s loss mask"),
                            "loading data");
    const uint32_t crc = crc32_ieee(0, bytes.data() + header, bytes.size() - header);
    STRATA_ASSIGN_OR_RETURN(LossMask lm, parse_loss_mask(mb, mask_path, path, d.tokens.size(), crc),
                            key + "'s loss mask (data.loss_mask = \"auto\")");
    d.mask = std::move(lm.bytes);
    d.preference = lm.preference;
    size_t loss = 0, starts = 0;
    for (uint8_t m : d.mask) {
      loss += m & kMaskLoss;
      starts += (m & kMaskStart) ? 1 : 0;
    }
    d.description += d.preference
                         ? fmt::format(", loss mask {}: {} preference pairs, loss on {} tokens",
                                       mask_path, starts / 2, loss)
                         : fmt::format(", loss mask {}: {} conversations, loss on {} tokens",
                                       mask_path, starts, loss);
  }
  return d;
}

}  // namespace

Result<Dataset> Dataset::load(const DataConfig& cfg, int vocab_size, uint64_t seed) {
  Dataset d;
  TokenFile train;
  if (cfg.source == "synthetic") {
    try {
      train.tokens = synthetic_corpus(cfg.synthetic_tokens, vocab_size, seed);
    } catch (const std::bad_alloc&) {
      return out_of_memory(fmt::format(
          "data.synthetic_tokens: {} tokens need {:.1f} GiB of host memory, more than this "
          "process can allocate; give fewer",
          cfg.synthetic_tokens, double(cfg.synthetic_tokens) * 4 / double(1 << 30)));
    }
    train.description = fmt::format("synthetic Markov corpus, {} tokens, vocab {}",
                                    train.tokens.size(), vocab_size);
  } else {
    STRATA_ASSIGN_OR_RETURN(train, read_tokens(cfg.source, "data.source", cfg, vocab_size), "");
  }
  d.description_ = std::move(train.description);
  d.tokens_ = std::move(train.tokens);
  const int T = cfg.seq_len;
  if (!cfg.eval_source.empty()) {
    std::error_code ec;
    if (cfg.source != "synthetic" && std::filesystem::equivalent(cfg.source, cfg.eval_source, ec)) {
      log_warn(
          "data.eval_source '{}' is data.source's file: the held-out loss is measured on the "
          "training tokens (it says nothing about generalization); give a separate validation "
          "file (prepare_data.py --val-out), or drop data.eval_source to hold out "
          "data.eval_fraction of data.source",
          cfg.eval_source);
    }
    STRATA_ASSIGN_OR_RETURN(TokenFile eval,
                            read_tokens(cfg.eval_source, "data.eval_source", cfg, vocab_size), "");
    if (eval.preference != train.preference) {
      const auto kind = [](const TokenFile& f) {
        return f.preference ? "holds preference pairs"
                            : "holds no preference pairs (its mask is plain, or it has none)";
      };
      return invalid_argument(fmt::format(
          "data.eval_source: '{}' {} but data.source '{}' {}: the held-out file must be of the "
          "training file's kind; write both with tools/prepare_data.py --format preference (DPO) "
          "or neither",
          cfg.eval_source, kind(eval), cfg.source, kind(train)));
    }
    // A plain held-out file needs one window and its next tokens (seq_len + 2, as each split).
    if (eval.mask.empty() && T > 0 && eval.tokens.size() < size_t(T) + 2) {
      return invalid_argument(fmt::format(
          "data.eval_source: '{}' holds {} tokens; the held-out file needs at least seq_len + 2 "
          "= {}: give a longer validation file, or a shorter data.seq_len",
          cfg.eval_source, eval.tokens.size(), T + 2));
    }
    d.split_ = d.tokens_.size();
    d.train_packed_ = !train.mask.empty();
    d.eval_packed_ = !eval.mask.empty();
    if (d.masked()) {
      // The split without a mask keeps its plain windows; its mask bytes only keep the indices.
      if (train.mask.empty()) train.mask.assign(d.split_, kMaskLoss);
      if (eval.mask.empty()) eval.mask.assign(eval.tokens.size(), kMaskLoss);
      d.mask_ = std::move(train.mask);
      d.mask_.insert(d.mask_.end(), eval.mask.begin(), eval.mask.end());
    }
    d.tokens_.insert(d.tokens_.end(), eval.tokens.begin(), eval.tokens.end());
    d.description_ += "; held out: " + eval.description;
  } else {
    size_t eval = static_cast<size_t>(double(d.tokens_.size()) * cfg.eval_fraction);
    d.split_ = d.tokens_.size() - eval;
    if (train.preference) {
      // The held-out tail starts at a pair: a chosen sequence's start (an even conversation).
      size_t conversation = 0, at = d.tokens_.size();
      for (size_t i = 0; i < train.mask.size(); ++i) {
        if (!(train.mask[i] & kMaskStart)) continue;
        if (i >= d.split_ && conversation % 2 == 0) {
          at = i;
          break;
        }
        ++conversation;
      }
      d.split_ = at;
    }
    if (!train.mask.empty()) {
      // The held-out tail starts at a conversation start.
      while (d.split_ < d.tokens_.size() && !(train.mask[d.split_] & kMaskStart)) ++d.split_;
      d.mask_ = std::move(train.mask);
      d.train_packed_ = d.eval_packed_ = true;
    }
  }
  d.per_sequence_ = cfg.packing == "sequence";
  d.preference_ = train.preference;
  if (d.preference_) {
    STRATA_RETURN_IF_ERROR(d.load_pairs(cfg), "loading data (preference pairs)");
    return d;
  }
  if (d.masked()) {
    d.description_ += d.per_sequence_
                          ? ", packed per sequence (each conversation attends to itself)"
                          : ", packed per window (attention crosses conversations)";
  }
  if (d.train_packed_ && T > 0) d.train_windows_ = pack_windows(d.mask_, 0, d.split_, T);
  if (d.eval_packed_ && T > 0) {
    d.eval_windows_ = pack_windows(d.mask_, d.split_, d.tokens_.size(), T);
  }
  // A packed split with tokens needs a loss target somewhere.
  const auto no_target = [](const std::string& key, const std::string& path, const char* part) {
    return invalid_argument(fmt::format(
        "{}: {}.mask marks no loss target in the {} (no assistant turn after a window's first "
        "token): give conversations with assistant replies, or set data.loss_mask = \"none\"",
        key, path, part));
  };
  if (d.train_packed_ && T > 0 && d.split_ > 0 && d.train_windows_.empty()) {
    return no_target("data.source", cfg.source, "training split");
  }
  // data.eval_fraction 0 holds nothing out: an empty eval split, which the trainer refuses
  // only where an eval runs (train.eval_interval > 0).
  if (d.eval_packed_ && T > 0 && d.eval_windows_.empty() &&
      !(cfg.eval_source.empty() && d.split_ == d.tokens_.size())) {
    return cfg.eval_source.empty() ? no_target("data.source", cfg.source, "held-out tail")
                                   : no_target("data.eval_source", cfg.eval_source, "file");
  }
  return d;
}

Status Dataset::load_pairs(const DataConfig& cfg) {
  const int T = cfg.seq_len;
  size_t left_train = 0, left_eval = 0;
  if (T > 0) {
    train_pairs_ = preference_pairs(mask_, 0, split_, T, &left_train);
    eval_pairs_ = preference_pairs(mask_, split_, tokens_.size(), T, &left_eval);
  }
  const size_t left = left_train + left_eval;
  if (left > 0) {
    log_info(
        "data: {} of {} preference pairs left out ({} training, {} held out): a sequence keeps "
        "no loss target in its first data.seq_len + 1 = {} tokens (its prompt fills them; the "
        "end past them is cut); raise data.seq_len (at most model.context) or shorten the "
        "prompts to keep them",
        left, left + train_pairs_.size() + eval_pairs_.size(), left_train, left_eval, T + 1);
  }
  description_ += fmt::format(
      ", preference pairs (chosen, rejected; one sequence a row, cut at data.seq_len + 1 = {} "
      "tokens): {} training, {} held out",
      T + 1, train_pairs_.size(), eval_pairs_.size());
  if (left > 0) description_ += fmt::format(", {} left out", left);
  const auto no_pair = [&](const std::string& key, const std::string& path, const char* part) {
    return invalid_argument(fmt::format(
        "{}: {}.mask leaves no preference pair in the {} whose chosen and rejected sequences "
        "both keep a loss target within data.seq_len + 1 = {} tokens: give pairs with "
        "completions, shorter prompts, or a longer data.seq_len (at most model.context)",
        key, path, part, T + 1));
  };
  if (T > 0 && split_ > 0 && train_pairs_.empty()) {
    return no_pair("data.source", cfg.source, "training split");
  }
  // data.eval_fraction 0 holds nothing out: no held-out pairs, refused only where an eval runs.
  if (T > 0 && eval_pairs_.empty() && !(cfg.eval_source.empty() && split_ == tokens_.size())) {
    return cfg.eval_source.empty() ? no_pair("data.source", cfg.source, "held-out tail")
                                   : no_pair("data.eval_source", cfg.eval_source, "file");
  }
  return Status::ok();
}

size_t Dataset::pick(uint64_t seed, int64_t step, int micro, uint64_t row, size_t n) {
  Rng rng(seed ^ 0xda7a, (static_cast<uint64_t>(step) << 32) ^ (uint64_t(micro) << 20) ^ row);
  return rng.below(n);
}

void Dataset::fill_window(size_t off, size_t len, int T, int32_t* tokens, int32_t* targets) const {
  for (size_t t = 0; t < size_t(T); ++t) {
    tokens[t] = t < len ? tokens_[off + t] : 0;  // past the window: padding, never a target
    const bool target = t + 1 < len && (mask_[off + t + 1] & kMaskLoss);
    targets[t] = target ? tokens_[off + t + 1] : -1;
  }
}

void Dataset::fill_pair(const PreferencePair& p, int T, int32_t* tokens, int32_t* targets) const {
  fill_window(p.chosen.off, p.chosen.len, T, tokens, targets);
  fill_window(p.rejected.off, p.rejected.len, T, tokens + T, targets + T);
}

void Dataset::pair_batch(bool eval_split, size_t first_pair, int B, int T, int32_t* tokens,
                         int32_t* targets) const {
  const std::vector<PreferencePair>& pairs = eval_split ? eval_pairs_ : train_pairs_;
  STRATA_CHECK(preference_ && B % 2 == 0 && !pairs.empty(),
               "pair_batch: preference data, an even B and pairs in the split");
  for (int j = 0; j < B / 2; ++j) {
    fill_pair(pairs[(first_pair + size_t(j)) % pairs.size()], T, tokens + size_t(2 * j) * T,
              targets + size_t(2 * j) * T);
  }
}

void Dataset::fill_positions(size_t off, size_t len, int T, int32_t* positions) const {
  int32_t p = 0;
  for (size_t t = 0; t < size_t(T); ++t) {
    if (t > 0) p = (t < len && (mask_[off + t] & kMaskStart)) ? 0 : p + 1;
    positions[t] = p;
  }
}

bool positions_are_plain(const int32_t* positions, int B, int T) {
  for (size_t i = 0, n = size_t(B) * size_t(T); i < n; ++i) {
    if (positions[i] != int32_t(i % size_t(T))) return false;
  }
  return true;
}

void Dataset::train_batch(uint64_t seed, int64_t step, int micro, int rank, int B, int T,
                          int32_t* tokens, int32_t* targets, int32_t* positions) const {
  if (preference_) {
    STRATA_CHECK(B % 2 == 0, "train_batch: preference pairs need an even batch");
    for (int j = 0; j < B / 2; ++j) {
      const uint64_t pair = uint64_t(rank) * uint64_t(B / 2) + uint64_t(j);
      fill_pair(train_pairs_[train_pair(seed, step, micro, pair)], T, tokens + size_t(2 * j) * T,
                targets + size_t(2 * j) * T);
    }
    return;
  }
  const size_t span = split_ - size_t(T) - 1;
  for (int b = 0; b < B; ++b) {
    const uint64_t row = uint64_t(rank) * uint64_t(B) + uint64_t(b);
    int32_t* tk = tokens + size_t(b) * T;
    int32_t* tg = targets + size_t(b) * T;
    if (train_packed_) {
      const PackedWindow& w = train_windows_[pick(seed, step, micro, row, train_windows_.size())];
      fill_window(w.off, w.len, T, tk, tg);
      if (positions != nullptr && per_sequence_) {
        fill_positions(w.off, w.len, T, positions + size_t(b) * T);
      }
      continue;
    }
    const size_t off = pick(seed, step, micro, row, span + 1);
    for (int t = 0; t < T; ++t) {
      tk[t] = tokens_[off + t];
      tg[t] = tokens_[off + t + 1];
    }
  }
}

int64_t Dataset::train_batch_targets(uint64_t seed, int64_t step, int micro, int rank, int B,
                                     int T) const {
  if (!train_packed_) return int64_t(B) * T;
  int64_t n = 0;
  if (preference_) {
    for (int j = 0; j < B / 2; ++j) {
      const uint64_t pair = uint64_t(rank) * uint64_t(B / 2) + uint64_t(j);
      const PreferencePair& p = train_pairs_[train_pair(seed, step, micro, pair)];
      n += int64_t(p.chosen.targets) + int64_t(p.rejected.targets);
    }
    return n;
  }
  for (int b = 0; b < B; ++b) {
    const uint64_t row = uint64_t(rank) * uint64_t(B) + uint64_t(b);
    n += train_windows_[pick(seed, step, micro, row, train_windows_.size())].targets;
  }
  return n;
}

size_t Dataset::eval_windows(int T) const {
  if (preference_) return 2 * eval_pairs_.size();
  return eval_packed_ ? eval_windows_.size() : (eval_tokens() - 1) / size_t(T);
}

int64_t Dataset::eval_window_targets(size_t w, int T) const {
  if (preference_) {
    const PreferencePair& p = eval_pairs_[w / 2];
    return int64_t(w % 2 ? p.rejected.targets : p.chosen.targets);
  }
  return eval_packed_ ? int64_t(eval_windows_[w].targets) : int64_t(T);
}

int64_t Dataset::eval_batch_targets(int i, int B, int T, int world) const {
  const size_t windows = eval_windows(T);
  int64_t n = 0;
  for (size_t r = 0; r < size_t(B) * size_t(world); ++r) {
    n += eval_window_targets((size_t(i) * B * world + r) % windows, T);
  }
  return n;
}

void Dataset::eval_batch(int i, int B, int T, int32_t* tokens, int32_t* targets, int rank,
                         int world, int32_t* positions) const {
  if (preference_) {
    STRATA_CHECK(B % 2 == 0, "eval_batch: preference pairs need an even batch");
    const size_t half = size_t(B / 2);
    for (size_t j = 0; j < half; ++j) {
      const size_t p =
          (size_t(i) * size_t(world) * half + size_t(rank) * half + j) % eval_pairs_.size();
      fill_pair(eval_pairs_[p], T, tokens + 2 * j * size_t(T), targets + 2 * j * size_t(T));
    }
    return;
  }
  const size_t windows = eval_windows(T);
  for (int b = 0; b < B; ++b) {
    size_t w = (size_t(i) * B * world + size_t(rank) * B + b) % windows;
    if (eval_packed_) {
      fill_window(eval_windows_[w].off, eval_windows_[w].len, T, tokens + size_t(b) * T,
                  targets + size_t(b) * T);
      if (positions != nullptr && per_sequence_) {
        fill_positions(eval_windows_[w].off, eval_windows_[w].len, T, positions + size_t(b) * T);
      }
      continue;
    }
    size_t off = split_ + w * T;
    for (int t = 0; t < T; ++t) {
      tokens[size_t(b) * T + t] = tokens_[off + t];
      targets[size_t(b) * T + t] = tokens_[off + t + 1];
    }
  }
}

}  // namespace strata
