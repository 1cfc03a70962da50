#!/usr/bin/env bash
# Installs what memscale needs on Debian 12, and only what is missing: a machine
# that already has everything does no apt work. Then reports which BLAS LibTorch
# will get, since the reference BLAS makes training ~10x slower.
set -euo pipefail

packages=(cmake g++ make pkg-config libtorch-dev libgloo-dev catch2 librange-v3-dev nlohmann-json3-dev libspdlog-dev
          libcpp-httplib-dev libopenblas0-pthread)
# --tests: what the tests run against besides the build: a Prometheus server
# and promtool (the metrics endpoint), headless Chromium (the HTML report),
# tcmalloc (a child process preloads it: the malloc memscale detects).
if [[ "${1:-}" == "--tests" ]]; then
  packages+=(prometheus chromium libtcmalloc-minimal4)
fi

missing=()
for package in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)
  if [[ "$status" != "install ok installed" ]]; then
    missing+=("$package")
  fi
done

if ((${#missing[@]})); then
  echo "setup-deps: installing ${missing[*]}"
  as_root=()
  if ((EUID != 0)); then
    if command -v sudo >/dev/null 2>&1; then
      as_root=(sudo)
    else
      echo "setup-deps: need root (or sudo) to install: ${missing[*]}" >&2
      exit 1
    fi
  fi
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends "${missing[@]}"
else
  echo "setup-deps: all of ${packages[*]} installed"
fi

blas=""
if command -v update-alternatives >/dev/null 2>&1; then
  blas=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null \
         | sed -n 's/^Value: //p' || true)
fi
if [[ -z "$blas" && -e /usr/lib/x86_64-linux-gnu/libblas.so.3 ]]; then
  blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3)
fi
echo "setup-deps: libblas.so.3 -> ${blas:-unknown}"
case "$blas" in
  */blas/libblas.so.3*)
    echo "setup-deps: WARNING: libblas.so.3 is the reference BLAS; LibTorch will be very slow." >&2
    echo "setup-deps:          run: update-alternatives --config libblas.so.3-x86_64-linux-gnu" >&2
    ;;
esac
