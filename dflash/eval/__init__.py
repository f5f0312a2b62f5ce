"""Evaluation by real speculative decoding: acceptance length tau and speedup.

`specdec` holds the decoding loop over a `Drafter` protocol (greedy and rejection sampling),
`prompt_lookup` the n-gram baseline, `dflash_drafter` the adapter over a trained DFlash drafter,
`evaluate` the `eval` command's work, `report` the JSON/markdown report and `plots` the PNGs.
"""
