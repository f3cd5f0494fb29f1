"""Calibration and reports on a Dask cluster (`--cluster`): the data set cut into shards of whole batches, each
shard's forward passes on a worker, the partial results folded on the client in shard order.

Both jobs are map-reduce. What a shard returns and how the client folds it:

- calibration: the |x| histograms of the shard (calib/histogram.py `StreamingHistogram.merge`: folded to the
  larger range and added, exact and order-free) and its per-sample channel sums (added in sample order, as the
  single-process run adds them: qdeploy/calibration.py `_Collector.merge`);
- report: each batch's walks (qdeploy/reports/evaluate.py `Evaluator.walk_batch`), added batch by batch in order
  by the client (`Evaluator.add_walks`) as the single-process run adds them.

So the table and the report are byte-identical to the single-process run's (timings aside), given the same
batch size: a batch's float forward pass is the same computation wherever it runs, and neither job's sums depend
on how many threads walk a batch. The client folds each result as it arrives while the workers run the next
shards; results that finish early wait for their turn (at most `IN_FLIGHT_PER_WORKER` shards per worker are
submitted ahead). A worker that dies loses nothing: Dask recomputes its unfinished shards on another worker (the
tasks are pure).

What a worker pays once, not per shard: its imports, Numba's kernels (from the on-disk cache) and the report's
evaluator (module-level caches in qdeploy/calibration.py and qdeploy/reports/build.py). The lowered graph it does
not compute at all: the cluster starts while the client imports and lowers the model (`starting`), and the client
sends its graph to every worker (`install`); only a worker that joins later lowers the model itself. Local
workers start with glibc's malloc defaults (`_glibc_malloc_defaults`), as the single process runs. Each
worker runs one shard at a time with as many threads as it has CPUs (`threads.usable_cpus`), so the cluster to
run is one worker per machine (`dask worker --nthreads 1`), and a shard is at least `BATCHES_PER_SHARD` batches
(more when the data is large: about `SHARDS_PER_WORKER` shards per worker, so the job is shipped few times yet the
last shards still balance).

Cluster specs: `local` is one worker with every core of this machine, which is this process itself: the run
takes the single-process path and starts no Dask (so it is never slower than it). `local:N` (N at most the
usable CPUs) starts N worker processes on this machine bound to 127.0.0.1 with no dashboard, the usable CPUs
split among them (worker i pinned to the i-th of N equal runs of them: `local:2` on 2 cores is 2 workers x 1
core). `tcp://HOST:PORT` joins a running scheduler (`dask scheduler`, `dask worker`: start them with `--host
127.0.0.1` and `--no-dashboard`, their defaults listen on every interface), once the server has opened with a
Dask handshake. Every worker must run this qdeploy version
(checked before any work). Dask is imported only here, when `--cluster` is given: it is
the optional extra `pip install 'qdeploy[distributed]'`."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from qdeploy import __version__
from qdeploy_base.errors import BadInput, QdeployError

IN_FLIGHT_PER_WORKER = 2
BATCHES_PER_SHARD = 4
SHARDS_PER_WORKER = 8


def _worker_version() -> str:
    import qdeploy

    return qdeploy.__version__


SPEC_FORMS = "local, local:N (1 <= N <= the usable CPUs) or tcp://HOST:PORT"
PROBE_SECONDS = 5  # a Dask server sends its handshake as soon as it accepts a connection
MAX_HANDSHAKE_BYTES = 1 << 16  # a Dask handshake is a few hundred bytes of msgpack


@dataclass(frozen=True)
class ClusterSpec:
    """A parsed `--cluster` value: `workers` local worker processes (0: this process, `local`), or the scheduler
    at (host, port)."""

    text: str
    workers: int | None = None
    host: str | None = None
    port: int | None = None

    @property
    def in_process(self) -> bool:
        """`local`: the one worker with every core of this machine is this process (module docstring)."""
        return self.workers == 0


def parse_spec(spec: str) -> ClusterSpec:
    """The cluster `spec` names (module docstring), or BadInput in one line: a malformed spec, or more local
    workers than this process may use CPUs (each worker is a process of some 60 MB that starts in ~2 s, so
    local:100000 would take the machine down). Imports nothing of Dask."""
    from qdeploy_base.threads import usable_cpus

    if spec == "local" or spec.startswith("local:"):
        count = spec.partition(":")[2]
        cpus = usable_cpus()
        if not count:
            return ClusterSpec(spec, workers=0)
        if not re.fullmatch(r"[0-9]+", count) or int(count[:12]) < 1:  # ASCII digits only: '²'.isdigit()
            raise BadInput(f"--cluster {spec}: expected {SPEC_FORMS}")
        if len(count) > 12 or int(count) > cpus:
            raise BadInput(f"--cluster {spec}: {count} workers, more than the {cpus} usable CPUs of this machine "
                           f"(one worker process per CPU at most; local alone runs in this process with all {cpus})")
        return ClusterSpec(spec, workers=int(count))
    host, _, port = spec[len("tcp://"):].rpartition(":") if spec.startswith("tcp://") else ("", "", "")
    if not host or "/" in host or not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise BadInput(f"--cluster {spec}: expected {SPEC_FORMS}")
    return ClusterSpec(spec, host=host.removeprefix("[").removesuffix("]"), port=int(port))


def runs_in_process(spec: str | None) -> bool:
    """Whether `--cluster spec` runs as the single process does: no spec, or `local` (module docstring)."""
    return spec is None or parse_spec(spec).in_process


def _probe_scheduler(spec: ClusterSpec) -> None:
    """BadInput unless the server at spec's address opens with what a Dask handshake starts with: an 8-byte
    little-endian length of at most MAX_HANDSHAKE_BYTES, within PROBE_SECONDS. Dask's client reads that
    length and allocates it before any check: an HTTP server's reply 'HTTP/1.1 ...' read as a length asks for
    3 EiB (a MemoryError), a smaller garbage length would allocate and wait."""
    try:
        probe = socket.create_connection((spec.host, spec.port), timeout=PROBE_SECONDS)
    except OSError as error:  # refused, unreachable, no such host, or no answer within PROBE_SECONDS
        raise BadInput(f"--cluster {spec.text}: cannot reach the scheduler ({error.strerror or error})") from None
    head = b""
    with probe:
        try:
            while len(head) < 8 and (chunk := probe.recv(8 - len(head))):
                head += chunk
        except TimeoutError:
            raise BadInput(f"--cluster {spec.text}: the server sent no Dask handshake within {PROBE_SECONDS} s "
                           f"(not a Dask scheduler, or not answering)") from None
        except OSError as error:
            raise BadInput(f"--cluster {spec.text}: the connection failed ({error.strerror or error})") from None
    if len(head) < 8:
        raise BadInput(f"--cluster {spec.text}: the server closed the connection without a Dask handshake "
                       f"(not a Dask scheduler)")
    (length,) = struct.unpack("<Q", head)
    if not 0 < length <= MAX_HANDSHAKE_BYTES:
        raise BadInput(f"--cluster {spec.text}: the server does not speak Dask's protocol (its first message "
                       f"declares {length:,} bytes; a Dask handshake has a few hundred)")


@contextlib.contextmanager
def connect(spec: str) -> Iterator[Any]:
    """A dask.distributed Client for `spec` (module docstring), closed (and a local cluster stopped) on exit.
    The spec is checked before Dask is imported (parse_spec); a tcp:// address must answer as a Dask scheduler
    (_probe_scheduler) before Dask's client reads from it."""
    parsed = parse_spec(spec)
    if parsed.in_process:
        raise ValueError(f"--cluster {spec} runs in this process; check runs_in_process first")
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise BadInput(f"--cluster {spec}: Dask is not installed (pip install 'qdeploy[distributed]')") from None
    cluster = None
    if parsed.workers is not None:
        with _glibc_malloc_defaults():
            cluster = LocalCluster(n_workers=parsed.workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                   scheduler_port=0, dashboard_address=None, silence_logs=logging.ERROR)
        address = cluster
    else:
        _probe_scheduler(parsed)
        address = spec
    try:
        try:
            client = Client(address, timeout="10s")
        except (OSError, TimeoutError) as error:
            raise BadInput(f"--cluster {spec}: cannot reach the scheduler ({error})") from error
        except Exception as error:  # a server that passed the probe but not the handshake (MemoryError, msgpack)
            raise BadInput(f"--cluster {spec}: the server does not speak Dask's protocol ({type(error).__name__}: "
                           f"{error})") from error
        try:
            _check_workers(client, spec)
            if parsed.workers is not None:
                _pin_workers(client, parsed.workers)
            yield client
        finally:
            client.close()
    finally:
        if cluster is not None:
            cluster.close()


def _glibc_malloc_defaults() -> contextlib.AbstractContextManager:
    """Dask's nanny starts each worker process with MALLOC_TRIM_THRESHOLD_=65536 (its pre-spawn-environ), and glibc
    then keeps its mmap threshold at 128 KiB: every array above it is mapped fresh and unmapped when freed, so each
    of a walk's thousands of arrays page-faults its memory in again (measured: a report worker spent 14 s of
    system time on 32 images, 0.4 s per image, against 0.11 in one process). The local workers start with glibc's
    own defaults, as the single process runs."""
    import dask

    return dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None})


def _check_workers(client, spec: str) -> None:
    try:
        client.wait_for_workers(1, timeout=30)
    except TimeoutError:
        raise BadInput(f"--cluster {spec}: the scheduler has no workers") from None
    try:
        versions = client.run(_worker_version)
    except Exception as error:  # a worker that cannot import qdeploy raises there
        raise BadInput(f"--cluster {spec}: a worker cannot run qdeploy ({type(error).__name__}: {error})") from None
    for worker, version in sorted(versions.items()):
        if version != __version__:
            raise BadInput(f"--cluster {spec}: worker {worker} runs qdeploy {version}, this client {__version__}; "
                           f"every worker needs the same version")


def cpu_shares(cpus: list[int], workers: int) -> list[list[int]]:
    """`cpus` cut into `workers` runs of consecutive entries, as equal as they can be (sizes differ by one)."""
    return [cpus[len(cpus) * i // workers: len(cpus) * (i + 1) // workers] for i in range(workers)]


def _pin_this_process(cpus: list[int]) -> list[int]:
    """Pin every thread of this process (a worker) to `cpus`; the threads it starts later inherit it. Linux's
    sched_setaffinity(0) pins the calling thread only, hence each thread of /proc/self/task."""
    import os

    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)
    return sorted(os.sched_getaffinity(0))


def _pin_workers(client, workers: int) -> None:
    """Give the `workers` local worker processes disjoint shares of this process's CPUs (cpu_shares), so each
    runs its shards with the threads its share holds and none oversubscribes another's cores."""
    from qdeploy_base.threads import usable_cpus
    import os

    addresses = sorted(client.scheduler_info()["workers"])
    shares = cpu_shares(sorted(os.sched_getaffinity(0)), len(addresses))
    if len(addresses) != workers or usable_cpus() < workers:
        return  # a worker was lost at start: leave them unpinned rather than share cores unevenly
    for address, share in zip(addresses, shares):
        client.run(_pin_this_process, share, workers=[address])


@dataclass
class ShardData:
    """The data set as each worker opens it for its shard (calibration and report alike)."""

    data: object  # a path (str) or the arrays themselves
    samples: int
    preprocess: object  # calib.data.Preprocess | None
    strict: bool
    batch_size: int

    def batches(self, graph, window: tuple[int, int], warnings: list[str]) -> Iterator[tuple[int, int, dict]]:
        """(first sample, size, feeds of `graph`'s inputs) per batch of samples window[0]..window[1]-1; the
        shard's skipped images go to `warnings` at the end."""
        from calib.data import open_data
        from qdeploy.binding import bind_inputs

        source = open_data(self.data, num_samples=self.samples, input_names=graph.inputs,
                           input_shapes=[graph.tensors[n].shape for n in graph.inputs],
                           preprocess=self.preprocess, strict=self.strict)
        with contextlib.closing(source.batches(self.batch_size, window)) as batches:
            for batch in batches:
                yield batch.start, batch.size, bind_inputs(graph, batch.arrays, source.source)
        warnings.extend(source.warnings)


def shard_windows(samples: int, batch_size: int, workers: int = 1) -> list[tuple[int, int]]:
    """Sample windows [start, stop) of whole batches (the last may be short) covering 0..samples-1: BATCHES_PER_SHARD
    batches each, fewer when the data would give a worker less than two shards (measured: 128 report images in
    batches of 32 were one shard, so local:2 ran them on one worker), more when there would be over
    SHARDS_PER_WORKER shards per worker."""
    batches, workers = -(-samples // batch_size), max(1, workers)
    per_shard = max(-(-batches // (SHARDS_PER_WORKER * workers)), min(BATCHES_PER_SHARD, -(-batches // (2 * workers))))
    step = batch_size * per_shard
    return [(start, min(start + step, samples)) for start in range(0, samples, step)]


@contextlib.contextmanager
def starting(spec: str) -> Iterator[Callable[[], Any]]:
    """connect(spec) entered in a background thread, so that the cluster starts (local worker processes import
    qdeploy and load Numba's kernels) while this process imports and lowers the model; yields a function that
    waits for the client and returns it (or raises connect's BadInput). On exit the cluster is closed, after its
    start has finished, whatever the caller raised."""
    from concurrent.futures import ThreadPoolExecutor, wait

    stack = contextlib.ExitStack()
    pool = ThreadPoolExecutor(1, thread_name_prefix="qdeploy-cluster-start")
    started = pool.submit(stack.enter_context, connect(spec))
    pool.shutdown(wait=False)
    try:
        yield started.result
    finally:
        wait([started])  # a start that failed holds its error in `started` and entered nothing into the stack
        stack.close()


def install(client, function: Callable, *args) -> None:
    """Run function(*args) once on every worker now: what the client computed and each worker would otherwise
    compute again before its first shard (the lowered graph: qdeploy/calibration.py `install_lowered`). A worker
    that joins later (a dead one's replacement) computes it itself, so this only saves time."""
    client.run(function, *args)


def run_sharded(client, function: Callable, job: Any, fold: Callable[[Any], None]) -> None:
    """On the cluster of `client` (from `starting` or `connect`), run function(job, window) for every shard of
    whole batches of job.data (a ShardData) and call fold(result) in sample order: the one walk that calibration
    and the report share."""
    workers = len(client.scheduler_info()["workers"])
    map_in_order(client, function, shard_windows(job.data.samples, job.data.batch_size, workers), job, fold)


def map_in_order(client, function: Callable, windows: list[tuple[int, int]], job: Any,
                 fold: Callable[[Any], None]) -> None:
    """Run function(job, window) for every window on the cluster and call fold(result) in window order. At most
    IN_FLIGHT_PER_WORKER shards per worker are running or waiting for their turn, so memory stays bounded."""
    from distributed import as_completed

    workers = max(1, len(client.scheduler_info()["workers"]))
    limit = IN_FLIGHT_PER_WORKER * workers
    # The job goes with every shard rather than scattered once: scattered data dies with its worker, a task's
    # arguments stay with the scheduler, so a dead worker's shard can run again elsewhere.
    index_of: dict[str, int] = {}
    running = as_completed()
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        start, stop = windows[submitted]
        future = client.submit(function, job, (start, stop), key=f"qdeploy-shard-{submitted}-{start}-{stop}",
                               pure=False)
        index_of[future.key] = submitted
        running.add(future)
        submitted += 1

    waiting: dict[int, Any] = {}
    folded = 0
    while submitted < len(windows) and submitted < limit:
        submit()
    for future in running:
        index = index_of.pop(future.key)
        try:
            waiting[index] = future.result()  # a shard's own error (a BadInput about the data) is raised as is
        except QdeployError:
            raise
        except Exception as error:  # the cluster failed the shard (workers lost too often, cancelled, ...)
            start, stop = windows[index]
            raise BadInput(f"cluster: the shard of samples {start}..{stop - 1} failed ({type(error).__name__}: "
                           f"{error})") from error
        future.release()
        while folded in waiting:
            fold(waiting.pop(folded))
            folded += 1
        while submitted < len(windows) and len(index_of) + len(waiting) < limit:
            submit()
