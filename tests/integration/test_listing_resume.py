"""A listing of the origin killed part way is resumed by the next one: the parts it had listed whole are not listed
again, and the manifest it commits is the whole tree (issue 45, goal 4)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from cachefs.testing.synthetic_s3 import SyntheticBucket, running
from cachefs.testing.waiting import wait_for

N = 20_000  # 20 directories of 1,000: each a unit of the listing
HELD = "d000013"


@pytest.fixture
def synthetic():
    with running("--objects", str(N), "--hold-prefix", HELD + "/") as endpoint:
        yield endpoint


def _server(endpoint: str, what: str) -> dict:
    req = urllib.request.Request(f"{endpoint}/_synthetic/{what}", method="POST" if what == "release" else "GET")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def _cli(*args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cachefs.cli.main", *args], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _record(cache: str) -> dict | None:
    try:
        (name,) = os.listdir(os.path.join(cache, "listings"))
        with open(os.path.join(cache, "listings", name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def test_a_killed_listing_is_resumed_without_listing_again_what_it_had_listed(synthetic, tmp_path):
    env = {"AWS_ENDPOINT_URL": synthetic, "AWS_ACCESS_KEY_ID": "synthetic", "AWS_SECRET_ACCESS_KEY": "synthetic",
           "AWS_REGION": "us-east-1"}
    cache = str(tmp_path / "cache")
    first = _cli("refresh", "s3://synthetic", "--cache-dir", cache, env=env)
    try:
        # Every unit but the held one gets listed; the record says so (written about once a second).
        rec = wait_for(lambda: (r := _record(cache)) and len(r["units_done"]) == 19 and r, what="19 parts listed")
        assert HELD not in rec["units_done"] and _server(synthetic, "requests")["held"] >= 1
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
    before = dict(_server(synthetic, "release")["lists_under"])
    second = _cli("refresh", "s3://synthetic", "--cache-dir", cache, "-v", env=env)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert "resuming the listing of manifest v1 (19 parts listed before)" in err
    after = _server(synthetic, "requests")["lists_under"]
    listed_again = {top for top, n in after.items() if n != before.get(top, 0)}
    assert listed_again == {"", HELD}  # the root's LIST (to find the parts) and the one part not done
    assert _record(cache) is None  # (a finished listing leaves no record)

    status = subprocess.run([sys.executable, "-m", "cachefs.cli.main", "status", "--cache-dir", cache, "--json"],
                            env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    (ds,) = json.loads(status.stdout)["datasets"]
    bucket = SyntheticBucket(N)
    assert ds["files"] == N and ds["total_bytes"] == sum(bucket.size(i) for i in range(N))
