"""ebpo_jax.aot: the TPU compiler's verdict on the default job (libtpu compiles for a TPU topology
on this CPU machine), layers counted once per layer, the LoRA state's dtypes on TPU chips.
The oversized case, and launch/tpu_pod.sh stopping on it, is in e2e/test_launch.py."""

import json
import textwrap

import pytest

from ebpo_jax.aot import topology as tpu_lib
from tests.helpers.processes import run_python

# ----------------------------------------------------------------------------- the TPU compiler


# e2e: the TPU compiler in a process of its own (~20 s)
def test_default_job_fits_a_v5e_2x2_slice():
  result = run_python(
    ["-m", "ebpo_jax.aot", "--config=configs/arith_ebpo.py", "--topology=v5e:2x2"]
  )
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert (report["topology"], report["chips"], report["fits"]) == ("v5e:2x2", 4, True)
  assert report["hbm_bytes_per_chip"] == tpu_lib.CHIPS["v5e"].usable_hbm_bytes
  for phase in ("train_step", "sampler"):
    assert report[phase]["bytes_per_chip"] > 0 and report[phase]["flops"] > 0
  # Donated: the state's buffers are reused for the new state, so they are not counted twice.
  assert report["train_step"]["alias_bytes"] > 0
  # auto is splash on TPU: its kernels counted from their shapes (the compiler counts ~0 FLOPs for
  # them); fsdp = 4 gathers the weights; the roofline is the slowest of compute, HBM and ICI.
  step = report["train_step"]
  assert step["kernel_flops"] > 0 and step["uncounted_kernels"] == []
  assert step["collectives"]["all-gather"]["count"] > 0 and step["collective_s"] > 0
  assert step["roofline_s"] == max(step["compute_s"], step["hbm_s"], step["collective_s"])
  # The limit from the model's shapes: the program computes at least that (no under-count). Not
  # true by construction: the numerator is the compiler's count and the kernels' bodies, no formula
  # of the limit's (`modelled` is 0 below); splash pads these 8-token rows to 128, hence ~14x.
  assert step["shared_prefix"] and step["limit_s"] > 0 and step["flops_to_limit"] >= 1
  assert step["roofline_to_limit"] == pytest.approx(step["roofline_s"] / step["limit_s"])
  assert "fits: headroom" in result.stdout and "limit from the model's shapes" in result.stdout
  # A line on stderr per compiled program, as it ends (issue 62, item 10: minutes of silence).
  for name in (
    "train step",
    "sampler call",
    "its prefill",
    "its decode step",
    "weights' conversion",
  ):
    assert f"aot: {name} compiled for 4 chips in " in result.stderr, result.stderr[-2000:]
  # The sampler: its prefill + the decode loop's trips x one step, against the bandwidth limit
  # from shapes (weights once a step, the written keys and values): never under it (~27x here:
  # the tiny model's logits and cache dominate; the paper config's is 1.25x, results/memory.md).
  sampler = report["sampler"]
  assert sampler["limit_s"] > 0 and sampler["bytes_to_limit"] >= 1
  assert sampler["roofline_s"] >= sampler["hbm_s"] >= sampler["limit_s"]
  assert sampler["decode_step"]["bytes_accessed"] * 3 <= sampler["bytes_accessed"]  # 3 steps
  # The round's weights in the decode layout: a copy per chip (fsdp = 4: replicated, 4x a shard).
  copy = sampler["rollout_layout"]["copy_bytes"]
  assert copy >= 4 * report["train_step"]["params_bytes"] * 0.99
  assert sampler["resident_bytes"] >= report["train_step"]["state_bytes"]
  assert "a decode step:" in result.stdout and "decode layout" in result.stdout
  # It decodes with the decode kernel (models.decode_attention), counted from shapes, and no
  # decode step gathers a weight (fsdp = 4 x tensor = 1: the weights replicated for the round).
  assert sampler["kernel_bytes"] > 0 and sampler["uncounted_kernels"] == []
  assert sampler["decode_step"]["weight_gathers"] == []
  # Each ratio's numerator by where it comes from (roofline.SOURCES): the kernels counted from
  # their bodies (aot.kernels: splash's mask tables and the decode kernel's written lengths), none
  # modelled by a formula; the formulas kept beside as the cross-check.
  for p in (step, sampler):
    assert sum(p["roofline_to_limit_shares"].values()) == pytest.approx(1)
    assert p["flops_sources"]["modelled"] == p["bytes_sources"]["modelled"] == 0
    assert p["bytes_sources"]["kernel_bodies"] > 0
  assert step["flops_to_limit_shares"]["kernel_bodies"] > 0
  assert sampler["bytes_to_limit_shares"]["kernel_bodies"] > 0
  assert sum(report["rl_step_roofline_shares"].values()) == pytest.approx(1)
  assert step["jaxpr_dots"]["formula_flops"] > 0
  assert result.stdout.count("[numerator:") == 3  # train step, sampler call, RL step


DECODE_KERNEL = textwrap.dedent(
  """
  import json, jax, numpy as np
  jax.config.update("jax_platforms", "cpu")
  import jax.numpy as jnp
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
  from ebpo_jax.aot import topology as tpu_lib
  from ebpo_jax.models.decode_attention import flash_decode
  devices = np.array(tpu_lib.topology_devices(tpu_lib.parse_slice("v5p:2x2x1")))
  mesh = Mesh(devices.reshape(2, 1, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
  def arg(shape, dtype, *spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
  # 4 rows, 8 q heads over 2 kv heads (G = 4), D = 128, 1000 slots: blocks of 512, the last partial
  q = arg((4, 1, 8, 128), jnp.bfloat16, "data", None, "tensor")
  k = arg((4, 2, 1000, 128), jnp.bfloat16, "data", "tensor")
  def decode(q, k, v, mask, written):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return flash_decode(q, k, v, mask, written, block=512, interpret=False)
  compiled = jax.jit(decode).lower(q, k, k, arg((4, 1000), jnp.bool_, "data"),
                                   arg((), jnp.int32)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  print(json.dumps({"bytes": cost.get("bytes accessed", 0.0), "text": compiled.as_text()}))
  """
)


# e2e: the decode kernel compiled per shard for 4 v5p chips by the TPU compiler (~15 s)
def test_decode_kernel_compiles_for_tpu_and_its_bytes_are_left_to_the_roofline():
  result = run_python(["-c", DECODE_KERNEL])
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert "tpu_custom_call" in report["text"]  # a Mosaic kernel, not an XLA fallback
  # The compiler counts about none of the 2 x 2 x 1000 x 128 x 2 = 1 MB of keys and values a
  # chip's kernel may read: aot.kernels counts them from the kernel's index maps (no double count).
  assert report["bytes"] < 0.1 * 2 * 2 * 1000 * 128 * 2


MOE_KERNEL = textwrap.dedent(
  """
  import jax, numpy as np
  jax.config.update("jax_platforms", "cpu")
  import flax.linen as nn
  import jax.numpy as jnp
  from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
  from ebpo_jax.aot import topology as tpu_lib
  from ebpo_jax.models import ModelConfig, moe
  devices = np.array(tpu_lib.topology_devices(tpu_lib.parse_slice("v5p:2x2x1")))
  mesh = Mesh(devices.reshape(2, 1, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
  config = ModelConfig(
    vocab_size=128, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=2,
    num_kv_heads=2, head_dim=128, architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=256, moe_kernel="megablox", dtype="bfloat16", param_dtype="bfloat16",
  )
  block = moe.SparseMoE(config)
  by_row = NamedSharding(mesh, P("data"))
  rows = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=by_row)
  x, mask = rows((4, 64, 256), jnp.bfloat16), rows((4, 64), jnp.bool_)
  params = nn.meta.unbox(jax.eval_shape(block.init, jax.random.key(0), x, mask))
  whole = NamedSharding(mesh, P())
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), params)
  def grads(p, x, mask):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.grad(lambda p: block.apply(p, x, mask).astype(jnp.float32).sum())(p)
  print(jax.jit(grads).lower(params, x, mask).compile().as_text().count("tpu_custom_call"))
  """
)


# e2e: a MoE block's gradient with megablox compiled per shard for 4 v5p chips (~15 s)
def test_the_megablox_experts_compile_for_tpu_as_mosaic_kernels():
  result = run_python(["-c", MOE_KERNEL])
  assert result.returncode == 0, result.stderr[-3000:]
  # 3 forward gmm, the input gradient of the down projection, the 3 weight gradients (tgmm):
  # Mosaic kernels, not an XLA fallback (the block's input takes no gradient).
  assert int(result.stdout.strip().splitlines()[-1]) == 7


LAYER_SWEEP = textwrap.dedent(
  """
  import json, jax
  jax.config.update("jax_platforms", "cpu")
  from ebpo_jax.aot import programs as aot
  from ebpo_jax.aot import topology as tpu_lib
  from ebpo_jax import cli
  out = {}
  for layers in (2, 4, 8):
    config = cli.load_config(
      "configs/arith_ebpo.py",
      # xla attention: the hand count below is of matmuls (splash pads these 8-token rows to 128)
      {"model.num_layers": layers, "model.remat": "full", "model.unroll_layers": False,
       "model.attention": "xla"},
    )
    step = aot.compile_train_step(aot.make_target(config, tpu_lib.parse_slice("v5e:2x2")))
    out[layers] = (step["flops"], step["flops_counted_once"])
  print(json.dumps(out))
  """
)


# e2e: three train-step compiles in a process of its own (~30 s)
def test_scanned_layers_are_counted_once_per_layer():
  """The compiler counts the scanned layers once: its FLOPs barely move from 2 to 8 layers. The
  corrected FLOPs grow by the same amount per layer (4 -> 8 is twice 2 -> 4), and that amount
  is about 2 x a layer's params x the tokens x 4 passes (forward, remat, backward twice)."""
  result = run_python(["-c", LAYER_SWEEP])
  assert result.returncode == 0, result.stderr[-3000:]
  flops = {int(k): v for k, v in json.loads(result.stdout.strip().splitlines()[-1]).items()}
  per_layer = (flops[4][0] - flops[2][0]) / 2
  assert (flops[8][0] - flops[4][0]) / 4 == pytest.approx(per_layer, rel=0.05)
  assert flops[8][1] - flops[2][1] < 0.1 * (flops[8][0] - flops[2][0])  # uncorrected: ~flat
  # arith_ebpo: hidden 64, 2 + 2 heads of 32, MLP 192; 32 prompts of 8 tokens (prompt bucket 8),
  # each run once for its G = 8 completions of 4 tokens (the shared-prefix step), over 4 chips.
  layer_params = 64 * 64 * 2 + 64 * 64 * 2 + 3 * 64 * 192
  tokens = 32 * 8 + 32 * 8 * 4
  assert per_layer == pytest.approx(2 * layer_params * tokens * 4 / 4, rel=0.15)


LORA_STATE = textwrap.dedent(
  """
  import json, jax
  jax.config.update("jax_platforms", "cpu")
  from ebpo_jax import advantages
  from ebpo_jax.aot import programs as aot
  from ebpo_jax.aot import topology as tpu_lib
  from ebpo_jax import cli
  from ebpo_jax.trainer import optimizer as optimizer_lib
  from ebpo_jax.trainer import state as state_lib
  out = {}
  for arg in ("qwen3_8b,ebpo_topic,g4", "qwen3_8b,ebpo_topic,g4,lora32"):
    config = cli.load_config("configs/paper.py:" + arg)
    target = aot.make_target(config, tpu_lib.parse_slice("v5p:2x2x1"))  # no weights on disk
    state = state_lib.StateSpec.from_config(config, 16).abstract(target.params)
    out[arg] = aot.state_bytes(state)
  print(json.dumps(out))
  """
)


# e2e: the 8B paper config's abstract state on 4 TPU chips, no compile (~10 s)
def test_lora_state_holds_float32_adapters_and_a_bfloat16_base():
  # configs/paper.py with lora32 has no model directory here: make_target builds its decoder from
  # the shape keys, and must still add the adapters (it once built the plain decoder).
  result = run_python(["-c", LORA_STATE])
  assert result.returncode == 0, result.stderr[-3000:]
  full, lora = json.loads(result.stdout.strip().splitlines()[-1]).values()
  # Qwen3-8B over 4 chips (fsdp 1 x tensor 4): 8.19e9 params in float32 with Adam m and v, and a
  # float32 KL reference; under LoRA the base (the same weights) in bfloat16, no reference.
  weights = 8.19e9 / 4
  assert full["params"] == pytest.approx(4 * weights, rel=0.01)
  assert full["opt_state"] == pytest.approx(2 * full["params"], rel=0.01)
  assert full["ref_params"] == full["params"] and full["base"] == 0
  assert lora["base"] == pytest.approx(2 * weights, rel=0.01)
  assert lora["ref_params"] == 0
  # rank-32 adapters on q, k, v, o, gate, up, down of 36 layers: 32 x (in + out) float32 each
  # (4096 + 4096, 4096 + 1024 twice, 4096 + 4096, 4096 + 12288 twice, 12288 + 4096), A over the
  # chips' input axis or B over the output axis: the per-chip bytes lie between /4 and /1.
  adapters = 36 * 32 * (8192 + 5120 * 2 + 8192 + 16384 * 3) * 4
  assert adapters / 4 < lora["params"] < adapters
  assert lora["opt_state"] == pytest.approx(2 * lora["params"], rel=0.01)
  assert lora["total"] < 0.25 * full["total"]


# e2e: the default job on a split v5e:2x2 (2 + 2 chips) and on all 4, synchronous (~45 s)
def test_a_split_slice_compiles_each_side_on_its_chips_and_compares_the_rl_steps():
  result = run_python(
    [
      "-m",
      "ebpo_jax.aot",
      "--config=configs/arith_ebpo.py",
      "--topology=v5e:2x2",
      "--config.mesh.rollout_devices=2",
      "--config.rl.max_staleness=1",
    ]
  )
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  split, sync = report["split"], report["synchronous"]
  assert (report["chips"], split["trainer_chips"], split["sampler_chips"]) == (4, 2, 2)
  assert report["mesh"]["fsdp"] == 2 and report["sampler_mesh"]["data"] == 2
  assert set(split["trainer_devices"]).isdisjoint(split["sampler_devices"])
  assert sync["chips"] == 4 and sync["mesh"]["fsdp"] == 4 and "split" not in sync
  train, sampler = report["train_step"], report["sampler"]
  # Each side's costs are per chip of its own: the limit's FLOPs over 2 chips, not the slice's 4.
  assert train["limit_flops"] == pytest.approx(2 * sync["train_step"]["limit_flops"])
  # The sampler's side holds no train state: only the step's rollouts wait beside its call.
  assert sampler["resident_bytes"] < sync["sampler"]["resident_bytes"]
  # The transfer: each sampler chip receives the whole float32 params (fsdp = 1 on its side),
  # over the 2 links between the halves (v5e: 4 links of 200 / 4 GB/s a chip), or its own links.
  per_chip = split["transfer_bytes_per_chip"]
  assert per_chip >= 4 * sync["train_step"]["params_bytes"] * 0.99
  assert split["transfer_bytes"] == 2 * per_chip and split["cut_links"] == 2
  link = tpu_lib.CHIPS["v5e"].ici_bandwidth / 4
  assert split["transfer_s"] == pytest.approx(max(2 * per_chip / (2 * link), per_chip / (4 * link)))
  # k = 1: the slower side, plus the transfer; against the synchronous step on all 4 chips.
  assert split["overlapped"] and split["trainer_s"] > train["roofline_s"]  # + the params' copy
  sides = max(split["trainer_s"], split["round_s"])
  assert split["rl_step_s"] == pytest.approx(sides + split["transfer_s"])
  assert report["rl_step_roofline_s"] == split["rl_step_s"]
  assert split["speedup"] == pytest.approx(sync["rl_step_roofline_s"] / split["rl_step_s"])
  assert "split: the train step on 2 chips" in result.stdout
  assert "weight transfer (modelled)" in result.stdout
  assert "synchronous on all 4 chips" in result.stdout
