"""A sweep launched from a command: checked, its --out locked, the model loaded, its runs run here, in local worker
processes (`workers`) or as Ray tasks (`ray_runs`).

Everything that can fail without the model (the sweep's settings, the device, the progress setting, the Ray address,
--out) fails before the model loads. A signal checkpoints every run, and `run_sweep` tells the command that resumes
before raising `Interrupted`.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING

from .interrupt import Interrupted, StopRequest
from .outdir import claim

if TYPE_CHECKING:  # imported where used: a command's --help loads no torch
    from .sweep import Sweep


def run_sweep(
    sweep: Sweep,
    specs_with_tokenizer,
    argv: list[str],
    note: Callable[[str], None],
    workers: int | None = 1,
    ray_address: str | None = None,
    resumes_as_given: bool = False,
    **loading,
) -> list[dict]:
    """Check `sweep`, lock its --out, load the model (`loading`: load_model's options), build the runs that need the
    tokenizer (`specs_with_tokenizer(tokenizer)` gives every run), check them all and run them: as Ray tasks with
    `ray_address`, else in `workers` local processes when more than one (None: `auto_workers`). `note` receives one
    line per event worth telling a user. Ctrl-C / SIGTERM checkpoint, tell `note` the command that resumes (`argv`
    with --resume, or as given for a command that always resumes: `resumes_as_given`) and raise `Interrupted`."""
    from h2o_stream.apps.progress import progress_every
    from h2o_stream.loading.models import load_model, resolve_device

    from .ray_runs import check_address, run_on_ray
    from .workers import auto_workers, run_in_workers

    sweep.check()
    progress_every()  # a bad H2O_STREAM_PROGRESS_EVERY fails before the model loads
    resolve_device(loading["device"])  # a device this machine lacks fails before --out is made
    if ray_address is not None:  # a bad address fails before the model loads, not after
        check_address(ray_address)
    with claim(sweep.out):  # before the model loads: an unwritable or busy --out fails before any work
        loaded = load_model(**loading)
        sweep.specs = specs_with_tokenizer(loaded.tokenizer)
        stop = StopRequest()
        try:
            if workers is None and len(sweep.specs) == 1:  # --workers auto with one run: all cores to it
                workers = 1
            if ray_address is not None or workers != 1:
                _, plans = sweep.check_runs(loaded.model, loaded.tokenizer, loaded.name)  # every run, before any starts
                if workers is None:  # --workers auto: from the runs (or groups of rows) left to do
                    left = {name for (name, _), plan in zip(sweep.specs, plans, strict=True) if not plan.done}
                    workers = auto_workers(
                        sum(any(name in left for name in group) for group in sweep.groups()), loaded.model
                    )
            if ray_address is not None or workers > 1:
                del loaded  # the workers (or Ray tasks) load their own
                if ray_address is not None:
                    return run_on_ray(sweep, loading, ray_address, note)
                return run_in_workers(sweep, loading, workers, note)
            with stop.catching():
                return sweep.run(loaded.model, loaded.tokenizer, loaded.name, stop=stop, note=note)
        except Interrupted as stopped:
            again = argv if resumes_as_given or "--resume" in argv else [*argv, "--resume"]
            note(f"{stopped}. Continue with:\n  {shlex.join(again)}")
            raise
