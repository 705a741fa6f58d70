"""The tuning service under load, on loopback, against a real ``python -m distune.tuning_service``.

Three parts (``--parts``, default all):

- ``throughput``: requests per second and p50/p99 latency of ``report``, ``hyperparameters``
  and ``status`` with 1, 16 and 64 concurrent clients, each a closed loop (send, wait for
  the answer, send again) on its own keep-alive connection, one model per client. The
  service measures its sessions for a day of reported time, so every report is an ordinary
  window (none finishes a sample): the request path, without Gaussian-process fits.
- ``memory``: the service's resident memory (RSS, from /proc) every 10,000 of 100,000 reports
  spread over 64 models whose samples never end by time (a day each), the case where a
  session's window history would grow without bound.
- ``load`` (issue 6): 64 clients, one model each, each reporting a 0.1 s window and polling
  its hyperparameters at 10 Hz for 30 s, plus 4 status readers at 10 Hz. The models tune for
  real (2 s warmup, 2 s samples, so Gaussian-process fits happen throughout): errors,
  latencies, and RSS every second.

Clients are threads spread over a few processes, so the client side is not one GIL. On a
shared 2-core machine the clients and the service compete for the same cores; the summary
records the load average before and after.

    .venv/bin/python -m benchmarks.service_load                       # JSON summary on stdout
    .venv/bin/python -m benchmarks.service_load --parts load --load-seconds 10
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import multiprocessing
import os
import platform
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date
from typing import Any
from urllib.parse import urlsplit

from distune.launcher.service_process import TuningServiceProcess

REGISTRATION = {"world_size": 8, "nnodes": 2, "local_world_size": 4, "gradient_bytes": 2**26}
#: Service arguments of the throughput and memory parts: a sample lasts a day of reported time.
ENDLESS_SAMPLES = ["--warmup-time", "0", "--sampling-confidence-time", "86400"]
#: Service arguments of the load part: short warmup and samples, so models tune for real.
TUNING = ["--warmup-time", "2", "--sampling-confidence-time", "2"]


@dataclass(frozen=True)
class Service:
    """A running service: where it listens, its token, its process id."""

    url: str
    token: str
    pid: int
    process: TuningServiceProcess


@contextmanager
def service(args: list[str]) -> Iterator[Service]:
    """A service process on loopback with a fresh token, stopped on exit."""
    token = secrets.token_urlsafe(16)
    process = TuningServiceProcess.start(
        ["--host", "127.0.0.1", "--port", "0", "--log-level", "error", *args], token
    )
    try:
        yield Service(process.url, token, process.pid, process)
    finally:
        process.stop()


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Connection:
    """One keep-alive HTTP/1.1 connection to the service, with the bearer token."""

    def __init__(self, url: str, token: str) -> None:
        parts = urlsplit(url)
        self._host, self._port = parts.hostname, parts.port
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._connection = http.client.HTTPConnection(self._host, self._port, timeout=10)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any, float]:
        """``(status, decoded JSON or text, seconds)``; status 0 for a transport failure."""
        payload = None if body is None else json.dumps(body).encode()
        start = time.perf_counter()
        try:
            self._connection.request(method, path, payload, self._headers)
            response = self._connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as error:
            self._connection.close()
            self._connection = http.client.HTTPConnection(self._host, self._port, timeout=10)
            return 0, str(error), time.perf_counter() - start
        seconds = time.perf_counter() - start
        kind = response.headers.get("Content-Type", "")
        return response.status, json.loads(data) if "json" in kind else data, seconds

    def close(self) -> None:
        self._connection.close()


@dataclass
class Tally:
    """What one client (or all of them) saw: latencies per endpoint, statuses, errors."""

    latencies: dict[str, list[float]] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def record(self, endpoint: str, status: int, body: Any, seconds: float, ok: bool) -> None:
        self.latencies.setdefault(endpoint, []).append(seconds)
        key = f"{endpoint} {status}"
        self.statuses[key] = self.statuses.get(key, 0) + 1
        if not ok and len(self.errors) < 20:
            self.errors.append(f"{endpoint}: {status} {str(body)[:200]}")

    def merge(self, other: Tally) -> None:
        for endpoint, values in other.latencies.items():
            self.latencies.setdefault(endpoint, []).extend(values)
        for key, count in other.statuses.items():
            self.statuses[key] = self.statuses.get(key, 0) + count
        self.errors += other.errors[: max(0, 20 - len(self.errors))]

    @property
    def error_count(self) -> int:
        """Answers that are neither 200 nor a report's 409 (a stale group, which is protocol)."""
        return sum(
            count
            for key, count in self.statuses.items()
            if not (key.endswith(" 200") or key == "report 409")
        )


def summarize(latencies: list[float], seconds: float) -> dict[str, float]:
    """Requests per second and latency percentiles (milliseconds)."""
    if not latencies:
        return {"requests": 0}
    ordered = sorted(latencies)

    def percentile(p: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]

    return {
        "requests": len(ordered),
        "rps": round(len(ordered) / seconds, 1),
        "p50_ms": round(percentile(50), 2),
        "p99_ms": round(percentile(99), 2),
        "max_ms": round(1000 * ordered[-1], 2),
    }


class Model:
    """A client's model: registers, reports windows of its current group, polls it."""

    def __init__(self, connection: Connection, name: str) -> None:
        self.connection, self.name = connection, name
        self.group_id = 0
        self.bucket_size_2p = 25
        self.train_iter = 0

    def follow(self, reply: dict[str, Any]) -> None:
        """Run the group the service answered."""
        self.group_id = reply["group"]["id"]
        self.bucket_size_2p = reply["group"]["hyperparameters"]["bucket_size_2p"]

    def register(self, tally: Tally) -> None:
        status, body, seconds = self.connection.call(
            "POST", f"/api/v1/models/{self.name}/register", REGISTRATION
        )
        tally.record("register", status, body, seconds, status == 200)
        if status == 200:
            self.follow(body)

    def report(self, tally: Tally, window_seconds: float) -> None:
        # A landscape with a peak at 2^22 B, so the optimizer has something to find.
        iterations = round(20 + 40 * math.exp(-(((self.bucket_size_2p - 22) / 3) ** 2)))
        self.train_iter += iterations
        body = {
            "group_id": self.group_id,
            "train_iter": self.train_iter,
            "iterations": iterations,
            "seconds": window_seconds,
        }
        status, reply, seconds = self.connection.call(
            "POST", f"/api/v1/models/{self.name}/report", body
        )
        tally.record("report", status, reply, seconds, status in (200, 409))
        if status in (200, 409):
            self.follow(reply)

    def poll(self, tally: Tally) -> None:
        status, reply, seconds = self.connection.call(
            "GET", f"/api/v1/models/{self.name}/hyperparameters"
        )
        tally.record("hyperparameters", status, reply, seconds, status == 200)
        if status == 200:
            self.follow(reply)


def window_seconds(rng_state: int) -> float:
    """A window's reported seconds around 0.1, jittered deterministically by ``rng_state``."""
    return 0.1 * (1.0 + 0.05 * math.sin(rng_state))


def _closed_loop(url: str, token: str, name: str, endpoint: str, deadline: float) -> Tally:
    tally = Tally()
    connection = Connection(url, token)
    model = Model(connection, name)
    model.group_id = -1  # learned from the first answer
    model.poll(Tally())
    step = 0
    while time.monotonic() < deadline:
        step += 1
        if endpoint == "report":
            model.report(tally, window_seconds(step))
        elif endpoint == "hyperparameters":
            model.poll(tally)
        else:
            status, body, seconds = connection.call("GET", "/api/v1/status")
            tally.record("status", status, body, seconds, status == 200)
    connection.close()
    return tally


def _paced(
    url: str, token: str, name: str | None, hz: float, start: float, phase: float, seconds: float
) -> Tally:
    """A load-test client at ``hz`` from ``start`` (a monotonic time) for ``seconds``: report
    and poll (a model), or read the status (None). ``phase`` (a fraction of the period) spreads
    the clients' ticks, as independent jobs' are, instead of sending them all at once."""
    tally = Tally()
    connection = Connection(url, token)
    model = None if name is None else Model(connection, name)
    if model is not None:
        model.register(tally)
    period = 1.0 / hz
    tick = start + phase * period
    deadline = start + seconds
    time.sleep(max(0.0, tick - time.monotonic()))
    step = 0
    while tick < deadline:
        step += 1
        if model is None:
            status, body, seconds = connection.call("GET", "/api/v1/status")
            tally.record("status", status, body, seconds, status == 200)
        else:
            model.report(tally, window_seconds(step))
            model.poll(tally)
        tick += period
        time.sleep(max(0.0, tick - time.monotonic()))
    connection.close()
    return tally


def _run_threads(jobs: list[Callable[[], Tally]]) -> Tally:
    results: list[Tally] = []
    lock = threading.Lock()

    def run(job: Callable[[], Tally]) -> None:
        tally = job()
        with lock:
            results.append(tally)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = Tally()
    for tally in results:
        total.merge(tally)
    return total


def _process_main(jobs: list[tuple[Callable[..., Tally], tuple]], queue: Any) -> None:
    queue.put(_run_threads([lambda f=f, a=a: f(*a) for f, a in jobs]))


def run_clients(jobs: list[tuple[Callable[..., Tally], tuple]], processes: int) -> Tally:
    """Run ``jobs`` (function, arguments), one thread each, spread over ``processes``."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    shares = [jobs[i::processes] for i in range(processes)]
    workers = [
        context.Process(target=_process_main, args=(share, queue)) for share in shares if share
    ]
    for worker in workers:
        worker.start()
    total = Tally()
    for _ in workers:
        total.merge(queue.get())
    for worker in workers:
        worker.join()
    return total


def register_models(url: str, token: str, names: list[str]) -> None:
    connection = Connection(url, token)
    tally = Tally()
    for name in names:
        Model(connection, name).register(tally)
    connection.close()
    if tally.error_count:
        raise RuntimeError(f"registration failed: {tally.errors}")


def throughput(clients: list[int], duration: float, processes: int) -> dict[str, Any]:
    """The ``throughput`` part (see the module's docstring)."""
    results: dict[str, Any] = {}
    with service(ENDLESS_SAMPLES) as process:
        names = [f"model{i}" for i in range(max(clients))]
        register_models(process.url, process.token, names)
        for count in clients:
            for endpoint in ("report", "hyperparameters", "status"):
                deadline = time.monotonic() + duration
                jobs = [
                    (_closed_loop, (process.url, process.token, names[i], endpoint, deadline))
                    for i in range(count)
                ]
                tally = run_clients(jobs, min(processes, count))
                summary = summarize(tally.latencies.get(endpoint, []), duration)
                summary["errors"] = tally.error_count
                results[f"{endpoint} x{count}"] = summary
                print(f"throughput {endpoint} x{count}: {summary}", flush=True)
        results["rss_mib"] = round(rss_bytes(process.pid) / 2**20, 1)
    return results


def memory(reports: int, models: int, processes: int, every: int = 10_000) -> dict[str, Any]:
    """The ``memory`` part: RSS every ``every`` reports, spread over ``models``."""
    with service(ENDLESS_SAMPLES) as process:
        names = [f"model{i}" for i in range(models)]
        register_models(process.url, process.token, names)
        rss = {0: rss_bytes(process.pid)}
        errors = 0
        started = time.monotonic()
        for done in range(every, reports + 1, every):
            per_model = every // models
            jobs = [
                (_count_reports, (process.url, process.token, name, per_model)) for name in names
            ]
            tally = run_clients(jobs, processes)
            errors += tally.error_count
            rss[done] = rss_bytes(process.pid)
            print(f"memory: {done} reports, RSS {rss[done] / 2**20:.1f} MiB", flush=True)
        elapsed = time.monotonic() - started
    mib = {count: round(value / 2**20, 2) for count, value in rss.items()}
    half = reports // 2
    return {
        "reports": reports,
        "models": models,
        "errors": errors,
        "seconds": round(elapsed, 1),
        "rss_mib": mib,
        "growth_second_half_mib": round((rss[max(rss)] - rss[half // every * every]) / 2**20, 2),
    }


def _count_reports(url: str, token: str, name: str, count: int) -> Tally:
    tally = Tally()
    connection = Connection(url, token)
    model = Model(connection, name)
    model.poll(Tally())
    for step in range(count):
        model.report(tally, window_seconds(step))
    connection.close()
    # Only the counts travel back: a hundred thousand latencies are not needed here.
    tally.latencies = {}
    return tally


def load(seconds: float, clients: int, readers: int, hz: float, processes: int) -> dict[str, Any]:
    """The ``load`` part (issue 6): paced clients and status readers; RSS every second."""
    with service(TUNING) as process:
        # Clients register first (within two seconds), then tick with their phases spread.
        start = time.monotonic() + 2.0
        names = [f"model{i}" for i in range(clients)] + [None] * readers
        jobs = [
            (_paced, (process.url, process.token, name, hz, start, i / len(names), seconds))
            for i, name in enumerate(names)
        ]
        samples: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample_rss() -> None:
            start = time.monotonic()
            while not stop.wait(1.0):
                samples.append((time.monotonic() - start, rss_bytes(process.pid)))

        sampler = threading.Thread(target=sample_rss)
        sampler.start()
        try:
            tally = run_clients(jobs, processes)
        finally:
            stop.set()
            sampler.join()
        status = process.process.status() or {"models": {}}
    states: dict[str, int] = {}
    for entry in status["models"].values():
        states[entry["state"]] = states.get(entry["state"], 0) + 1
    rss = [value for _, value in samples]
    settled = rss[len(rss) // 3 :] or rss
    result = {
        "seconds": seconds,
        "clients": clients,
        "status_readers": readers,
        "hz": hz,
        "errors": tally.error_count,
        "error_examples": tally.errors[:5],
        "statuses": tally.statuses,
        "states": states,
        "rss_mib": {
            "first": round(rss[0] / 2**20, 1) if rss else None,
            "last": round(rss[-1] / 2**20, 1) if rss else None,
            "max": round(max(rss) / 2**20, 1) if rss else None,
            "growth_last_two_thirds": round((settled[-1] - settled[0]) / 2**20, 2) if rss else None,
        },
    }
    for endpoint, values in sorted(tally.latencies.items()):
        result[endpoint] = summarize(values, seconds)
    return result


def machine() -> dict[str, Any]:
    """Where and when: host, cores, load average."""
    return {
        "date": date.today().isoformat(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.service_load", description=__doc__)
    parser.add_argument("--parts", default="throughput,memory,load")
    parser.add_argument("--clients", default="1,16,64", help="throughput: concurrent clients")
    parser.add_argument("--duration", type=float, default=5.0, help="throughput: seconds each")
    parser.add_argument("--reports", type=int, default=100_000, help="memory: reports in all")
    parser.add_argument("--load-seconds", type=float, default=30.0)
    parser.add_argument("--load-clients", type=int, default=64)
    parser.add_argument("--status-readers", type=int, default=4)
    parser.add_argument("--hz", type=float, default=10.0, help="load: requests per client")
    parser.add_argument("--processes", type=int, default=4, help="client processes")
    parser.add_argument("--output", help="also write the JSON summary here")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {"machine_before": machine()}
    if "throughput" in parts:
        clients = [int(n) for n in args.clients.split(",")]
        result["throughput"] = throughput(clients, args.duration, args.processes)
    if "memory" in parts:
        result["memory"] = memory(args.reports, 64, args.processes)
    if "load" in parts:
        result["load"] = load(
            args.load_seconds, args.load_clients, args.status_readers, args.hz, args.processes
        )
    result["machine_after"] = machine()
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as file:
            file.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
