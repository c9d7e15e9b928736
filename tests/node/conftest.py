"""The node tier's one cluster (built and started once per run, deploy/ applied as README says) and the times it
reports at the end of the run."""

from __future__ import annotations

import shutil

import pytest

from .harness import NodeCluster, build, environment_refusal, temp_workdir

TIMES: dict[str, float] = {}
#: Other figures of the run: what each fault did to its reader, same-run ratios.
REPORT: dict[str, str] = {}


@pytest.fixture(scope="session")
def cluster():
    why = environment_refusal()
    if why:
        pytest.skip(why)
    k8s_bins, node_cache, build_s = build()
    TIMES["build check (what .cache/node lacked, built now)"] = build_s
    last = node_cache / "last-build.txt"
    if last.exists():  # (make test-node builds before pytest starts: what that build took)
        REPORT["the last build that did work, by step (tests/node/build.sh)"] = "; ".join(
            line.strip() for line in last.read_text().splitlines())
    from .cluster import clean_host

    clean_host(k8s_bins)  # what a run that died left behind
    c = NodeCluster(k8s_bins, node_cache, temp_workdir(), TIMES)
    try:
        c.start()
        c.deploy()
        yield c
    finally:
        c.stop()
        shutil.rmtree(c.workdir, ignore_errors=True)


def pytest_collection_modifyitems(items):
    # The cluster is built and started in the first test's setup (minutes on a fresh machine), and pods take their
    # time: a longer limit than the suite's 300 s for every test of the tier.
    for item in items:
        if item.path.parent.name == "node":
            item.add_marker(pytest.mark.timeout(1200))


def pytest_terminal_summary(terminalreporter):
    if TIMES:
        terminalreporter.section("node tier: times (this run)")
        for what, seconds in TIMES.items():
            terminalreporter.write_line(f"{seconds:9.2f} s  {what}")
    if REPORT:
        terminalreporter.section("node tier: what it measured (this run)")
        for what, figure in REPORT.items():
            terminalreporter.write_line(f"{what}: {figure}")
