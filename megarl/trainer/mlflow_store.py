"""A new run's MLflow store (``RUN_DIR/mlflow.db``), copied from an empty one made once per
MLflow version.

MLflow creates a sqlite store by running every one of its schema migrations, which took 2.4 s of
each run's start on a 2-core machine (opening an existing store: 0.5 s). The empty store is made
by MLflow itself, once, under ``$XDG_CACHE_HOME/megarl`` (``~/.cache/megarl``), and each new run
gets a copy: the same tables, schema revision and ``Default`` experiment as MLflow's own creation,
with that experiment's artifact location and times set as MLflow sets them (``mlruns/0`` under
the working directory, now). Where the cache cannot be written, MLflow creates the store as before.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import time
from pathlib import Path


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megarl"


def _empty_store() -> Path:
    """The cached empty store of the installed MLflow, made (atomically) if missing."""
    import mlflow
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    cached = _cache_dir() / f"mlflow-{mlflow.__version__}-empty.db"
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
        try:
            store = SqlAlchemyStore(f"sqlite:///{tmp}", default_artifact_root=str(Path.cwd() / "mlruns"))
            store.engine.dispose()
            os.replace(tmp, cached)
        finally:
            tmp.unlink(missing_ok=True)
    return cached


def new_store(db: Path) -> None:
    """Put an empty MLflow store at ``db`` unless one is there (temp file, then rename); on any
    failure leave nothing, for MLflow to create the store as it would have."""
    if db.exists():
        return
    try:
        source = _empty_store()
    except OSError:  # a read-only home or a full cache disk: MLflow creates the store itself
        return
    tmp = db.with_name(f".{db.name}.tmp")
    # a full disk: nothing is left, and MLflow meets the full disk itself, as without the copy
    with contextlib.suppress(OSError, sqlite3.Error):
        try:
            shutil.copyfile(source, tmp)
            con = sqlite3.connect(tmp)
            try:
                with con:
                    now_ms = int(time.time() * 1000)
                    con.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                                "WHERE experiment_id = 0", (str(Path.cwd() / "mlruns" / "0"), now_ms, now_ms))
            finally:
                con.close()
            os.replace(tmp, db)
        finally:
            tmp.unlink(missing_ok=True)
