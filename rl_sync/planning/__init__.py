"""Planning: pure, deterministic code from layouts to an ordered schedule, and its predictions.

`layout` (meshes, placements, boxes) -> `template` and `parts` (one tensor's transfers) ->
`plan` (every tensor's transfers) -> `bands`, `relay` and `schedule` (buckets in launch
order); `quant` adds FP8 scale tensors and `simulate` predicts a round's seconds (the planner
report behind `rl-sync plan`, which plans a synthetic model, is `rl_sync.models.plan_report`).
Nothing here imports a model, torch.distributed, CuPy or Ray, and nothing allocates device memory.
"""
