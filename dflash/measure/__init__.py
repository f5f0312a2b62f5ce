"""Memory measured, beside the analytic model (dflash.memory) it checks and corrects: the trainer's own
step traced on fake tensors (`trace`, with the fake target and trackers in `fake`), the calibration
measured on GPUs (`gpu_calibration`) and the allocator peaks and CPU transients it reads (`peaks`).
Above the trainer, whose step it runs; the launcher's plan never imports it."""
