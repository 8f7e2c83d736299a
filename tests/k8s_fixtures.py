"""The session's Kubernetes test cluster (devbroker.testing.k8s; docs/kubernetes.md).

`k8s_cluster` brings up one real two-node cluster per pytest session, the first time a test
asks for it, and takes it down at the end; the teardown fails the session if anything of it
is left (a process, mount, network namespace, link or cgroup). Needs root and the binaries
of scripts/k8s/build.sh (scripts/test.sh builds them); skips otherwise.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def k8s_cluster():
    from devbroker.testing.k8s import Cluster, missing_prerequisites

    missing = missing_prerequisites()
    if missing:
        pytest.skip("no test cluster: missing " + ", ".join(missing))
    # A short state dir: the kubelet's and the DRA plugins' unix sockets live under it, and a
    # socket path must stay under 108 bytes.
    state = Path(tempfile.mkdtemp(prefix="dbk", dir="/tmp"))
    cluster = Cluster(state_dir=state)
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()
        left = cluster.leftovers()
        if not left:
            shutil.rmtree(state, ignore_errors=True)
        assert not left, f"the test cluster left behind: {left} (logs in {state})"
