"""How dpscale runs Beam: options from the command line pass through, local defaults fill gaps."""

from apache_beam.options.pipeline_options import DirectOptions, GoogleCloudOptions, StandardOptions, WorkerOptions

from dpscale.pipelines.runner import DEFAULT_RUNNER, is_local_runner, pipeline_options


def test_dataflow_options_pass_through_unchanged():
    args = [
        "--runner",
        "DataflowRunner",
        "--project",
        "p",
        "--region",
        "europe-west4",
        "--temp_location",
        "gs://bucket/tmp",
        "--num_workers",
        "7",
        "--machine_type",
        "n1-standard-8",
    ]
    options = pipeline_options(args, parallel=True)
    assert options.view_as(StandardOptions).runner == "DataflowRunner"
    gcp = options.view_as(GoogleCloudOptions)
    assert (gcp.project, gcp.region, gcp.temp_location) == ("p", "europe-west4", "gs://bucket/tmp")
    workers = options.view_as(WorkerOptions)
    assert (workers.num_workers, workers.machine_type) == (7, "n1-standard-8")
    assert options.view_as(DirectOptions).direct_num_workers == 1  # untouched Beam default
    assert not is_local_runner(options)


def test_local_defaults_use_both_cores_only_when_parallel_and_never_override_the_user():
    big = pipeline_options([], parallel=True)
    assert is_local_runner(big)
    assert (big.view_as(DirectOptions).direct_num_workers, big.view_as(DirectOptions).direct_running_mode) == (
        2,
        "multi_processing",
    )
    small = pipeline_options([], parallel=False)
    assert small.view_as(DirectOptions).direct_running_mode == "in_memory"
    assert small.view_as(StandardOptions).runner == DEFAULT_RUNNER
    mine = pipeline_options(["--direct_num_workers=3", "--direct_running_mode=multi_threading"], parallel=True).view_as(
        DirectOptions
    )
    assert (mine.direct_num_workers, mine.direct_running_mode) == (3, "multi_threading")
    one = pipeline_options(["--direct_num_workers=1"], parallel=True)
    assert one.view_as(DirectOptions).direct_num_workers == 1
