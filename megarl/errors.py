"""Errors that end a run and that the ``megarl`` command reports by name (megarl/cli.py), kept in a
module without heavy imports so that the command can catch them before loading any engine."""

from __future__ import annotations


class NonFiniteUpdateError(RuntimeError):
    """``trainer.max_bad_steps`` optimizer steps in a row had a non-finite loss or gradient."""


class NonFiniteOutput(RuntimeError):
    """A role's log-probs or values of a step's batch hold NaN or inf."""
