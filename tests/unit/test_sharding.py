"""Mesh construction and logical-axis rules on 8 fake CPU devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from ebpo_jax import sharding
from ebpo_jax.models import Decoder
from tests.helpers.configs import TINY_MODEL


def test_make_mesh_fills_the_minus_one_axis():
  mesh = sharding.make_mesh({"fsdp": -1, "tensor": 2})
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}  # 8 devices / 2 = 4
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize(
  "shape, message",
  [
    ({"model": 8}, "unknown axes"),
    ({"data": 3}, "3 devices requested, 8 available"),
    ({"data": -1, "fsdp": -1}, "at most one -1"),
    ({"data": 3, "fsdp": -1}, "not divisible by 3"),
  ],
)
def test_make_mesh_rejects_bad_shapes(shape, message):
  with pytest.raises(ValueError, match=message):
    sharding.make_mesh(shape)


def test_logical_to_spec_replicates_what_does_not_divide():
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  spec = sharding.logical_to_spec((30, 576, 9, 64), ("layers", "embed", "heads", "head_dim"), mesh)
  assert spec == P(None, "fsdp", None, None)  # 9 heads do not split over tensor=2
  assert sharding.logical_to_spec((8, 5), ("batch", None), mesh) == P(("data", "fsdp"), None)
  # batch 6 splits over data=2 but not over data*fsdp=4: keeps 'data' only.
  assert sharding.logical_to_spec((6,), ("batch",), mesh) == P("data")
  # A mesh axis is used at most once per array.
  rules = (("a", "tensor"), ("b", "tensor"))
  assert sharding.logical_to_spec((4, 4), ("a", "b"), mesh, rules) == P("tensor", None)
  with pytest.raises(ValueError, match="no sharding rule"):
    sharding.logical_to_spec((4,), ("nope",), mesh)


def test_logical_shardings_of_model_params():
  model = Decoder(TINY_MODEL)
  abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
  mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
  shardings = sharding.logical_shardings(abstract, mesh)
  assert jax.tree.structure(shardings) == jax.tree.structure(nn.meta.unbox(abstract))
  assert shardings["embed_tokens"].spec == P("tensor", "fsdp")
  assert shardings["layers"]["mlp"]["down_proj"]["kernel"].spec == P(None, "tensor", "fsdp")
  assert shardings["layers"]["self_attn"]["o_proj"]["kernel"].spec == P(
    None, "tensor", None, "fsdp"
  )
  init = lambda key: nn.meta.unbox(model.init(key, jnp.zeros((1, 1), jnp.int32))["params"])
  params = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
  assert params["lm_head"].sharding.spec == P("fsdp", "tensor")


def test_row_sharding_splits_rows_over_data_and_fsdp():
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  x = jax.device_put(jnp.zeros((8, 3)), sharding.row_sharding((8, 3), mesh))
  assert {s.data.shape for s in x.addressable_shards} == {(2, 3)}
  y = jax.device_put(jnp.zeros((8, 3)), sharding.replicated(mesh))
  assert {s.data.shape for s in y.addressable_shards} == {(8, 3)}
