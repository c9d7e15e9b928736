#!/usr/bin/env bash
# Regenerates the Python gRPC stubs of the CSI spec (pinned: container-storage-interface/spec v1.12.0, the
# version csi-test v5.4.0 brings; tests/e2e/k8s-bins/build.sh downloads it into the Go module cache).
set -euo pipefail
cd "$(dirname "$0")"
SPEC="$(go env GOMODCACHE)/github.com/container-storage-interface/spec@v1.12.0"
python -m grpc_tools.protoc -I"$SPEC" --python_out=. --grpc_python_out=. "$SPEC/csi.proto"
sed -i 's/^import csi_pb2 as csi__pb2/from . import csi_pb2 as csi__pb2/' csi_pb2_grpc.py
