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
from safetensors.torch import load_file, save_file

from dflash import DFlash2DraftModel


def main() -> None:
    checkpoint, inputs_path, output_path = sys.argv[1:4]
    model, info = DFlash2DraftModel.from_pretrained(checkpoint, output_loading_info=True, dtype=torch.float32)
    model.eval()
    inputs = load_file(inputs_path)
    head = torch.nn.Linear(inputs["lm_head"].shape[1], inputs["lm_head"].shape[0], bias=False)
    head.weight.data.copy_(inputs["lm_head"])
    with torch.no_grad():
        hidden = model(position_ids=inputs["position_ids"], noise_embedding=inputs["noise_embedding"],
                       target_hidden=inputs["target_hidden"])
        logits = model.compute_logits(hidden, head)
        path, candidates, q = model.propose(hidden[:, 1:], inputs["anchor_ids"], head, 0.0)
    save_file({"logits": logits.contiguous(), "path": path.contiguous(), "candidates": candidates.contiguous()},
              output_path)
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
