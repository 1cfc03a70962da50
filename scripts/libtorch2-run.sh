#!/usr/bin/env bash
# Builds memscale and runs its whole test suite against LibTorch 2.x: Debian
# unstable's libtorch-dev (CPU), in a chroot made by debootstrap, with this
# checkout's sources (tracked and untracked files git does not ignore).
#
#   sudo scripts/libtorch2-run.sh [ROOT]     # ROOT: the chroot, default .cache/sid (reused)
#
# Needs root (debootstrap, chroot, mount), Debian's package registry, and this
# machine's test packages (scripts/setup-deps.sh --tests): unstable's catch2 is
# v3, so the tests take Catch2 v2 from a copy scripts/vendor-deps.sh makes.
# The test tools come too (prometheus with promtool, chromium); Conan does not
# (its test skips). libgloo-dev: Torch's 2.x CMake config defines USE_C10D_GLOO, so
# c10d's Gloo header needs it, and unstable's libtorch-dev does not pull it in.
# Logs: ROOT/src/libtorch2-*.log. Exit status: the build's or ctest's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(realpath -m "${1:-.cache/sid}")
mirror=${MEMSCALE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
jobs=${MEMSCALE_JOBS:-$(nproc)}
packages=(libtorch-dev g++ cmake make librange-v3-dev libopenblas0-pthread nlohmann-json3-dev libspdlog-dev
  libcpp-httplib-dev pkg-config libgloo-dev prometheus chromium)

if [[ $(id -u) != 0 ]]; then
  echo "libtorch2-run: needs root (debootstrap, chroot, mount /proc)" >&2
  exit 1
fi
if ! command -v debootstrap >/dev/null; then
  apt-get install -y --no-install-recommends debootstrap
fi
if [[ ! -x $root/usr/bin/apt-get ]]; then
  echo "=== debootstrap sid into $root"
  mkdir -p "$root"
  debootstrap --variant=minbase sid "$root" "$mirror"
fi

in_root() { chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"; }
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
trap 'umount "$root/proc" 2>/dev/null || true' EXIT
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true

echo "=== packages: ${packages[*]}"
# The registry's unstable snapshot carries an expired Release date.
in_root apt-get -o Acquire::Check-Valid-Until=false -qq update
in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
version=$(in_root dpkg-query -W -f='${Version}' libtorch-dev)
echo "libtorch-dev $version"
if [[ $version != 2.* ]]; then
  echo "libtorch2-run: the chroot's libtorch-dev is $version, not 2.x" >&2
  exit 1
fi

echo "=== sources into $root/src/memscale"
rm -rf "$root/src/memscale" "$root/src/third_party"
mkdir -p "$root/src/memscale"
git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$root/src/memscale"
./scripts/vendor-deps.sh "$root/src/third_party" >/dev/null

echo "=== build (-j$jobs)"
log=$root/src/libtorch2-build.log
status=0
in_root cmake -S /src/memscale -B /src/build -DCMAKE_BUILD_TYPE=Release -DMEMSCALE_THIRD_PARTY_DIR=/src/third_party \
  -DMEMSCALE_BUILD_CUDA=OFF >"$log" 2>&1 &&
  in_root cmake --build /src/build -j "$jobs" >>"$log" 2>&1 || status=$?
if ((status != 0)); then
  tail -n 40 "$log"
  echo "libtorch2-run: the build failed against libtorch-dev $version (log: $log)" >&2
  exit "$status"
fi

echo "=== ctest"
log=$root/src/libtorch2-ctest.log
in_root ctest --test-dir /src/build -j "$jobs" --output-on-failure >"$log" 2>&1 || status=$?
grep -E '^[0-9]+% tests passed|tests? failed out of|\*\*\*(Failed|Exception)|Not Run|Skipped' "$log" | tail -n 40 || true
echo "libtorch2-run: libtorch-dev $version, ctest exit $status (log: $log)"
exit "$status"
