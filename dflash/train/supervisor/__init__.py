"""The launcher's side of a training run: the torchrun command and its agent, the loopback rendezvous,
launch-time checks and checkpoint choice, watching the ranks (heartbeat, watchdog, progress) and naming
how a run ended. It also defines what the ranks write for it (heartbeat and progress records, OOM
records, environment variables): the rank package imports those, never the reverse."""
