#!/usr/bin/env bash
# Copies the header-only dependencies (range-v3, nlohmann-json, spdlog and fmt
# (used header-only), Catch2 v2 and its CMake test
# discovery) from this machine's Debian packages into third_party/ (or $1), for
# a machine without those packages, e.g. a GPU box with a pip LibTorch:
#   scripts/vendor-deps.sh && rsync -a third_party/ gpu:memscale/third_party/
#   cmake --preset default -DMEMSCALE_THIRD_PARTY_DIR=$PWD/third_party -DCMAKE_PREFIX_PATH=...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest=${1:-third_party}

for package in librange-v3-dev nlohmann-json3-dev libspdlog-dev libfmt-dev catch2; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
    echo "vendor-deps: $package is not installed (scripts/setup-deps.sh installs it)" >&2
    exit 1
  fi
done

# range-v3 ships range/, meta/, concepts/ and std/ (plus a clang module map).
rm -rf "$dest/range-v3"
mkdir -p "$dest/range-v3/include"
for dir in range meta concepts std; do
  cp -a "/usr/include/$dir" "$dest/range-v3/include/"
done
cp /usr/share/doc/librange-v3-dev/copyright "$dest/range-v3/"
dpkg-query -W -f='${Version}\n' librange-v3-dev > "$dest/range-v3/VERSION"

rm -rf "$dest/nlohmann-json"
mkdir -p "$dest/nlohmann-json/include"
cp -a /usr/include/nlohmann "$dest/nlohmann-json/include/"
cp /usr/share/doc/nlohmann-json3-dev/copyright "$dest/nlohmann-json/"
dpkg-query -W -f='${Version}\n' nlohmann-json3-dev > "$dest/nlohmann-json/VERSION"

# spdlog and fmt header-only (FMT_HEADER_ONLY): Debian's spdlog headers use the
# external fmt. No cpp-httplib: Debian's is split into a compiled library; drop
# upstream's single httplib.h into $dest/cpp-httplib/include/ for the metrics endpoint.
for pair in spdlog:libspdlog-dev fmt:libfmt-dev; do
  name=${pair%%:*} package=${pair#*:}
  rm -rf "${dest:?}/$name"
  mkdir -p "$dest/$name/include"
  cp -a "/usr/include/$name" "$dest/$name/include/"
  cp "/usr/share/doc/$package/copyright" "$dest/$name/"
  dpkg-query -W -f='${Version}\n' "$package" > "$dest/$name/VERSION"
done

rm -rf "$dest/catch2"
mkdir -p "$dest/catch2/include" "$dest/catch2/cmake"
cp -a /usr/include/catch2 "$dest/catch2/include/"
cp /usr/lib/cmake/Catch2/Catch.cmake /usr/lib/cmake/Catch2/CatchAddTests.cmake "$dest/catch2/cmake/"
cp /usr/share/doc/catch2/copyright "$dest/catch2/"
dpkg-query -W -f='${Version}\n' catch2 > "$dest/catch2/VERSION"

echo "vendor-deps: range-v3 $(cat "$dest/range-v3/VERSION"), nlohmann-json $(cat "$dest/nlohmann-json/VERSION"), Catch2 $(cat "$dest/catch2/VERSION") in $dest"
du -sh "$dest"
