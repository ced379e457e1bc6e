"""Environments and tools: the tool-call format, ToolEnvironment's answers and counts, tool schemas,
the config's names, and bad tools in the verifier pool (raise, hang, no text, a killed worker):
each an error observation, counted, and the episodes go on."""

import pytest

from ebpo_jax import envs
from ebpo_jax.envs import tools
from ebpo_jax.errors import ConfigError
from ebpo_jax.rollouts import episodes
from ebpo_jax.tasks import rewards, tool_calls
from tests.helpers import bad_tools


def test_a_call_is_written_and_read_back():
  text = "let me compute " + tool_calls.format_call("calc", {"expression": "12*34"}) + " done"
  assert tool_calls.parse_call(text) == tool_calls.ToolCall("calc", {"expression": "12*34"})
  assert tool_calls.parse_call("408") is None
  for bad, why in [
    ('<tool_call>{"name": "calc"', "not closed"),
    ("<tool_call>{nope}</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no"),
    ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', "not an object"),
  ]:
    with pytest.raises(ValueError, match=why):
      tool_calls.parse_call(bad)


def test_the_tool_environment_answers_and_counts():
  env = envs.ToolEnvironment([tools.calc, bad_tools.raises, bad_tools.no_text])
  assert env.reset({"prompt": "12*34="}) is None
  call = lambda name, **kw: tool_calls.format_call(name, kw)
  assert env.step(call("calc", expression="123*456")) == ("<tool_response>56088</tool_response>",
                                                           None, False)  # fmt: skip
  observation, _, done = env.step(call("raises", x="a"))
  assert "error: RuntimeError: broken on a" in observation and not done
  assert "returned no text" in env.step(call("no_text", x="a"))[0]
  assert "unknown tool 'nope'" in env.step(call("nope"))[0]
  assert "not JSON" in env.step("<tool_call>{</tool_call>")[0]
  assert "error" in env.step(call("calc", expression="__import__('os')"))[0]
  assert (env.tool_calls, env.tool_errors) == (6, 5)
  assert env.step("56088") == (None, None, True)  # no call: the final answer
  env.reset({})
  assert (env.tool_calls, env.tool_errors) == (0, 0)


def test_a_tool_schema_comes_from_the_signature_and_docstring():
  schema = envs.tool_schema(tools.calc)
  assert schema["function"]["name"] == "calc"
  assert schema["function"]["description"].startswith("Evaluates an integer expression")
  assert schema["function"]["parameters"] == {
    "type": "object",
    "properties": {"expression": {"type": "string"}},
    "required": ["expression"],
  }


def _env_config(**overrides):
  return {"name": "tool", "tools": "calc", "options": {}, **overrides}


def test_environments_and_tools_are_named_in_the_config():
  assert envs.from_config(_env_config(name="")) is None
  env = envs.from_config(_env_config(tools="calc, tests.helpers.bad_tools:echo"))()
  assert [fn.__name__ for fn in env.tools] == ["calc", "echo"]
  with pytest.raises(ConfigError, match="config.env.name='nope'"):
    envs.from_config(_env_config(name="nope"))
  with pytest.raises(ConfigError, match="not an ebpo_jax.envs.Environment subclass"):
    envs.from_config(_env_config(name="tests.helpers.bad_tools:echo"))
  with pytest.raises(ConfigError, match="config.env.tools='calc, nope:fn'"):
    envs.from_config(_env_config(tools="calc, nope:fn"))
  with pytest.raises(ConfigError, match="config.env.options"):
    envs.from_config(_env_config(options={"no_such_option": 1}))


class _Encoder:
  """`PromptEncoder.observation_ids` for the host loop: one id per character."""

  def observation_ids(self, text, after_end_of_turn=True):
    return [ord(c) for c in text]


def test_bad_tools_become_counted_error_observations_and_the_episodes_go_on():
  names = ["raises", "hangs", "no_text", "kills_worker", "echo"]
  fns = [getattr(bad_tools, n) for n in names]
  trajectories = [episodes._Trajectory(envs.ToolEnvironment(fns), []) for _ in names]
  stepping = {r: tool_calls.format_call(n, {"x": "hi"}) for r, n in enumerate(names)}
  with rewards.RewardPool(1, timeout_s=1.0) as pool:
    episodes._step_envs(trajectories, stepping, pool, _Encoder(), width=80)
    again = {4: tool_calls.format_call("echo", {"x": "still here"})}  # after the killed worker
    episodes._step_envs(trajectories, again, pool, _Encoder(), width=80)
  texts = ["".join(map(chr, t.observation)) for t in trajectories]
  assert "RuntimeError: broken on hi" in texts[0]
  assert "timed out after 1 s" in texts[1]
  assert "returned no text" in texts[2]
  assert "worker died" in texts[3]
  assert texts[4] == "<tool_response>still here</tool_response>"
  assert [t.env.tool_errors for t in trajectories] == [1, 1, 1, 1, 0]
  assert all(t.live for t in trajectories)
  assert trajectories[4].transcript[-1] == ("observation", texts[4])
