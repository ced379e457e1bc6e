"""Several benchmark scripts run in one process, one after another, as e2e/test_bench.py runs
their smoke runs: `python -m tests.helpers.bench_runs OUT NAME [ARGS ...] [-- NAME [ARGS ...]]`.

Each `bench/NAME.py` runs as `__main__` with its own `sys.argv` (as `python bench/NAME.py ARGS`
would, bench/ first on the path); its stdout goes to OUT/NAME.out, and the traceback of a run that
raised (or exited non-zero) to OUT/NAME.err; the next one runs either way. Exit status 1 if any
failed. Benchmarks that import the same stack share one interpreter's imports and JAX's warm-up
(tracing and lowering caches): about a quarter of their CPU time when each had its own process.
"""

import contextlib
import pathlib
import resource
import runpy
import sys
import time
import traceback

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def run_one(name: str, args: list[str], out: pathlib.Path) -> bool:
  """bench/NAME.py ARGS as `__main__` (`{out}` in an argument: OUT), its stdout in OUT/NAME.out;
  whether it succeeded."""
  script = BENCH / f"{name}.py"
  sys.argv = [str(script), *(arg.replace("{out}", str(out)) for arg in args)]
  with open(out / f"{name}.out", "w") as stdout, contextlib.redirect_stdout(stdout):
    try:
      runpy.run_path(str(script), run_name="__main__")
      return True
    except SystemExit as e:  # argparse, or a benchmark's own exit
      if e.code in (None, 0):
        return True
      (out / f"{name}.err").write_text(f"SystemExit({e.code!r})\n{traceback.format_exc()}")
    except Exception:  # noqa: BLE001  (reported in NAME.err; the next benchmark still runs)
      (out / f"{name}.err").write_text(traceback.format_exc())
  return False


def split_runs(argv: list[str]) -> list[tuple[str, list[str]]]:
  """`NAME ARGS -- NAME ARGS` -> [(NAME, ARGS), ...]."""
  runs, current = [], []
  for arg in [*argv, "--"]:
    if arg == "--":
      if current:
        runs.append((current[0], current[1:]))
      current = []
    else:
      current.append(arg)
  return runs


def _cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def main() -> None:
  from ebpo_jax import process

  process.collect_garbage_less_often()  # as the entry points (13 full collections, 4 CPU-s)
  out = pathlib.Path(sys.argv[1])
  sys.path.insert(0, str(BENCH))  # as for a script in bench/: `import train_step` works
  results = []
  for name, args in split_runs(sys.argv[2:]):
    cpu, wall = _cpu_seconds(), time.perf_counter()
    results.append(run_one(name, args, out))
    cpu, wall = _cpu_seconds() - cpu, time.perf_counter() - wall
    print(f"bench/{name}.py: {cpu:.1f} CPU-s, {wall:.1f} s", file=sys.stderr, flush=True)
  sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
  main()
