"""Checkpoint benchmark: the training stall and the time to the origin of a writable cachefs mount, against s3fs
writing the same bytes and against bare multipart uploads (the least any client must do), in one run.

The origin is moto's S3 server behind a capped link (``tc tbf`` on a veth into a namespace made for the run, as
bench/read_bench.py does; loopback without a cap when not root, printed). Two checkpoints, each written three ways:

* one file of ``--mib`` MiB (a ``torch.save`` of a state dict: the same bytes), written to ``ckpt.pt.tmp`` and
  renamed to ``ckpt.pt``;
* a DCP-style directory: 8 shards, then ``.metadata`` by rename (which commits the directory).

For each, *stall* is the time until the writer's last ``close`` returns (what the training loop waits for), and
*to origin* the time until ``cachefs sync`` returns (every object, and the commit record, on the origin). Targets
(issue 35): the stall ≥ 5× shorter than s3fs's upload of the same bytes, and the time to the origin ≤ 1.1× the
link's time for them (printed against the bare upload measured here and against the nominal rate).

    python -m bench.checkpoint_bench                  # the issue's 2 GiB
    python -m bench.checkpoint_bench --mib 512        # a quicker pass
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import fsspec

from bench.read_bench import origin_on_link

MiB = 1 << 20
PART = 16 * MiB


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "cachefs.cli.main", *args], capture_output=True, text=True,
                       timeout=3600)
    if check and r.returncode != 0:
        raise SystemExit(f"cachefs {' '.join(args[:2])} failed: {r.stderr.strip()}")
    return r


def write_file(path: str, data: memoryview) -> None:
    with open(path, "wb") as f:
        for i in range(0, len(data), 4 * MiB):  # (torch.save writes in pieces too)
            f.write(data[i:i + 4 * MiB])


def checkpoint_file(root: str, data: memoryview) -> None:
    write_file(os.path.join(root, "ckpt.pt.tmp"), data)
    os.replace(os.path.join(root, "ckpt.pt.tmp"), os.path.join(root, "ckpt.pt"))


def checkpoint_dcp(root: str, data: memoryview, name: str) -> None:
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    shard = len(data) // 8
    with ThreadPoolExecutor(8) as pool:  # DCP writes its shards from several threads
        list(pool.map(lambda i: write_file(os.path.join(d, f"__{i}_0.distcp"), data[i * shard:(i + 1) * shard]),
                      range(8)))
    write_file(os.path.join(d, ".metadata.tmp"), memoryview(b"metadata"))
    os.replace(os.path.join(d, ".metadata.tmp"), os.path.join(d, ".metadata"))


def bare_upload(client, bucket: str, key: str, data: memoryview, concurrency: int) -> None:
    """A multipart upload with ``concurrency`` parts in flight: the least any client must do."""
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    starts = range(0, len(data), PART)

    def part(n: int) -> dict:
        body = bytes(data[starts[n]:starts[n] + PART])
        return {"PartNumber": n + 1, "ETag": client.upload_part(Bucket=bucket, Key=key, UploadId=upload,
                                                                 PartNumber=n + 1, Body=body)["ETag"]}

    with ThreadPoolExecutor(concurrency) as pool:
        parts = list(pool.map(part, range(len(starts))))
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=2048, help="checkpoint size (default 2048: the issue's 2 GiB)")
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--rate-mbit", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=8, help="parts in flight (cachefs's default too)")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the writable mount needs root (FUSE)")
    with origin_on_link(args.rate_mbit, args.delay_ms) as (server, work, capped):
        run(args, server, work, capped)


def run(args, server, work: str, capped: bool) -> None:
    os.environ.update(server.env())
    client = server.client()
    bucket = "bench"
    client.create_bucket(Bucket=bucket)
    data = memoryview(os.urandom(args.mib * MiB))
    size = len(data)
    link = f"{args.rate_mbit} Mbit/s tbf on a veth into a namespace" if capped else "loopback, no bandwidth cap"
    nominal = size / (args.rate_mbit * 1e6 / 8) if capped else None
    print(f"# origin: moto S3 at {server.endpoint}, +{args.delay_ms:g} ms per request, {link}; checkpoint "
          f"{args.mib} MiB; parts {PART // MiB} MiB, {args.concurrency} in flight")

    # The ceiling: bare multipart uploads of the same bytes, as fast as a client can.
    t = time.perf_counter()
    bare_upload(client, bucket, "bare/ckpt.pt", data, args.concurrency)
    bare = time.perf_counter() - t
    print(f"bare multipart upload    {bare:7.2f} s  {size / bare / 1e6:7.1f} MB/s"
          + (f"  (nominal link {nominal:.2f} s)" if nominal else ""))

    # s3fs: the training loop waits for the whole upload.
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    t = time.perf_counter()
    with fs.open(f"{bucket}/s3fs/ckpt.pt", "wb", block_size=PART) as f:
        for i in range(0, size, 4 * MiB):
            f.write(data[i:i + 4 * MiB])
    s3fs_time = time.perf_counter() - t
    print(f"s3fs write               {s3fs_time:7.2f} s  (stall = upload)")

    rows = []
    for shape in ("file", "dcp"):
        cache = os.path.join(work, f"cache-{shape}")
        mnt = tempfile.mkdtemp(prefix="mnt-", dir=work)
        url = f"s3://{bucket}/cachefs-{shape}"
        cli("mount", url, mnt, "--writable", "--cache-dir", cache)
        try:
            t = time.perf_counter()
            if shape == "file":
                checkpoint_file(mnt, data)
            else:
                checkpoint_dcp(mnt, data, "step-1")
            stall = time.perf_counter() - t
            cli("sync", mnt, "--cache-dir", cache)
            to_origin = time.perf_counter() - t
        finally:
            cli("umount", mnt, "--cache-dir", cache, "--no-sync", check=False)
            shutil.rmtree(cache, ignore_errors=True)
        print(f"cachefs {shape:4s}             stall {stall:6.2f} s   to origin {to_origin:7.2f} s")
        rows.append((f"{shape}: stall, s3fs's upload ÷ ours (≥ 5)", s3fs_time / stall, 5.0))
        rows.append((f"{shape}: time to origin ÷ bare upload (≤ 1.1)", to_origin / bare, None))
        if nominal:
            rows.append((f"{shape}: time to origin ÷ nominal link time (≤ 1.1)", to_origin / nominal, None))
    check = client.get_object(Bucket=bucket, Key="cachefs-file/ckpt.pt")["Body"].read()
    assert check == data, "the uploaded checkpoint differs from what was written"
    if shutil.which("rclone") is None:
        print("# rclone is not installed here: its mount (--vfs-cache-mode writes) is not measured")
    print()
    for name, ratio, target in rows:
        verdict = "" if target is None else ("  meets target" if ratio >= target else "  BELOW target")
        if target is None:
            verdict = "  meets target" if ratio <= 1.1 else "  above 1.1"
        print(f"{name:55s} {ratio:6.2f}×{verdict}")


if __name__ == "__main__":
    main()
