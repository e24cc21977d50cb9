#!/usr/bin/env bash
# Vendors uPlot (MIT), the flight recorder page's charting library, into the package, so the page
# needs no CDN at run time. Pinned by version and npm's integrity digest; rerun to update (change
# both). Needs npm and the npm registry; the result is committed.
set -euo pipefail
VERSION=1.6.32
INTEGRITY=sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw==
dest=$(cd "$(dirname "$0")/.." && pwd)/src/bouncer/recorder/static/vendor
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
tarball=$(npm pack --silent "uplot@$VERSION")
got="sha512-$(openssl dgst -sha512 -binary "$tarball" | base64 -w0)"
if [ "$got" != "$INTEGRITY" ]; then
  echo "uplot@$VERSION: integrity $got, expected $INTEGRITY" >&2
  exit 1
fi
tar -xzf "$tarball"
mkdir -p "$dest"
cp package/dist/uPlot.iife.min.js package/dist/uPlot.min.css "$dest/"
cp package/LICENSE "$dest/uPlot.LICENSE.txt"
echo "uplot $VERSION ($INTEGRITY)" > "$dest/VERSIONS.txt"
echo "vendored uplot@$VERSION into $dest"
