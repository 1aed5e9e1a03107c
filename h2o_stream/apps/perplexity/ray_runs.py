"""Runs of a sweep on a Ray cluster (`--ray ADDRESS`; the optional extra: pip install "h2o-stream[ray]").

Every run (or group of runs, with --rows) is one Ray task that asks for --threads CPUs (default 1), loads the model on
whichever node it lands and runs it with `Sweep.run`, so it checkpoints, resumes and writes its result file exactly as
it would alone.
--out must be a path that every node sees (a shared filesystem): checkpoints live there, so a run stopped on one node
resumes on whichever node takes it next. Each finished run's result also comes back to this process, which writes it
into --out when the node's own file did not land there, and the report covers every run in --out. Ctrl-C / SIGTERM
here cancels the tasks: a task checkpoints after its current chunk where Ray lets it, and its last periodic
checkpoint is intact either way; the same command with --resume continues.
"""

from __future__ import annotations

import socket
from pathlib import Path

from h2o_stream.errors import H2OStreamError, one_line
from h2o_stream.files import write_json

from .interrupt import Interrupted, StopRequest
from .schema import read_result
from .sweep import run_share, write_reports

#: --ray value that starts a Ray instance on this machine for the sweep (and stops it afterwards)
LOCAL = "local"
#: seconds to wait for a cluster's port to answer before the model loads
CONNECT_TIMEOUT = 5.0


def check_address(address: str) -> None:
    """Refuse, before any model loads, a --ray address that cannot work: not `auto`, `local`, `ray://HOST:PORT` or
    `HOST:PORT`, or a host and port where nothing answers (Ray itself keeps retrying such an address). `auto` is left
    to Ray, which answers at once when no cluster runs here."""
    if address in (LOCAL, "auto"):
        return
    scheme, _, rest = address.rpartition("://")
    host, colon, port = rest.rpartition(":")
    if scheme not in ("", "ray") or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise H2OStreamError(
            f"--ray {address!r} is not a Ray address: use auto, local, ray://HOST:PORT (a Ray "
            "client server) or HOST:PORT (a cluster's head node)"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as error:
        reason = "no answer" if isinstance(error, TimeoutError) else (error.strerror or str(error))
        raise H2OStreamError(
            f"cannot reach a Ray cluster at {address!r} ({reason} within {CONNECT_TIMEOUT:g} s)"
        ) from None


def run_on_ray(sweep, loading: dict, address: str, note=lambda text: None) -> list[dict]:
    """Run `sweep`'s runs (complete specs, already checked) as Ray tasks on the cluster at `address` ("auto", a
    "ray://host:port" client address, or "local"); return every result in --out. Raises Interrupted when a signal
    stopped the sweep, H2OStreamError with a run's message when one failed."""
    try:
        import ray
    except ImportError:
        raise H2OStreamError('--ray needs Ray: pip install "h2o-stream[ray]"') from None
    threads = loading.get("threads") or 1
    loading = {**loading, "threads": threads}
    started_here = not ray.is_initialized()
    if started_here:
        try:
            ray.init(address=None if address == LOCAL else address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise H2OStreamError(f"cannot reach a Ray cluster at {address!r}: {error}") from None
    try:
        task = ray.remote(num_cpus=threads, max_retries=0)(_run_one)
        pending = {task.remote(sweep, names, loading): ", ".join(names) for names in sweep.groups()}
        note(f"== {len(sweep.specs)} runs as {len(pending)} Ray tasks of {threads} CPU(s) each")
        failures, stop, cancelled = [], StopRequest(), False
        with stop.catching():
            while pending:
                if stop.requested and not cancelled:
                    for ref in pending:
                        ray.cancel(ref)
                    cancelled = True
                done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                for ref in done:
                    name = pending.pop(ref)
                    try:
                        kind, notes, results = ray.get(ref)
                    except (ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError) as error:
                        kind, notes, results = ("stopped" if cancelled else "error"), [one_line(error)], {}
                    for text in notes:
                        note(f"[{name}] {text}")
                    if kind == "error":
                        failures.append(f"{name}: {notes[-1] if notes else 'failed'}")
                    for run_name, result in results.items():
                        _gather(Path(sweep.out) / f"{run_name}.json", result)
    finally:
        if started_here:
            ray.shutdown()
    results = write_reports(sweep.out)
    if stop.signum is not None:  # a stop was requested
        raise Interrupted(stop.signum, None, None)
    if failures:
        raise H2OStreamError("; ".join(failures))
    return results


def _gather(path: Path, result: dict) -> None:
    """Write a run's result into --out unless the node already did (a shared filesystem)."""
    if not path.exists():
        write_json(path, result)


def _run_one(sweep, names: list[str], loading: dict) -> tuple[str, list[str], dict[str, dict]]:
    """One group of runs (`Sweep.groups`), in a Ray worker: ("done" | "stopped" | "error", its notes, each finished
    run's result by name)."""
    notes: list[str] = []
    stop = StopRequest()
    try:
        with stop.catching():
            run_share(sweep, [names], loading, stop, note=notes.append)
    except Interrupted as stopped:
        return "stopped", [*notes, str(stopped)], {}
    except H2OStreamError as error:
        return "error", [*notes, str(error)], {}
    return "done", notes, {name: read_result(Path(sweep.out) / f"{name}.json") for name in names}
