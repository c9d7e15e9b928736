# The two entry points README.md opens with.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-loaders test-s3impl test-node setup setup-test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q -e '.[server]'

setup-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'

## Start a local S3 server with a sample dataset, prefetch it through cachefs, read it back, print what happened.
demo: setup
	$(BIN)/cachefs demo

## Every test tier: unit, integration against a real S3 server, crash and full-disk tests (root tiers included).
## The checks first (lint, import layers, types), then what the tests need from outside Python (tests/prepare.sh),
## then the tests on two workers, each test file on one of them; the ten slowest tests are listed at the end.
test: setup-test
	$(BIN)/ruff check src tests bench
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy
	tests/prepare.sh
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=10 --ignore=tests/node

## The loader recipes of docs/LOADERS.md against torch, torchvision and MosaicML streaming (CUDA wheels, gigabytes),
## in their own venv resolved beside every loader (tests/loaders/setup.sh), with the light loader tests again there.
test-loaders: setup-test
	tests/loaders/setup.sh
	.venv-loaders/bin/python -m pytest -q -p no:cacheprovider tests/loaders tests/integration/test_loaders.py

## The read path and the checkpoint write path against a second real S3 server, SeaweedFS (conditional writes,
## multipart uploads, copies and listings differ between servers). `weed` is built from Go modules into .cache/
## (tests/s3impl/seaweedfs/build.sh: about 20 minutes cold on 2 cores, reused after); `make test` runs the same
## tests when it is there and skips them, saying so, when it is not.
test-s3impl: setup-test
	tests/s3impl/seaweedfs/build.sh >/dev/null
	$(BIN)/python -m pytest -q -p no:cacheprovider -rs tests/integration/test_seaweedfs.py

## A real Kubernetes node (tests/node/): kubelet, kube-proxy and kubectl built from the control plane's module, containerd,
## runc and CNI from Debian's packages, the cachefs image and deploy/'s other images built here without a registry
## (tests/node/build.sh, into .cache/node/), deploy/ applied as README says, pods reading and writing through cachefs
## volumes, faults on the node. Needs root and /dev/fuse (skips, saying why, without them).
test-node: setup-test
	tests/node/build.sh >/dev/null
	$(BIN)/python -m pytest -q -p no:cacheprovider -rs --durations=5 tests/node

bench: setup-test
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) .venv-loaders .pytest_cache
