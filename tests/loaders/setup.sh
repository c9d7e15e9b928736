#!/usr/bin/env bash
# The heavy loader tier's environment (.venv-loaders): cachefs beside every loader docs/LOADERS.md has a recipe
# for (torch, torchvision, MosaicML streaming, HF datasets, webdataset, polars), resolved together in a fresh venv
# as a user would install them, then checked for conflicts. torch's CUDA wheels are gigabytes: uv installs them
# from its cache (.cache/uv, kept between runs) in about 40 s here; pip's resolver backtracked for minutes over
# this set (mosaicml-streaming pins transformers<5, which pins the Hub client that HF datasets needs).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${LOADERS_VENV:-.venv-loaders}
PY=${PY:-python3}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$PWD/.cache/uv}
[ -x .venv/bin/uv ] || { [ -x .venv/bin/python ] || $PY -m venv .venv; .venv/bin/pip install -q 'uv>=0.5'; }
[ -x "$VENV/bin/python" ] || .venv/bin/uv venv -q --python "$PY" "$VENV"
start=$(date +%s)
VIRTUAL_ENV=$VENV .venv/bin/uv pip install -q -e '.[test,loaders,loaders-heavy]' pytest-xdist
VIRTUAL_ENV=$VENV .venv/bin/uv pip check
echo "tests/loaders/setup.sh: $VENV ready in $(( $(date +%s) - start )) s:" \
  "$(VIRTUAL_ENV=$VENV .venv/bin/uv pip list 2>/dev/null | grep -E '^(fsspec|s3fs|torch|mosaicml-streaming|datasets) ' | tr -s ' ' | paste -sd, -)"
