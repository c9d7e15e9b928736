#!/usr/bin/env bash
# Build SeaweedFS's `weed` (Apache-2.0), the second real S3 server of the integration tier, from Go modules only.
# `go install github.com/seaweedfs/seaweedfs/weed@…` is refused (its go.mod has a replace directive), so this
# wrapper module requires it with the same replace. About 20 minutes cold on two cores (a ~230 MB binary).
# Output: $CACHEFS_SEAWEEDFS_BIN (default <repo>/.cache/seaweedfs/<version>/weed), reused when present.
# Prints the binary's path on its last line. Only go.mod/go.sum, tools.go and this script are committed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
version=$(awk '/^require github.com\/seaweedfs\/seaweedfs /{print $3}' "$here/go.mod")
out="${CACHEFS_SEAWEEDFS_BIN:-$repo/.cache/seaweedfs/$version/weed}"
if [ -x "$out" ]; then echo "$out"; exit 0; fi
command -v go >/dev/null || { echo "build.sh: the go command is needed (Go >= 1.26)" >&2; exit 2; }
mkdir -p "$(dirname "$out")"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
start=$(date +%s)
( cd "$here" && go build -trimpath -ldflags "-s -w" -o "$out.partial" github.com/seaweedfs/seaweedfs/weed ) >&2
mv "$out.partial" "$out"
echo "build.sh: built weed $version in $(( $(date +%s) - start )) s" >&2
echo "$out"
