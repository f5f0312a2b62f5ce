"""Online training, split by the process the code runs in: `supervisor` (the launcher process and the
torchrun agent: launch, rendezvous, watchdog, failures, resume) and `rank` (each torchrun worker: the
state, the step, checkpoints). The ranks report to the supervisor through files and variables the
supervisor defines; the supervisor never imports the rank package (tests/test_layers.py)."""
