#!/usr/bin/env bash
# Regenerates the Python gRPC stubs of the CSI spec and of kubelet's plugin registration API (pinned: container-storage-interface/spec v1.12.0, the
# version csi-test v5.4.0 brings; tests/e2e/k8s-bins/build.sh downloads it into the Go module cache).
set -euo pipefail
cd "$(dirname "$0")"
SPEC="$(go env GOMODCACHE)/github.com/container-storage-interface/spec@v1.12.0"
python -m grpc_tools.protoc -I"$SPEC" --python_out=. --grpc_python_out=. "$SPEC/csi.proto"
sed -i 's/^import csi_pb2 as csi__pb2/from . import csi_pb2 as csi__pb2/' csi_pb2_grpc.py
# kubelet's plugin registration API v1 (k8s.io/kubelet v0.36.3, the release of the node tier's kubelet), which the
# node plugin serves itself to register with kubelet (csi/registration.py). Generated under a name of its own.
REG="$(go env GOMODCACHE)/k8s.io/kubelet@v0.36.3/pkg/apis/pluginregistration/v1"
tmp=$(mktemp -d)
cp "$REG/api.proto" "$tmp/pluginregistration.proto"
python -m grpc_tools.protoc -I"$tmp" --python_out=. --grpc_python_out=. "$tmp/pluginregistration.proto"
rm -rf "$tmp"
sed -i 's/^import pluginregistration_pb2 as/from . import pluginregistration_pb2 as/' pluginregistration_pb2_grpc.py
