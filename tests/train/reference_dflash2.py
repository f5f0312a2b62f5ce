"""Runs INSIDE the reference venv (dflash 0.1.0 + its transformers): the reference
`DFlash2DraftModel` loads a checkpoint directory through its own `from_pretrained` (its codebook
key mapping included) and drafts one block, greedy, for given inputs.

argv: CHECKPOINT_DIR INPUTS.safetensors OUTPUT.safetensors; writes the unary logits of every
block slot, the selector's path and its candidates (slots 1..B-1); prints a JSON line with the
loading info (missing / unexpected / mismatched keys) and what the reference read from config.json.
"""
import json
import sys

import torch
from reference_logits import draft_block  # beside this script: sys.path[0]
from safetensors.torch import save_file

from dflash import DFlash2DraftModel


def main() -> None:
    model, info, inputs, head, hidden, logits = draft_block(DFlash2DraftModel)
    with torch.no_grad():
        path, candidates, q = model.propose(hidden[:, 1:], inputs["anchor_ids"], head, 0.0)
    save_file({"logits": logits.contiguous(), "path": path.contiguous(), "candidates": candidates.contiguous()},
              sys.argv[3])
    selector = model.candidate_selector
    print(json.dumps({
        "loading_info": {key: sorted(map(str, value)) for key, value in info.items()},
        "q": q is not None,
        "block_size": model.block_size, "mask_token_id": model.mask_token_id,
        "target_layer_ids": list(model.target_layer_ids),
        "top_k": selector.top_k, "rank": selector.hidden_projection.out_features,
        "conv": [[layer.attention_conv.kernel_size, layer.attention_conv.group_size] for layer in model.layers],
        "layers": [[layer.self_attn.sliding_window, layer.self_attn.is_causal] for layer in model.layers],
    }))


if __name__ == "__main__":
    main()
