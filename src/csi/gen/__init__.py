"""Generated from the CSI spec v1.12.0 csi.proto by generate.sh (grpcio-tools 1.85.1). Do not edit."""
