// Config parser, the key table as a whole: every key's typo and type errors, the origin prefix,
// the batch triple and sizes against straightforward references, DeepSpeed's defaults, the
// shipped DeepSpeed config, and docs/CONFIG.md against the key table. (The table of good and
// bad configs is config_test.cc.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "src/config/leaf.h"
#include "src/model/family.h"
#include "strata/config.h"

namespace strata {
namespace {

// Every key path in the reference table (read back from config_reference_markdown()).
std::vector<std::string> all_key_paths() {
  std::vector<std::string> paths;
  std::istringstream in(config_reference_markdown());
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("| `", 0) != 0) continue;
    size_t end = line.find('`', 3);
    paths.push_back(line.substr(3, end - 3));
  }
  return paths;
}

// {"a": {"b": {"c": value}}} for "a.b.c", inside a document that has a batch size.
std::string nest(const std::string& path, const std::string& value) {
  std::vector<std::string> segs;
  std::stringstream ss(path);
  std::string seg;
  while (std::getline(ss, seg, '.')) segs.push_back(seg);
  std::string doc = value;
  for (size_t i = segs.size(); i-- > 0;) doc = "{\"" + segs[i] + "\": " + doc + "}";
  const char* batch = path == "train_micro_batch_size_per_gpu" ? "train_batch_size"
                                                               : "train_micro_batch_size_per_gpu";
  return "{\"" + std::string(batch) + "\": 1, " + doc.substr(1);
}

// The name a "did you mean X?" message suggests ("" when it has none).
std::string suggestion(const std::string& message) {
  const std::string mark = "did you mean ";
  const size_t at = message.find(mark);
  if (at == std::string::npos) return "";
  const size_t from = at + mark.size();
  return message.substr(from, message.find('?', from) - from);
}

// For every key of the table, at its own depth: every typo that drops one character (never the
// first) is refused with the key as suggestion, in the file and as an override -- or, when the
// typo is one edit from a sibling too (simulate_attention_fwd_tflops without its f is one edit
// from ..._bwd_tflops), with a sibling that close; and a value of the wrong type is refused
// naming the path.
TEST(Config, EveryKeyTypoSuggestsItAndWrongTypeIsRefused) {
  const std::vector<std::string> paths = all_key_paths();
  ASSERT_GT(paths.size(), 150u);
  const std::set<std::string> known(paths.begin(), paths.end());
  size_t typos = 0, ties = 0;
  for (const std::string& path : paths) {
    SCOPED_TRACE(path);
    const size_t dot = path.rfind('.');
    const std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
    const std::string parent = dot == std::string::npos ? "" : path.substr(0, dot + 1);
    // A one-letter name (PEFT's lora.r) has no character to drop.
    for (size_t cut = 1; cut < name.size(); ++cut) {
      std::string typo = name;
      typo.erase(cut, 1);
      SCOPED_TRACE(typo);
      ++typos;
      const std::string head = "f.json: " + parent + typo + ": unknown key; did you mean ";
      Result<Config> r = parse_config(nest(parent + typo, "1"), "f.json");
      ASSERT_FALSE(r.is_ok());
      Result<Config> o =
          parse_config(R"({"train_batch_size": 1})", "f.json", {parent + typo + "=1"});
      ASSERT_FALSE(o.is_ok());
      for (const std::string& m : {r.status().message(), o.status().message()}) {
        EXPECT_NE(m.find(parent + typo + ": unknown key; did you mean "), std::string::npos) << m;
        const std::string s = suggestion(m);
        if (s == name) continue;
        ++ties;
        EXPECT_TRUE(known.count(parent + s)) << m;
        EXPECT_EQ(config_internal::edit_distance(typo, s), 1u) << m;
      }
      EXPECT_NE(r.status().message().find(head), std::string::npos) << r.status().message();
    }

    if (path == "amp") continue;  // free-form: any JSON is accepted
    Result<Config> w = parse_config(nest(path, "{\"x\": 1}"), "f.json");
    ASSERT_FALSE(w.is_ok());
    EXPECT_NE(w.status().message().find("f.json: " + path + ": expected "), std::string::npos)
        << w.status().message();
  }
  EXPECT_GT(typos, 2000u);
  EXPECT_LT(ties, typos / 20) << "most typos must have their own key as the only close one";
}

// model.type takes every name of every registered family (a family added to model_families()
// needs no line in the key table), and refuses any other naming the key and the families.
TEST(Config, ModelTypeIsEveryRegisteredFamily) {
  size_t names = 0;
  for (const ModelFamily* f : model_families()) {
    for (const std::string& type : f->types) {
      ++names;
      auto c = parse_config(nest("model.type", "\"" + type + "\""), "test");
      if (!c.is_ok()) {
        EXPECT_EQ(c.status().message().find("model.type"), std::string::npos)
            << type << ": " << c.status().message();
      }
    }
  }
  EXPECT_GE(names, 4u);
  auto bad = parse_config(nest("model.type", "\"no_such_family\""), "test");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("model.type"), std::string::npos) << bad.status().message();
  for (const ModelFamily* f : model_families()) {
    EXPECT_NE(bad.status().message().find(f->types.front()), std::string::npos)
        << bad.status().message();
  }
}

TEST(Config, OriginPrefixesMessage) {
  Result<Config> r = parse_config(R"({"train_batch_size": 8, "zero_optimization": {"stage": 4}})",
                                  "configs/x.json");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message(), "configs/x.json: zero_optimization.stage: 4 out of range [0, 3]");
}

// An error about a value an override gave names the override, not the file (the file is fine):
// a number, an enum string, a bool, a nested DeepSpeed key, an unknown key, a whole section. An
// error across keys names the file with the overrides of the keys it names; the file's own
// errors still name the file.
TEST(Config, OverrideErrorsNameTheOverrideNotTheFile) {
  const std::string file = R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"train.steps=-3", "--set train.steps=-3: train.steps: -3 out of range"},
      {"optimizer.type=Adamm", "--set optimizer.type=Adamm: optimizer.type: \"Adamm\" is not one"},
      {"fp16.enabled=maybe", "--set fp16.enabled=maybe: fp16.enabled: expected boolean"},
      {"zero_optimization.offload_optimizer.device=gpu",
       "--set zero_optimization.offload_optimizer.device=gpu: "
       "zero_optimization.offload_optimizer.device: \"gpu\" is not one of"},
      {"zero_optimization.offload_parm.device=nvme",
       "--set zero_optimization.offload_parm.device=nvme: zero_optimization.offload_parm: "
       "unknown key"},
      {R"(zero_optimization={"stage": 9})",
       R"(--set zero_optimization={"stage": 9}: zero_optimization.stage: 9 out of range)"},
      {"train.steps", "--set train.steps: expected path=value"},
      {"train_batch_size=7",
       "configs/x.json with --set train_batch_size=7: train_batch_size (7) must equal"},
      {R"(data={"seq_len": 100000})",
       R"(configs/x.json with --set data={"seq_len": 100000}: data.seq_len: 100000 is longer)"},
  };
  for (const auto& [ov, head] : cases) {
    Result<Config> r = parse_config(file, "configs/x.json", {"train.seed=3", ov});
    ASSERT_FALSE(r.is_ok()) << ov;
    EXPECT_EQ(r.status().message().rfind(head, 0), 0u) << r.status().message();
  }
  // The last override of a key is the one named; one of another key is not.
  Result<Config> twice =
      parse_config(file, "configs/x.json", {"train.steps=-1", "train.steps=-2", "train.seed=3"});
  ASSERT_FALSE(twice.is_ok());
  EXPECT_EQ(twice.status().message().rfind("--set train.steps=-2: ", 0), 0u)
      << twice.status().message();
  Result<Config> in_file = parse_config(R"({"train_batch_size": 8, "train": {"steps": -3}})",
                                        "configs/x.json", {"train.seed=3", "fp16.enabled=false"});
  ASSERT_FALSE(in_file.is_ok());
  EXPECT_EQ(in_file.status().message().rfind("configs/x.json: train.steps: -3 out of range", 0), 0u)
      << in_file.status().message();
  // A long value is cut short in the origin (a JSON value nested too deep: the message stays
  // short).
  Result<Config> deep = parse_config(file, "configs/x.json",
                                     {"amp=" + std::string(10000, '[') + std::string(10000, ']')});
  ASSERT_FALSE(deep.is_ok());
  EXPECT_EQ(deep.status().message().rfind("--set amp=[[[", 0), 0u) << deep.status().message();
  EXPECT_NE(deep.status().message().find("(20004 characters)"), std::string::npos)
      << deep.status().message();
  EXPECT_LT(deep.status().message().size(), 400u) << deep.status().message();
}

// The batch triple against the rule itself, on random values and random subsets of given keys.
TEST(Config, BatchTripleRandomized) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> small(1, 9);
  for (int iter = 0; iter < 300; ++iter) {
    const int64_t m = small(rng), g = small(rng), ws = small(rng) % 4 + 1;
    const int64_t t = m * g * ws;
    const int mask = std::uniform_int_distribution<int>(1, 7)(rng);
    std::vector<std::string> parts;
    if (mask & 1) parts.push_back("\"train_batch_size\": " + std::to_string(t));
    if (mask & 2) parts.push_back("\"train_micro_batch_size_per_gpu\": " + std::to_string(m));
    if (mask & 4) parts.push_back("\"gradient_accumulation_steps\": " + std::to_string(g));
    std::string doc = "{";
    for (size_t i = 0; i < parts.size(); ++i) doc += (i ? ", " : "") + parts[i];
    doc += "}";
    Result<Config> r = parse_config(doc, "<random>", {}, static_cast<int>(ws));
    SCOPED_TRACE(doc + " world_size " + std::to_string(ws));
    if (mask == 4) {  // accumulation alone: DeepSpeed refuses
      EXPECT_FALSE(r.is_ok());
      continue;
    }
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    // With one of train/micro missing accumulation defaults to 1 (DeepSpeed).
    const int64_t want_g = (mask == 1 || mask == 2) ? 1 : g;
    const int64_t want_m = (mask == 1) ? t / ws : m;
    EXPECT_EQ(r->gradient_accumulation_steps, want_g);
    EXPECT_EQ(r->train_micro_batch_size_per_gpu, want_m);
    EXPECT_EQ(r->train_batch_size,
              r->train_micro_batch_size_per_gpu * r->gradient_accumulation_steps * ws);
    // Perturbing one of three given values must break consistency.
    if (mask == 7) {
      std::string broken = "{\"train_batch_size\": " + std::to_string(t + 1) +
                           ", \"train_micro_batch_size_per_gpu\": " + std::to_string(m) +
                           ", \"gradient_accumulation_steps\": " + std::to_string(g) + "}";
      Result<Config> b = parse_config(broken, "<random>", {}, static_cast<int>(ws));
      ASSERT_FALSE(b.is_ok());
      EXPECT_NE(b.status().message().find("train_batch_size (" + std::to_string(t + 1) + ")"),
                std::string::npos);
    }
  }
}

TEST(Config, ParseSizeTable) {
  struct S {
    const char* text;
    size_t want;
  };
  for (const S& s : std::vector<S>{{"0", 0},
                                   {"512", 512},
                                   {"1e8", 100'000'000},
                                   {"4k", 4000},
                                   {"4K", 4000},
                                   {"4KiB", 4096},
                                   {"512MB", 512'000'000},
                                   {"100 MiB", 100u << 20},
                                   {"1.5GB", 1'500'000'000},
                                   {"16GiB", size_t{16} << 30},
                                   {"2 TiB", size_t{2} << 40},
                                   {"  3 gb ", 3'000'000'000},
                                   {"1.5k", 1500},
                                   {"7b", 7}}) {
    Result<size_t> r = parse_size(s.text);
    ASSERT_TRUE(r.is_ok()) << s.text << ": " << r.status().to_string();
    EXPECT_EQ(*r, s.want) << s.text;
  }
  struct B {
    const char* text;
    const char* error;
  };
  for (const B& b : std::vector<B>{{"-1", "negative"},
                                   {"-4GiB", "negative"},
                                   {"", "not a size"},
                                   {"GiB", "not a size"},
                                   {"abc", "not a size"},
                                   {"4 XB", "unknown unit \"XB\""},
                                   {"4GiBs", "unknown unit"},
                                   {"1.5", "not a whole number of bytes"},
                                   {"1e30", "too large"},
                                   {"nan", "not a size"},
                                   {"inf", "not a size"}}) {
    Result<size_t> r = parse_size(b.text);
    ASSERT_FALSE(r.is_ok()) << b.text;
    EXPECT_NE(r.status().message().find(b.error), std::string::npos)
        << b.text << ": " << r.status().message();
  }
}

// Random integer x unit round trips against the arithmetic reference.
TEST(Config, ParseSizeRandomized) {
  std::mt19937_64 rng(std::random_device{}());
  const std::vector<std::pair<std::string, uint64_t>> units = {{"", 1},
                                                               {"k", 1000},
                                                               {"MB", 1000000},
                                                               {"G", 1000000000},
                                                               {"KiB", 1024},
                                                               {"MiB", 1 << 20},
                                                               {"GiB", uint64_t{1} << 30},
                                                               {" TiB", uint64_t{1} << 40}};
  for (int i = 0; i < 500; ++i) {
    const auto& [unit, mult] = units[rng() % units.size()];
    const uint64_t n = rng() % 100000;
    Result<size_t> r = parse_size(std::to_string(n) + unit);
    ASSERT_TRUE(r.is_ok()) << n << unit;
    EXPECT_EQ(*r, n * mult) << n << unit;
  }
}

TEST(Config, DefaultsMatchDeepSpeed) {
  Result<Config> r = parse_config(R"({"train_micro_batch_size_per_gpu": 1})", "<s>");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const Config& c = *r;
  EXPECT_EQ(c.zero.offload_param.buffer_count, 5);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(c.zero.sub_group_size, size_t{1'000'000'000});
  EXPECT_FALSE(c.zero.overlap_comm);
  EXPECT_EQ(c.aio.block_size, size_t{1} << 20);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.model.padded_vocab_size, 256);
  EXPECT_EQ(c.data.seq_len, c.model.context);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, c.optimizer.lr);
  EXPECT_TRUE(c.not_acted_on.empty());
  EXPECT_TRUE(c.resolved_auto.empty());
}

TEST(Config, LoadFileErrorsNameThePath) {
  Result<Config> r = load_config("/nonexistent/strata/cfg.json");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("/nonexistent/strata/cfg.json"), std::string::npos);
  Result<Config> d = load_config(std::string(STRATA_SOURCE_DIR) + "/configs");
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("configs: is a directory"), std::string::npos)
      << d.status().message();
}

TEST(Config, ShippedDeepSpeedZero3NvmeConfigParses) {
  const std::string path = std::string(STRATA_SOURCE_DIR) + "/configs/deepspeed-zero3-nvme.json";
  Result<Config> r = load_config(path, {}, 1);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->zero.stage, 3);
  EXPECT_EQ(r->zero.offload_param.device, "nvme");
  EXPECT_EQ(r->zero.offload_optimizer.device, "nvme");
  EXPECT_FALSE(r->not_acted_on.empty());
  // And with an override, as the CLI passes them.
  Result<Config> o = load_config(path, {"zero_optimization.offload_optimizer.device=cpu"}, 1);
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_EQ(o->zero.offload_optimizer.device, "cpu");
}

// Every shipped config parses as it is (a config that drifted from the key table would fail
// only when a user tried it).
TEST(Config, EveryShippedConfigParses) {
  // Their paths are relative to the repository, where the README runs them.
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(STRATA_SOURCE_DIR);
  int n = 0;
  for (const auto& e :
       std::filesystem::directory_iterator(std::string(STRATA_SOURCE_DIR) + "/configs")) {
    if (e.path().extension() != ".json") continue;
    Result<Config> r = load_config(e.path().string(), {}, 1);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    ++n;
  }
  EXPECT_GE(n, 10);
  // The simulated H200's GPT-2 124M times its third step's ops (the op profile).
  Result<Config> sim =
      load_config(std::string(STRATA_SOURCE_DIR) + "/configs/sim-h200-gpt2-124m.json", {}, 1);
  ASSERT_TRUE(sim.is_ok()) << sim.status().to_string();
  EXPECT_TRUE(sim->flops_profiler.enabled);
  EXPECT_EQ(sim->flops_profiler.profile_step, 2);
  EXPECT_EQ(sim->device.simulate, "h200");
  std::filesystem::current_path(cwd);
}

// docs/CONFIG.md embeds config_reference_markdown() verbatim, so the docs list exactly the keys,
// defaults and ranges the parser has. Regenerate with STRATA_UPDATE_CONFIG_DOC=1
// ./config_keys_test.
TEST(Config, DocsMatchTheKeyTable) {
  const std::string path = std::string(STRATA_SOURCE_DIR) + "/docs/CONFIG.md";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot open " << path;
  std::stringstream ss;
  ss << in.rdbuf();
  std::string doc = ss.str();
  const std::string begin = "<!-- BEGIN GENERATED: config_reference_markdown() -->\n";
  const std::string end = "<!-- END GENERATED -->";
  size_t b = doc.find(begin), e = doc.find(end);
  ASSERT_NE(b, std::string::npos) << path << " lacks the marker " << begin;
  ASSERT_NE(e, std::string::npos) << path << " lacks the marker " << end;
  std::string want = config_reference_markdown();
  std::string have = doc.substr(b + begin.size(), e - b - begin.size());
  if (have != want && std::getenv("STRATA_UPDATE_CONFIG_DOC")) {
    doc.replace(b + begin.size(), e - b - begin.size(), want);
    std::ofstream(path) << doc;
    have = want;
  }
  EXPECT_EQ(have, want) << path
                        << " is out of date; run STRATA_UPDATE_CONFIG_DOC=1 config_keys_test to "
                           "regenerate its tables";
}

}  // namespace
}  // namespace strata
