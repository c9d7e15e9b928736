#!/usr/bin/env bash
# What the tests need from outside Python, made ready before the timed tests start (`make test` runs this):
#   - the Debian tools some tests use: installed when this runs as root with apt-get, otherwise the tests that
#     need a missing one skip, and this says which and why;
#   - the real Kubernetes components the end-to-end tests run, built once from Go modules into .cache/
#     (tests/e2e/k8s-bins/build.sh; minutes on two cores the first time, reused after).
set -euo pipefail
cd "$(dirname "$0")/.."
tools="mount:util-linux fincore:util-linux mkfs.ext4:e2fsprogs ip:iproute2 tc:iproute2 fio:fio openssl:openssl
fusermount3:fuse3 setpriv:util-linux pgrep:procps cmp:diffutils"
missing=""
for tool in $tools; do
  command -v "${tool%%:*}" >/dev/null || missing="$missing ${tool#*:}"
done
missing=$(echo "$missing" | tr ' ' '\n' | sort -u | xargs)
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "tests/prepare.sh: installing $missing (Debian packages the tests use)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq $missing >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq $missing >/dev/null; }
  else
    echo "tests/prepare.sh: not installed: $missing (needs root and apt-get); the tests that use them will skip"
  fi
fi
if command -v go >/dev/null; then
  start=$(date +%s)
  tests/e2e/k8s-bins/build.sh >/dev/null
  echo "tests/prepare.sh: Kubernetes components ready ($(( $(date +%s) - start )) s)"
else
  echo "tests/prepare.sh: no Go toolchain (Go >= 1.26): the end-to-end tests on a real control plane will skip"
fi
