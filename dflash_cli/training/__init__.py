"""Training a DFlash drafter (`dflash train`): the target's answers through the served engine (distill), its
features stored once (features), batches (data), the objective and its schedule (objective), checkpoints
(checkpoint) and the run (loop)."""
