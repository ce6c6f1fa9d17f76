"""Suite-wide: Ray without token auth unless the caller chose (CI sets ``RAY_AUTH_MODE=disabled``
too; clusters that test auth set their own token), and the shared Ray cluster of the end-to-end
runs (:mod:`tests.ray_cluster`) stopped when the session ends.

SIGINT as in a terminal: a suite started in the background (``make test &``, nohup, a CI runner
without job control) has SIGINT ignored, and an ignored signal stays ignored across exec, so every
``megarl`` process the Ctrl-C tests start would ignore their Ctrl-C (they failed so, "the driver did
not exit", in background runs). Python's own handler is reset to the default at exec."""

from __future__ import annotations

import os
import signal

from tests import ray_cluster

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionfinish(session, exitstatus):
    ray_cluster.stop_shared()
