"""Subcommand modules (workload ones, and `profiles`). Each defines `add_arguments(parser)` and
`run(args) -> int` and keeps heavy imports inside `run`; `launcher.py` registers them."""
