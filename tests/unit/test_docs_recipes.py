"""The recipes of docs/extending.md (a reward, a task, an estimator, a tool, an environment) work
as written: their
code, taken from the page, runs here with the registries patched as the recipes' one-line edits
would patch them (the trainer runs of the recipes are the e2e test of rewards.fns and
`:runlocal`)."""

import shlex
import sys
import textwrap

import jax.numpy as jnp
import numpy as np

from ebpo_jax import advantages, envs, tasks
from ebpo_jax.advantages import estimators, registry
from ebpo_jax.tasks import reward_fns
from ebpo_jax.tasks.arithmetic import score_arithmetic
from tests.helpers import ROOT

PAGE = (ROOT / "docs" / "extending.md").read_text()


def block(first_line: str) -> str:
  """The page's code (4-space indented lines) from the line after `first_line` to the next
  comment line, command or prose."""
  lines = PAGE.splitlines()
  start = next(i for i, line in enumerate(lines) if line.strip() == first_line) + 1
  out = []
  for line in lines[start:]:
    code = line.startswith("    ") or not line.strip()
    if line.startswith("    # ") or "python -m ebpo_jax" in line or not code:
      break
    out.append(line)
  return textwrap.dedent("\n".join(out)).strip() + "\n"


def command(word: str) -> list[str]:
  """The page's command (continued lines joined) that holds `word`, split as a shell would."""
  text = PAGE.replace("\\\n", " ")
  (line,) = [ln for ln in text.splitlines() if "python -m ebpo_jax.train" in ln and word in ln]
  return shlex.split(line)


def test_the_reward_recipe(tmp_path, monkeypatch):
  (tmp_path / "my_rewards.py").write_text(block("# my_rewards.py, anywhere on PYTHONPATH"))
  monkeypatch.syspath_prepend(str(tmp_path))
  (spec,) = [w.split("=", 1)[1] for w in command("brevity") if w.startswith("--config.rewards.fns")]
  task, brevity = reward_fns.load(spec)
  assert (task.name, task.weight, brevity.name, brevity.weight) == ("task", 1.0, "brevity", 0.5)
  rows = [{"answer": "12"}] * 3
  assert brevity.fn(["12", "123", ""], rows, lengths=[3, 4, 1]) == [1.0, 0.0, None]
  got = task.fn(["12", "13", ""], rows, task_score=score_arithmetic)
  assert got == [1.0, 0.0, 0.0]
  sys.modules.pop("my_rewards", None)


def test_the_task_recipe(tmp_path, monkeypatch):
  (tmp_path / "reverse_recipe.py").write_text(block("# ebpo_jax/tasks/reverse.py"))
  monkeypatch.syspath_prepend(str(tmp_path))
  entry = block("# ebpo_jax/tasks/__init__.py, in TASKS:").strip()
  assert entry == '"reverse": "ebpo_jax.tasks.reverse:ReverseTask",'
  monkeypatch.setitem(tasks.TASKS, "reverse", "reverse_recipe:ReverseTask")
  assert "--config.task.name=reverse" in command("reverse")
  task = tasks.get_task("reverse", eval_fraction=0.3)
  train, evals = task.rows("train", 40, seed=0), task.rows("eval", 10, seed=0)
  assert len(train) == 40 and len(evals) == 10
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
  assert {r["cluster"] for r in train} == {0, 1} and task.rows("train", 40, seed=0) == train
  row = train[0]
  assert task.score(row["prompt"].split()[1][:-1][::-1], row) == 1.0
  assert task.score("x", row) == 0.0
  sys.modules.pop("reverse_recipe", None)


def test_the_estimator_recipe(monkeypatch):
  namespace = dict(vars(estimators))
  exec(block("# estimators.py"), namespace)
  namespace = {**vars(registry), "_sign": namespace["_sign"]}
  exec(block("# registry.py: import _sign beside _rloo, then"), namespace)
  entry = block("# and in _SPECS:").strip().removesuffix(",")
  name, spec = entry.split(": ", 1)
  monkeypatch.setitem(registry._SPECS, eval(name), eval(spec, namespace))
  assert "--config.rl.advantage=sign" in command("sign")
  estimator = advantages.from_config({"advantage": "sign", "eps": 1e-6})
  rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
  adv, _, metrics = estimator(
    rewards, cluster_ids_b=jnp.zeros(3, jnp.int32), prior=estimator.init_prior(1)
  )
  # Means 0.5, 1, 0.25: signs of r - mean; an equal group gets 0.
  expected = [[1, -1, -1, 1], [0, 0, 0, 0], [-1, -1, -1, 1]]
  np.testing.assert_array_equal(adv, expected)
  assert metrics == {}


def test_the_tool_recipe(tmp_path, monkeypatch):
  (tmp_path / "my_tools.py").write_text(block("# my_tools.py, anywhere on PYTHONPATH"))
  monkeypatch.syspath_prepend(str(tmp_path))
  (spec,) = [w.split("=", 1)[1] for w in command("digit_sum") if w.startswith("--config.env.tools")]
  env = envs.from_config({"name": "tool", "tools": spec, "options": {}})()
  call = '<tool_call>{"name": "digit_sum", "arguments": {"number": "1234"}}</tool_call>'
  assert env.step(call) == ("<tool_response>10</tool_response>", None, False)
  assert envs.tool_schema(env.tools[1])["function"]["description"].startswith("The sum of")
  sys.modules.pop("my_tools", None)


def test_the_environment_recipe(tmp_path, monkeypatch):
  (tmp_path / "my_env.py").write_text(block("# my_env.py, anywhere on PYTHONPATH"))
  monkeypatch.syspath_prepend(str(tmp_path))
  words = command("SecondChance")
  (name,) = [w.split("=", 1)[1] for w in words if w.startswith("--config.env.name")]
  factory = envs.from_config({"name": name, "tools": "", "options": {}})
  env = factory()
  assert env.reset({"answer": "56088"}) is None
  assert env.step("5608") == (" wrong, again: ", None, False)
  assert env.step("56088") == (None, 1.0, True)
  env.reset({"answer": "7"})
  env.step("1")
  assert env.step("2") == (None, 0.0, True)
  sys.modules.pop("my_env", None)
