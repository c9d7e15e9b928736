#!/usr/bin/env bash
# Everything the node tier (make test-node) runs, built here without a registry, into .cache/node/ (reused when present):
#   - kubelet, kube-proxy and kubectl from the control plane's k8s.io/kubernetes module and version
#     (tests/e2e/k8s-bins/build.sh node);
#   - the images deploy/ names, as docker-archive tarballs the runtime imports (no registry is reachable):
#       localhost/cachefs:0.1.0              the Dockerfile, FROM a Debian base made here with mmdebstrap;
#       localhost/cachefs:0.1.0-next         a second build of it (another image id), to upgrade to;
#       localhost/csi-provisioner:v5.2.0     github.com/kubernetes-csi/external-provisioner/v5 (bins/provisioner);
#       localhost/kube-scheduler:v1.36.3     the control plane's own kube-scheduler binary;
#       localhost/pause:3.10                 the runtime's sandbox image (bins/pause, ours);
#     built with podman (daemonless, from Debian's packages).
# The Debian packages it needs (podman, mmdebstrap, containerd, runc, CNI plugins, iptables) are installed when missing
# and this runs as root with apt-get. Prints each step's time; the output directory on its last line (its file
# k8s-bins names the Kubernetes binaries' directory).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${CACHEFS_NODE_CACHE:-$repo/.cache/node}"
mkdir -p "$out/images" "$out/bin"
# Each step's time, to stderr and (for the tier's report) to last-build.txt when this run built anything.
worked=0
: > "$out/build-times.tmp"
step() {
  local took=$(( $(date +%s) - $2 ))
  echo "tests/node/build.sh: $1 in $took s" >&2
  echo "$took s  $1" >> "$out/build-times.tmp"
  [ "$took" -gt 0 ] && worked=1
  return 0
}

t=$(date +%s)
need=""
for tool in podman:podman mmdebstrap:mmdebstrap containerd:containerd runc:runc /usr/lib/cni/bridge:containernetworking-plugins \
            iptables:iptables; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || [ -x "${tool%%:*}" ] || need="$need ${tool#*:}"
done
if [ -n "$need" ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "tests/node/build.sh: needs the Debian packages$need (run as root with apt-get)" >&2; exit 2
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq $need >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq $need >/dev/null; }
  step "installed$need" "$t"
fi

t=$(date +%s)
k8s="$("$repo/tests/e2e/k8s-bins/build.sh" node | tail -n 1)"
echo "$k8s" > "$out/k8s-bins"  # (where the tier finds them)
step "Kubernetes binaries ready" "$t"

export CGO_ENABLED=0 GOFLAGS=-mod=mod
t=$(date +%s)
[ -x "$out/bin/csi-provisioner" ] || ( cd "$here/bins/provisioner" && go build -trimpath -ldflags "-s -w" \
    -o "$out/bin/csi-provisioner" github.com/kubernetes-csi/external-provisioner/v5/cmd/csi-provisioner ) >&2
[ -x "$out/bin/pause" ] || ( cd "$here/bins/pause" && go build -trimpath -ldflags "-s -w" -o "$out/bin/pause" . ) >&2
step "csi-provisioner and pause ready" "$t"

# A single static binary as an image (what the upstream sidecar and control plane images hold, without a registry).
binary_image() {  # name binary-path path-in-image [args...]
  local name="$1" bin="$2" path="$3" tar="$out/images/$(echo "$1" | tr '/:' '__').tar"
  shift 3
  [ -s "$tar" ] && return 0
  local ctx
  ctx="$(mktemp -d)"
  cp "$bin" "$ctx/binary"
  { echo "FROM scratch"
    echo "COPY binary $path"
    echo "ENV PATH=/usr/local/bin:/usr/bin:/bin"
    printf 'ENTRYPOINT ["%s"]\n' "$path"; } > "$ctx/Containerfile"
  podman build -q -t "$name" -f "$ctx/Containerfile" "$ctx" >/dev/null
  rm -rf "$ctx"
  podman save -q --format docker-archive -o "$tar.tmp" "$name" && mv "$tar.tmp" "$tar"
}
t=$(date +%s)
binary_image localhost/csi-provisioner:v5.2.0 "$out/bin/csi-provisioner" /csi-provisioner
binary_image localhost/kube-scheduler:v1.36.3 "$k8s/kube-scheduler" /usr/local/bin/kube-scheduler
binary_image localhost/pause:3.10 "$out/bin/pause" /pause
step "sidecar and pause images ready" "$t"

# The base: a minimal Debian root file system from Debian's packages (the same apt sources as this machine) with
# Python 3.11 and pip, what python:3.11-slim gives; it trusts the certificate authorities this machine trusts
# (/usr/local/share/ca-certificates), as a site's own base image does, so pip reaches PyPI through the same proxy.
t=$(date +%s)
base="$out/base-bookworm.tar"
if [ ! -s "$base" ]; then
  mmdebstrap --quiet --format=tar --variant=minbase --include=python3,python3-pip,ca-certificates \
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED; ln -sf python3 "$1"/usr/bin/python' \
    --customize-hook='cp /usr/local/share/ca-certificates/*.crt "$1"/usr/local/share/ca-certificates/ 2>/dev/null || true' \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$base.tmp" >&2
  mv "$base.tmp" "$base"
  podman rmi -f localhost/cachefs-base:bookworm >/dev/null 2>&1 || true
fi
podman image exists localhost/cachefs-base:bookworm ||
  podman import -q --change 'CMD ["python3"]' "$base" localhost/cachefs-base:bookworm >/dev/null
step "Debian base image ready" "$t"

# The cachefs image, rebuilt when anything it copies changes.
t=$(date +%s)
key="$(cd "$repo" && find Dockerfile .dockerignore pyproject.toml README.md src -type f \
        ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"
tar="$out/images/localhost_cachefs_0.1.0.tar"
if [ "$(cat "$tar.key" 2>/dev/null)" != "$key" ] || [ ! -s "$tar" ]; then
  podman build -q --network=host --build-arg BASE=localhost/cachefs-base:bookworm -t localhost/cachefs:0.1.0 \
    "$repo" >/dev/null
  podman save -q --format docker-archive -o "$tar.tmp" localhost/cachefs:0.1.0 && mv "$tar.tmp" "$tar"
  echo "$key" > "$tar.key"
  podman image prune -f >/dev/null 2>&1 || true  # the previous build's layers
fi
step "cachefs image ready" "$t"

# A second build of it (the same layers, one more label: another image id), for the upgrade by `kubectl set image`.
t=$(date +%s)
next="$out/images/localhost_cachefs_0.1.0-next.tar"
if [ "$(cat "$next.key" 2>/dev/null)" != "$key" ] || [ ! -s "$next" ]; then
  podman image exists localhost/cachefs:0.1.0 || podman load -q -i "$tar" >/dev/null
  ctx="$(mktemp -d)"
  printf 'FROM localhost/cachefs:0.1.0\nLABEL io.cachefs.build=next\n' > "$ctx/Containerfile"
  podman build -q -t localhost/cachefs:0.1.0-next -f "$ctx/Containerfile" "$ctx" >/dev/null
  rm -rf "$ctx"
  podman save -q --format docker-archive -o "$next.tmp" localhost/cachefs:0.1.0-next && mv "$next.tmp" "$next"
  echo "$key" > "$next.key"
fi
step "cachefs image's second build ready" "$t"
if [ "$worked" = 1 ]; then mv "$out/build-times.tmp" "$out/last-build.txt"; else rm -f "$out/build-times.tmp"; fi
echo "$out"
