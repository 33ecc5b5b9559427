// The metrics log and monitors: a write failure is reported, never silent; a fresh run appends
// to another run's metrics (JSONL and CSV), never truncates them.
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

// ---- 5. metrics
// ----------------------------------------------------------------------------------

TEST_F(Hardening, MetricsWriteFailureIsReportedNotSilent) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const auto dir = temp_dir("devfull");
  TrainResult r = must_train(small_config(dir, {"train.steps=3", "train.log_file=\"/dev/full\""}));
  EXPECT_TRUE(contains(r.metrics_error, "train.log_file")) << r.metrics_error;
  EXPECT_TRUE(contains(r.metrics_error, "No space left on device")) << r.metrics_error;
  EXPECT_EQ(r.end_step, 3);  // training went on and saved
  EXPECT_TRUE(fs::exists(r.last_checkpoint));
  MetricsLog log;
  ASSERT_TRUE(log.open("/dev/full", /*append=*/true).is_ok());
  EXPECT_EQ(log.write_line("{}").code(), StatusCode::kNoSpace);
  EXPECT_FALSE(log.error().is_ok());
  fs::remove_all(dir);
}

// A monitor file that cannot be written (a link planted at the CSV's name: refused, never
// followed) is reported like the JSONL log's failure: training goes on, the CLI exits 1.
TEST_F(Hardening, MonitorWriteFailureIsReportedNotSilent) {
  const auto dir = temp_dir("monitor");
  fs::create_directories(dir + "/mon/j");
  fs::create_symlink("/dev/null", dir + "/mon/j/loss.csv");
  TrainResult r = must_train(small_config(
      dir, {"train.steps=3", "csv_monitor.enabled=true",
            "csv_monitor.output_path=\"" + dir + "/mon\"", "csv_monitor.job_name=\"j\"",
            "tensorboard.enabled=true", "tensorboard.output_path=\"" + dir + "/mon\""}));
  EXPECT_TRUE(contains(r.metrics_error, "csv_monitor.output_path")) << r.metrics_error;
  EXPECT_EQ(r.end_step, 3);
  EXPECT_TRUE(fs::is_symlink(dir + "/mon/j/loss.csv"));
  EXPECT_TRUE(fs::exists(dir + "/mon/j/lr.csv"));             // the other metrics still written
  EXPECT_FALSE(fs::is_empty(dir + "/mon/DeepSpeedJobName"));  // tensorboard's event file
  fs::remove_all(dir);
}

// ---- BAD 4: logs are appended per run, never truncated ----------------------------------------

std::vector<json> log_lines(const std::string& path) {
  std::vector<json> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) out.push_back(json::parse(line));
  return out;
}

TEST_F(Hardening2, FreshRunKeepsAnotherRunsMetrics) {
  const auto dir = temp_dir("metrics");
  must_train(small_config(dir, {"train.steps=3"}));
  // A fresh run of fewer steps in the same directory (it overwrites no checkpoint of the first).
  must_train(small_config(dir, {"train.steps=2"}));
  const auto lines = log_lines(dir + "/metrics.jsonl");
  int losses = 0;
  std::vector<std::string> runs;
  for (const json& l : lines) {
    losses += l.contains("loss");
    if (l.contains("run_id")) runs.push_back(l["run_id"]);
  }
  EXPECT_EQ(losses, 3 + 2) << "the first run's metrics were lost";
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_NE(runs[0], runs[1]);
  // An existing train.log_file keeps what it held.
  const std::string log = dir + "/my.log";
  std::ofstream(log) << "{\"mine\": 1}\n";
  must_train(small_config(dir + "/b", {"train.steps=1", "train.log_file=\"" + log + "\""}));
  EXPECT_TRUE(log_lines(log).at(0).contains("mine"));
  fs::remove_all(dir);
}

TEST_F(Hardening2, FreshRunKeepsAnotherRunsCsvMetrics) {
  const auto dir = temp_dir("csv");
  const std::vector<std::string> csv = {"csv_monitor.enabled=true",
                                        "csv_monitor.output_path=\"" + dir + "/mon\"",
                                        "csv_monitor.job_name=\"j\""};
  auto with = [&](std::vector<std::string> ov) {
    ov.insert(ov.end(), csv.begin(), csv.end());
    return ov;
  };
  must_train(small_config(dir + "/a", with({"train.steps=3"})));
  must_train(small_config(dir + "/b", with({"train.steps=2"})));
  // As DeepSpeed's csv_monitor ("a+"): each run appends its header and its rows.
  std::ifstream f(dir + "/mon/j/loss.csv");
  int headers = 0, rows = 0;
  for (std::string line; std::getline(f, line);) (line == "step,loss" ? headers : rows) += 1;
  EXPECT_EQ(headers, 2);
  EXPECT_EQ(rows, 3 + 2) << "the first run's rows were lost";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
