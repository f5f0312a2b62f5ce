"""Runs INSIDE the reference venv (dflash 0.1.0 + its transformers): the reference
`DFlashDraftModel` loads a checkpoint directory and computes draft logits for given inputs.

argv: CHECKPOINT_DIR INPUTS.safetensors OUTPUT.safetensors; prints a JSON line with the loading
info (missing / unexpected / mismatched keys) and what the reference read from config.json.
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file

from dflash import DFlashDraftModel


def draft_block(model_class):
    """argv's checkpoint loaded by the reference's own `from_pretrained`, and one block drafted
    from argv's inputs: (model, loading info, inputs, lm_head, hidden states, unary logits)."""
    checkpoint, inputs_path = sys.argv[1:3]
    model, info = model_class.from_pretrained(checkpoint, output_loading_info=True, dtype=torch.float32)
    model.eval()
    inputs = load_file(inputs_path)
    head = torch.nn.Linear(inputs["lm_head"].shape[1], inputs["lm_head"].shape[0], bias=False)
    head.weight.data.copy_(inputs["lm_head"])
    with torch.no_grad():
        hidden = model(position_ids=inputs["position_ids"], noise_embedding=inputs["noise_embedding"],
                       target_hidden=inputs["target_hidden"])
        logits = model.compute_logits(hidden, head)
    return model, info, inputs, head, hidden, logits


def main() -> None:
    model, info, _inputs, _head, _hidden, logits = draft_block(DFlashDraftModel)
    save_file({"logits": logits.contiguous()}, sys.argv[3])
    print(json.dumps({
        "loading_info": {key: sorted(map(str, value)) for key, value in info.items()},
        "block_size": model.block_size, "mask_token_id": model.mask_token_id,
        "target_layer_ids": list(model.target_layer_ids),
        "rope_theta": float(model.config.rope_parameters["rope_theta"]),
        "inv_freq": model.rotary_emb.inv_freq.tolist(),
        "attention_scaling": float(model.rotary_emb.attention_scaling),
        "rope_type": model.config.rope_parameters.get("rope_type", "default"),
        "layers": [[layer.self_attn.sliding_window, layer.self_attn.is_causal] for layer in model.layers],
    }))


if __name__ == "__main__":
    main()
