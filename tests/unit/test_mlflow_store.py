"""A run's MLflow store is a copy of an empty one made once: the same schema, revision and rows as
MLflow's own creation, opened without running a migration; without a writable cache, nothing is
left and MLflow creates the store as before."""

from __future__ import annotations

import sqlite3

import pytest

from megarl.trainer import mlflow_store


def _dump(db):
    con = sqlite3.connect(db)
    try:
        # a table's clauses in any order: MLflow's own creations differ in the order of CHECKs
        schema = sorted((kind, name, sorted((sql or "").split(", \n")))
                        for kind, name, sql in con.execute("SELECT type, name, sql FROM sqlite_master"))
        rows = {name: sorted(con.execute(f"SELECT * FROM {name}")) for (kind, name, _) in schema if kind == "table"}
        times = con.execute("SELECT creation_time, last_update_time FROM experiments").fetchall()
    finally:
        con.close()
    # the Default experiment's times: when the store was made, checked apart
    rows["experiments"] = [r[:4] + r[6:] for r in rows["experiments"]]
    return schema, rows, times


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "cache" / "megarl"


def test_the_copy_is_what_mlflow_creates(cache, tmp_path, monkeypatch):
    import mlflow
    import mlflow.store.db.utils as db_utils

    (tmp_path / "own").mkdir()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'own' / 'mlflow.db'}")
    mlflow.get_experiment_by_name("x")  # MLflow's own creation, in this working directory
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    mlflow_store.new_store(run_dir / "mlflow.db")
    assert [p.name for p in cache.iterdir()] == [f"mlflow-{mlflow.__version__}-empty.db"]
    ours, theirs = _dump(run_dir / "mlflow.db"), _dump(tmp_path / "own" / "mlflow.db")
    assert ours[:2] == theirs[:2]
    (created, updated), = ours[2]
    assert created == updated and created >= theirs[2][0][0]  # made now, not when the cache was
    assert sorted(p.name for p in run_dir.iterdir()) == ["mlflow.db"]  # no temp file left

    def no_migration(engine):
        raise AssertionError("MLflow ran its migrations on a copied store")

    monkeypatch.setattr(db_utils, "_initialize_tables", no_migration)
    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = mlflow.create_experiment("e", artifact_location=(run_dir / "a").as_uri())
    with mlflow.start_run(experiment_id=experiment) as run:
        mlflow.log_metric("m", 1.5, step=3)
    assert mlflow.get_run(run.info.run_id).data.metrics == {"m": 1.5}


def test_an_existing_store_is_left_alone(cache, tmp_path):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"kept")
    mlflow_store.new_store(db)
    assert db.read_bytes() == b"kept" and not cache.exists()


def test_an_unwritable_cache_leaves_nothing(tmp_path, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    mlflow_store.new_store(run_dir / "mlflow.db")
    assert list(run_dir.iterdir()) == []


def test_a_copy_that_fails_leaves_nothing(cache, tmp_path, monkeypatch):
    import errno
    import shutil

    def full(src, dst):
        with open(dst, "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    mlflow_store.new_store(run_dir / "mlflow.db")
    assert list(run_dir.iterdir()) == []  # neither the store nor the half-written temp file
