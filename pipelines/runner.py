"""How dpscale runs a Beam graph: runner options, local progress, one call.

``run_pipeline`` is what every data stage (ingest, dedup, featurize) calls: it turns the
command line's pipeline arguments into Beam options, adds local defaults only where the user
gave none, shows progress when the workers share this machine's disk, and runs the graph.

Local runs are guarded against two failure modes of Beam's local runner:

* **Lost rows.** The FnApiRunner gives each gRPC worker connection a *time-based*
  buffered output stream (``worker_handlers.DATA_BUFFER_TIME_LIMIT_MS = 1000``). Its timer
  thread flushes the buffer into a bounded send queue (100 MB since Beam 2.74) and then
  clears it; while the flush blocks on a full queue the runner thread keeps appending a
  bundle's input, and the clear drops those bytes without any error (Beam defect; minimal
  reproducer without a pipeline: ``benchmarks/beam_flush_race.py`` at commit 037e7ac). With
  the limit at 0 the streams flush by size, only from the writing thread: nothing is dropped.
* **Stalls.** A worker blocked on a full queue while the runner blocks sending it more
  input never finishes. A watchdog stops a local run whose processes used no CPU for
  ``stall_seconds`` and raises one clear error instead of hanging.

Beam's own logging (and its worker processes' stderr) goes to a log file unless
``verbose``; a failure names that file and the next thing to try (``pipelines.beam_log``
captures the log and reads a worker's failure from it).

Other runners take Beam's own options after ``--``. ``DaskRunner`` is accepted by that short
name (Beam knows it only by its module path). On ``DataflowRunner`` the workers must be able to
install dpscale (``--setup_file``, ``--extra_package`` or ``--sdk_container_image``: refused
without one), and ``--dry_run`` builds the job without submitting it, writing its description
to ``--dataflow_job_file`` (``DryRun``). See docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

from dpscale.errors import PipelineError, PipelineStalledError
from dpscale.pipelines.beam_log import TRY_IN_MEMORY, beam_log_to_file, logged_failure, one_line, worker_error
from dpscale.pipelines.progress import LocalProgress

DEFAULT_RUNNER = "FnApiRunner"
DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
_LOCAL_RUNNERS = ("directrunner", "direct", "fnapirunner", "bundlebaseddirectrunner")
STALL_SECONDS = 300.0  # no CPU used by any local process for this long = stalled
FAILED_WORKER_GRACE = 15.0  # idle this long after a worker logged its traceback = failed with it
_IDLE_CPU = 0.02  # CPU-seconds per second below which the process tree counts as idle


def pipeline_options(args: Sequence[str], *, parallel: bool) -> PipelineOptions:
    """Beam options from command-line style ``args``; local defaults only fill gaps.

    Without ``--runner`` this is the local engine behind Beam's DirectRunner
    (``FnApiRunner``; naming it directly skips DirectRunner's attempt to fetch the Prism
    binary from the internet on every run), on both cores (multi-processing) when
    ``parallel`` and one in-memory worker otherwise, where process start-up and pickling
    cost more than they save. Anything given explicitly wins.
    """
    options = PipelineOptions(list(args))
    standard = options.view_as(StandardOptions)
    if standard.runner is None:
        standard.runner = DEFAULT_RUNNER
    if str(standard.runner).lower() in ("daskrunner", "dask"):
        standard.runner = DASK_RUNNER
    if standard.runner.lower() in ("directrunner", "direct", "fnapirunner"):
        direct = options.view_as(DirectOptions)
        given = " ".join(args)
        if "direct_num_workers" not in given:
            direct.direct_num_workers = 2 if parallel else 1
        if "direct_running_mode" not in given:
            direct.direct_running_mode = "in_memory" if direct.direct_num_workers == 1 else "multi_processing"
    return options


def _dry_run(options: PipelineOptions) -> bool:
    from apache_beam.options.pipeline_options import TestOptions

    return str(options.view_as(TestOptions).dry_run).lower() in ("true", "1")


def is_local_runner(options: PipelineOptions) -> bool:
    """Whether workers share this machine's disk (progress markers can reach us)."""
    return str(options.view_as(StandardOptions).runner or "").lower() in _LOCAL_RUNNERS


class DryRun(PipelineError):
    """A Dataflow job was built and checked but, as asked (``--dry_run``), not submitted: nothing ran."""


def _is_dataflow(options: PipelineOptions) -> bool:
    return str(options.view_as(StandardOptions).runner or "").lower() in ("dataflowrunner", "dataflow")


def check_dataflow_options(options: PipelineOptions) -> None:
    """Refuse a Dataflow job whose workers could not import dpscale (they would fail after minutes)."""
    from apache_beam.options.pipeline_options import SetupOptions, WorkerOptions

    setup = options.view_as(SetupOptions)
    if not (setup.setup_file or setup.extra_packages or options.view_as(WorkerOptions).sdk_container_image):
        raise PipelineError(
            "Dataflow workers need dpscale: add --setup_file PATH/pyproject.toml (a source "
            "checkout), --extra_package dpscale-*.whl or --sdk_container_image IMAGE "
            "(docs/cluster.md, Run on Dataflow)"
        )


def _write_job(result: object, options: PipelineOptions) -> str | None:
    """The built job as JSON at ``--dataflow_job_file``: its options and its portable pipeline."""
    from apache_beam.options.pipeline_options import DebugOptions
    from google.protobuf import json_format

    from dpscale import files

    path = options.view_as(DebugOptions).dataflow_job_file
    job = getattr(result, "job", None)
    if not path or job is None:
        return None
    payload = {
        "options": options.get_all_options(drop_default=True, retain_unknown_options=True),
        "pipeline": json_format.MessageToDict(job.proto_pipeline),
    }
    files.write_json_atomic(path, payload)
    return path


def avoid_flush_race() -> None:
    """Size-based data-plane streams for the local runner (see the module docstring).

    Read by the runner when it starts its gRPC data service, so it must run in the
    launching process before the pipeline does.
    """
    from apache_beam.runners.portability.fn_api_runner import worker_handlers

    worker_handlers.DATA_BUFFER_TIME_LIMIT_MS = 0


def _tree_cpu_seconds() -> float:
    """CPU time of this process and all its descendants (Beam's worker processes)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system + getattr(t, "children_user", 0.0)
    return total


def _stop_children() -> None:
    """Kill the worker processes this process started (a stalled run cannot be resumed)."""
    import psutil

    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            p.kill()


def run_pipeline(
    build: Callable[..., object],
    *,
    args: Sequence[str],
    parallel: bool,
    progress_total: int,
    progress_label: str,
    log: logging.Logger,
    progress_unit: str | None = None,
    progress_since: float | None = None,
    verbose: bool = False,
    stall_seconds: float = STALL_SECONDS,
    writes_to: str | None = None,
    rerun: str = "run the command again",
) -> None:
    """Build the graph with ``build(pipeline, progress_dir)`` and run it to completion.

    ``progress_dir`` is where workers ``mark`` finished work (None on a remote runner, whose
    own monitoring takes over); ``progress_unit`` names what they count (e.g. ``"images"``), to
    show the throughput, over the time since ``progress_since`` (the stage's start,
    ``time.monotonic()``). A failure raises ``PipelineError`` and a local stall
    ``PipelineStalledError``: one line each, with what to try. A worker's own user error
    (``DpscaleError``) is raised as it is, and an operating-system fault (a full disk) as a
    ``StorageError`` naming ``writes_to`` (where the pipeline writes) and ``rerun``.
    """
    import apache_beam as beam

    options = pipeline_options(args, parallel=parallel)
    dataflow = _is_dataflow(options)
    if dataflow:
        check_dataflow_options(options)
    local = is_local_runner(options)
    if local:
        avoid_flush_race()
    progress = (
        LocalProgress(progress_total, label=progress_label, unit=progress_unit, since=progress_since) if local else None
    )
    outcome: dict[str, BaseException] = {}

    def target() -> None:
        pipeline = None
        try:
            with beam.Pipeline(options=options) as pipeline:
                build(pipeline, progress.directory if progress else None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc
        finally:
            result = getattr(pipeline, "result", None)
            outcome["result"] = result  # type: ignore[assignment]
            client = getattr(result, "client", None)  # Beam's DaskRunner leaves its client open
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()

    with beam_log_to_file(verbose) as log_path, progress or contextlib.nullcontext():
        thread = threading.Thread(target=target, name="beam-pipeline", daemon=True)
        thread.start()
        last_cpu, last_busy = _tree_cpu_seconds() if local else 0.0, time.monotonic()
        while thread.is_alive():
            thread.join(timeout=min(5.0, stall_seconds / 4))
            if not local or not thread.is_alive():
                continue
            cpu, now = _tree_cpu_seconds(), time.monotonic()
            if cpu - last_cpu > _IDLE_CPU * (now - last_busy):
                last_cpu, last_busy = cpu, now
            elif (
                now - last_busy > min(stall_seconds, FAILED_WORKER_GRACE)
                and (failed := logged_failure(log_path)) is not None
            ):
                _stop_children()  # a worker failed and Beam did not end the run (it can hang there)
                raise failed
            elif now - last_busy > stall_seconds:
                _stop_children()
                where = f"; Beam's log: {log_path}" if log_path else ""
                raise PipelineStalledError(
                    f"the Beam pipeline stalled (no CPU used for {stall_seconds:.0f} s) and was "
                    f"stopped; {TRY_IN_MEMORY}{where}"
                )
    error = outcome.get("error")
    if error is None:
        if log_path:
            os.unlink(log_path)
        if dataflow and _dry_run(options):
            where = _write_job(outcome.get("result"), options)
            raise DryRun(
                "dry run: the Dataflow job was built and not submitted"
                + (f" (its description: {where})" if where else " (add --dataflow_job_file PATH to keep it)")
                + "; nothing was computed"
            )
        return
    if isinstance(error, KeyboardInterrupt):
        raise error
    if verbose:  # a progress line (not a second error line), then the trace
        log.info("the Beam pipeline failed; its trace:", exc_info=error)
    user_error = worker_error(error, writes_to=writes_to, rerun=rerun)
    if user_error is not None:  # its own line says it all
        if log_path:
            os.unlink(log_path)
        raise user_error from None
    if log_path:  # the log the line names holds the failure's own trace, after Beam's logging
        with open(log_path, "a") as f:
            traceback.print_exception(error, file=f)
    where = f" (its trace: Beam's log {log_path})" if log_path else " (its trace is above)"
    # One process cannot fail the way several can (pickling, worker start-up, the data plane).
    several = local and options.view_as(DirectOptions).direct_running_mode != "in_memory"
    hints = [TRY_IN_MEMORY] if several else [] if local else ["see the runner's job log"]
    if not verbose:
        hints.append("add --verbose to see Beam's logging as it runs")
    tried = f"; {', or '.join(hints)}" if hints else ""
    raise PipelineError(f"the Beam pipeline failed: {one_line(error)}{where}{tried}") from error
