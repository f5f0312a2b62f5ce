"""What runs inside each torchrun worker: the process group and FSDP2 (`parallel`), the training state
(`setup`), the step, data, validation, the agreed micro-batch, checkpoints and fault injection."""
