"""The DFlash drafter: model (layers, KV injection, block forward), attention masks and
backends, the loss, anchor sampling, target taps (which layers, how they are captured), the
draft vocabulary and the checkpoint format."""
