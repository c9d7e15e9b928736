#!/usr/bin/env bash
# Build the real Kubernetes components the end-to-end tests run, from Go modules only:
#   kube-apiserver, kube-scheduler, kube-controller-manager (k8s.io/kubernetes $K8S; the tests run only its
#   resourceclaim controller), etcd (go.etcd.io/etcd/server/v3 $ETCD),
#   csi-sanity (github.com/kubernetes-csi/csi-test/v5 $CSI_TEST).
# With the argument `node`, also what the node tier runs (make test-node): kubelet, kube-proxy and kubectl from the same
# k8s.io/kubernetes module and version.
# Output: $CACHEFS_K8S_BINS (default <repo>/.cache/k8s-bins/<versions>/), reused when every binary is present.
# Prints that directory on its last line. Only go.mod/go.sum and this script are committed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
K8S=v1.36.3
ETCD=v3.6.14
CSI_TEST=v5.4.0
out="${CACHEFS_K8S_BINS:-$repo/.cache/k8s-bins/k8s-$K8S-etcd-$ETCD-csitest-$CSI_TEST}"
bins="kube-apiserver kube-scheduler kube-controller-manager etcd csi-sanity"
node_bins="kubelet kube-proxy kubectl"
want="$bins"
[ "${1:-}" = node ] && want="$bins $node_bins"
have=1
for b in $want; do [ -x "$out/$b" ] || have=0; done
if [ "$have" = 1 ]; then echo "$out"; exit 0; fi
command -v go >/dev/null || { echo "build.sh: the go command is needed (Go >= 1.26)" >&2; exit 2; }
mkdir -p "$out"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
minor=$(echo "$K8S" | cut -d. -f2)
ldf="-s -w -X k8s.io/component-base/version.gitVersion=$K8S -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
start=$(date +%s)
missing() { for b in "$@"; do [ -x "$out/$b" ] || return 0; done; return 1; }
if missing $bins; then
  ( cd "$here/kube" && go build -trimpath -ldflags "$ldf" -o "$out/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
      k8s.io/kubernetes/cmd/kube-controller-manager ) >&2
  ( cd "$here/etcd" && go build -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3 ) >&2
  ( cd "$here/csi" && go build -trimpath -ldflags "-s -w" -o "$out/csi-sanity" \
      github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity ) >&2
fi
if [ "${1:-}" = node ] && missing $node_bins; then
  ( cd "$here/kube" && go build -trimpath -ldflags "$ldf" -o "$out/" \
      k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubectl ) >&2
fi
echo "build.sh: built $want in $(( $(date +%s) - start )) s" >&2
echo "$out"
