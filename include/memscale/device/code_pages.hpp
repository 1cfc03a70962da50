// memscale::detail — which pages of the process's loaded code are resident in
// it, page by page (Linux's /proc/self/pagemap), and a way to give some back.
//
// predict() measures what a training step makes the process hold outside
// LibTorch's allocator over a calibration run shape-only, and a first step
// reads code in: LibTorch's kernels, autograd's, the dispatcher's. A
// shape-only calibration reads other code than a step does (meta kernels, the
// fallback's boxed calls, predict's own), 1.3-2.1 MiB more on the benchmark
// models (benchmarks/RESULTS.md, 2026-12-02). So predict() replaces the code
// pages its calibration read in by those a real step at a small batch reads in:
// it gives back the former (madvise(MADV_DONTNEED): the mapping stays, the
// next use of a page maps it again from the page cache, a minor fault) and
// counts the pages present after the step that were not before the calibration.
//
// Only pages that are the file's own are given back: those of the
// non-writable segments (PT_LOAD without PF_W) of every loaded ELF object
// (dl_iterate_phdr), and of those only pages pagemap reports present and
// file-backed. A page of such a segment that was written (text relocations)
// is anonymous and is never given back: giving it back would lose the write.
// A non-writable segment cannot be written in between without an mprotect.
// Unprivileged processes read pagemap's flags (present, file) with the frame
// numbers zeroed (Linux >= 4.2); where pagemap cannot be read, or off Linux,
// nullopt, and predict() counts what the calibration read in, as before.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <utility>
#include <optional>
#include <vector>

#if defined(__linux__)
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>
#define MEMSCALE_CODE_PAGES 1
#else
#define MEMSCALE_CODE_PAGES 0
#endif

namespace memscale::detail {

/// The addresses of the resident, file-backed pages of the non-writable
/// segments of every loaded ELF object, sorted; and the page size.
struct code_pages {
  std::vector<std::uintptr_t> pages;
  std::int64_t page_bytes = 4096;

  /// The bytes of the pages here that are not in `before`.
  [[nodiscard]] std::int64_t bytes_beyond(const code_pages& before) const {
    return static_cast<std::int64_t>(added_to(before).size()) * page_bytes;
  }
  /// The pages here that are not in `before`.
  [[nodiscard]] std::vector<std::uintptr_t> added_to(const code_pages& before) const {
    std::vector<std::uintptr_t> added;
    std::set_difference(pages.begin(), pages.end(), before.pages.begin(), before.pages.end(),
                        std::back_inserter(added));
    return added;
  }
};

#if MEMSCALE_CODE_PAGES
namespace code_pages_detail {

struct range {
  std::uintptr_t begin = 0, end = 0;
  [[nodiscard]] bool contains(std::uintptr_t a) const noexcept { return a >= begin && a < end; }
};

inline std::uintptr_t page_size() { return static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE)); }

struct segments {
  std::vector<range> code, writable;  // whole pages
};

inline int collect_segments(dl_phdr_info* info, std::size_t, void* data) {
  auto& out = *static_cast<segments*>(data);
  const auto page = page_size();
  for (int k = 0; k < info->dlpi_phnum; ++k) {
    const auto& h = info->dlpi_phdr[k];
    if (h.p_type != PT_LOAD || h.p_memsz == 0) continue;
    const auto first = static_cast<std::uintptr_t>(info->dlpi_addr + h.p_vaddr);
    const range r{first & ~(page - 1), (first + h.p_memsz + page - 1) & ~(page - 1)};
    ((h.p_flags & PF_W) != 0 ? out.writable : out.code).push_back(r);
  }
  return 0;
}

/// The pagemap entries of [r.begin, r.end); empty where they cannot be read.
inline std::vector<std::uint64_t> entries(int fd, range r, std::uintptr_t page) {
  std::vector<std::uint64_t> e((r.end - r.begin) / page);
  const auto bytes = static_cast<ssize_t>(e.size() * sizeof(std::uint64_t));
  const auto at = static_cast<off_t>(r.begin / page * sizeof(std::uint64_t));
  if (e.empty() || pread(fd, e.data(), static_cast<std::size_t>(bytes), at) != bytes) return {};
  return e;
}

constexpr std::uint64_t present_bit = std::uint64_t{1} << 63;
constexpr std::uint64_t file_bit = std::uint64_t{1} << 61;

/// Calls visit(address) for each present, file-backed page of the code
/// segments (and of no writable one: a page two segments share); false where
/// pagemap cannot be read.
template <class Visit>
bool each_resident_page(Visit&& visit) {
  segments s;
  dl_iterate_phdr(&collect_segments, &s);
  // In address order, so that the pages come out sorted (a page two segments share: twice, in a row).
  std::sort(s.code.begin(), s.code.end(), [](range a, range b) { return a.begin < b.begin; });
  const int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const auto page = page_size();
  bool read_any = false;
  for (const auto& r : s.code) {
    const auto e = entries(fd, r, page);
    read_any = read_any || !e.empty();
    std::vector<range> shared;  // the writable segments that overlap this one (almost always none)
    std::copy_if(s.writable.begin(), s.writable.end(), std::back_inserter(shared),
                 [&](range w) { return w.begin < r.end && r.begin < w.end; });
    const auto writable = [&](std::uintptr_t a) {
      return std::any_of(shared.begin(), shared.end(), [&](range w) { return w.contains(a); });
    };
    for (std::size_t i = 0; i < e.size(); ++i)
      if ((e[i] & present_bit) != 0 && (e[i] & file_bit) != 0 && !writable(r.begin + i * page))
        visit(r.begin + i * page);
  }
  close(fd);
  return read_any;
}

}  // namespace code_pages_detail

/// The code pages resident now; nullopt where pagemap cannot be read.
[[nodiscard]] inline std::optional<code_pages> resident_code_pages() {
  code_pages out;
  out.page_bytes = static_cast<std::int64_t>(code_pages_detail::page_size());
  if (!code_pages_detail::each_resident_page([&](std::uintptr_t a) { out.pages.push_back(a); })) return std::nullopt;
  if (!std::is_sorted(out.pages.begin(), out.pages.end())) std::sort(out.pages.begin(), out.pages.end());
  out.pages.erase(std::unique(out.pages.begin(), out.pages.end()), out.pages.end());  // segments can share a page
  return out;
}

/// Those of `pages` that lie in a non-writable segment of the loaded ELF
/// object holding code address `in` (a function of memscale's: the program or
/// library memscale is compiled into; or one of a library's).
[[nodiscard]] inline std::vector<std::uintptr_t> pages_in_object_of(const std::vector<std::uintptr_t>& pages,
                                                                    std::uintptr_t in) {
  struct search {
    std::uintptr_t in;
    code_pages_detail::segments found;
  } s{in, {}};
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t size, void* data) {
        auto& q = *static_cast<search*>(data);
        code_pages_detail::segments mine;
        code_pages_detail::collect_segments(info, size, &mine);
        if (std::none_of(mine.code.begin(), mine.code.end(), [&](auto r) { return r.contains(q.in); })) return 0;
        q.found = std::move(mine);
        return 1;
      },
      &s);
  std::vector<std::uintptr_t> in_object;
  std::copy_if(pages.begin(), pages.end(), std::back_inserter(in_object), [&](std::uintptr_t a) {
    return std::any_of(s.found.code.begin(), s.found.code.end(), [&](auto r) { return r.contains(a); });
  });
  return in_object;
}

/// The bytes of pages_in_object_of(pages, in).
[[nodiscard]] inline std::int64_t bytes_in_object_of(const std::vector<std::uintptr_t>& pages, std::uintptr_t in) {
  return static_cast<std::int64_t>(code_pages_detail::page_size() * pages_in_object_of(pages, in).size());
}

/// Gives back those of `pages` that are still resident and file-backed code
/// (read again now, not trusted from the list). Returns the bytes given back.
inline std::int64_t give_back_code_pages(const std::vector<std::uintptr_t>& pages) {
  const auto now = resident_code_pages();
  if (!now) return 0;
  std::vector<std::uintptr_t> both;
  std::set_intersection(pages.begin(), pages.end(), now->pages.begin(), now->pages.end(), std::back_inserter(both));
  const auto page = static_cast<std::uintptr_t>(now->page_bytes);
  std::int64_t given = 0;
  for (std::size_t i = 0; i < both.size();) {  // runs of adjacent pages, one call each
    std::size_t j = i + 1;
    while (j < both.size() && both[j] == both[j - 1] + page) ++j;
    // NOLINTNEXTLINE(performance-no-int-to-ptr): pagemap's page addresses
    if (madvise(reinterpret_cast<void*>(both[i]), (j - i) * page, MADV_DONTNEED) == 0)
      given += static_cast<std::int64_t>(j - i) * now->page_bytes;
    i = j;
  }
  return given;
}
#else
[[nodiscard]] inline std::optional<code_pages> resident_code_pages() { return std::nullopt; }
inline std::int64_t give_back_code_pages(const std::vector<std::uintptr_t>&) { return 0; }
[[nodiscard]] inline std::vector<std::uintptr_t> pages_in_object_of(const std::vector<std::uintptr_t>&,
                                                                    std::uintptr_t) {
  return {};
}
[[nodiscard]] inline std::int64_t bytes_in_object_of(const std::vector<std::uintptr_t>&, std::uintptr_t) { return 0; }
#endif

}  // namespace memscale::detail
