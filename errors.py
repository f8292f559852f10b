"""Errors that mean "the user asked for something impossible", as opposed to bugs.

The CLI turns these into one line on stderr and exit code 2; anything else is a bug
and keeps its traceback.
"""


class DpscaleError(Exception):
    """Base class for errors caused by the user's input or environment."""


class InvalidConfigError(DpscaleError, ValueError):
    """A configuration value is out of range or inconsistent with another one."""


class InfeasiblePrivacyTargetError(DpscaleError, ValueError):
    """No admissible hyper-parameter reaches the requested (epsilon, delta)."""


class DataError(DpscaleError):
    """Input data is missing, corrupt, or does not match what the run expects."""


class PipelineError(DpscaleError, RuntimeError):
    """A Beam pipeline failed (or lost data); the message says what to try next."""


class PipelineStalledError(PipelineError):
    """A local Beam pipeline made no progress and was stopped instead of hanging."""
