"""Several runs of a sweep at once: local worker processes, each with its own model, sharing the sweep's --out.

The parent has already checked every run and holds --out (`launch.run_sweep`'s `claim`); it hands run names out through
a queue. Each worker (a fresh `spawn`ed interpreter: no forked torch threads) loads the model once with the sweep's
loading options and its share of the CPU threads, then runs one run at a time with `Sweep.run`, so a run checkpoints,
resumes and writes its result file exactly as it would alone (results equal a sequential sweep, tested). A signal to the
parent (SIGINT, SIGTERM) is passed on: every worker checkpoints after its current chunk and stops; the parent then
raises `Interrupted` and the same command with --resume continues every run where it stopped.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queues
import signal
import threading
import time

from h2o_stream.errors import H2OStreamError

from .interrupt import SIGNALS, Interrupted, StopRequest
from .progress import Bars, SentBars
from .sweep import run_share, write_reports


def auto_workers(runs: int, model, *, cores: int | None = None, available: int | None = None) -> int:
    """Workers for `--workers auto`: on a CPU, one per core, at most one per run and as many as the available memory
    holds a model's copy (its parameters twice over plus 512 MiB of working memory each); elsewhere 1. One thread per
    worker: the cache's many small operations gain little from a second thread (eval/results/speed/: the 1- and
    2-thread rows of the same runs), while a second worker runs a second run beside the first."""
    if model.device.type != "cpu" or runs <= 1:
        return 1
    cores = cores or os.cpu_count() or 1
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    fits = available // (2 * weights + (512 << 20))
    return max(1, min(runs, cores, fits))


def threads_per_worker(workers: int, threads: int | None) -> int:
    """Each worker's torch threads: as given, else an equal share of this machine's cores (at least 1)."""
    if threads is not None:
        return threads
    return max(1, (os.cpu_count() or 1) // workers)


def run_in_workers(sweep, loading: dict, workers: int, note=lambda text: None) -> list[dict]:
    """Run `sweep`'s runs (complete specs, already checked) in `workers` processes, a group of runs (`Sweep.groups`:
    one run unless `--rows`) at a time each; return every result in --out.

    `loading` is `load_model`'s keyword arguments (spec, dtype, device, threads). Raises Interrupted when a signal
    stopped the workers, H2OStreamError with a worker's message when a run failed."""
    context = multiprocessing.get_context("spawn")
    names, events = context.Queue(), context.Queue()
    groups = sweep.groups()
    for group in groups:
        names.put(group)
    count = min(workers, len(groups))
    for _ in range(count):
        names.put(None)
    loading = {**loading, "threads": threads_per_worker(workers, loading.get("threads"))}
    processes = [
        context.Process(target=_work, args=(index, sweep, loading, names, events), daemon=True)
        for index in range(count)
    ]
    stop = StopRequest()
    bars = Bars(leave=False)  # the workers' bars, drawn here: one line per run in progress
    with stop.catching():
        # Workers start with SIGINT/SIGTERM blocked (a new process inherits the mask) and unblock them once they can
        # checkpoint on one; a signal here meanwhile waits and is passed on below.
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            for process in processes:
                process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        note(
            f"== {len(sweep.specs)} runs on {count} workers, {loading['threads']} thread(s) each; each worker first "
            "imports torch and loads its own copy of the model"
        )
        failures, forwarded = [], False
        while any(process.is_alive() for process in processes) or not events.empty():
            if stop.signum is not None and not forwarded:  # a stop was requested: pass it on
                for process in processes:
                    if process.is_alive():
                        assert process.pid is not None  # a started process has its pid
                        os.kill(process.pid, stop.signum)
                forwarded = True
            try:
                index, kind, text = events.get(timeout=0.2)
            except queues.Empty:
                continue
            if kind == "progress":
                bars.update(*text)
            elif kind == "finished":
                bars.finish(text)
            else:
                bars.note(note, f"[worker {index}] {text}")
            if kind == "error":
                failures.append(text)
        bars.close()
        for process in processes:
            process.join()
    crashed = [p.exitcode for p in processes if p.exitcode not in (0, None)]
    results = write_reports(sweep.out)  # over every run: the workers' own reports may have raced
    if stop.signum is not None:  # a stop was requested
        raise Interrupted(stop.signum, None, None)
    if failures or crashed:
        raise H2OStreamError("; ".join(failures) or f"a worker died (exit status {crashed[0]}); rerun with --resume")
    return results


def _work(index: int, sweep, loading: dict, names, events) -> None:
    """One worker: load the model, then take groups of runs (`Sweep.groups`) until the queue's end marker (or a
    stop)."""
    # Signals come from the parent alone (a terminal's Ctrl-C would otherwise arrive twice: directly and passed on,
    # and a second signal means "stop now"); they were blocked at the start and are taken once the stop request is
    # in place, so that one arriving during start-up stops this worker before its first run.
    os.setpgrp()
    _stop_with(os.getppid())
    stop = StopRequest()

    def taken():
        while not stop.requested and (group := names.get()) is not None:
            yield group
            events.put((index, "note", f"{', '.join(group)} done"))

    try:
        with stop.catching():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
            run_share(
                sweep,
                taken(),
                loading,
                stop,
                note=lambda text: events.put((index, "note", text)),
                bars=SentBars(events, index),
            )
    except Interrupted as stopped:
        events.put((index, "stopped", str(stopped)))
    except H2OStreamError as error:
        events.put((index, "error", str(error)))


def _stop_with(parent: int) -> None:
    """Stop this worker (SIGTERM to itself: checkpoint and stop) if the parent dies, e.g. by SIGKILL."""

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()
