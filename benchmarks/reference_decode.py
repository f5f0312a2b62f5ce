"""Runs INSIDE the reference venv (PyPI dflash 0.1.0 + its transformers; tests/train/reference_venv.py builds
it): z-lab's own greedy speculative decoding (`dflash.model.dflash_generate`) of token-id prompts with a
drafter exported `--for reference`, recording each step's acceptance. bench_parity_three_way.py runs it.

argv: JOB.json OUT.json. JOB: {target, drafter, block_size, max_new_tokens, stop_ids, draft_vocab (target
ids of the drafter's draft vocabulary, or null), prompts: [[ids]]}. OUT: [{tokens, produced}] per prompt,
`produced` the tokens each step committed (accepted drafts + 1, cut at a stop token or the length).

Two changes around the reference's decoding: with a draft vocabulary, its draft logits are kept to those
rows (the rest set to -inf) before its argmax, as our drafter and vLLM's `d2t` head score them (the reference
has no draft vocabulary of its own); and its timer, which synchronises CUDA, reads the wall clock on a CPU.
"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

import dflash.model as zlab
from dflash.model import DFlashDraftModel, dflash_generate


def restrict_to_draft_vocab(model: DFlashDraftModel, draft_vocab: list) -> None:
    """Draft logits outside the draft vocabulary set to -inf (the instance's compute_logits wrapped)."""
    rows = torch.tensor(draft_vocab, dtype=torch.long)
    score = model.compute_logits

    def compute_logits(hidden, output_head):
        logits = score(hidden, output_head)
        kept = torch.full_like(logits, float("-inf"))
        kept[..., rows] = logits[..., rows]
        return kept

    model.compute_logits = compute_logits


def main() -> None:
    job = json.load(open(sys.argv[1], encoding="utf-8"))
    if not torch.cuda.is_available():
        zlab._cuda_time = time.perf_counter      # return_stats times its phases with a CUDA sync
    torch.set_num_threads(int(job.get("threads", 2)))
    target = AutoModelForCausalLM.from_pretrained(job["target"], dtype=torch.float32).eval()
    model = DFlashDraftModel.from_pretrained(job["drafter"], dtype=torch.float32).eval()
    if job.get("draft_vocab"):
        restrict_to_draft_vocab(model, job["draft_vocab"])
    results = []
    for ids in job["prompts"]:
        stats = dflash_generate(model, target, torch.tensor([ids]), job["max_new_tokens"], job["stop_ids"],
                                block_size=job["block_size"], return_stats=True)
        results.append({"tokens": stats.output_ids[0, len(ids):].tolist(), "produced": list(stats.acceptance_lengths)})
    json.dump(results, open(sys.argv[2], "w", encoding="utf-8"))


if __name__ == "__main__":
    main()
