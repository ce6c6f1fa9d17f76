"""What each tracker of a finished run holds, read back from its own files: ``{metric: {step:
value}}``, metric names as the tracker shows them. wandb's offline run is read with SwanLab's reader
of wandb's log format (its wandb converter's) and wandb's own record schema; SwanLab's with its own
reader and schema; TensorBoard's with its event accumulator; MLflow's through its client."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterator

Series = Dict[str, Dict[int, float]]


def wandb_records(run_dir: Path) -> Iterator:
    """The records of the run's offline log (wandb's ``Record`` protos), in order."""
    from swanlab.converter.wb.wbdatastore import WBDataStoreReader
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    reader = WBDataStoreReader()
    reader.open(path)
    try:
        while (data := reader.scan()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            yield record
    finally:
        reader.close()


def wandb_series(run_dir: Path) -> Series:
    out: Series = defaultdict(dict)
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for key, value in row.items():
            if not key.startswith("_") and isinstance(value, (int, float)):
                out[key][int(row["_step"])] = float(value)
    return dict(out)


def wandb_exit_code(run_dir: Path) -> int:
    exits = [r.exit.exit_code for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "exit"]
    assert len(exits) == 1, f"{run_dir}: {len(exits)} exit records"
    return exits[0]


def swanlab_series(run_dir: Path) -> Series:
    from swanlab.sdk.internal.core_python.store import DataStoreReader
    from swanlab.sdk.internal.core_python.sync import Record

    (path,) = (run_dir / "swanlog").glob("run-*/run-*.swanlab")
    out: Series = defaultdict(dict)
    reader = DataStoreReader()
    reader.open(path)
    try:
        for data in reader:
            record = Record()
            record.ParseFromString(data)
            if record.HasField("scalar"):
                out[record.scalar.key][record.scalar.step] = record.scalar.value.number
    finally:
        reader.close()
    return dict(out)


def tensorboard_series(run_dir: Path) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def mlflow_series(run_dir: Path) -> Series:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("megarl").experiment_id])
    return {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            for key in run.data.metrics}


READERS = {"wandb": wandb_series, "swanlab": swanlab_series, "tensorboard": tensorboard_series,
           "mlflow": mlflow_series}
