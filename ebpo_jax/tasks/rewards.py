"""Scoring responses on the host: verifier calls in a process pool, each with a timeout.

A verifier call that raises, returns something other than a number in [0, 1], runs past the
timeout, or kills its worker scores 0 and is counted as an error; a hung worker is killed and a
crashed or killed one replaced, so the pool keeps working. Workers start with `forkserver` (or
`spawn`), never `fork`: the trainer process runs JAX threads, which a forked child would inherit
in an undefined state.

Reward functions (`reward_fns`: batch in, one float or None per completion out) run in the same
pool, one completion per call, under the same rules (`score_rewards`); their values may be any
finite float. They are the user's code, so they always run in workers: with `workers=0` the pool
starts one worker for them on their first call (a function that kills its interpreter kills a
worker, never the trainer), while the task's verifier still scores inline.

A function whose calls time out more times in a row than there are workers (twice with one worker
or inline) in one batch (one `score` or `score_rewards` call) is not called again in that batch:
its remaining calls score 0 and are counted, each "not called". So a function that hangs on every
input costs about two timeouts of wall time a batch, not one timeout per completion (32 x 5 s a
step at the defaults), while a function that hangs on a few inputs still scores the others.

The timeout of a call starts when the worker has unpickled it (importing the verifier's module the
first time), so slow first imports do not count; unpickling has its own, long, `start_timeout_s`.
So verifier modules should import their heavy dependencies at module level, not lazily inside
the scoring function.

`workers=0` scores the verifier inline in the calling process: exceptions still score 0 and are
counted, but a timeout is enforced only on the main thread (SIGALRM via `signal.setitimer`; it
would clash with a verifier that uses SIGALRM itself, like math-verify's own timeout), and a
verifier that kills the process kills the trainer (the built-in tasks' verifiers are this
project's code).
"""

import collections
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

ScoreFn = Callable[[str, dict[str, Any]], float]
_log = logging.getLogger(__name__)
_CONTEXTS = ("forkserver", "spawn")


class VerifierTimeout(Exception):
  """An inline verifier call ran past its timeout."""


class RewardPool:
  """Scores responses with a verifier, in `workers` processes (0: inline), `timeout_s` per call."""

  def __init__(
    self,
    workers: int,
    timeout_s: float,
    *,
    context: str = "forkserver",
    start_timeout_s: float = 120.0,
  ):
    if not isinstance(workers, int) or workers < 0:
      raise ValueError(f"workers must be an int >= 0, got {workers!r}")
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if context not in _CONTEXTS:
      raise ValueError(f"context must be one of {_CONTEXTS}, got {context!r}")
    self.timeout_s, self.start_timeout_s = float(timeout_s), float(start_timeout_s)
    self.last_errors: list[str] = []  # messages of the last `score` call's errors (first 10)
    # Held by each call (re-entrant): the workers serve one caller at a time, and a caller that
    # reads `last_errors` after its call holds it across both (concurrent sampler calls).
    self.lock = threading.RLock()
    self._ctx = multiprocessing.get_context(context)
    if context == "forkserver":
      # Keep the trainer's __main__ (and JAX) out of the fork server.
      self._ctx.set_forkserver_preload([__name__])
    self._inline = workers == 0  # the verifier inline; reward functions in a worker regardless
    self._workers = [_Worker.start(self._ctx) for _ in range(workers)]
    self._finalizer = weakref.finalize(self, _stop_all, self._workers)

  @property
  def num_workers(self) -> int:
    return len(self._workers)

  def score(
    self, score_fn: ScoreFn, responses: Sequence[str], rows: Sequence[dict[str, Any]]
  ) -> tuple[np.ndarray, int]:
    """(rewards float32 [N], number of calls that failed); failed calls score 0."""
    if len(responses) != len(rows):
      raise ValueError(f"{len(responses)} responses but {len(rows)} rows")
    calls = [(_call, (score_fn, r, row)) for r, row in zip(responses, rows, strict=True)]
    results = self._call_all(calls, [score_fn], [0] * len(calls), inline=self._inline)
    errors = self._note_errors([message for ok, _, message in results if not ok], "verifier")
    rewards = np.array([value if ok else 0.0 for ok, value, _ in results], dtype=np.float32)
    return rewards, errors

  def score_rewards(
    self,
    reward_fns: Sequence[tuple[str, Callable[..., Sequence[Any]]]],
    completions: Sequence[str],
    rows: Sequence[dict[str, Any]],
    extras: Sequence[dict[str, Any]],
  ) -> tuple[np.ndarray, np.ndarray]:
    """(values float32 [F, N], failed calls per function int [F]) of the reward functions, given
    as (name, fn) (see `reward_fns`), each called on one completion at a time:
    `fn([completions[i]], [rows[i]], **extras[i])`. None is NaN; a failed call scores 0."""
    if not len(completions) == len(rows) == len(extras):
      raise ValueError(f"{len(completions)} completions, {len(rows)} rows, {len(extras)} extras")
    calls = [
      (_call_reward, (fn, c, row, ex))
      for _, fn in reward_fns
      for c, row, ex in zip(completions, rows, extras, strict=True)
    ]
    groups = [f for f in range(len(reward_fns)) for _ in completions]
    results = self._call_all(calls, [fn for _, fn in reward_fns], groups, inline=False)
    names = [name for name, _ in reward_fns for _ in completions]
    failed = [f"{name}: {m}" for name, (ok, _, m) in zip(names, results, strict=True) if not ok]
    self._note_errors(failed, "reward function")
    errors = np.zeros(len(reward_fns), np.int64)
    np.add.at(errors, [g for g, (ok, _, _) in zip(groups, results, strict=True) if not ok], 1)
    values = [(np.nan if value is None else value) if ok else 0.0 for ok, value, _ in results]
    # float32 like the verifier's rewards: the same values after a gather over processes.
    return np.array(values, np.float32).reshape(len(reward_fns), len(completions)), errors

  def run(
    self, runner: Callable[..., tuple[bool, Any, str]], calls: Sequence[tuple]
  ) -> list[tuple[bool, Any, str]]:
    """`runner(*args)` of each of `calls` in the workers (user code: one worker is started when
    there are none), each with the pool's timeout: its `(ok, value, message)`, or `(False, None,
    why)` for a call that timed out, killed its worker or was not made (`_Breaker`). The
    environments' steps run here (`envs.step_in_worker`)."""
    results = self._call_all([(runner, args) for args in calls], [runner], [0] * len(calls),
                             inline=False)  # fmt: skip
    return [(ok, value if ok else None, message) for ok, value, message in results]

  def _call_all(
    self,
    calls: list[tuple[Callable, tuple]],
    fns: Sequence[Callable],
    groups: Sequence[int],
    *,
    inline: bool,
  ) -> list:
    """(ok, value, message) of each `runner(*args)` of `calls`, inline or in the workers (one
    started when there are none); `groups[i]`: which of `fns` call i runs (the unit that timeouts
    in a row drop, `_Breaker`)."""
    with self.lock:
      return self._call_all_locked(calls, fns, groups, inline=inline)

  def _call_all_locked(self, calls, fns, groups, *, inline: bool) -> list:
    if not self._finalizer.alive:
      raise RuntimeError("this RewardPool is closed")
    # Inline only on the main thread, where SIGALRM bounds a call (the asynchronous producer's
    # thread scores in a worker, with the same timeout).
    if inline and threading.current_thread() is threading.main_thread():
      return _run_inline(calls, self.timeout_s, _Breaker(groups, limit=2))
    for fn in fns:
      _check_picklable(fn)
    if not self._workers:  # the finalizer stops the workers of this same list
      self._workers.append(_Worker.start(self._ctx))
    breaker = _Breaker(groups, limit=len(self._workers) + 1)
    return self._run_all([pickle.dumps(call) for call in calls], breaker)

  def _note_errors(self, errors: list[str], kind: str) -> int:
    self.last_errors = errors[:10]
    if errors:
      _log.warning("%d %s calls failed; first: %s", len(errors), kind, errors[0])
    return len(errors)

  def _run_all(self, jobs: list[bytes], breaker: "_Breaker") -> list[tuple[bool, float, str]]:
    """Runs the jobs; if interrupted (e.g. Ctrl-C), replaces the busy workers before re-raising,
    so that no stale result is read by a later call."""
    busy: dict[int, _Call] = {}  # worker slot -> its current call
    try:
      return self._run(jobs, busy, breaker)
    except BaseException:
      for slot in busy:
        self._replace(slot)
      raise

  def _run(
    self, jobs: list[bytes], busy: dict[int, "_Call"], breaker: "_Breaker"
  ) -> list[tuple[bool, float, str]]:
    """Hands jobs to idle workers and collects results, killing calls past their deadline."""
    results: list[tuple[bool, float, str] | None] = [None] * len(jobs)
    pending = collections.deque(range(len(jobs)))
    idle = list(range(len(self._workers)))
    while pending or busy:
      while pending and idle:
        index = pending.popleft()
        if breaker.dropped(index):
          results[index] = breaker.NOT_CALLED
          continue
        slot = idle.pop()
        busy[slot] = self._send(slot, index, jobs[index])
      if not busy:  # the rest were not called
        continue
      now = time.monotonic()
      timeout = max(0.0, min(call.deadline for call in busy.values()) - now)
      by_conn = {self._workers[slot].conn: slot for slot in busy}
      for conn in multiprocessing.connection.wait(list(by_conn), timeout):
        slot = by_conn[conn]
        finished = self._receive(slot, busy[slot])
        if finished is not None:
          index = busy.pop(slot).index
          results[index] = finished
          breaker.note(index, timed_out=finished[2].startswith(_DIED))
          idle.append(slot)
      now = time.monotonic()
      for slot, call in list(busy.items()):
        if now >= call.deadline:
          phase = "running" if call.started else "starting"
          limit = self.timeout_s if call.started else self.start_timeout_s
          results[call.index] = (False, 0.0, f"timed out after {limit:g} s ({phase})")
          breaker.note(call.index, timed_out=True)
          self._replace(slot)
          del busy[slot]
          idle.append(slot)
    return results  # type: ignore[return-value]

  def _send(self, slot: int, index: int, job: bytes) -> "_Call":
    try:
      self._workers[slot].conn.send_bytes(job)
    except OSError:  # the worker died while idle: replace it and try once more
      self._replace(slot)
      self._workers[slot].conn.send_bytes(job)
    return _Call(index=index, deadline=time.monotonic() + self.start_timeout_s)

  def _receive(self, slot: int, call: "_Call") -> tuple[bool, float, str] | None:
    """The call's result when it has finished; None when the worker only said it started."""
    try:
      kind, value = self._workers[slot].conn.recv()
    except (EOFError, OSError):
      self._workers[slot].process.join(timeout=1)
      code = self._workers[slot].process.exitcode
      self._replace(slot)
      return False, 0.0, f"{_DIED} (exit code {code})"
    if kind == "started":
      call.started, call.deadline = True, time.monotonic() + self.timeout_s
      return None
    if kind == "ok":
      return True, value, ""
    return False, 0.0, value

  def _replace(self, slot: int) -> None:
    self._workers[slot].kill()
    self._workers[slot] = _Worker.start(self._ctx)

  def close(self) -> None:
    """Stops the workers (also done when the pool is garbage-collected or at exit)."""
    self._finalizer()

  def __enter__(self) -> "RewardPool":
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()


@dataclasses.dataclass
class _Call:
  index: int
  deadline: float
  started: bool = False


@dataclasses.dataclass
class _Worker:
  process: Any
  conn: multiprocessing.connection.Connection

  @classmethod
  def start(cls, ctx: Any) -> "_Worker":
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_worker_main, args=(child_conn,), daemon=True)
    process.start()
    child_conn.close()  # so that the worker's death reads as EOF here
    return cls(process, parent_conn)

  def kill(self) -> None:
    self.process.kill()
    self.process.join(timeout=5)
    self.conn.close()

  def stop(self) -> None:
    with contextlib.suppress(OSError):
      self.conn.send_bytes(b"")
    self.process.join(timeout=1)
    if self.process.is_alive():
      self.process.kill()
      self.process.join(timeout=5)
    self.conn.close()


def _check_picklable(score_fn: ScoreFn) -> None:
  try:
    pickle.dumps(score_fn)
  except (pickle.PicklingError, AttributeError, TypeError) as e:
    raise ValueError(
      f"the verifier {score_fn!r} cannot be sent to a worker process: use a top-level "
      f"function ({e})"
    ) from e


def _stop_all(workers: list[_Worker]) -> None:
  for worker in workers:
    worker.stop()


def _worker_main(conn: multiprocessing.connection.Connection) -> None:
  """Worker loop: receive a pickled (runner, args), say "started", run it, send the result."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
  while True:
    try:
      job = conn.recv_bytes()
    except EOFError:
      return
    if not job:
      return
    try:
      runner, args = pickle.loads(job)
    except Exception as e:
      conn.send(("error", f"cannot unpickle the call: {e!r}"))
      continue
    conn.send(("started", None))
    ok, value, message = runner(*args)
    conn.send(("ok", value) if ok else ("error", message))


def _call(score_fn: ScoreFn, response: str, row: dict[str, Any]) -> tuple[bool, float, str]:
  """(ok, reward, error message) of one verifier call."""
  try:
    value = score_fn(response, row)
  except Exception as e:
    return False, 0.0, f"{type(e).__name__}: {e}"
  if isinstance(value, bool) or not isinstance(value, int | float | np.number):
    return False, 0.0, f"verifier returned {type(value).__name__} {value!r}, not a number"
  value = float(value)
  if not (math.isfinite(value) and 0.0 <= value <= 1.0):
    return False, 0.0, f"verifier returned {value}, outside [0, 1]"
  return True, value, ""


def _call_reward(
  reward_fn: Callable[..., Sequence[Any]], completion: str, row: dict[str, Any], extras: dict
) -> tuple[bool, float | None, str]:
  """(ok, value or None, error message) of one reward function on one completion."""
  try:
    values = reward_fn([completion], [row], **extras)
  except Exception as e:
    return False, 0.0, f"{type(e).__name__}: {e}"
  if not isinstance(values, Sequence | np.ndarray) or len(values) != 1:
    return False, 0.0, f"returned {values!r}, not a list of 1 value (float or None)"
  value = values[0]
  if value is None:
    return True, None, ""
  if isinstance(value, bool) or not isinstance(value, int | float | np.number):
    return False, 0.0, f"returned {type(value).__name__} {value!r}, not a number or None"
  if not math.isfinite(value):
    return False, 0.0, f"returned {value}"
  return True, float(value), ""


_DIED = "worker died"  # a call that killed its worker (its message starts so)


class _Breaker:
  """Which calls of one batch are not made: those of a function (a group) whose last `limit`
  finished calls all timed out or killed their worker (workers + 1: a function that hangs on every
  input fills all the workers with hangs at once, while a few inputs that hang side by side do not
  drop it); each costs a worker restart."""

  def __init__(self, groups: Sequence[int], limit: int):
    self._groups, self._limit = groups, limit
    self._in_a_row: dict[int, int] = collections.Counter()  # group -> timeouts in a row
    message = f"not called: timed out or killed its worker {limit} times in a row in this batch"
    self.NOT_CALLED = (False, 0.0, message)

  def note(self, index: int, *, timed_out: bool) -> None:
    """Call `index` finished; `timed_out`: by its timeout or its worker's death."""
    group = self._groups[index]
    self._in_a_row[group] = self._in_a_row[group] + 1 if timed_out else 0

  def dropped(self, index: int) -> bool:
    return self._in_a_row[self._groups[index]] >= self._limit


def _run_inline(
  calls: list[tuple[Callable, tuple]], timeout_s: float, breaker: _Breaker
) -> list[tuple[bool, float, str]]:
  """`runner(*args)` of each call in this process, each with a SIGALRM timeout when on the main
  thread."""
  if threading.current_thread() is not threading.main_thread():
    return [runner(*args) for runner, args in calls]

  def on_alarm(signum: int, frame: Any) -> None:
    raise VerifierTimeout(f"timed out after {timeout_s:g} s")

  previous = signal.signal(signal.SIGALRM, on_alarm)
  try:
    results = []
    for index, (runner, args) in enumerate(calls):
      if breaker.dropped(index):
        results.append(breaker.NOT_CALLED)
        continue
      timed_out = False
      try:  # the alarm may also fire just after the call returns, before it is disarmed
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
          result = runner(*args)
        finally:
          signal.setitimer(signal.ITIMER_REAL, 0)
      except VerifierTimeout as e:
        result, timed_out = (False, 0.0, f"VerifierTimeout: {e}"), True
      breaker.note(index, timed_out=timed_out)
      results.append(result)
    return results
  finally:
    signal.signal(signal.SIGALRM, previous)
