#!/usr/bin/env bash
# Fetch the ONNX Runtime C/C++ API headers (Debian trixie's libonnxruntime-dev 1.21, API version 21, MIT) and
# print their include directory. The headers are not on PyPI; the onnxruntime wheel (1.32) serves API 21.
#
#   scripts/fetch_ort_headers.sh [CACHE_DIR]      # default ${XDG_CACHE_HOME:-~/.cache}/layerzero/ort-headers
#
# apt runs with a sources list, state and cache directories of its own (under CACHE_DIR/apt): the system's
# /etc/apt configuration and package state are never touched. The .deb's sha256 is pinned; a mismatch fails.
# Idempotent: a second run prints the include directory without a download.
set -euo pipefail

PACKAGE=libonnxruntime-dev
VERSION=1.21.0+dfsg-1
SHA256=14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
MIRROR=${LAYERZERO_DEBIAN_MIRROR:-http://deb.debian.org/debian}

cache=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/layerzero/ort-headers}
root="$cache/$VERSION"
include="$root/usr/include/onnxruntime"
if [[ -f "$include/onnxruntime_lite_custom_op.h" ]]; then
  echo "$include"
  exit 0
fi
for tool in apt-get dpkg-deb sha256sum; do
  command -v "$tool" >/dev/null || { echo "fetch_ort_headers: $tool not found (a Debian/Ubuntu system is needed)" >&2; exit 2; }
done
[[ -r "$KEYRING" ]] || { echo "fetch_ort_headers: $KEYRING missing (apt-get install debian-archive-keyring)" >&2; exit 2; }

apt_dir="$cache/apt"
mkdir -p "$apt_dir/etc/sources.list.d" "$apt_dir/etc/preferences.d" "$apt_dir/state/lists/partial" \
  "$apt_dir/cache/archives/partial" "$apt_dir/download"
echo "deb [signed-by=$KEYRING] $MIRROR trixie main" >"$apt_dir/etc/sources.list"
: >"$apt_dir/state/status"
apt_opts=(
  -o "Dir::Etc::SourceList=$apt_dir/etc/sources.list"
  -o "Dir::Etc::SourceParts=$apt_dir/etc/sources.list.d"
  -o "Dir::Etc::Preferences=$apt_dir/etc/preferences"
  -o "Dir::Etc::PreferencesParts=$apt_dir/etc/preferences.d"
  -o "Dir::State=$apt_dir/state"
  -o "Dir::State::status=$apt_dir/state/status"
  -o "Dir::Cache=$apt_dir/cache"
  -o "APT::Sandbox::User=root"
  -o "Debug::NoLocking=1"
  -q
)
apt-get "${apt_opts[@]}" update >&2
(cd "$apt_dir/download" && apt-get "${apt_opts[@]}" download "$PACKAGE=$VERSION" >&2)
deb=$(ls "$apt_dir/download/${PACKAGE}_"*.deb | head -n 1)
actual=$(sha256sum "$deb" | cut -d' ' -f1)
if [[ "$actual" != "$SHA256" ]]; then
  echo "fetch_ort_headers: $deb has sha256 $actual, expected $SHA256 (pinned); not unpacked" >&2
  exit 1
fi
tmp=$(mktemp -d "$cache/unpack.XXXXXX")
dpkg-deb -x "$deb" "$tmp"
rm -rf "$root"
mv "$tmp" "$root"
echo "$include"
