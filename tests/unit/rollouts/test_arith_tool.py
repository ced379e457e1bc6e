"""The arith_tool task: its warm-start transcripts call `calc` as the environment serves it, in
the share of rows asked; the tokenizer keeps the call's text; observations are out of the loss."""

import numpy as np

from ebpo_jax import envs
from ebpo_jax.envs import tools
from ebpo_jax.rollouts.prompts import PromptEncoder
from ebpo_jax.tasks import arith_tool, tool_calls


def test_demonstrations_are_what_the_tool_environment_answers():
  task = arith_tool.ArithToolTask(tool_fraction=0.3)
  rows = task.rows("train", 400, seed=0)
  with_tool = [task.target_turns(r) for r in rows if len(task.target_turns(r)) == 3]
  assert 0.22 < len(with_tool) / len(rows) < 0.38  # 0.3 by a hash of the prompt
  env = envs.ToolEnvironment([tools.calc])
  for (_, call), (_, response), (_, answer) in with_tool[:20]:
    assert env.step(call) == (response, None, False)
    assert response == tool_calls.format_response(answer)
    assert env.step(answer) == (None, None, True)
  assert task.score(answer, {"answer": answer}) == 1.0


def test_the_warm_start_trains_model_tokens_only():
  task = arith_tool.ArithToolTask(tool_fraction=0.5)
  encoder = PromptEncoder(task, task.tokenizer, (8, 16))
  rows = task.rows("train", 40, seed=1)
  ids, mask, loss_mask = encoder.targets(rows, 32)
  tok = task.tokenizer
  for row, i, m, lm in zip(rows, ids, mask, loss_mask, strict=True):
    turns = task.target_turns(row)
    text = tok.decode(i[m])
    assert text == "".join(t for _, t in turns)  # EOS ends the decoded text
    trained = tok.decode(i[lm])
    assert trained == "".join(t for role, t in turns if role == "model")
    if len(turns) == 2:  # answered directly: only the choice (the first digit) is trained
      assert turns[0] == ("model", row["answer"][:1]) and len(tok.encode(trained)) == 1
  response_open = tok.encode(tool_calls.RESPONSE_OPEN)
  assert len(response_open) == 1 and not loss_mask[ids == response_open[0]].any()
  assert loss_mask.sum() < mask.sum()


def test_the_tokenizer_keeps_tool_calls_whole_and_stops_a_turn_at_the_close_tag():
  tok = arith_tool.tool_tokenizer()
  call = tool_calls.format_call("calc", {"expression": "123*456"})
  ids = tok.encode(call)
  assert len(ids) == 9 and tok.decode(ids) == call
  assert ids[-1] in tok.stop_ids and tok.eos_id in tok.stop_ids
  assert tok.decode(tok.encode("error: é")) == "error: é"  # any text, by bytes
  assert np.all(np.array(ids) < tok.vocab_size)
