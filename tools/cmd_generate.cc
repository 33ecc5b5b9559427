// `strata generate --config FILE [--checkpoint PATH] (--prompt TEXT | --prompt-file FILE |
// --prompt-ids IDS) [options]`
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "src/base/safe_file.h"
#include "src/checkpoint/checkpoint.h"
#include "src/hf/master_weights.h"
#include "src/model/architecture.h"
#include "src/model/generate.h"
#include "src/tiers/placement.h"
#include "src/train/process_memory.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/log.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace strata::tools {
namespace {

const char kUsage[] =
    "usage: strata generate --config FILE (--prompt TEXT | --prompt-file FILE | --prompt-ids IDS)\n"
    "                       [options]\n"
    "\n"
    "A quick look at what a model says: the prompt, tokenized with the model's tokenizer, then\n"
    "up to --max-new-tokens tokens, greedy (the default) or sampled with --temperature and\n"
    "--top-p, stopping at the end-of-sequence token (generation_config.json's eos_token_id) or\n"
    "at model.context. The weights are --checkpoint's, else model.from_pretrained's (a LoRA\n"
    "run's adapters merged into its base). The model's own forward runs them on the config's\n"
    "device.backend (cuda, cpu, or auto: cuda where a GPU is visible), every model type alike\n"
    "(GPT-2, Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE), with the weights on the device in fp32\n"
    "(4 bytes a parameter, plus the activations of one window of model.context tokens and a\n"
    "key/value cache; a model that does not fit is refused before anything is allocated). The\n"
    "prompt runs as one forward, then each token as one token's forward against the cache.\n"
    "Greedy decoding gives transformers' tokens. Tokenizing runs tools/hf_tokenizer.py\n"
    "with $STRATA_PYTHON (default python3; it needs transformers or tokenizers).\n"
    "\n"
    "options:\n"
    "  --config FILE          the config (required): its model section\n"
    "  --checkpoint PATH      a checkpoint file, a sharded checkpoint's manifest, or a run\n"
    "                         directory (its latest checkpoint)\n"
    "  --prompt TEXT          the prompt\n"
    "  --prompt-file FILE     the prompt, from a file\n"
    "  --prompt-ids IDS       the prompt as token ids: 1,2,3 (no tokenizer needed to encode)\n"
    "  --max-new-tokens N     at most this many tokens (default 64)\n"
    "  --temperature T        0 = greedy (default); > 0 samples from softmax(logits / T)\n"
    "  --top-p P              sample from the fewest most likely tokens reaching P (default 1)\n"
    "  --seed S               the sampling seed (default 0)\n"
    "  --tokenizer DIR        the tokenizer's directory (default model.from_pretrained)\n"
    "  --ignore-eos           do not stop at the end-of-sequence token\n"
    "  --json                 print one line {\"prompt_ids\", \"ids\", \"text\"}\n"
    "  --set KEY=VALUE        override a config key, as for strata train; repeatable\n"
    "  -h, --help             this text\n"
    "\n"
    "exit status: 0 generated; 1 error (the message says what and how to fix it); 2 bad usage.\n";

// Runs tools/hf_tokenizer.py MODE DIR [MAX] with `input` on its stdin; returns its stdout (JSON).
// `max_ids` (>= 0): encode stops counting past that many ids (its "more_than" reply).
Result<nlohmann::json> tokenizer(const std::string& mode, const std::string& dir,
                                 const std::string& input, int64_t max_ids = -1) {
  const char* env = std::getenv("STRATA_PYTHON");
  const std::string python = env && *env ? env : "python3";
  const std::string script = std::string(STRATA_TOOLS_DIR) + "/hf_tokenizer.py";
  char in_path[] = "/tmp/strata-generate-XXXXXX";
  const int in_fd = ::mkstemp(in_path);
  if (in_fd < 0) return errno_status(errno, "generate: a temporary file for the tokenizer");
  ::unlink(in_path);  // open, nameless: nothing left behind
  if (::write(in_fd, input.data(), input.size()) != ssize_t(input.size()) ||
      ::lseek(in_fd, 0, SEEK_SET) != 0) {
    ::close(in_fd);
    return io_error("generate: writing the tokenizer's input");
  }
  int out[2];
  if (::pipe(out) != 0) {
    ::close(in_fd);
    return errno_status(errno, "generate: pipe");
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(in_fd, 0);
    ::dup2(out[1], 1);
    ::close(out[0]);
    const std::string max_text = std::to_string(max_ids);
    ::execlp(python.c_str(), python.c_str(), script.c_str(), mode.c_str(), dir.c_str(),
             max_ids >= 0 ? max_text.c_str() : static_cast<char*>(nullptr),
             static_cast<char*>(nullptr));
    std::fprintf(stderr, "strata generate: cannot run %s: %s\n", python.c_str(),
                 std::strerror(errno));
    ::_exit(127);
  }
  ::close(in_fd);
  ::close(out[1]);
  if (pid < 0) {
    ::close(out[0]);
    return errno_status(errno, "generate: fork");
  }
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof(buf))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    text.append(buf, size_t(n));
  }
  ::close(out[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    // hf_tokenizer.py's exit status says whose the failure is: only a missing library (3) or
    // an interpreter that cannot run (127) is STRATA_PYTHON's.
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    const std::string cmd = fmt::format("{} {} {} {}", python, script, mode, dir);
    if (code == 3 || code == 127) {
      return unavailable(fmt::format(
          "the tokenizer ({}) cannot run: {} (its message is above); set STRATA_PYTHON to a "
          "python with transformers or tokenizers, or give --prompt-ids",
          cmd, code == 3 ? "no transformers or tokenizers library" : "no such interpreter"));
    }
    if (code == 4) {
      return invalid_argument(fmt::format(
          "the tokenizer of {} cannot be loaded (its message is above): give --tokenizer DIR "
          "with the model's tokenizer files, or --prompt-ids",
          dir));
    }
    if (code == 5) {
      return invalid_argument("the prompt cannot be tokenized (its message is above)");
    }
    return unavailable(
        fmt::format("the tokenizer ({}) failed with status {} (its message is "
                    "above)",
                    cmd, code));
  }
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return internal_error("the tokenizer printed no JSON: " + text);
  return j;
}

// The device generation runs on: `backend` (device.backend with auto settled: cuda or cpu).
// The CPU backend's memory is the host's: at least `need` bytes. A GPU with less than `need` is
// refused, naming what to change.
Result<std::unique_ptr<Device>> open_device(const Config& cfg, const std::string& backend,
                                            uint64_t need) {
  if (!cfg.device.simulate.empty()) {
    return invalid_argument(
        "device.simulate computes no real numbers: strata generate runs on device.backend cpu or "
        "cuda (set device.simulate to \"\")");
  }
  std::unique_ptr<Device> dev;
  if (backend == "cuda") {
    CudaDeviceOptions o;
    o.ordinal = std::max(cfg.device.ordinal, 0);
    o.reserve = cfg.device.reserve;
    o.capacity = cfg.device.memory_limit;
    o.deterministic = cfg.device.deterministic;
    STRATA_ASSIGN_OR_RETURN(dev, create_cuda_device(o), "generate: device.backend cuda");
  } else {
    CpuDeviceOptions o;
    // Training's device.memory_limit models a GPU's memory; generation's share of the host's
    // is what it needs (checked against the host's memory before).
    o.capacity = std::max(cfg.device.memory_limit, size_t(need));
    o.threads = cfg.device.cpu_threads;
    STRATA_ASSIGN_OR_RETURN(dev, create_cpu_device(o), "generate: device.backend cpu");
  }
  const size_t capacity = dev->memory_stats().capacity;
  if (need > capacity) {
    return out_of_memory(fmt::format(
        "generate: the model's fp32 weights, activations and key/value cache take {} on the "
        "device, which has {} ({}): use a smaller model, a shorter model.context, or raise "
        "device.memory_limit",
        format_bytes(double(need)), format_bytes(double(capacity)), dev->name()));
  }
  log_info("generate: {}", dev->name());
  return dev;
}

bool parse_number(const std::string& s, double* out) {
  char* end = nullptr;
  errno = 0;
  *out = std::strtod(s.c_str(), &end);
  return !s.empty() && end && *end == '\0' && errno == 0;
}

// Whether the host has room for what `strata generate` holds there before any of it is
// allocated (a model too large was a bad_alloc abort, or the OOM killer): the fp32 weights, and
// on the CPU backend the activations and the cache too. MemAvailable, or the address-space
// limit when lower.
Status check_host_memory(const Architecture& arch, const Config& cfg, const std::string& backend,
                         const DecoderBytes& need) {
  // On the CPU backend the device's memory is the host's: each module's host copy is freed as
  // it reaches the device, so at most one module is held twice.
  uint64_t largest = 0;
  for (const ModuleSpec& m : arch.layout().modules) largest = std::max<uint64_t>(largest, m.numel);
  const uint64_t host_need =
      backend == "cpu" ? std::max(need.host, need.device) + largest * 4 : need.host;
  uint64_t avail = host_available_bytes();
  const char* limit = "MemAvailable";
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    const uint64_t used = proc_status_bytes("VmSize:");
    const uint64_t room = rl.rlim_cur > used ? rl.rlim_cur - used : 0;
    if (avail == 0 || room < avail) avail = room, limit = "the address-space limit (ulimit -v)";
  }
  if (avail > 0 && host_need > avail) {
    return out_of_memory(fmt::format(
        "the model's fp32 weights{} take {} ({} parameters, context {}); {} leaves {}: strata "
        "generate reads the whole model in fp32 in host memory{}: use a smaller model, or a "
        "shorter model.context",
        backend == "cpu" ? ", activations and key/value cache" : "",
        format_bytes(double(host_need)), arch.layout().num_params(), cfg.model.context, limit,
        format_bytes(double(avail)),
        backend == "cpu" ? " and runs it there (device.backend cpu)" : ""));
  }
  return Status::ok();
}

// --max-new-tokens, --temperature, --top-p and --seed into `opt`; an exit code when one is
// not a number in its range.
std::optional<int> parse_sample_options(const CliOptions& cli, const std::string& max_new,
                                        const std::string& temperature, const std::string& top_p,
                                        const std::string& seed, SampleOptions* opt) {
  double n = 0, s = 0;
  if (!parse_number(max_new, &n) || n < 1 || n > 1e9 || n != double(int64_t(n))) {
    return cli.usage_error("--max-new-tokens: " + max_new + " is not a positive integer");
  }
  opt->max_new_tokens = int(n);
  if (!parse_number(temperature, &opt->temperature) || !(opt->temperature >= 0) ||
      !std::isfinite(opt->temperature)) {
    return cli.usage_error("--temperature: " + temperature + " is not a finite number >= 0");
  }
  if (!parse_number(top_p, &opt->top_p) || !(opt->top_p > 0 && opt->top_p <= 1)) {
    return cli.usage_error("--top-p: " + top_p + " is not in (0, 1]");
  }
  if (!parse_number(seed, &s) || s < 0 || s != double(uint64_t(s))) {
    return cli.usage_error("--seed: " + seed + " is not a non-negative integer");
  }
  opt->seed = uint64_t(s);
  return std::nullopt;
}

// The prompt's token ids: --prompt-ids as given, else --prompt-file's text (into `prompt`) or
// --prompt encoded, with the tokenizer's end-of-sequence ids into `stop` unless --ignore-eos;
// an exit code when they cannot be read or do not fit the context.
std::optional<int> read_prompt(const CliOptions& cli, const std::string& prompt_ids,
                               const std::string& prompt_file, const std::string& tok_dir,
                               int64_t context, bool ignore_eos, std::string* prompt,
                               std::vector<int32_t>* ids, std::vector<int32_t>* stop) {
  if (!prompt_ids.empty()) {
    std::stringstream ss(prompt_ids);
    for (std::string item; std::getline(ss, item, ',');) {
      double v = 0;
      if (!parse_number(item, &v) || v < 0 || v > 2147483647.0 || v != double(int64_t(v))) {
        return cli.usage_error("--prompt-ids: \"" + item + "\" is not a token id");
      }
      ids->push_back(int32_t(v));
    }
  } else {
    if (!prompt_file.empty()) {
      if (Status st = expect_regular_file(prompt_file, "--prompt-file"); !st.is_ok()) {
        return cli.fail(st.message());
      }
      std::ifstream in(prompt_file, std::ios::binary);
      if (!in) return cli.fail("--prompt-file: cannot open " + prompt_file);
      std::stringstream ss;
      ss << in.rdbuf();
      *prompt = ss.str();
    }
    // The tokenizer stops counting past the context: a prompt of megabytes is refused after a
    // piece of it is encoded, not the whole.
    Result<nlohmann::json> enc = tokenizer("encode", tok_dir, *prompt, context);
    if (!enc.is_ok()) return cli.fail(enc.status().message());
    if ((*enc)["ids"].is_null()) {
      return cli.fail(fmt::format(
          "the prompt has more tokens than model.context {} (its first {} characters alone are "
          "{} tokens): shorten it, or raise model.context (--set model.context=N, at most the "
          "model's max_position_embeddings)",
          context, (*enc).value("chars", int64_t(0)), (*enc).value("counted", int64_t(0))));
    }
    *ids = (*enc)["ids"].get<std::vector<int32_t>>();
    if (!ignore_eos) *stop = (*enc)["eos"].get<std::vector<int32_t>>();
  }
  return std::nullopt;
}

// Prints what was generated: decoded after the prompt, as token ids when no tokenizer decodes
// them (an error unless the prompt was ids too), or as JSON with --json.
int print_generated(const CliOptions& cli, const std::string& tok_dir, bool have_tokenizer,
                    bool ids_given, bool json, const std::string& prompt,
                    const std::vector<int32_t>& ids, const std::vector<int32_t>& out) {
  std::string text;
  bool decoded = false;
  if (have_tokenizer) {
    Result<nlohmann::json> dec =
        tokenizer("decode", tok_dir, nlohmann::json{{"ids", out}, {"prefix", ids}}.dump());
    if (dec.is_ok()) {
      text = (*dec)["text"].get<std::string>();
      decoded = true;
    } else if (!ids_given) {
      return cli.fail(dec.status().message());
    } else {  // ids in, ids out: the numbers are still the answer
      std::fprintf(stderr, "strata generate: %s; printing token ids\n",
                   dec.status().message().c_str());
    }
  }
  if (json) {
    std::printf("%s\n",
                nlohmann::json{{"prompt_ids", ids}, {"ids", out}, {"text", text}}.dump().c_str());
  } else if (decoded) {
    std::printf("%s%s\n", prompt.c_str(), text.c_str());
  } else {
    for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? "," : "", out[i]);
    std::printf("\n");
  }
  return 0;
}

}  // namespace

int cmd_generate(int argc, char** argv) {
  std::string config_path, checkpoint, prompt, prompt_file, prompt_ids, tok_dir;
  std::string max_new = "64", temperature = "0", top_p = "1", seed = "0";
  std::vector<std::string> overrides;
  bool json = false, ignore_eos = false;
  CliOptions cli("generate", kUsage);
  cli.value("--config", &config_path)
      .value("--checkpoint", &checkpoint)
      .value("--prompt", &prompt)
      .value("--prompt-file", &prompt_file)
      .value("--prompt-ids", &prompt_ids)
      .value("--max-new-tokens", &max_new)
      .value("--temperature", &temperature)
      .value("--top-p", &top_p)
      .value("--seed", &seed)
      .value("--tokenizer", &tok_dir)
      .flag("--ignore-eos", &ignore_eos)
      .flag("--json", &json)
      .repeated("--set", &overrides);
  if (auto rc = cli.parse(argc, argv)) return *rc;
  if (config_path.empty()) return cli.usage_error("--config FILE is required");
  if (!prompt.empty() + !prompt_file.empty() + !prompt_ids.empty() != 1) {
    return cli.usage_error("give one of --prompt, --prompt-file and --prompt-ids");
  }
  SampleOptions opt;
  if (auto rc = parse_sample_options(cli, max_new, temperature, top_p, seed, &opt)) return *rc;

  Result<Config> cfg = load_config(config_path, overrides);
  if (!cfg.is_ok()) return cli.fail(cfg.status().message());
  if (Status st = check_model_given(*cfg); !st.is_ok()) return cli.fail(st.message());
  if (!checkpoint.empty()) {
    Result<std::string> path = resolve_checkpoint(checkpoint);
    if (!path.is_ok()) return cli.fail("--checkpoint: " + path.status().message());
    checkpoint = *path;
  }
  if (tok_dir.empty()) tok_dir = cfg->model.from_pretrained;
  const bool have_tokenizer = !tok_dir.empty();
  if (!have_tokenizer && prompt_ids.empty()) {
    return cli.fail(
        "no tokenizer: the model has no model.from_pretrained; give --tokenizer DIR (a Hugging "
        "Face model directory) or --prompt-ids");
  }

  auto arch = create_architecture(cfg->model);
  if (!arch.is_ok()) return cli.fail(arch.status().message());
  const int64_t context = (*arch)->shape().context;
  std::vector<int32_t> ids;
  if (auto rc = read_prompt(cli, prompt_ids, prompt_file, tok_dir, context, ignore_eos, &prompt,
                            &ids, &opt.stop)) {
    return *rc;
  }

  if (!ignore_eos && opt.stop.empty() && have_tokenizer && !prompt_ids.empty()) {
    Result<nlohmann::json> enc = tokenizer("encode", tok_dir, "");
    if (enc.is_ok()) opt.stop = (*enc)["eos"].get<std::vector<int32_t>>();
  }

  // A prompt past the context: refused with its own length before any weight is loaded.
  if (int64_t(ids.size()) > context) {
    return cli.fail(fmt::format(
        "the prompt has {} tokens, more than model.context {}: shorten it, or raise "
        "model.context (--set model.context=N, at most the model's max_position_embeddings)",
        ids.size(), (*arch)->shape().context));
  }
  // The weights, activations and cache must fit before any of it is allocated (a model too
  // large was a bad_alloc abort, or the OOM killer): the host's share first, then the device's.
  const DecoderBytes need = decoder_bytes(**arch);
  std::string backend = cfg->device.backend;
  if (backend == "auto") {
    std::string why;
    backend = cuda_device_available(&why) ? "cuda" : "cpu";
  }
  if (Status st = check_host_memory(**arch, *cfg, backend, need); !st.is_ok()) {
    return cli.fail(st.message());
  }
  auto device = open_device(*cfg, backend, need.device);
  if (!device.is_ok()) return cli.fail(device.status().message());
  auto weights = load_master_weights(**arch, cfg->model, checkpoint);
  if (!weights.is_ok()) return cli.fail(weights.status().message());
  auto decoder = Decoder::create(**arch, **device, std::move(*weights));
  if (!decoder.is_ok()) return cli.fail(decoder.status().message());
  Result<std::vector<int32_t>> out = generate(**decoder, ids, opt);
  if (!out.is_ok()) return cli.fail(out.status().message());

  return print_generated(cli, tok_dir, have_tokenizer, !prompt_ids.empty(), json, prompt, ids,
                         *out);
}

}  // namespace strata::tools
