"""Where a run's metrics go besides ``metrics.jsonl``: the experiment trackers of
``logging.backends`` (``console`` is the RunLogger's own line). A registry: each tracker opens a run
(or reopens the one a resumed run started), takes each step's metrics under the same names, keeps
artifacts where it can, and ends its run FINISHED, FAILED or KILLED.

Metric names are the same in every tracker: those of ``metrics.jsonl`` (``reward/mean``, slashes
kept), with ``@`` written ``_at_`` (``val/pass_at_4``), since MLflow refuses ``@``.

wandb and SwanLab are optional extras (``megarl[wandb]``, ``megarl[swanlab]``); their mode is theirs
to set: ``WANDB_MODE=offline`` writes ``<run_dir>/wandb/offline-run-*`` for ``wandb sync``;
``SWANLAB_MODE=offline`` writes ``<run_dir>/swanlog``."""

from __future__ import annotations

import abc
import dataclasses
import enum
import os
from pathlib import Path
from typing import Callable, Dict, Optional, Type

from megarl.config import to_yaml
from megarl.config.schema import LogBackend


class Ending(enum.Enum):
    """How a run ended, in each tracker's own words."""

    finished = "FINISHED"
    failed = "FAILED"
    killed = "KILLED"  # Ctrl-C, a signal, a preemption


def metric_name(key: str) -> str:
    """A metric's name in every tracker: ``metrics.jsonl``'s, with ``@`` (``val/pass@4``), which
    MLflow refuses, written ``_at_`` (``val/pass_at_4``), as verl does."""
    return key.replace("@", "_at_")


def flat_config(prefix: str, obj) -> Dict[str, str]:
    """``{"optimizer.lr": "1e-06", ...}``: every leaf of the config, as trackers' params take it."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        out.update(flat_config(key + ".", value) if dataclasses.is_dataclass(value) else {key: str(value)[:250]})
    return out


class Tracker(abc.ABC):
    """One experiment tracker's run. ``run_id``: what a resumed run passes back to reopen it (kept
    in each checkpoint's driver state); None where the tracker has no run to reopen."""

    extra: str = ""  # the pip extra that installs it
    module: str = ""

    run_id: Optional[str] = None

    @abc.abstractmethod
    def log(self, metrics: Dict[str, float], step: int) -> None:
        """Record ``metrics`` at ``step``."""

    def artifact(self, path: Path) -> None:
        """Keep a file (the reward curve) with the run, where the tracker keeps files."""

    @abc.abstractmethod
    def end(self, ending: Ending) -> None:
        """End the tracker's run as ``ending``."""


TRACKERS: Dict[LogBackend, Type[Tracker]] = {}


def tracker(backend: LogBackend) -> Callable[[Type[Tracker]], Type[Tracker]]:
    def register(cls: Type[Tracker]) -> Type[Tracker]:
        TRACKERS[backend] = cls
        return cls

    return register


def missing_package(backend: LogBackend) -> Optional[str]:
    """What to install for ``backend``, if its package is missing (checked before Ray starts)."""
    import importlib.util

    cls = TRACKERS.get(backend)
    if cls is None or not cls.module:
        return None
    try:
        found = importlib.util.find_spec(cls.module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None in sys.modules
        found = False
    if found:
        return None
    return f"logging.backends has {backend.value}, which needs the {cls.module} package: pip install 'megarl[{cls.extra}]'"


def _import(backend: LogBackend, name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(missing_package(backend) or f"logging.backends has {backend.value}: cannot import "
                          f"{name}") from err


@tracker(LogBackend.mlflow)
class MLflowTracker(Tracker):
    """A sqlite store and artifacts (config.yaml among them) in the run directory, unless
    ``logging.mlflow_tracking_uri`` is set."""

    extra, module = "ui", "mlflow"

    def __init__(self, cfg, run_dir: Path, start_step: int, run_id: Optional[str]):
        from megarl.trainer.mlflow_store import new_store

        self.mlflow = mlflow = _import(LogBackend.mlflow, "mlflow")
        if cfg.logging.mlflow_tracking_uri:  # the server's store decides where artifacts go
            mlflow.set_tracking_uri(cfg.logging.mlflow_tracking_uri)
        else:  # everything in the run directory, artifacts too (MLflow's default is ./mlruns)
            new_store(run_dir / "mlflow.db")
            mlflow.set_tracking_uri(f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
            if mlflow.get_experiment_by_name(cfg.logging.experiment) is None:
                mlflow.create_experiment(cfg.logging.experiment,
                                         artifact_location=(run_dir / "mlartifacts").resolve().as_uri())
        mlflow.set_experiment(cfg.logging.experiment)
        if run_id:
            mlflow.start_run(run_id=run_id)
        else:
            mlflow.start_run(run_name=cfg.logging.run_name or run_dir.name)
            mlflow.log_params(flat_config("", cfg))
            mlflow.log_text(to_yaml(cfg), "config.yaml")
        self.run_id = mlflow.active_run().info.run_id

    def log(self, metrics: Dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({metric_name(k): float(v) for k, v in metrics.items()}, step=step)

    def artifact(self, path: Path) -> None:
        self.mlflow.log_artifact(str(path))

    def end(self, ending: Ending) -> None:
        if self.mlflow.active_run() is not None:
            self.mlflow.end_run(ending.value)


@tracker(LogBackend.tensorboard)
class TensorBoardTracker(Tracker):
    """Event files in ``<run_dir>/tensorboard``; a resumed run appends to them, the events past its
    checkpoint (lost like metrics.jsonl's lines) purged."""

    extra, module = "tensorboard", "tensorboard"

    def __init__(self, cfg, run_dir: Path, start_step: int, run_id: Optional[str]):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(missing_package(LogBackend.tensorboard) or "logging.backends has tensorboard, which "
                              "needs the tensorboard package: pip install 'megarl[tensorboard]'") from err
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)

    def log(self, metrics: Dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(metric_name(key), value, step)
        self.writer.flush()

    def end(self, ending: Ending) -> None:
        self.writer.close()


@tracker(LogBackend.wandb)
class WandbTracker(Tracker):
    """A wandb run in project ``logging.experiment``, its files in ``<run_dir>/wandb``; a resumed
    run reopens it by id. ``WANDB_MODE=offline`` for a machine without the service."""

    extra, module = "wandb", "wandb"

    def __init__(self, cfg, run_dir: Path, start_step: int, run_id: Optional[str]):
        self.wandb = wandb = _import(LogBackend.wandb, "wandb")
        self.run = wandb.init(project=cfg.logging.experiment, name=cfg.logging.run_name or run_dir.name,
                              dir=str(run_dir), config=flat_config("", cfg), id=run_id,
                              resume="allow" if run_id else None, reinit="create_new")
        self.run_id = self.run.id

    def log(self, metrics: Dict[str, float], step: int) -> None:
        self.run.log({metric_name(k): float(v) for k, v in metrics.items()}, step=step)

    def artifact(self, path: Path) -> None:
        self.run.log({path.stem: self.wandb.Image(str(path))})

    def end(self, ending: Ending) -> None:
        self.run.finish(exit_code=0 if ending is Ending.finished else 1)
        self.wandb.teardown()  # its service process, which would outlive the run in this process


@tracker(LogBackend.swanlab)
class SwanLabTracker(Tracker):
    """A SwanLab run in project ``logging.experiment``, its logs in ``<run_dir>/swanlog``.
    ``SWANLAB_MODE=offline`` for a machine without the service."""

    extra, module = "swanlab", "swanlab"
    ENDINGS = {Ending.finished: "success", Ending.failed: "crashed", Ending.killed: "aborted"}

    def __init__(self, cfg, run_dir: Path, start_step: int, run_id: Optional[str]):
        self.swanlab = swanlab = _import(LogBackend.swanlab, "swanlab")
        self.run = swanlab.init(project=cfg.logging.experiment, name=cfg.logging.run_name or run_dir.name,
                                log_dir=str(run_dir / "swanlog"), config=flat_config("", cfg),
                                mode=os.environ.get("SWANLAB_MODE") or None,
                                **({"id": run_id, "resume": "allow"} if run_id else {}))
        self.run_id = self.run.id

    def log(self, metrics: Dict[str, float], step: int) -> None:
        self.swanlab.log({metric_name(k): float(v) for k, v in metrics.items()}, step=step)

    def artifact(self, path: Path) -> None:
        self.swanlab.log({path.stem: self.swanlab.Image(str(path))})

    def end(self, ending: Ending) -> None:
        if ending is Ending.finished:
            self.swanlab.finish()
        else:
            self.swanlab.finish(state=self.ENDINGS[ending], error=f"the run ended {ending.value}")
