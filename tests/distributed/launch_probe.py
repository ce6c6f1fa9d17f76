"""A rank that reports what its process looks like (tests/distributed/test_runtime.py: the test
launcher's ranks, forked or new interpreters), then exits with the code asked for: ``probe.py
CODE`` makes rank 1 exit ``CODE`` (``kill``: SIGKILL itself). Imports nothing heavy itself."""

import json
import os
import signal
import socket
import sys

rank = int(os.environ["RANK"])
store = None
if "MEGARL_STORE_FD" in os.environ:
    with socket.socket(fileno=int(os.environ["MEGARL_STORE_FD"])) as sock:
        store = sock.getsockname()[1]
print("PROBE " + json.dumps({"rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv,
                             "path0": sys.path[0], "name": __name__, "stdin": sys.stdin.read(), "cwd": os.getcwd(),
                             "torch_preloaded": "torch" in sys.modules, "store_port": store,
                             "master_port": int(os.environ["MASTER_PORT"]), "omp": os.environ.get("OMP_NUM_THREADS")}))
sys.stdout.flush()
if rank == 1 and sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(sys.argv[1]) if rank == 1 else 0)
