"""Evaluation by real speculative decoding: acceptance length tau and speedup.

`specdec` holds the decoding loop over a `Drafter` protocol (greedy and rejection sampling),
`prompt_lookup` the n-gram baseline, `dflash_drafter` the adapter over a trained DFlash drafter,
`evaluate` the `eval` command's work, `report_schema` the report's records and their JSON, `report_writer`
the report built from the runs and written as JSON and markdown, and `plots` the PNGs.
"""
