"""Will it fit and how fast: the TPU compiler's model of a config on a slice, on any machine.

- `programs`: the train step and a sampler call compiled for the slice from abstract sharded
  inputs; memory per chip, costs and the RL step's roofline (`check`).
- `split`: a slice split between the trainer and the sampler (`mesh.rollout_devices`): each side
  compiled on its own chips, the weight transfer between them, the asynchronous RL step against
  the synchronous one on the whole slice.
- `roofline`: FLOPs, HBM bytes and collectives per chip corrected for what the compiler's cost
  analysis misses (loop trip counts, Pallas kernels), where each number comes from, and the limits
  counted from the model's shapes.
- `kernels`: a Pallas kernel's FLOPs and HBM bytes counted from its body, grid and index maps,
  its prefetched scalars followed through the program.
- `formulas`: the kernels' hand formulas from shapes, only a cross-check of the counts.
- `collectives`: the collectives of compiled HLO, with their bytes and time at ICI bandwidth.
- `topology`: TPU slices and chips (names, HBM, peak FLOPs and bandwidths) and their devices.
- `report`: the human-readable summary `python -m ebpo_jax.aot` prints before its JSON line.

A model, not a measurement: nothing here runs on a TPU.
"""
