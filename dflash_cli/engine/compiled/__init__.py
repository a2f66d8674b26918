"""Compiled steps: `jit` compiles the loop's step functions at start (torch.compile; CUDA graphs on a GPU), `stored`
keeps steps compiled ahead of time (AOTInductor packages: keyed, built, stored, loaded, pruned). The target's and
the drafter's stored steps live beside their models (engine/target/compiled_step.py,
engine/drafter/compiled_step.py)."""
