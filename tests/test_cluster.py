"""Calibration and reports on a Dask cluster (qdeploy/cluster.py, issue 23): the same table and report, byte for
byte (timings aside), as the single-process commands; exact, order-free merges; a dead worker loses nothing; a
worker of another qdeploy version is refused in one line; what qdeploy starts listens on 127.0.0.1 only."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from builders import one_line_error
from calib.histogram import StreamingHistogram
from qdeploy.cli import app

distributed = pytest.importorskip("distributed")


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def lite0(tmp_path_factory, efficientnet_lite0_onnx, real_images):
    """EfficientNet-Lite0, 12 photographs as .npy, its table and program (single process)."""
    folder = tmp_path_factory.mktemp("cluster")
    data = folder / "x.npy"
    np.save(data, np.ascontiguousarray(real_images[:12]))
    table, program = folder / "single.json", folder / "m.qdp"
    # batch 2: six batches, on two workers three shards of two (qdeploy.cluster.shard_windows)
    result = cli("calibrate", efficientnet_lite0_onnx, "--data", data, "--batch-size", "2", "-o", table)
    assert result.exit_code == 0, result.output
    assert cli("compile", efficientnet_lite0_onnx, "--calib", table, "-o", program).exit_code == 0
    return {"model": efficientnet_lite0_onnx, "data": data, "table": table, "program": program, "folder": folder}


def without_timings(path: Path) -> str:
    document = json.loads(path.read_text())
    document.pop("seconds", None)
    document.pop("command", None)
    return json.dumps(document, sort_keys=True)


def test_calibrate_and_report_on_a_local_cluster_equal_the_single_process_run(lite0):
    folder = lite0["folder"]
    result = cli("calibrate", lite0["model"], "--data", lite0["data"], "--batch-size", "2", "--cluster", "local:2",
                 "-o", folder / "cluster.json")
    assert result.exit_code == 0, result.output
    assert (folder / "cluster.json").read_bytes() == lite0["table"].read_bytes()
    for name, extra in (("single", ()), ("cluster", ("--cluster", "local:2"))):
        result = cli("report", lite0["model"], lite0["program"], "--data", lite0["data"], "--batch-size", "4",
                     "--calib", lite0["table"], *extra, "-o", folder / f"report_{name}")
        assert result.exit_code == 0, result.output
    assert without_timings(folder / "report_single" / "report.json") == \
        without_timings(folder / "report_cluster" / "report.json")
    single, clustered = ((folder / f"report_{n}" / "report.md").read_text().splitlines() for n in ("single", "cluster"))
    differing = [(a, b) for a, b in zip(single, clustered) if a != b]
    assert len(single) == len(clustered) and all("report_" in a or " s (qdeploy" in a for a, _ in differing)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DIE_ONCE = '''
"""Worker preload for the tests: the first calibration shard any worker runs kills that worker's process."""
import os
from pathlib import Path

import qdeploy.calibration as calibration

MARKER = Path(os.environ["QDEPLOY_TEST_DIE_MARKER"])
# Dask may run a preload module more than once in a worker: wrap the original function, not a wrapper.
_shard = getattr(calibration, "_unwrapped_calibrate_shard", calibration.calibrate_shard)
calibration._unwrapped_calibrate_shard = _shard


def calibrate_shard(job, window):
    if not MARKER.exists():
        MARKER.write_text(str(window))
        os._exit(1)
    return _shard(job, window)


calibration.calibrate_shard = calibrate_shard
'''

OTHER_VERSION = '''
import qdeploy
qdeploy.__version__ = "0.0.0-other"
'''


class DaskCluster:
    """`dask scheduler` on 127.0.0.1 and `dask worker` processes, as a user starts them."""

    def __init__(self, folder: Path, workers: int, preload: str | None = None, env: dict | None = None):
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        dask = str(Path(sys.executable).parent / "dask")
        environment = {**os.environ, **(env or {})}
        self.processes = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", str(self.port),
                                            "--no-dashboard"], env=environment, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL)]
        extra = []
        if preload is not None:
            script = folder / "preload_qdeploy_test.py"
            script.write_text(preload)
            extra = ["--preload", str(script)]
        for _ in range(workers):
            self.processes.append(subprocess.Popen(
                [dask, "worker", self.address, "--host", "127.0.0.1", "--no-dashboard", "--nthreads", "1", *extra],
                env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        with distributed.Client(self.address, timeout="30s") as client:
            client.wait_for_workers(workers, timeout=max(1, deadline - time.monotonic()))

    def close(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture
def dask_cli():
    if shutil.which("dask", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("the dask command is not installed beside this Python")
    started = []

    def start(folder, workers, preload=None, env=None):
        cluster = DaskCluster(folder, workers, preload, env)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.close()


def test_a_scheduler_and_two_workers_started_by_hand_and_a_worker_that_dies(lite0, tmp_path, dask_cli):
    """The first shard kills its worker (a preload script wraps the shard function); the nanny restarts it,
    Dask runs the shard again, and the table is still the single-process one."""
    marker = tmp_path / "died"
    cluster = dask_cli(tmp_path, 2, DIE_ONCE, {"QDEPLOY_TEST_DIE_MARKER": str(marker)})
    result = cli("calibrate", lite0["model"], "--data", lite0["data"], "--batch-size", "2", "--cluster",
                 cluster.address, "-o", tmp_path / "t.json")
    assert result.exit_code == 0, result.output
    assert marker.exists()  # a worker did die
    assert (tmp_path / "t.json").read_bytes() == lite0["table"].read_bytes()


def test_a_worker_of_another_version_is_one_line(lite0, tmp_path, dask_cli):
    cluster = dask_cli(tmp_path, 1, OTHER_VERSION)
    line = one_line_error(cli("calibrate", lite0["model"], "--data", lite0["data"], "--cluster", cluster.address,
                              "-o", tmp_path / "t.json"), "0.0.0-other", "same version")
    assert "worker tcp://127.0.0.1:" in line
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("spec, fragment", [("local:0", "local:N"), ("cluster9", "tcp://HOST:PORT"),
                                            ("tcp://127.0.0.1:1", "cannot reach the scheduler")])
def test_bad_cluster_specs_are_one_line(lite0, tmp_path, spec, fragment):
    one_line_error(cli("calibrate", lite0["model"], "--data", lite0["data"], "--cluster", spec,
                       "-o", tmp_path / "t.json"), f"--cluster {spec}", fragment)


def test_a_local_cluster_listens_on_loopback_only():
    from qdeploy.cluster import connect

    with connect("local:1") as client:
        info = client.scheduler_info()
        addresses = [client.scheduler.address, *info["workers"]]
        assert all(a.startswith("tcp://127.0.0.1:") for a in addresses), addresses
        ports = {str(port) for port in info.get("services", {}).values()}  # the scheduler's HTTP (dashboard) port
        if ports and shutil.which("ss"):
            listening = [line.split()[3] for line in subprocess.run(["ss", "-ltn"], capture_output=True,
                                                                    text=True).stdout.splitlines()[1:]]
            bound = [address for address in listening if address.rpartition(":")[2] in ports]
            assert bound and all(address.startswith("127.0.0.1:") for address in bound), bound


def test_histogram_merge_is_exact_and_order_free():
    rng = np.random.default_rng(0)
    for _ in range(200):
        parts = [np.abs(rng.standard_normal(rng.integers(0, 300))) * 10.0 ** rng.integers(-8, 8) * rng.integers(0, 2)
                 for _ in range(rng.integers(1, 6))]
        whole = StreamingHistogram()
        for part in parts:
            whole.update(part)
        merged = StreamingHistogram()
        for index in rng.permutation(len(parts)):
            shard = StreamingHistogram()
            shard.update(parts[index])
            merged.merge(shard)
        a, b = whole.result(), merged.result()
        assert a.amax == b.amax and np.array_equal(a.counts, b.counts)


def test_channel_sums_do_not_depend_on_batching_or_sharding(lite0):
    """Per-sample sums added in sample order: batch 3, batch 5, and shards merged give the same bits."""
    from qdeploy.calibration import ShardJob, calibrate, calibrate_shard, _Collector, lowered_graph_of, \
        calibration_tensors
    from qdeploy_base.threads import one_blas_thread

    x = np.load(lite0["data"])[:6]
    tables = [calibrate(lite0["model"], x, "kl", batch_size=b).table.to_text() for b in (3, 5)]
    graph = lowered_graph_of(str(lite0["model"]), None, False)
    names = calibration_tensors(graph)
    from qdeploy.cluster import ShardData

    job = ShardJob(str(lite0["model"]), None, False, ShardData(x, 6, None, False, 2), names)
    collector = _Collector(graph, names)
    for window in ((0, 2), (2, 6)):
        collector.merge(calibrate_shard(job, window))
    single = _Collector(graph, names)
    with one_blas_thread():  # as calibrate runs it: OpenBLAS's multi-threaded sgemm (AVX2 kernels) rounds otherwise
        single.run({graph.inputs[0]: x}, 0)
    assert tables[0] == tables[1]
    for name in names:
        assert np.array_equal(collector.channel_means().get(name, 0), single.channel_means().get(name, 0)), name
        assert np.array_equal(collector.channel_spreads().get(name, 0), single.channel_spreads().get(name, 0)), name


def test_local_workers_get_disjoint_shares_of_the_cpus():
    """local:N pins worker i to the i-th of N equal runs of the usable CPUs (qdeploy/cluster.py cpu_shares), so
    each runs its shards with its share's threads and no two share a core."""
    from qdeploy.cluster import connect, cpu_shares

    assert cpu_shares([0, 1], 2) == [[0], [1]]
    assert cpu_shares([0, 1, 2, 5, 7], 2) == [[0, 1], [2, 5, 7]]
    assert cpu_shares([3, 4, 6], 3) == [[3], [4], [6]]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one usable CPU: nothing to split")
    with connect("local:2") as client:
        pinned = client.run(lambda: sorted(os.sched_getaffinity(0)))
    assert sorted(pinned.values()) == cpu_shares(cpus, 2), pinned


def test_shards_are_whole_batches_sized_to_the_workers():
    """BATCHES_PER_SHARD batches a shard; fewer when a worker would get less than two shards, more when there would
    be over SHARDS_PER_WORKER per worker."""
    from qdeploy.cluster import BATCHES_PER_SHARD, SHARDS_PER_WORKER, shard_windows

    assert shard_windows(12, 2, 2) == [(0, 4), (4, 8), (8, 12)]
    assert shard_windows(128, 32, 2) == [(0, 32), (32, 64), (64, 96), (96, 128)]  # every worker busy
    assert shard_windows(256, 32, 2) == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert shard_windows(1024, 32, 2) == [(start, start + 128) for start in range(0, 1024, 128)]
    windows = shard_windows(100_000, 32, 4)
    assert len(windows) <= SHARDS_PER_WORKER * 4 and all((b - a) % 32 == 0 for a, b in windows[:-1])
    assert windows[0][0] == 0 and windows[-1][1] == 100_000
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:]))
    assert all(b - a >= 32 * BATCHES_PER_SHARD for a, b in windows[:-1])


def test_cluster_local_is_this_process_and_starts_no_dask(lite0, tmp_path, monkeypatch):
    """`--cluster local` is one worker with every core of this machine: this process on the single-process path
    (never slower than it), so the table is the single process's byte for byte and Dask is never connected."""
    import qdeploy.cluster as cluster

    def no_dask(spec):
        raise AssertionError("--cluster local connected to Dask")

    monkeypatch.setattr(cluster, "connect", no_dask)
    assert cluster.parse_spec("local").in_process and cluster.runs_in_process("local")
    assert not cluster.runs_in_process("local:1") and not cluster.runs_in_process("tcp://127.0.0.1:8786")
    result = cli("calibrate", lite0["model"], "--data", lite0["data"], "--batch-size", "2", "--cluster", "local",
                 "-o", tmp_path / "local.json")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "local.json").read_bytes() == lite0["table"].read_bytes()


def test_local_workers_start_with_glibc_malloc_defaults(monkeypatch):
    """Dask's nanny would start each worker with MALLOC_TRIM_THRESHOLD_=65536, which pins glibc's mmap threshold
    at 128 KiB, so every array of a walk is mapped and page-faulted fresh (a report worker spent 3x the single
    process's system time); qdeploy's local workers start without it (qdeploy/cluster.py)."""
    from qdeploy.cluster import connect

    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    with connect("local:1") as client:
        values = client.run(os.environ.get, "MALLOC_TRIM_THRESHOLD_")
    assert list(values.values()) == [None], values


def test_a_worker_walks_the_graph_the_client_sent_and_lowers_nothing(lite0, monkeypatch):
    """The client sends its lowered graph to every worker (qdeploy/cluster.py install), so a worker neither
    imports nor lowers the model again; a worker without it (a later replacement) lowers the model itself."""
    import qdeploy.calibration as calibration
    from qdeploy.cluster import ShardData
    from qdeploy.lowering.as_compiled import graph_as_compiled
    from qdeploy.program import read_program
    from qdeploy.reports import build

    model = str(lite0["model"])
    x = np.load(lite0["data"])[:4]
    graph = calibration.lowered_graph_of(model, None, False)
    names = calibration.calibration_tensors(graph)
    job = calibration.ShardJob(model, None, False, ShardData(x, 4, None, False, 2), names)
    expected = calibration.calibrate_shard(job, (0, 4))
    calibration._LOWERED.clear()

    def no_lowering(*args, **kwargs):
        raise AssertionError("a worker lowered the model again")

    monkeypatch.setattr(calibration, "import_onnx", no_lowering)
    calibration.install_lowered(calibration.calibration_key(model, None, False), graph)
    got = calibration.calibrate_shard(job, (0, 4))
    for name in names:
        empty = np.zeros(0)
        assert got.sample_sums.get(name, empty).tobytes() == expected.sample_sums.get(name, empty).tobytes(), name
        a, b = got.histograms[name].result(), expected.histograms[name].result()
        assert (a is None and b is None) or (a.amax == b.amax and np.array_equal(a.counts, b.counts)), name

    walk = build.WalkJob(model, read_program(lite0["program"]), None, ShardData(x, 4, None, False, 2))
    compiled = graph_as_compiled(graph, walk.program.manifest["options"])  # what the client sends (its stem split)
    calibration.install_lowered(build.report_graph_key(walk), compiled)
    assert calibration.installed_graph(build.report_graph_key(walk)) is compiled
    assert [start for start, _ in build.walk_shard(walk, (0, 4))] == [0, 2]
    for evaluator in build._EVALUATORS.values():
        evaluator.close()
    build._EVALUATORS.clear()
    calibration._LOWERED.clear()
    with pytest.raises(AssertionError, match="lowered the model again"):
        build.walk_shard(walk, (0, 2))
