"""Everything about the machine: snapshots, checks, baselines, the CUDA probe and the bisect."""
