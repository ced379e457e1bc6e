"""Weights & Biases for MetricsWriter: one wandb run per workdir, continued when the run resumes.

wandb is optional (`pip install 'ebpo_jax[wandb]'`) and imported only when `logging.wandb` is on.
The run's id is kept in WORKDIR/wandb_run_id, so every start on the workdir (a resume after a crash
or a SIGTERM) logs into the same wandb run (`resume="allow"`). wandb accepts only increasing steps:
the steps a resumed run does again after its checkpoint, which the dead run had already logged, keep
their first values (an exact resume logs the same values again, wall-clock times aside). Offline
(`WANDB_MODE=offline` or `logging.wandb_mode=offline`) the run is written under WORKDIR/wandb/ (or
$WANDB_DIR) for a later `wandb sync`.
"""

import dataclasses
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from ebpo_jax import files
from ebpo_jax.metrics.names import WANDB_RUN_ID_FILE

MODES = ("", "online", "offline", "disabled")
MISSING = "the wandb package is not installed (pip install -e '.[wandb]' in the checkout)"
SAMPLES_KEY = "samples"  # the key of the sample completions table


@dataclasses.dataclass(frozen=True, kw_only=True)
class WandbOptions:
  """Where and how a run logs to wandb (`config.logging.wandb_*`); "" leaves a field to wandb."""

  project: str
  entity: str = ""
  name: str = ""  # "": the workdir's base name
  tags: tuple[str, ...] = ()
  mode: str = ""  # online | offline | disabled; "": wandb's own (WANDB_MODE, else online)


def wandb_options(logging_config: ml_collections.ConfigDict) -> WandbOptions | None:
  """The wandb options of `config.logging`; None when `logging.wandb` is off."""
  lc = logging_config
  if not lc.wandb:
    return None
  tags = tuple(t.strip() for t in lc.wandb_tags.split(",") if t.strip())
  return WandbOptions(
    project=lc.wandb_project,
    entity=lc.wandb_entity,
    name=lc.wandb_run_name,
    tags=tags,
    mode=lc.wandb_mode,
  )


def require_wandb() -> None:
  """ImportError with the install line when wandb is missing."""
  try:
    import wandb  # noqa: F401
  except ImportError:
    raise ImportError(MISSING) from None


class WandbRun:
  """The wandb run of `workdir`: created, or continued when WORKDIR/wandb_run_id names one."""

  def __init__(
    self, options: WandbOptions, workdir: str | os.PathLike, config: Mapping[str, Any] | None
  ):
    require_wandb()
    import wandb

    workdir = os.fspath(workdir)
    self._wandb = wandb
    id_path = files.join(workdir, WANDB_RUN_ID_FILE)
    if files.exists(id_path):
      run_id = files.read_text(id_path).strip()
    else:
      run_id = uuid.uuid4().hex[:16]
      files.write_atomic(id_path, run_id + "\n")
    # Locally the run's files go beside the rest of the run (WORKDIR/wandb/), unless $WANDB_DIR.
    local = not files.is_remote(workdir) and not os.environ.get("WANDB_DIR")
    self.run = wandb.init(
      project=options.project,
      entity=options.entity or None,
      name=options.name or os.path.basename(os.path.normpath(workdir)),
      tags=list(options.tags) or None,
      mode=options.mode or None,
      id=run_id,
      resume="allow",
      config=dict(config or {}),
      dir=workdir if local else None,
    )
    # A continued run: steps below wandb's are dropped here rather than warned about by wandb.
    self._first_step = self.run.step if self.run.resumed else 0

  def log(self, step: int, values: Mapping[str, float]) -> None:
    if step >= self._first_step:
      self.run.log(dict(values), step=step)

  def log_table(self, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """The sample completions table of `step` (one wandb Table per logging step)."""
    if step >= self._first_step:
      table = self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])
      self.run.log({SAMPLES_KEY: table}, step=step)

  def finish(self) -> None:
    self.run.finish()
