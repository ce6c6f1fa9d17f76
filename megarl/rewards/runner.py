"""Scoring a batch safely: a reward function that raises or runs past its time limit on one
sample gives that sample 0, is counted and logged, and never stops the run."""

from __future__ import annotations

import concurrent.futures as cf
import logging
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

log = logging.getLogger(__name__)


@dataclass
class ScoreReport:
    scores: List[float]
    errors: int = 0
    timeouts: int = 0
    examples: List[str] = field(default_factory=list)  # the first few failures


def score_all(fn, samples: Sequence[Tuple[str, object]], timeout_s: float = 10.0, workers: int = 4) -> ScoreReport:
    """``fn(response, answer)`` for every sample, each bounded by ``timeout_s`` seconds."""
    report = ScoreReport(scores=[0.0] * len(samples))
    pool = cf.ThreadPoolExecutor(max_workers=workers)
    futures = [pool.submit(fn, text, answer) for text, answer in samples]
    for i, future in enumerate(futures):
        try:
            report.scores[i] = float(future.result(timeout=timeout_s))
        except cf.TimeoutError:
            report.timeouts += 1
            if len(report.examples) < 3:
                report.examples.append(f"sample {i}: timed out after {timeout_s}s")
        except Exception as err:  # a user's function may raise anything; the run goes on
            report.errors += 1
            if len(report.examples) < 3:
                report.examples.append(f"sample {i}: {type(err).__name__}: {err}")
    pool.shutdown(wait=False, cancel_futures=True)
    if report.errors or report.timeouts:
        log.warning("reward: %d error(s), %d timeout(s) scored 0; e.g. %s", report.errors, report.timeouts,
                    report.examples)
    return report
