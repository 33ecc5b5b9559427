// The Hugging Face import and export against misuse: a config.json's sizes bounded as the native
// model section's, exports that would overwrite or mix models refused before training, a failed
// export says how to finish, imported weights that are not finite named, directories read as
// transformers reads them.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/adversarial_util.h"

namespace strata {
namespace {

using namespace adversarial;

// ---- BAD 1: a config.json's sizes are bounded as the native model section's are ----------------

TEST_F(Hardening2, PretrainedSizesAreBoundedLikeTheNativeOnes) {
  // A billion layers grew until the OOM killer (or bad_alloc) ended the process.
  Status s = llama_config_with("layers", [](json& c) { c["num_hidden_layers"] = 1000000000; });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "num_hidden_layers")) << s.message();
  EXPECT_TRUE(contains(s.message(), "model.n_layer: 1000000000 out of range [1, 4096]"))
      << s.message();
  s = llama_config_with("vocab", [](json& c) { c["vocab_size"] = 2147483548; });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "vocab_size")) << s.message();
  s = llama_config_with("hidden", [](json& c) {
    c["hidden_size"] = 1 << 24;
    c["head_dim"] = (1 << 24) / 4;
  });
  EXPECT_TRUE(contains(s.message(), "hidden_size")) << s.message();
  s = llama_config_with("mlp", [](json& c) { c["intermediate_size"] = 1 << 30; });
  EXPECT_TRUE(contains(s.message(), "intermediate_size")) << s.message();
  // A context past the native bound says to give a shorter model.context, and that works.
  s = llama_config_with("positions", [](json& c) { c["max_position_embeddings"] = 1 << 30; });
  EXPECT_TRUE(contains(s.message(), "max_position_embeddings")) << s.message();
  EXPECT_TRUE(contains(s.message(), "shorter model.context")) << s.message();
  s = llama_config_with("positions_ctx", [](json& c) { c["max_position_embeddings"] = 1 << 30; },
                        {"model.context=32"});
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  s = llama_config_with("eps", [](json& c) { c["rms_norm_eps"] = 2.0; });
  EXPECT_TRUE(contains(s.message(), "rms_norm_eps")) << s.message();
}

// ---- BAD 2, 3 and the export directory's weak points
// ----------------------------------------------

TEST_F(Hardening2, ExportIntoTheBaseModelIsRefusedBeforeTraining) {
  const auto dir = temp_dir("export_base");
  const std::string base = fixture_copy("gpt2", dir);
  const std::string before = test::read_file(base + "/model.safetensors");
  int steps = 0;
  TrainOptions o;
  o.progress = false;
  o.on_step_end = [&](int64_t) { ++steps; };
  // The same directory spelled differently is still the same directory.
  auto r = train(pretrained_config(dir, base, {"train.export_dir=\"" + base + "/./\""}), o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(steps, 0) << "trained before refusing";
  EXPECT_TRUE(contains(r.status().message(), "train.export_dir")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "model.from_pretrained")) << r.status().message();
  EXPECT_EQ(test::read_file(base + "/model.safetensors"), before);
  fs::remove_all(dir);
}

TEST_F(Hardening2, ExportDirIsCheckedInThePreflight) {
  const auto dir = temp_dir("export_pre");
  std::ofstream(dir + "/a-file") << "x";
  int steps = 0;
  TrainOptions o;
  o.progress = false;
  o.on_step_end = [&](int64_t) { ++steps; };
  for (const std::string& bad : {dir + "/a-file", dir + "/a-file/below", std::string("/sys/x")}) {
    auto r =
        train(small_config(dir + "/run", {"train.steps=2", "train.export_dir=\"" + bad + "\""}), o);
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_EQ(steps, 0) << bad << ": trained before refusing";
    EXPECT_TRUE(contains(r.status().message(), "train.export_dir")) << r.status().message();
  }
  fs::remove_all(dir);
}

TEST_F(Hardening2, FailedExportSaysTheCheckpointIsSavedAndHowToFinish) {
  const auto dir = temp_dir("export_fail");
  const std::string out = dir + "/hf";
  TrainOptions o;
  o.progress = false;
  // Passes the preflight, then is made a file before the export.
  o.on_step_end = [&](int64_t) { std::ofstream(out) << "in the way"; };
  auto r =
      train(small_config(dir + "/run", {"train.steps=2", "train.export_dir=\"" + out + "\""}), o);
  ASSERT_FALSE(r.is_ok());
  const std::string& m = r.status().message();
  EXPECT_TRUE(contains(m, "train.export_dir")) << m;
  EXPECT_TRUE(contains(m, "is saved")) << m;
  EXPECT_TRUE(contains(m, "strata export --config")) << m;
  EXPECT_TRUE(contains(m, name_of(2))) << m;
  EXPECT_TRUE(fs::exists(dir + "/run/" + name_of(2)));
  fs::remove_all(dir);
}

// Writes a stand-in export: config.json and model.safetensors with `text`.
Status fake_export(const std::string& dir, const std::string& text) {
  fs::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors"}) {
    const std::string tmp = dir + "/" + f + ".tmp";
    std::ofstream(tmp) << text;
    fs::rename(tmp, dir + "/" + f);
  }
  return Status::ok();
}

TEST_F(Hardening2, ExportNeverMixesTwoModels) {
  const auto dir = temp_dir("export_mix");
  const std::string base = fixture_copy("llama", dir);  // 3 shards and an index
  std::ofstream(base + "/generation_config.json") << "{}";
  std::ofstream(base + "/README.md") << "notes";
  ExportTarget t{base, "--out", "run-a", 7, "", false, ", or add --force to replace it"};
  // Another model: refused, naming what is there; nothing written.
  Status s = export_as_owner(t, [&] { return fake_export(base, "new"); });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "LlamaForCausalLM")) << s.message();
  EXPECT_TRUE(contains(s.message(), "config.json")) << s.message();
  EXPECT_TRUE(contains(s.message(), "--force")) << s.message();
  EXPECT_TRUE(fs::exists(base + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(base + "/model.safetensors"));
  // --force: the new model, and none of the old one's model files beside it.
  t.force = true;
  ASSERT_TRUE(export_as_owner(t, [&] { return fake_export(base, "new"); }).is_ok());
  EXPECT_EQ(test::read_file(base + "/model.safetensors"), "new");
  for (const char* gone : {"model.safetensors.index.json", "model-00001-of-00003.safetensors",
                           "model-00003-of-00003.safetensors", "generation_config.json"}) {
    EXPECT_FALSE(fs::exists(base + "/" + gone)) << gone << " of the old model is still there";
  }
  EXPECT_TRUE(fs::exists(base + "/README.md"));  // not a model file: kept
  // The same lineage exports again without --force; another lineage is refused, named.
  t.force = false;
  EXPECT_TRUE(export_as_owner(t, [&] { return fake_export(base, "newer"); }).is_ok());
  EXPECT_EQ(test::read_file(base + "/model.safetensors"), "newer");
  ExportTarget other = t;
  other.run_id = "run-b";
  s = check_export_owner(other);
  EXPECT_TRUE(contains(s.message(), "lineage run-a, step 7")) << s.message();
  fs::remove_all(dir);
}

TEST_F(Hardening2, FailedExportLeavesNoEmptyDirectory) {
  const auto dir = temp_dir("export_empty");
  ExportTarget t{dir + "/new/deeper", "--out", "run-a", 1, "", false, ""};
  Status s = export_as_owner(t, [&] {
    fs::create_directories(t.dir);
    return io_error("the export failed");
  });
  EXPECT_FALSE(s.is_ok());
  EXPECT_FALSE(fs::exists(dir + "/new")) << "an empty export directory was left behind";
  // A directory that was there stays.
  fs::create_directories(dir + "/mine");
  t.dir = dir + "/mine";
  EXPECT_FALSE(export_as_owner(t, [] { return io_error("failed"); }).is_ok());
  EXPECT_TRUE(fs::is_directory(dir + "/mine"));
  fs::remove_all(dir);
}

// ---- WEAK: imported weights that are not finite are named at import -----------------------------

TEST_F(Hardening2, NonFiniteImportedWeightIsNamed) {
  const auto dir = temp_dir("nan");
  const std::string base = fixture_copy("gpt2", dir);
  const std::string file = base + "/model.safetensors";
  uint64_t offset = 0;
  {
    auto f = SafetensorsFile::open(file);
    ASSERT_TRUE(f.is_ok());
    const SafetensorsTensor* t = (*f)->find("transformer.h.1.mlp.c_fc.weight");
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->dtype, DType::kF32);
    offset = t->offset + 4 * 77;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(offset));
    f.write(reinterpret_cast<const char*>(&nan), 4);
  }
  Status s = train_status(pretrained_config(dir, base));
  EXPECT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "transformer.h.1.mlp.c_fc.weight")) << s.message();
  EXPECT_TRUE(contains(s.message(), file)) << s.message();
  EXPECT_TRUE(contains(s.message(), "byte offset " + std::to_string(offset))) << s.message();
  EXPECT_FALSE(contains(s.message(), "diverged")) << s.message();
  fs::remove_all(dir);
}

// ---- WEAK: directories transformers reads one way are read the same way ----------------------

TEST_F(Hardening2, SingleFileWinsOverAnIndexAsInTransformers) {
  const auto dir = temp_dir("both");
  const std::string both = fixture_copy("llama", dir);  // fp32 shards and their index
  fs::copy(std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/llama-bf16/model.safetensors",
           both + "/model.safetensors");  // the same weights rounded to bf16
  Config cfg = pretrained_config(dir, both);
  auto arch = create_architecture(cfg.model);
  ASSERT_TRUE(arch.is_ok());
  auto read = [&](const std::string& d) {
    auto r = HfCheckpointReader::open(d, **arch);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    std::vector<float> w((*arch)->layout().modules[0].numel);
    EXPECT_TRUE((*r)->read_module(0, w.data()).is_ok());
    return w;
  };
  EXPECT_EQ(read(both), read(std::string(STRATA_SOURCE_DIR) + "/tests/fixtures/hf/llama-bf16"));
  fs::remove_all(dir);
}

// Appends tensor `name` (F32, `shape`, `values`) to the safetensors file `path`.
void add_tensor(const std::string& path, const std::string& name, std::vector<int64_t> shape,
                const std::vector<float>& values) {
  const std::string bytes = test::read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  json header = json::parse(bytes.substr(8, n));
  std::string data = bytes.substr(8 + n);
  header[name] = {{"dtype", "F32"},
                  {"shape", shape},
                  {"data_offsets", {data.size(), data.size() + values.size() * 4}}};
  data.append(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t len = text.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << text << data;
}

TEST_F(Hardening2, TiedConfigWithADistinctHeadLoadsUntiedAsInTransformers) {
  const auto dir = temp_dir("tied");
  for (const bool distinct : {true, false}) {
    const std::string base = fixture_copy("llama3", dir + (distinct ? "/distinct" : "/same"));
    std::vector<float> embed(100 * 32);
    {
      auto f = SafetensorsFile::open(base + "/model.safetensors");
      ASSERT_TRUE(f.is_ok());
      const SafetensorsTensor* t = (*f)->find("model.embed_tokens.weight");
      ASSERT_NE(t, nullptr);
      ASSERT_EQ(t->numel(), embed.size());
      ASSERT_TRUE((*f)->read_as(*t, DType::kF32, embed.data()).is_ok());
    }
    std::vector<float> head = embed;
    if (distinct) {  // not a constant shift (the softmax would not see it)
      for (size_t i = 0; i < head.size(); ++i) head[i] += 0.01f * float(i % 7);
    }
    add_tensor(base + "/model.safetensors", "lm_head.weight", {100, 32}, head);
    Config cfg = pretrained_config(dir, base);
    // transformers ties them only when they are equal.
    EXPECT_EQ(cfg.model.tied_embeddings, !distinct);
    if (!distinct) continue;
    auto arch = create_architecture(cfg.model);
    ASSERT_TRUE(arch.is_ok());
    auto r = HfCheckpointReader::open(base, **arch);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    bool found = false;
    const ModelLayout& layout = (*arch)->layout();
    for (size_t m = 0; m < layout.modules.size(); ++m) {
      for (const TensorSpec& t : layout.modules[m].tensors) {
        if (t.name != "lm_head") continue;
        found = true;
        std::vector<float> w(layout.modules[m].numel);
        ASSERT_TRUE((*r)->read_module(int(m), w.data()).is_ok());
        EXPECT_TRUE(std::equal(head.begin(), head.end(), w.begin() + std::ptrdiff_t(t.offset)))
            << "the head is not the checkpoint's lm_head.weight";
      }
    }
    EXPECT_TRUE(found) << "no lm_head tensor in the untied layout";
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
