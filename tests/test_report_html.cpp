// Report::to_html: one self-contained page (nothing fetched from anywhere),
// rendered by headless Chromium (Debian's chromium; scripts/setup-deps.sh
// --tests installs it): its script runs, the DOM holds the timeline's points,
// one plan row per decision, the offload table and the Config; and a screenshot.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

/// A report of the flat chain trained under a budget that makes it checkpoint and offload.
memscale::Report trained_report() {
  auto model = test::flat_chain(4);
  const auto x = torch::randn({256, 64});
  memscale::Config c = test::quiet();
  c.memory_budget_gb = 0.004;
  c.target_gpu_utilization = 1.0;
  auto guard = memscale::optimize(model, x, c);
  test::train_sgd(model, x, 2);
  return guard.report();
}

}  // namespace

TEST_CASE("Report::to_html: a self-contained page with the timeline, the plan and the Config", "[report][html]") {
  const auto report = trained_report();
  REQUIRE(report.checkpointed_segments() > 0);
  const auto page = report.to_html();
  // Self-contained: no external resource of any kind.
  CHECK_FALSE(std::regex_search(page, std::regex(R"((src|href)\s*=)")));
  CHECK(page.find("@import") == std::string::npos);
  CHECK(page.find("url(") == std::string::npos);
  // The timeline: the start point, then each unit's forward and backward, baseline and planned.
  std::size_t planned_units = 0, slots = 0;
  for (const auto& u : report.plan.units) planned_units += u.size();
  for (const auto& chain : report.chains) slots += chain.slots.size();
  CHECK(count_of(page, "<circle class=\"planned\"") == 1 + 2 * planned_units);
  CHECK(count_of(page, "<circle class=\"baseline\"") == 1 + 2 * slots);
  CHECK(count_of(page, "<tr data-unit=") == report.plan.decisions.size());
  CHECK(page.find("<table id=\"config\">") != std::string::npos);
  // With offload traffic: the rate the plan costed its transfers at beside the rate they ran at.
  memscale::Report offloaded = report;
  offloaded.offload = memscale::offload::engine_stats{};
  offloaded.offload->add_written(memscale::offload::tier::disk, 300'000'000);
  offloaded.offload->add_read(memscale::offload::tier::disk, 300'000'000);
  offloaded.offload->transfer_seconds = 1.0;
  offloaded.offload->timed_bytes = 600'000'000;
  offloaded.offload_bytes_per_second = 812.4e6;
  offloaded.offload_rate_measured = true;
  CHECK_THAT(offloaded.to_html(), Catch::Contains("<p id=\"offload-rate\">Planned at 812 MB/s one way (measured in "
                                                  "this process); the timed copies ran at 600 MB/s.</p>"));
  offloaded.offload_rate_measured = false;
  CHECK_THAT(offloaded.to_html(), Catch::Contains("Planned at 812 MB/s one way (nominal); the timed copies"));
  offloaded.offload_bytes_per_second = 0;  // offloading was not weighed: no rate to name
  CHECK(offloaded.to_html().find("offload-rate") == std::string::npos);
  // Text from the model reaches the page escaped.
  memscale::Report hostile = report;
  hostile.notes.push_back("<script>alert(1)</script>");
  CHECK(hostile.to_html().find("<script>alert(1)</script>") == std::string::npos);
}

TEST_CASE("Report::to_html: headless Chromium renders it, its script runs, and a screenshot is taken",
          "[report][html][chromium]") {
  REQUIRE(std::system("command -v chromium > /dev/null 2>&1") == 0);  // scripts/setup-deps.sh --tests
  const auto report = trained_report();
  const auto dir = fs::temp_directory_path() / ("memscale_html_" + std::to_string(::getpid()));
  memscale::detail::remove_tree(dir);
  fs::create_directories(dir);
  const auto page = dir / "report.html";
  std::ofstream(page) << report.to_html();
  const std::string chromium = "chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
                               "--disable-background-networking --disable-component-update --disable-sync "
                               "--user-data-dir=" + (dir / "profile").string() + " ";
  const auto dom_file = dir / "dom.html";
  const int dumped = std::system((chromium + "--dump-dom file://" + page.string() + " > " + dom_file.string() +
                                  " 2> " + (dir / "chromium.log").string()).c_str());
  INFO(slurp(dir / "chromium.log"));
  REQUIRE(WIFEXITED(dumped));
  REQUIRE(WEXITSTATUS(dumped) == 0);
  const auto dom = slurp(dom_file);
  // The script ran: it marked the body and counted the planned points into the page.
  CHECK(dom.find("data-rendered=\"yes\"") != std::string::npos);
  std::size_t planned_units = 0;
  for (const auto& u : report.plan.units) planned_units += u.size();
  CHECK(dom.find("<span id=\"points\">" + std::to_string(1 + 2 * planned_units) + "</span>") != std::string::npos);
  CHECK(count_of(dom, "<tr data-unit=") == report.plan.decisions.size());
  CHECK(dom.find("<svg id=\"timeline\"") != std::string::npos);

  const auto shot = dir / "report.png";
  const int shot_status = std::system((chromium + "--window-size=1100,1500 --screenshot=" + shot.string() +
                                       " file://" + page.string() + " > /dev/null 2>> " +
                                       (dir / "chromium.log").string()).c_str());
  REQUIRE(WIFEXITED(shot_status));
  CHECK(WEXITSTATUS(shot_status) == 0);
  const auto png = slurp(shot);
  REQUIRE(png.size() > 10000);
  CHECK(png.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0);
  memscale::detail::remove_tree(dir);
}

TEST_CASE("trace_step: one step measured at every unit's boundary, the plan left as it was", "[report][trace]") {
  auto model = test::flat_chain(4);
  const auto x = torch::randn({256, 64});
  memscale::Config c = test::quiet();
  c.memory_budget_gb = 0.004;
  c.target_gpu_utilization = 1.0;
  {
    auto deferred = memscale::optimize(model, c);  // no example: planned at the first forward
    CHECK_THROWS_WITH(deferred.trace_step([] {}), Catch::Contains("not planned yet"));
  }
  auto guard = memscale::optimize(model, x, c);
  const auto slots = test::slot_identity(*model);
  const auto report = guard.trace_step([&] { test::train_sgd(model, x, 1); });
  CHECK(test::slot_identity(*model) == slots);  // the marks are gone
  CHECK(guard.active());
  REQUIRE(report.plan.units.size() == 1);
  const auto units = report.plan.units[0].size();
  const auto& points = report.measured_timeline;
  REQUIRE(points.size() == 2 * units);  // each unit's forward, then backward reaching each, last first
  for (std::size_t i = 0; i < units; ++i) {
    CHECK_FALSE(points[i].backward);
    CHECK(points[i].unit == static_cast<int>(i));
    CHECK(points[units + i].backward);
    CHECK(points[units + i].unit == static_cast<int>(units - 1 - i));
  }
  // The measured growth at the end of forward, against the projection's.
  const auto projected = memscale::core::project_chain(report.chains[0].slots, report.plan.units[0]).forward_end;
  const auto measured = points[units - 1].bytes;
  INFO("projected forward end " << projected << ", measured " << measured);
  CHECK(measured >= projected / 2);
  CHECK(measured <= projected * 2);
  // Drawn as a third series, one point each.
  CHECK(count_of(report.to_html(), "<circle class=\"traced\"") == points.size());
  // A step that throws leaves the plan's slots as they were, and throws through.
  CHECK_THROWS_WITH(guard.trace_step([] { throw std::runtime_error("step failed"); }), "step failed");
  CHECK(test::slot_identity(*model) == slots);
}

TEST_CASE("trace_step: call-site units (the example GPT) are traced too", "[report][trace]") {
  gpt::GPT model(test::small_gpt());
  const auto tokens = torch::randint(0, test::small_gpt().vocab, {4, 64}, torch::kLong);
  memscale::Config c = test::quiet();
  c.mode = memscale::OptimizationMode::Aggressive;
  auto guard = memscale::optimize(model, tokens, c);
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  const auto report = guard.trace_step([&] {
    optimizer.zero_grad();
    model->forward(tokens).pow(2).mean().backward();
    optimizer.step();
  });
  std::size_t units = 0;
  for (const auto& u : report.plan.units) units += u.size();
  INFO(report.str());
  CHECK(report.measured_timeline.size() == 2 * units);
  // The guard still runs the plan: a second traced step gives as many points.
  const auto again = guard.trace_step([&] { model->forward(tokens).pow(2).mean().backward(); });
  CHECK(again.measured_timeline.size() == report.measured_timeline.size());
}
