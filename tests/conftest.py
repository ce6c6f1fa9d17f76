"""Suite-wide: Ray without token auth unless the caller chose (CI sets ``RAY_AUTH_MODE=disabled``
too; clusters that test auth set their own token), and the shared Ray cluster of the end-to-end
runs (:mod:`tests.ray_cluster`) stopped when the session ends."""

from __future__ import annotations

import os

from tests import ray_cluster

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_sessionfinish(session, exitstatus):
    ray_cluster.stop_shared()
