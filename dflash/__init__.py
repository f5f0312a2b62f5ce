"""Everything about the workload: data, generation, the DFlash drafter, training and evaluation."""
