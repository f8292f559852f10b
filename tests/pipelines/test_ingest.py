"""The ingest graph: runner options pass through, local defaults, shard planning."""

import apache_beam as beam
import numpy as np
from apache_beam.options.pipeline_options import (DirectOptions, GoogleCloudOptions,
                                                  StandardOptions, WorkerOptions)

from dpscale.pipelines import ingest as graph
from dpscale.stages import ingest as stage
from dpscale.stages.sources import parse_source, plan_source


def test_dataflow_options_pass_through_unchanged():
    args = ["--runner", "DataflowRunner", "--project", "p", "--region", "europe-west4",
            "--temp_location", "gs://bucket/tmp", "--num_workers", "7"]
    options = graph.pipeline_options(args, estimated_examples=10**6)
    assert options.view_as(StandardOptions).runner == "DataflowRunner"
    gcp = options.view_as(GoogleCloudOptions)
    assert (gcp.project, gcp.region, gcp.temp_location) == ("p", "europe-west4", "gs://bucket/tmp")
    assert options.view_as(WorkerOptions).num_workers == 7
    assert options.view_as(DirectOptions).direct_num_workers == 1  # untouched Beam default


def test_local_defaults_use_both_cores_for_large_inputs_only():
    big = graph.pipeline_options([], estimated_examples=60_000).view_as(DirectOptions)
    assert (big.direct_num_workers, big.direct_running_mode) == (2, "multi_processing")
    small = graph.pipeline_options([], estimated_examples=100)
    assert small.view_as(DirectOptions).direct_running_mode == "in_memory"
    assert small.view_as(StandardOptions).runner == graph.DEFAULT_RUNNER
    mine = graph.pipeline_options(["--direct_num_workers=3", "--direct_running_mode=multi_threading"],
                                  estimated_examples=60_000).view_as(DirectOptions)
    assert (mine.direct_num_workers, mine.direct_running_mode) == (3, "multi_threading")


def test_cli_forwards_beam_options_to_the_stage(config_from_cli, tmp_path):
    config = config_from_cli(stage, [
        "ingest", "digits", str(tmp_path), "--validation-fraction", "0.1",
        "--runner", "DataflowRunner", "--project", "p", "--", "--temp_location", "gs://b/t"])
    assert config.validation_fraction == 0.1
    options = graph.pipeline_options(config.pipeline_args, estimated_examples=10)
    assert options.view_as(StandardOptions).runner == "DataflowRunner"
    assert options.view_as(GoogleCloudOptions).project == "p"
    assert options.view_as(GoogleCloudOptions).temp_location == "gs://b/t"


def test_shards_per_split_accounts_for_validation():
    shards = graph.shards_per_split({"train": 50_000, "test": 10_000}, validation_fraction=0.1,
                                    examples_per_shard=10_000)
    assert shards == {"train": 5, "test": 1, "validation": 1}
    assert graph.shards_per_split({"train": 0}, validation_fraction=0,
                                  examples_per_shard=10) == {"train": 1}


def test_graph_builds_for_a_remote_output_without_running():
    """Graph construction touches no files, so a gs:// output needs no credentials here."""
    plan = plan_source(parse_source("digits"))
    pipeline = beam.Pipeline(options=graph.pipeline_options([], estimated_examples=1797))
    graph.build(pipeline, plan, graph.GraphSettings(
        output_dir="gs://b/out", validation_fraction=0.1, encoding="raw", num_inputs=1797,
        shards_per_split={"train": 1, "test": 1, "validation": 1}))
    labels = {t.unique_name for t in pipeline.to_runner_api().components.transforms.values()}
    assert {"ReadDecodeEncode", "GroupShards", "WriteShards", "WriteManifest"} <= labels


def test_pipeline_runs_multi_processing_with_two_workers(tmp_path):
    """The local default for big inputs (two worker processes) produces the same data."""
    args = ("--runner=FnApiRunner", "--direct_num_workers=2",
            "--direct_running_mode=multi_processing")
    one = stage.run(stage.IngestConfig("digits", str(tmp_path / "a"),
                                       pipeline_args=("--direct_running_mode=in_memory",)))
    two = stage.run(stage.IngestConfig("digits", str(tmp_path / "b"), pipeline_args=args))
    assert one.manifest == two.manifest
    assert two.num_examples["train"] + two.num_examples["test"] == 1797
    a = (tmp_path / "a" / "train-00000-of-00001.array_record").read_bytes()
    b = (tmp_path / "b" / "train-00000-of-00001.array_record").read_bytes()
    assert np.frombuffer(a, np.uint8).size > 0 and a == b  # byte-identical shards
