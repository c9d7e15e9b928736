// Command pause is the pod sandbox's process for the node tier's container runtime: it holds the pod's
// namespaces, reaps the children it inherits as the pod's PID 1, and exits on SIGTERM or SIGINT.
// (The node tier builds every image it runs; no registry is reachable, so the runtime's sandbox image is this.)
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
