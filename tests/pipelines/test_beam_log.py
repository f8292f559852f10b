"""What Beam's log says when a worker failed: the worker's own line, not Beam's wrapping of it."""

from dpscale.errors import DataError, PipelineError
from dpscale.pipelines.beam_log import logged_failure, one_line, worker_error


def test_a_worker_error_found_only_in_beams_log_is_raised_as_its_own_line(tmp_path):
    # What Beam's multi-process runner logs when a worker's bundle fails: the traceback, then a
    # one-line status with the same text escaped. When Beam stops there without ending the run,
    # the runner raises the logged error instead of waiting for the stall limit.
    log = tmp_path / "beam.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in fail\n'
        "dpscale.errors.DataError: shard 'x' is damaged; rebuild it [while running 'Map(fail)']\n"
        "Worker: severity: ERROR message: \"Traceback ...\\ndpscale.errors.StorageError: shard \\'x\\'\\n\"\n"
    )
    error = logged_failure(str(log))
    assert isinstance(error, DataError) and str(error) == "shard 'x' is damaged; rebuild it"
    log.write_text("Traceback (most recent call last):\nValueError: bad element 7 [while running 'Map(fail)']\n")
    error = logged_failure(str(log))
    assert type(error) is PipelineError and "ValueError: bad element 7 (" in str(error) and "in_memory" in str(error)
    log.write_text("INFO nothing failed\n")
    assert logged_failure(str(log)) is None
    assert logged_failure(None) is None and logged_failure(str(tmp_path / "missing.log")) is None


def test_a_worker_error_beam_raised_is_the_workers_own_line():
    try:  # in one process Beam re-raises the worker's error, wrapped, with the step's name added
        try:
            raise DataError("shard 'x' is damaged; rebuild it [while running 'Map(fail)']")
        except DataError as worker:
            raise RuntimeError("Beam's wrapping") from worker
    except RuntimeError as exc:
        error = worker_error(exc)
    assert type(error) is DataError and str(error) == "shard 'x' is damaged; rebuild it"
    # from worker processes only the traceback's text arrives
    error = worker_error(RuntimeError("Traceback ...\ndpscale.errors.DataError: bad shard [while running 'Map(f)']"))
    assert type(error) is DataError and str(error) == "bad shard"
    assert worker_error(RuntimeError("Traceback ...\ndpscale.errors.NoSuchError: x")) is None
    assert worker_error(ValueError("bad element")) is None


def test_one_line_is_the_last_exception_line_of_beams_message_and_short():
    wrapped = RuntimeError(
        'Traceback (most recent call last):\n  File "x.py"\nValueError: bad element 7\n  while processing bundle 3'
    )
    assert one_line(wrapped) == "ValueError: bad element 7"
    assert one_line(RuntimeError("no exception named\n  here")) == "here"
    assert one_line(RuntimeError()) == "RuntimeError"
    assert len(one_line(RuntimeError("ValueError: " + "x" * 500))) == 300
