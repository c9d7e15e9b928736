"""Checkpoint savers unchanged on a writable volume (docs/LOADERS.md, Checkpoints): ``torch.save`` to a temporary
name and a rename, PyTorch DCP's ``FileSystemWriter`` (shards, then ``.metadata`` by rename: the directory is
committed), safetensors, and ``torch.save`` through the fsspec protocol; each read back from the mount and from
the bucket, tensor for tensor. Heavy tier: ``make test-loaders``."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import fsspec
import pytest

torch = pytest.importorskip("torch", reason="the heavy loader tier: make test-loaders")

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse (CI runs as root)", allow_module_level=True)

from tests.integration.test_fuse import Mounted  # noqa: E402

pytestmark = [pytest.mark.root]

ENV = {"CACHEFS_CHECKPOINT_PART_SIZE": "5MiB"}


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(1024, 1024, generator=g), "layer.bias": torch.randn(1024, generator=g),
            "step": torch.tensor(seed)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sync(m: Mounted) -> None:
    r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "sync", m.mountpoint, "--timeout", "120",
                        "--cache-dir", m.cache_dir], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr


@pytest.fixture
def volume(s3, cache_dir, tmp_path):
    _, client, bucket = s3
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = Mounted(cache_dir, f"s3://{bucket}/run", str(mnt), "--writable", env=ENV)
    try:
        yield m, client, bucket
    finally:
        m.close()


def from_bucket(client, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def test_torch_save_to_a_temporary_name_and_rename(volume):
    m, client, bucket = volume
    sd = state(1)
    torch.save(sd, m.path("ckpt.pt.tmp"))
    os.replace(m.path("ckpt.pt.tmp"), m.path("ckpt.pt"))
    assert same(torch.load(m.path("ckpt.pt")), sd)
    sync(m)
    assert same(torch.load(io.BytesIO(from_bucket(client, bucket, "run/ckpt.pt"))), sd)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"]]
    assert keys == ["run/ckpt.pt"]  # renamed before its upload: never under the temporary name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # (one process: no group needed)
def test_dcp_file_system_writer_commits_the_checkpoint_directory(volume):
    import torch.distributed.checkpoint as dcp

    m, client, bucket = volume
    sd = state(2)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(m.path("step-100")))
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(back, storage_reader=dcp.FileSystemReader(m.path("step-100")))
    assert same(back, sd)
    sync(m)
    record = json.loads(from_bucket(client, bucket, "run/.cachefs/commits/step-100.json"))
    names = {f["path"] for f in record["files"]}
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    listed = {o["Key"][len("run/step-100/"):] for o in
              client.list_objects_v2(Bucket=bucket, Prefix="run/step-100/")["Contents"]}
    assert listed == names  # no .metadata.tmp, nothing else


def test_safetensors_and_torch_save_through_fsspec(volume, s3, cache_dir):
    from safetensors.torch import load, save_file

    m, client, bucket = volume
    sd = {k: v for k, v in state(3).items() if k != "step"}
    save_file(sd, m.path("model.safetensors"))
    sync(m)
    assert same(load(from_bucket(client, bucket, "run/model.safetensors")), sd)
    with fsspec.open(f"cachefs::s3://{bucket}/run/by-url.pt", "wb",
                     cachefs={"writable": True, "cache_dir": cache_dir, "checkpoint_part_size": "5MiB"}) as f:
        torch.save(sd, f)
    fs = fsspec.filesystem("cachefs", writable=True, cache_dir=cache_dir)
    with fs.open(f"{bucket}/run/by-url.pt", "rb") as f:
        assert same(torch.load(f), sd)
    fs.writes.volumes.close()  # (the drain a process does at exit)
    assert same(torch.load(io.BytesIO(from_bucket(client, bucket, "run/by-url.pt"))), sd)
