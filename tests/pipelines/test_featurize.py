"""The featurize graph: Beam options pass through, local defaults, graph shape (no network)."""

import apache_beam as beam
from apache_beam.options.pipeline_options import (DirectOptions, GoogleCloudOptions,
                                                  StandardOptions, WorkerOptions)

from dpscale.pipelines import featurize as graph
from dpscale.stages import featurize as stage


def test_dataflow_options_pass_through_unchanged():
    args = ["--runner", "DataflowRunner", "--project", "p", "--region", "us-central1",
            "--temp_location", "gs://bucket/tmp", "--num_workers", "50",
            "--machine_type", "n1-standard-8"]
    options = graph.pipeline_options(args, num_chunks=1250)
    assert options.view_as(StandardOptions).runner == "DataflowRunner"
    gcp = options.view_as(GoogleCloudOptions)
    assert (gcp.project, gcp.region, gcp.temp_location) == ("p", "us-central1", "gs://bucket/tmp")
    workers = options.view_as(WorkerOptions)
    assert (workers.num_workers, workers.machine_type) == (50, "n1-standard-8")
    assert not graph.is_local_runner(options)


def test_local_default_uses_both_cores_unless_there_is_little_work():
    many = graph.pipeline_options([], num_chunks=59)
    assert graph.is_local_runner(many)
    direct = many.view_as(DirectOptions)
    assert (direct.direct_num_workers, direct.direct_running_mode) == (2, "multi_processing")
    few = graph.pipeline_options([], num_chunks=graph.MIN_CHUNKS_FOR_TWO_WORKERS - 1)
    assert few.view_as(DirectOptions).direct_running_mode == "in_memory"
    mine = graph.pipeline_options(["--direct_num_workers=1"], num_chunks=59)
    assert mine.view_as(DirectOptions).direct_num_workers == 1


def test_cli_forwards_beam_options_to_the_stage(config_from_cli, tmp_path):
    config = config_from_cli(stage, [
        "featurize", str(tmp_path), "--backbone", "efficientnet-lite0", "--resolution", "128",
        "--runner", "DataflowRunner", "--project", "p", "--", "--temp_location", "gs://b/t"])
    assert (config.resolution, config.backbone, config.chunk_rows) == (128, "efficientnet-lite0", 1024)
    options = graph.pipeline_options(config.pipeline_args, num_chunks=10)
    assert options.view_as(StandardOptions).runner == "DataflowRunner"
    gcp = options.view_as(GoogleCloudOptions)
    assert (gcp.project, gcp.temp_location) == ("p", "gs://b/t")


def test_graph_builds_for_remote_paths_without_running():
    """Building the graph touches no files: gs:// data and cache need no credentials here."""
    pipeline = beam.Pipeline(options=graph.pipeline_options([], num_chunks=3))
    settings = graph.WorkerSettings(data="gs://b/data", backbone="gs://b/backbone",
                                    entry="gs://b/cache/abc", batch_size=32)
    graph.build(pipeline, [("train", 0), ("train", 1), ("test", 0)], settings)
    labels = {t.unique_name for t in pipeline.to_runner_api().components.transforms.values()}
    assert {"Chunks", "SpreadChunks", "FeaturizeChunks"} <= labels
