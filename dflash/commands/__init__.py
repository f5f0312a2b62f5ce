"""Workload subcommands (see envcheck.commands for the module contract)."""
