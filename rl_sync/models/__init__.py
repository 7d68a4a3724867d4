"""An inference-style model written for rl-sync's tests and examples: fused
qkv and gate_up projections, column/row-parallel linears, vocab-parallel
embedding and head, expert-parallel MoE, pipeline stages (`tp_model`)."""
