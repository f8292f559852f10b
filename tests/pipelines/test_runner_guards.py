"""The local runner neither loses rows nor hangs, and fails in one line.

``test_multi_processing_delivers_every_row`` pushes ~200 MB through a shuffle into a slow
consumer, so the runner's 100 MB send queue to each worker fills up: the situation in
which Beam's time-based flush drops data (without ``avoid_flush_race`` it lost rows here:
benchmarks/results/dedup.md at commit 037e7ac). It runs the real two-process runner, as ingest, dedup and
featurize do by default on big inputs.
"""

import logging
import os
import threading
import time

import apache_beam as beam
import numpy as np
import pytest

from dpscale.errors import DataError, PipelineError, PipelineStalledError
from dpscale.pipelines.runner import run_pipeline

TWO = ("--direct_num_workers=2", "--direct_running_mode=multi_processing")
ELEMENTS, ROWS, WIDTH, KEYS = 480, 1000, 512, 240  # 480 elements of 0.5 MB = 240 MB


def _emit(task: int):
    for i in range(ELEMENTS // 8):
        yield (task * 131 + i) % KEYS, np.full((ROWS, WIDTH), task, np.uint8)


def _slow_count(kv):
    time.sleep(0.02)  # a busy worker: its input queue backs up into the runner's
    return sum(len(a) for a in kv[1])


def _write(total, *, path):
    with open(path, "w") as f:
        f.write(str(total))


def test_multi_processing_delivers_every_row(tmp_path):
    path = str(tmp_path / "count")

    def build(pipeline, _):
        _ = (
            pipeline
            | beam.Create(list(range(8)))
            | beam.Reshuffle()
            | beam.FlatMap(_emit)
            | beam.GroupByKey()
            | beam.Map(_slow_count)
            | beam.CombineGlobally(sum)
            | beam.Map(_write, path=path)
        )

    run_pipeline(build, args=TWO, parallel=True, progress_total=1, progress_label="test", log=logging.getLogger("test"))
    assert int(open(path).read()) == ELEMENTS * ROWS


def test_a_failing_pipeline_is_one_error_naming_the_cause_and_what_to_try():
    def fail(_):
        raise ValueError("bad element 7")

    def build(pipeline, _):
        _ = pipeline | beam.Create([1]) | beam.Map(fail)

    with pytest.raises(PipelineError) as info:
        run_pipeline(
            build, args=(), parallel=False, progress_total=1, progress_label="test", log=logging.getLogger("test")
        )
    message = str(info.value)
    assert "bad element 7" in message and "--verbose" in message and "\n" not in message
    assert "in_memory" not in message  # it ran in one process already: that hint cannot help
    with pytest.raises(PipelineError) as info:
        run_pipeline(
            build, args=TWO, parallel=True, progress_total=1, progress_label="test", log=logging.getLogger("test")
        )
    assert "bad element 7" in str(info.value) and "in_memory" in str(info.value)


def test_a_user_error_in_a_worker_is_its_own_line_without_beams_wrapping(capfd):
    def fail(_):
        raise DataError("shard 'x' is damaged; rebuild it")

    def build(pipeline, _):
        _ = pipeline | beam.Create([1]) | beam.Map(fail)

    for args in ((), TWO):  # in this process, and in worker processes (only the traceback's text arrives)
        with pytest.raises(DataError) as info:
            run_pipeline(
                build,
                args=args,
                parallel=bool(args),
                progress_total=1,
                progress_label="test",
                log=logging.getLogger("test"),
            )
        assert str(info.value) == "shard 'x' is damaged; rebuild it"
        assert "Traceback" not in capfd.readouterr().err  # Beam's log of the failure went to its file


_release = threading.Event()


def _wait(x):
    _release.wait(60)  # blocked without using CPU, like a worker stuck on a full queue
    return x


def test_a_stalled_pipeline_is_stopped_with_a_clear_error():
    def build(pipeline, _):
        _ = pipeline | beam.Create([1]) | beam.Map(_wait)

    start = time.monotonic()
    try:
        with pytest.raises(PipelineStalledError, match="stalled"):
            run_pipeline(
                build,
                args=(),
                parallel=False,
                progress_total=1,
                progress_label="t",
                log=logging.getLogger("test"),
                stall_seconds=3,
            )
    finally:
        _release.set()
    assert time.monotonic() - start < 30


_go, _logged, _hold = threading.Event(), threading.Event(), threading.Event()


def _leftover_worker():
    _go.wait(60)
    try:
        raise DataError("shard 'x' is damaged")
    except DataError:
        logging.getLogger("apache_beam.runners.worker.sdk_worker").exception("Error processing instruction")
    _logged.set()


def _let_it_fail_then_wait(x):
    _go.set()
    _logged.wait(60)
    _hold.wait(60)  # then stalled, like test_a_stalled_pipeline_is_stopped_with_a_clear_error
    return x


def test_a_failure_logged_by_an_older_thread_is_not_this_pipelines():
    """A worker thread left over from an earlier pipeline in this process that logs its failure late (it once
    made the stall test above fail with another test's DataError) is not why this pipeline stopped."""
    threading.Thread(target=_leftover_worker, daemon=True).start()

    def build(pipeline, _):
        _ = pipeline | beam.Create([1]) | beam.Map(_let_it_fail_then_wait)

    try:
        with pytest.raises(PipelineStalledError, match="stalled"):
            run_pipeline(
                build,
                args=(),
                parallel=False,
                progress_total=1,
                progress_label="t",
                log=logging.getLogger("test"),
                stall_seconds=3,
            )
    finally:
        _hold.set()
    assert _logged.is_set()  # the old thread did log its failure during the run


def test_beam_logging_goes_to_a_file_unless_verbose(capfd):
    def build(pipeline, _):
        _ = (
            pipeline
            | beam.Create([1])
            | beam.Map(
                lambda x: (
                    logging.getLogger("apache_beam.test").error("beam says hello") or os.write(2, b"raw fd2 noise\n")
                )
            )
        )

    run_pipeline(build, args=(), parallel=False, progress_total=1, progress_label="t", log=logging.getLogger("test"))
    assert "noise" not in capfd.readouterr().err
    run_pipeline(
        build,
        args=(),
        parallel=False,
        progress_total=1,
        progress_label="t",
        log=logging.getLogger("test"),
        verbose=True,
    )
    assert "noise" in capfd.readouterr().err


def _send_through_runner_data_plane(chunks: int, chunk_mb: int) -> int:
    """Bytes a slow reader receives of what the runner writes into one worker's data stream."""
    from apache_beam.runners.portability.fn_api_runner import worker_handlers
    from apache_beam.runners.worker import data_plane

    # what the runner's gRPC data service gives every worker connection
    channel = data_plane._GrpcDataChannel(data_buffer_time_limit_ms=worker_handlers.DATA_BUFFER_TIME_LIMIT_MS)
    received = [0]

    def read():  # a worker busy with its bundle drains the stream slowly
        for elements in channel._write_outputs():
            received[0] += sum(len(d.data) for d in elements.data)
            time.sleep(0.3)

    reader = threading.Thread(target=read)
    reader.start()
    stream = channel.output_stream("bundle", "transform")
    chunk = b"x" * (chunk_mb << 20)
    for _ in range(chunks):
        stream.write(chunk)
        time.sleep(0.1)  # the sender shares the GIL with gRPC's threads
    stream.close()
    channel.close()
    reader.join()
    return received[0]


def test_the_runner_data_plane_as_configured_drops_nothing():
    """Beam's time-based flush dropped 25-50% of these bytes; ``avoid_flush_race`` stops it."""
    from dpscale.pipelines.runner import avoid_flush_race

    avoid_flush_race()
    assert _send_through_runner_data_plane(16, 10) == 16 * 10 << 20
