// memscale — the Report as one self-contained HTML page (Report::to_html): no
// network, inline CSS, SVG and script. The memory of a training step, unit by
// unit through forward and backward, as projected without memscale (baseline)
// and with its plan, beside the budget and the peaks measured so far; the plan
// table (each unit's technique, rule and line); the offload engine's traffic
// by tier; the hardware and the Config (the caller's and the one planned with).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iomanip>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <memscale/config.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/observability/config_json.hpp>
#include <memscale/offload/tiers.hpp>
#include <memscale/version.hpp>

namespace memscale {

namespace html_detail {

inline std::string escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

/// A point of a step's timeline: x in slots (forward 0..N, backward N..2N), bytes live.
struct point {
  double x = 0.0;
  std::int64_t bytes = 0;
  std::string label;
};

/// The whole model's step, chain after chain: each unit's peak at the end of its
/// forward and of its backward, over the static bytes and the chains run before it.
inline std::vector<point> timeline(const Report& r, bool planned) {
  std::vector<int> first_slot;  // global index of each chain's slot 0
  int total = 0;
  for (const auto& chain : r.chains) {
    first_slot.push_back(total);
    total += static_cast<int>(chain.slots.size());
  }
  std::vector<std::vector<core::step_point>> traces(r.chains.size());
  std::vector<std::vector<core::unit>> units(r.chains.size());
  std::vector<std::int64_t> forward_end(r.chains.size(), 0);
  for (std::size_t c = 0; c < r.chains.size(); ++c) {
    units[c] = planned && c < r.plan.units.size() ? r.plan.units[c] : core::keep_all(r.chains[c].slots.size());
    forward_end[c] = core::project_chain(r.chains[c].slots, units[c], &traces[c]).forward_end;
  }
  std::vector<point> points{{0.0, r.static_bytes(), "start"}};
  std::int64_t earlier = r.static_bytes();
  std::vector<std::int64_t> base(r.chains.size(), 0);
  for (std::size_t c = 0; c < r.chains.size(); ++c) {
    base[c] = earlier;
    for (const auto& p : traces[c]) {
      if (p.backward) continue;
      const auto& u = units[c][static_cast<std::size_t>(p.unit)];
      points.push_back({static_cast<double>(first_slot[c] + u.last + 1), earlier + p.peak,
                        "forward, chain " + std::to_string(c) + " slots " + std::to_string(u.first) + ".." +
                            std::to_string(u.last)});
    }
    earlier += forward_end[c];
  }
  for (std::size_t c = r.chains.size(); c-- > 0;)
    for (const auto& p : traces[c]) {
      if (!p.backward) continue;
      const auto& u = units[c][static_cast<std::size_t>(p.unit)];
      points.push_back({static_cast<double>(2 * total - (first_slot[c] + u.first)), base[c] + p.peak,
                        "backward, chain " + std::to_string(c) + " slots " + std::to_string(u.first) + ".." +
                            std::to_string(u.last)});
    }
  return points;
}

/// The last traced step's points (OptimizationGuard::trace_step), placed as the
/// projection's: a unit's forward at its end; backward reaching it where the
/// backward of the unit after it ends. Over the static bytes, in measured order.
inline std::vector<point> measured(const Report& r) {
  std::vector<int> first_slot;
  int total = 0;
  for (const auto& chain : r.chains) {
    first_slot.push_back(total);
    total += static_cast<int>(chain.slots.size());
  }
  std::vector<point> points;
  for (const auto& m : r.measured_timeline) {
    const auto c = static_cast<std::size_t>(m.chain);
    if (c >= r.plan.units.size() || static_cast<std::size_t>(m.unit) >= r.plan.units[c].size()) continue;
    const auto& u = r.plan.units[c][static_cast<std::size_t>(m.unit)];
    const double end = first_slot[c] + u.last + 1;
    points.push_back({m.backward ? 2.0 * total - end : end, r.static_bytes() + m.bytes,
                      std::string(m.backward ? "backward reaching" : "forward, after") + " chain " +
                          std::to_string(c) + " slots " + std::to_string(u.first) + ".." + std::to_string(u.last)});
  }
  return points;
}

inline void chart(std::ostream& os, const Report& r) {
  const auto baseline = timeline(r, false);
  const auto planned = timeline(r, true);
  const auto traced = measured(r);
  double x_max = 1.0;
  std::int64_t y_max = std::max<std::int64_t>({r.measured_peak_bytes, r.plan.baseline_peak, 1});
  for (const auto* series : {&baseline, &planned, &traced})
    for (const auto& p : *series) {
      x_max = std::max(x_max, p.x);
      y_max = std::max(y_max, p.bytes);
    }
  // The budget is drawn when it is near the step's memory; far above (a host's
  // RAM), it would flatten everything else: the caption gives it instead.
  const bool budget_drawn = r.usable_bytes <= 2 * y_max;
  if (budget_drawn) y_max = std::max(y_max, r.usable_bytes);
  y_max = y_max + y_max / 10;
  constexpr double width = 960, height = 360, left = 70, bottom = 30, top = 10;
  const auto X = [&](double x) { return left + (width - left - 10) * x / x_max; };
  const auto Y = [&](std::int64_t b) { return top + (height - top - bottom) * (1.0 - static_cast<double>(b) / y_max); };
  os << "<svg id=\"timeline\" viewBox=\"0 0 " << width << ' ' << height << "\" role=\"img\" "
     << "aria-label=\"memory over a training step\">\n";
  os << "<rect x=\"" << left << "\" y=\"" << Y(r.static_bytes()) << "\" width=\"" << width - left - 10
     << "\" height=\"" << Y(0) - Y(r.static_bytes()) << "\" class=\"static\"><title>static: "
     << escape(detail::format_bytes(r.static_bytes())) << "</title></rect>\n";
  for (int i = 0; i <= 4; ++i) {
    const auto b = y_max * i / 4;
    os << "<text x=\"" << left - 6 << "\" y=\"" << Y(b) + 4 << "\" class=\"axis\" text-anchor=\"end\">"
       << escape(detail::format_bytes(b)) << "</text>\n";
  }
  const double middle = x_max / 2;
  os << "<line x1=\"" << X(middle) << "\" x2=\"" << X(middle) << "\" y1=\"" << top << "\" y2=\"" << Y(0)
     << "\" class=\"divider\"/>\n<text x=\"" << X(middle / 2) << "\" y=\"" << height - 8
     << "\" class=\"axis\">forward</text><text x=\"" << X(middle * 1.5) << "\" y=\"" << height - 8
     << "\" class=\"axis\">backward</text>\n";
  const auto level = [&](std::int64_t bytes, const char* cls, const std::string& what) {
    if (bytes <= 0) return;
    os << "<line x1=\"" << left << "\" x2=\"" << width - 10 << "\" y1=\"" << Y(bytes) << "\" y2=\"" << Y(bytes)
       << "\" class=\"" << cls << "\"><title>" << escape(what) << ": " << escape(detail::format_bytes(bytes))
       << "</title></line>\n";
  };
  if (budget_drawn) level(r.usable_bytes, "budget", "usable budget");
  else
    os << "<text x=\"" << width - 14 << "\" y=\"" << top + 12 << "\" class=\"axis\" text-anchor=\"end\">budget "
       << escape(detail::format_bytes(r.usable_bytes)) << ": far above, not drawn</text>\n";
  level(r.measured_peak_bytes, "measured", "measured peak so far (allocator)");
  for (const auto& [series, cls] :
       {std::pair{&baseline, "baseline"}, std::pair{&planned, "planned"}, std::pair{&traced, "traced"}}) {
    if (series->empty()) continue;
    os << "<polyline class=\"" << cls << "\" points=\"";
    for (const auto& p : *series) os << X(p.x) << ',' << Y(p.bytes) << ' ';
    os << "\"/>\n";
    for (const auto& p : *series)
      os << "<circle class=\"" << cls << "\" cx=\"" << X(p.x) << "\" cy=\"" << Y(p.bytes) << "\" r=\"3\" data-label=\""
         << escape(p.label) << "\"><title>" << cls << ", " << escape(p.label) << ": "
         << escape(detail::format_bytes(p.bytes)) << "</title></circle>\n";
  }
  os << "</svg>\n";
}

inline const char* style = R"(body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}th{background:#f2f2f2}
.num{text-align:right;font-variant-numeric:tabular-nums}#timeline{width:100%;max-width:960px;background:#fafafa}
polyline{fill:none;stroke-width:2}polyline.baseline{stroke:#999}polyline.planned{stroke:#1f6feb}
circle.baseline{fill:#999}circle.planned{fill:#1f6feb}polyline.traced{stroke:#2a2;stroke-width:2}circle.traced{fill:#2a2}circle.hot{r:6;fill:#d63}.static{fill:#e8e8e8}
.budget{stroke:#c00;stroke-dasharray:6 4}.measured{stroke:#2a2;stroke-dasharray:2 3;stroke-width:2}
.divider{stroke:#bbb}.axis{font-size:11px;fill:#555}.legend span{margin-right:18px}
.sw{display:inline-block;width:14px;height:3px;vertical-align:middle;margin-right:4px}
tr.hot td{background:#fff3d6}pre{background:#f6f6f6;padding:8px;overflow:auto})";

inline const char* script = R"(document.querySelectorAll('tr[data-unit]').forEach(function(row){
  row.addEventListener('mouseenter',function(){var u=row.getAttribute('data-unit');
    document.querySelectorAll('circle.planned').forEach(function(c){
      c.classList.toggle('hot',c.getAttribute('data-label').endsWith(u));});row.classList.add('hot');});
  row.addEventListener('mouseleave',function(){row.classList.remove('hot');
    document.querySelectorAll('circle.hot').forEach(function(c){c.classList.remove('hot');});});});
document.body.setAttribute('data-rendered','yes');
document.getElementById('points').textContent=document.querySelectorAll('circle.planned').length;)";

}  // namespace html_detail

/// Report::to_html's work (found by argument-dependent lookup).
[[nodiscard]] inline std::string report_html(const Report& r) {
  using detail::format_bytes;
  using html_detail::escape;
  std::ostringstream os;
  os << std::fixed << std::setprecision(2);
  os << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>memscale plan: "
     << escape(to_string(r.mode)) << " on " << escape(r.device) << "</title>\n<style>" << html_detail::style
     << "</style></head>\n<body>\n<h1>memscale plan: " << escape(to_string(r.mode)) << " on " << escape(r.device)
     << "</h1>\n<p>memscale " << version_string << ". Projected step peak " << escape(format_bytes(r.plan.baseline_peak))
     << " without memscale, <b>" << escape(format_bytes(r.plan.planned_peak)) << "</b> with its plan (budget "
     << escape(format_bytes(r.usable_bytes)) << ", pressure " << r.plan.pressure << "); "
     << r.checkpointed_segments() << " checkpointed segment(s), " << r.tiled_segments() << " tiled, "
     << r.offloaded_units() << " offloaded unit(s), recompute " << r.recompute_seconds() * 1e3 << " ms/step.</p>\n";

  os << "<h2>Memory over a training step</h2>\n<p class=\"legend\"><span><i class=\"sw\" style=\"background:#999\">"
     << "</i>baseline (projected)</span><span><i class=\"sw\" style=\"background:#1f6feb\"></i>planned (projected)"
     << "</span><span><i class=\"sw\" style=\"background:#2a2\"></i>measured: a traced step (solid), the peak so far in this process (dotted)</span><span><i class=\"sw\" "
     << "style=\"background:#c00\"></i>budget</span><span><i class=\"sw\" style=\"background:#e8e8e8\"></i>static "
     << "(parameters, gradients, optimizer, buffers, reserve)</span></p>\n";
  html_detail::chart(os, r);
  os << "<p>Each point: a unit's peak as its forward (left half) or backward (right half) runs; <span id=\"points\">"
     << "</span> planned points. Budget " << escape(format_bytes(r.usable_bytes)) << ". "
     << (r.measured_timeline.empty()
             ? std::string("No step traced (OptimizationGuard::trace_step measures one at every unit's boundary).")
             : "A traced step: " + std::to_string(r.measured_timeline.size()) +
                   " points, each the device's allocated bytes over the static ones as a unit's forward returned "
                   "or backward reached it.")
     << " Measured: allocator peak "
     << (r.measured_peak_bytes >= 0 ? escape(format_bytes(r.measured_peak_bytes)) : std::string("not measured"))
     << ", process resident peak "
     << (r.process_peak_bytes >= 0 ? escape(format_bytes(r.process_peak_bytes)) : std::string("not measured"))
     << ".</p>\n";

  os << "<h2>Plan</h2>\n<table id=\"plan\"><tr><th>chain</th><th>slots</th><th>technique</th><th>rule</th>"
     << "<th>why</th></tr>\n";
  for (const auto& d : r.plan.decisions) {
    const auto path = static_cast<std::size_t>(d.chain) < r.chains.size() ? r.chains[static_cast<std::size_t>(d.chain)].path : std::string();
    const auto slots = std::to_string(d.first) + ".." + std::to_string(d.last);
    os << "<tr data-unit=\"chain " << d.chain << " slots " << slots << "\"><td>" << escape(path.empty() ? "<root>" : path)
       << "</td><td>" << slots << "</td><td>" << Report::technique_of(d) << "</td><td>"
       << escape(core::to_string(d.rule)) << "</td><td>" << escape(r.decision_text(d)) << "</td></tr>\n";
  }
  os << "</table>\n";

  os << "<h2>Offload traffic by tier</h2>\n";
  if (!r.offload) {
    os << "<p>Nothing offloaded.</p>\n";
  } else {
    os << "<table id=\"offload\"><tr><th>tier</th><th class=\"num\">out</th><th class=\"num\">in</th>"
       << "<th class=\"num\">held now</th><th class=\"num\">peak held</th><th class=\"num\">tensors</th></tr>\n";
    for (const auto t : {offload::tier::pinned_host, offload::tier::pageable_host, offload::tier::disk}) {
      const auto& u = r.offload->at(t);
      os << "<tr><td>" << escape(offload::to_string(t)) << "</td><td class=\"num\">" << escape(format_bytes(u.written))
         << "</td><td class=\"num\">" << escape(format_bytes(u.read)) << "</td><td class=\"num\">"
         << escape(format_bytes(u.bytes)) << "</td><td class=\"num\">" << escape(format_bytes(u.peak))
         << "</td><td class=\"num\">" << u.tensors << "</td></tr>\n";
    }
    os << "</table>\n<p>Copying took " << r.offload->transfer_seconds * 1e3 << " ms, training waited "
       << r.offload->wait_seconds * 1e3 << " ms of it; prefetch hits " << r.offload->prefetch_hits << ", misses "
       << r.offload->prefetch_misses << ", served before their write ended " << r.offload->served_before_written
       << ".</p>\n";
    if (r.offload_bytes_per_second > 0) {  // the rate planned with beside the rate the copies ran at
      os << "<p id=\"offload-rate\">Planned at " << std::setprecision(0) << r.offload_bytes_per_second / 1e6
         << " MB/s one way (" << (r.offload_rate_measured ? "measured in this process" : "nominal") << ")";
      if (const double rate = r.offload->timed_bytes_per_second(); rate > 0)
        os << "; the timed copies ran at " << rate / 1e6 << " MB/s";
      os << ".</p>\n" << std::setprecision(2);
    }
  }

  std::ostringstream hardware;
  hardware << r.hardware;
  os << "<h2>Hardware and Config</h2>\n<pre id=\"hardware\">" << escape(hardware.str()) << "</pre>\n"
     << "<table id=\"config\"><tr><th>Config</th><th>as the caller passed it</th><th>as planned with</th></tr>\n";
  const nlohmann::json caller = r.strategy.caller, effective = r.strategy.effective;
  for (const auto& [key, value] : caller.items()) {
    const auto other = effective.value(key, nlohmann::json());
    constexpr auto lenient = nlohmann::json::error_handler_t::replace;  // a path need not be UTF-8
    os << "<tr><td>" << escape(key) << "</td><td>" << escape(value.dump(-1, ' ', false, lenient)) << "</td><td>"
       << escape(other.dump(-1, ' ', false, lenient))
       << "</td></tr>\n";
  }
  os << "</table>\n<h2>The text report</h2>\n<pre id=\"text\">" << escape(r.str()) << "</pre>\n<script>"
     << html_detail::script << "</script>\n</body></html>\n";
  return os.str();
}

}  // namespace memscale
