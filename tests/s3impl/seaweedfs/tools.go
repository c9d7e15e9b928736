//go:build tools

// Package tools pins the SeaweedFS server the S3 conformance tests run (github.com/seaweedfs/seaweedfs/weed).
package tools

import _ "github.com/seaweedfs/seaweedfs/weed"
