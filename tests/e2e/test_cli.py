"""Every command line on one flag library (absl), as a process: its `--help` names the module and
lists its own flags; `--print_config` prints the config and writes nothing."""

import json
import re

from tests.helpers import ROOT
from tests.helpers.processes import run_module

# Each CLI's own flags: its --help must list them under the module's own section (absl shows
# flags defined elsewhere, e.g. in ebpo_jax.trainer, only under --helpfull unless adopted).
OWN_FLAGS = {
  "ebpo_jax.train": {"config", "workdir", "print_config"},
  "ebpo_jax.evaluate": {"config", "workdir", "print_config", "run_dir", "step"},
  "ebpo_jax.difficulty": {"config", "print_config", "input", "output", "k", "run_dir", "step"},
  "ebpo_jax.aot": {"config", "print_config", "topology", "prompt_len"},
  "ebpo_jax.export": {"run_dir", "out", "step", "dtype"},
  "ebpo_jax.ablate": {"config", "workdir", "variants", "group_sizes", "seeds", "workers"},
  "ebpo_jax.data.prepare": {"source", "path", "out", "prompt_column", "answer_regex"},
  "ebpo_jax.data.cluster": {"input", "output", "num_clusters", "seed", "from_column"},
  "ebpo_jax.simulate": {"num_prompts", "group_sizes", "steps", "rewards", "decay", "json"},
  "ebpo_jax.models.convert": {"gguf", "out", "dtype"},
}


def own_section(help_text: str, module: str) -> set[str]:
  """The flag names listed under the module's own file in absl's --help."""
  path = module.replace(".", "/")
  path += "/__main__.py" if (ROOT / path / "__main__.py").exists() else ".py"  # a package's main
  section = help_text.split(path + ":", 1)[1].split("\n\n", 1)[0]
  return set(re.findall(r"^  --(?:\[no\])?(\w+)", section, re.MULTILINE))


def test_every_cli_help_names_the_module_and_lists_its_own_flags():
  # All at once: each is mostly imports (about 2 s alone).
  procs = {m: run_module(m, "--help", devices=1, wait=False) for m in OWN_FLAGS}
  for module, proc in procs.items():
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err
    assert proc.returncode == 0, (module, proc.returncode)  # asked for help: not a failure
    assert f"python -m {module} " in out, out[:500]  # the usage line, not `usage: convert.py`
    missing = OWN_FLAGS[module] - own_section(out, module)
    assert not missing, (module, missing)


def test_print_config_of_evaluate_difficulty_and_aot_prints_the_config_and_writes_nothing(tmp_path):
  workdir = tmp_path / "eval"
  extra = {
    "ebpo_jax.evaluate": [f"--workdir={workdir}"],
    "ebpo_jax.difficulty": [f"--input={tmp_path}/rows.jsonl", f"--output={tmp_path}/out.jsonl"],
    "ebpo_jax.aot": ["--topology=v5p-8"],
  }
  args = ["--config=configs/arith_ebpo.py:runlocal", "--config.seed=3", "--print_config"]
  procs = {m: run_module(m, *args, *more, devices=1, wait=False) for m, more in extra.items()}
  for module, proc in procs.items():
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (module, err[-2000:])
    printed = json.loads(out)  # nothing but the JSON on stdout
    assert printed["seed"] == 3 and printed["task"]["name"] == "arithmetic", module
  assert sorted(p.name for p in tmp_path.iterdir()) == []  # no eval.json, no rows written
