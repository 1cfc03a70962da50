#!/usr/bin/env bash
# Usage: cmake/fetch_libtorch2_headers.sh <dest>
# Puts LibTorch 2.x headers (Debian unstable's libtorch-dev, whatever version it
# carries) under <dest>/root/usr/include, for a syntax-only check of memscale's
# headers. Never installs anything: apt runs against private state under <dest>
# and the .deb is only unpacked. Cached: does nothing once the headers exist.
set -euo pipefail

if (($# != 1)); then
  echo "usage: $0 <dest>" >&2
  exit 2
fi
mkdir -p "$1"
dest=$(cd "$1" && pwd)
include="$dest/root/usr/include"

if [[ -d "$include/torch" ]]; then
  echo "fetch-libtorch2: cached: $include ($(cat "$dest/VERSION" 2>/dev/null || echo 'version unknown'))"
  exit 0
fi

mkdir -p "$dest/apt/lists/partial" "$dest/apt/cache/archives/partial"
cat > "$dest/unstable.sources" <<SOURCES
Types: deb
URIs: http://deb.debian.org/debian
Suites: unstable
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES

# The host's update hooks (AppStream, PackageKit) have no business with this.
cat > "$dest/apt.conf" <<'CONF'
#clear APT::Update::Post-Invoke;
#clear APT::Update::Post-Invoke-Success;
CONF

apt_options=(
  -c "$dest/apt.conf"
  -o Dir::Etc::SourceList=/dev/null
  -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::Etc::sourcelist=$dest/unstable.sources"
  -o "Dir::State::Lists=$dest/apt/lists"
  -o "Dir::Cache=$dest/apt/cache"
  -o APT::Sandbox::User=root
)

cd "$dest"
if ! compgen -G 'libtorch-dev_*.deb' >/dev/null; then
  echo "fetch-libtorch2: apt-get update (unstable, private lists under $dest/apt)"
  apt-get -q "${apt_options[@]}" update
  echo "fetch-libtorch2: apt-get download libtorch-dev/unstable"
  apt-get -q "${apt_options[@]}" download libtorch-dev/unstable
fi

debs=(libtorch-dev_*.deb)
if ((${#debs[@]} != 1)); then
  echo "fetch-libtorch2: expected one libtorch-dev_*.deb in $dest, found: ${debs[*]}" >&2
  exit 1
fi
rm -rf "$dest/root.partial"
dpkg -x "${debs[0]}" "$dest/root.partial"
mv "$dest/root.partial" "$dest/root"
dpkg-deb -f "${debs[0]}" Version > "$dest/VERSION"
echo "fetch-libtorch2: LibTorch headers $(cat "$dest/VERSION") in $include"
