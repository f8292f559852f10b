"""Minimal reproducer: Beam's time-based data-plane flush drops bytes written during a flush.

No pipeline, no workers: one ``_GrpcDataChannel`` configured as the FnApiRunner configures
the data stream to each of its gRPC workers (``multi_processing`` / ``multi_threading``:
``worker_handlers.DATA_BUFFER_TIME_LIMIT_MS = 1000``), drained by a slow reader (a worker
busy with its bundle).

``TimeBasedBufferingClosableOutputStream`` flushes from a timer thread:
``self._flush_callback(self.get()); self._clear()``. The callback puts onto a bounded send
queue (100 MB since apache-beam 2.74) and blocks while it is full, releasing the GIL; the
writing thread appends more bytes meanwhile (``write`` takes no lock); ``_clear()`` then
discards them. Elements vanish without an error.

    python benchmarks/beam_flush_race.py              # time-based flush: loses data
    python benchmarks/beam_flush_race.py --size-only  # what dpscale configures: never loses
"""

import argparse
import threading
import time

import apache_beam as beam
from apache_beam.runners.worker import data_plane


def trial(limit_ms: int, chunks: int, chunk_mb: int) -> tuple[int, int]:
    channel = data_plane._GrpcDataChannel(data_buffer_time_limit_ms=limit_ms)
    received = [0]

    def read() -> None:
        for elements in channel._write_outputs():
            received[0] += sum(len(d.data) for d in elements.data)
            time.sleep(0.5)

    reader = threading.Thread(target=read)
    reader.start()
    chunk = b"x" * (chunk_mb << 20)
    stream = channel.output_stream("bundle_1", "transform")
    for _ in range(chunks):  # what the runner does when it sends a bundle's input
        stream.write(chunk)
        time.sleep(0.1)
    stream.close()
    channel.close()
    reader.join()
    return chunks * len(chunk), received[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-only", action="store_true")
    p.add_argument("--trials", type=int, default=3)
    a = p.parse_args()
    lost_trials = 0
    for t in range(a.trials):
        sent, got = trial(0 if a.size_only else 1000, 20, 10)
        lost_trials += got < sent
        print(f"trial {t}: sent {sent >> 20} MB, received {got >> 20} MB")
    mode = "size-based" if a.size_only else "time-based (1000 ms)"
    print(f"apache-beam {beam.__version__}, {mode} flush: {lost_trials}/{a.trials} trials lost data")


if __name__ == "__main__":
    main()
