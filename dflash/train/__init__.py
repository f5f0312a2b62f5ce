"""Online training: the launcher side (torchrun command, run dir, failures) and the rank side
(process group and collectives, state setup, the step, AutoBatch, checkpoints, feature cache)."""
