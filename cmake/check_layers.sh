#!/usr/bin/env bash
# Checks that include/memscale reads bottom-up: every memscale header includes
# only headers of its own folder or of a layer below it (ARCHITECTURE.md §3),
# that no header is much over 400 lines, that every #include comes before
# the first namespace, and that no virtual member function is declared without
# a body unless declared inline. Prints each violation and exits 1
# when there is one. Usage: cmake/check_layers.sh [repo root]
#
# The layers, bottom first. A folder named here takes the layer's number; the
# files at the top of include/memscale are named one by one.
set -euo pipefail
repo="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$repo/include"

declare -A layer=(
  [version.hpp]=0 [errors.hpp]=0 [config.hpp]=0  # facts every layer may use
  [detail]=1 [cuda]=1                            # internals; the kernel declarations
  [device]=2                                     # hardware, memory tracking, process memory
  [observability]=2                              # logging (spdlog), metrics, telemetry, Config as JSON
  [offload]=3                                    # offload engine, tiers, I/O pool, saved-tensor hooks
  [policy]=3                                     # Stage 1: its context, decision, rule and trained policies
  [techniques]=4                                 # checkpoint, offload, tile, precision, 8-bit
  [core]=5                                       # units, profiler, decision engine, plan, optimal chain
  [execute]=6                                    # executor, attach and detach, verify_correctness
  [report]=6                                     # the Report as JSON and HTML (beside execute, not on it)
  [predict]=7                                    # the OOM predictor
  [autotuning]=8 [distributed]=8                 # the AutoTuner; data parallel
  [api.hpp]=9 [memscale.hpp]=9 [distributed.hpp]=9  # the public surface
)
max_lines="${MEMSCALE_MAX_HEADER_LINES:-420}"

unit_of() {  # memscale/<folder>/x.hpp -> folder; memscale/x.hpp -> x.hpp
  local rest="${1#memscale/}"
  if [[ "$rest" == */* ]]; then echo "${rest%%/*}"; else echo "$rest"; fi
}

failures=0
while IFS= read -r header; do
  unit="$(unit_of "$header")"
  own="${layer[$unit]:-}"
  if [[ -z "$own" ]]; then
    echo "check_layers: $header: folder or file '$unit' has no layer (add it to cmake/check_layers.sh and ARCHITECTURE.md)"
    failures=$((failures + 1))
    continue
  fi
  # Every #include above the first namespace: check_headers.sh checks a chain of
  # headers in one translation unit on that premise.
  late=$(awk '/^namespace /{ns=1} ns && /^[[:space:]]*#[[:space:]]*include/{print NR; exit}' "$header")
  if [[ -n "$late" ]]; then
    echo "check_layers: $header:$late: an #include below the first namespace; put every #include at the top"
    failures=$((failures + 1))
  fi
  lines=$(wc -l < "$header")
  if (( lines > max_lines )); then
    echo "check_layers: $header has $lines lines (at most $max_lines): split it along its responsibilities"
    failures=$((failures + 1))
  fi
  while IFS= read -r included; do
    target="$(unit_of "$included")"
    theirs="${layer[$target]:-}"
    if [[ ! -f "$included" ]]; then
      echo "check_layers: $header includes $included, which does not exist"
      failures=$((failures + 1))
    elif [[ "$target" == "$unit" ]] || { [[ "$unit" != */* && "$unit" == *.hpp && "$target" == *.hpp ]] && (( theirs == own )); }; then
      continue  # its own folder, or a file at the top beside it in the same layer
    elif [[ -z "$theirs" ]] || (( theirs >= own )); then
      echo "check_layers: $header (layer $own, $unit) includes $included (layer ${theirs:-none}, $target): only lower layers may be included"
      failures=$((failures + 1))
    fi
  done < <(grep -oP '^\s*#\s*include\s+[<"]\Kmemscale/[^>"]+' "$header" || true)
done < <(find memscale -name '*.hpp' | LC_ALL=C sort)

# The benchmarks' sources are held to the same size.
while IFS= read -r source; do
  lines=$(wc -l < "$source")
  if (( lines > max_lines )); then
    echo "check_layers: $source has $lines lines (at most $max_lines): split it along its responsibilities"
    failures=$((failures + 1))
  fi
done < <(cd "$repo" && find benchmarks -maxdepth 1 \( -name '*.cpp' -o -name '*.hpp' \) | LC_ALL=C sort | sed "s#^#$repo/#")

# A virtual member function declared in its class without a body and without
# `inline` is the class's key function (Itanium C++ ABI) even where its
# definition below says `inline`: GCC then emits the vtable, and every function
# it reaches, in every translation unit that includes the header. For
# core::attachment that was the whole planner: a unit that included
# memscale.hpp and called nothing took 38 s at -O0 (a 14 MB object), 21-24 s
# (0.5 MB) once begin_call was defined in the class, forwarding to take_call.
# (Declared inline instead, it must be defined in every unit that includes the
# class, a virtual function being odr-used wherever its class is complete.)
while IFS= read -r violation; do
  echo "check_layers: $violation: define this virtual function in its class (it may forward to a" \
       "member defined elsewhere), or its class's vtable and all it reaches compile in every unit"
  failures=$((failures + 1))
done < <(find memscale -name '*.hpp' | LC_ALL=C sort | xargs perl -e '
  local $/;
  for my $file (@ARGV) {
    open(my $fh, "<", $file) or die "$file: $!";
    my $text = <$fh>;
    $text =~ s{//[^\n]*}{}g;                                              # comments, keeping lines
    $text =~ s{/\*.*?\*/}{ (my $c = $&) =~ s/[^\n]//g; $c }gse;
    while ($text =~ /([^;{}]*)(?=;)/g) {                                  # each declaration, up to its ;
      my ($decl, $end) = ($1, pos($text));
      next unless $decl =~ /\(/ && $decl =~ /\b(virtual|override|final)\b/;
      next if $decl =~ /=\s*(0|default|delete)\s*$/ || $decl =~ /\binline\b/;
      my $line = 1 + (substr($text, 0, $end - length($decl)) =~ tr/\n//) + (($decl =~ /^(\s*)/)[0] =~ tr/\n//);
      (my $flat = $decl) =~ s/\s+/ /g;
      $flat =~ s/^ //;
      print "$file:$line: $flat\n";
    }
  }')

if (( failures > 0 )); then
  echo "check_layers: $failures violation(s)"
  exit 1
fi
echo "check_layers: $(find memscale -name '*.hpp' | wc -l) headers, every include runs downward, none over $max_lines lines, no key function declared out of line"
