"""The DFlash drafter adapter: checkpoint round trip, context = target taps of the committed prefix."""
from __future__ import annotations

import pytest
import torch

from dflash.drafter.network import _attend_all
from dflash.drafter.taps import extract_taps
from dflash.eval.dflash_drafter import DFlashDraft, load_dflash_draft
from dflash.eval.specdec import DecodeSettings, NoDrafter, TargetVerifier, speculative_decode

PROMPT = [785, 6722, 315, 9625, 374, 12095, 13]


def save_random_drafter(run_dir, target, block_size: int = 4, seed: int = 0, draft_vocab: list[int] | None = None):
    """A random-weight drafter shaped for `target`, saved as a real training checkpoint."""
    from dflash.drafter.checkpoint_files import save_checkpoint
    from dflash.drafter.network import DFlashDrafter, drafter_config
    from dflash.drafter.taps import default_target_layer_ids

    config = drafter_config(target.config, num_layers=1, block_size=block_size,
                            target_layer_ids=default_target_layer_ids(target.config.num_hidden_layers, 1),
                            mask_token_id=151669, draft_vocab_size=len(draft_vocab or []))
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).attach_target(target)
    if draft_vocab:
        drafter.set_draft_vocab(torch.tensor(draft_vocab))
    return save_checkpoint(run_dir, drafter, step=3, state={})


def target_greedy_tokens(target, prompt: list[int], count: int) -> list[int]:
    settings = DecodeSettings(block_size=4, max_new_tokens=count)
    return speculative_decode(TargetVerifier(target), NoDrafter(), prompt, settings).tokens


@pytest.fixture(scope="module")
def vocab_draft(tiny_qwen3_model, tmp_path_factory):
    """A drafter whose draft vocabulary holds the target's own greedy tokens and some others."""
    greedy = target_greedy_tokens(tiny_qwen3_model, PROMPT, 20)
    vocabulary = sorted(set(greedy) | set(range(100, 140)))
    run_dir = tmp_path_factory.mktemp("vocab-run")
    save_random_drafter(run_dir, tiny_qwen3_model, draft_vocab=vocabulary)
    return load_dflash_draft(str(run_dir / "train" / "checkpoints"), tiny_qwen3_model), vocabulary


@pytest.fixture(scope="module")
def saved_draft(tiny_qwen3_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    save_random_drafter(run_dir, tiny_qwen3_model)
    return run_dir / "train" / "checkpoints"


class RecordingDraft(DFlashDraft):
    """Records the context features the loop passes at each step."""

    def __init__(self, model):
        super().__init__(model=model)
        self.seen: list[tuple[list[int], torch.Tensor]] = []

    def propose(self, committed, features, k, temperature):
        self.seen.append((list(committed), features.clone()))
        return super().propose(committed, features, k, temperature)


def test_context_features_are_the_targets_taps_of_the_committed_prefix(tiny_qwen3_model, saved_draft):
    draft = load_dflash_draft(str(saved_draft), tiny_qwen3_model)
    recording = RecordingDraft(draft.model)
    verifier = TargetVerifier(tiny_qwen3_model, recording.layer_ids)
    speculative_decode(verifier, recording, PROMPT, DecodeSettings(block_size=4, max_new_tokens=14))
    assert len(recording.seen) >= 3
    for committed, features in recording.seen:
        expected = extract_taps(tiny_qwen3_model, torch.tensor([committed[:-1]]), recording.layer_ids)[0]
        torch.testing.assert_close(features, expected, atol=1e-4, rtol=1e-4)


def test_greedy_with_the_dflash_drafter_is_lossless(tiny_qwen3_model, saved_draft):
    draft = load_dflash_draft(str(saved_draft), tiny_qwen3_model)
    assert draft.block_size == 4 and draft.layer_ids == [2]
    settings = DecodeSettings(block_size=draft.block_size, max_new_tokens=20)
    plain = speculative_decode(TargetVerifier(tiny_qwen3_model), NoDrafter(), PROMPT, settings)
    drafted = speculative_decode(TargetVerifier(tiny_qwen3_model, draft.layer_ids), draft, PROMPT, settings)
    assert drafted.tokens == plain.tokens
    assert all(count == 3 for count in drafted.proposed)
    assert 1 <= min(drafted.taus) and max(drafted.taus) <= 4


def test_sampled_drafts_carry_their_distribution(tiny_qwen3_model, saved_draft):
    draft = load_dflash_draft(str(saved_draft), tiny_qwen3_model)
    draft.generator = torch.Generator().manual_seed(0)
    verifier = TargetVerifier(tiny_qwen3_model, draft.layer_ids)
    verifier.reset()
    features = verifier.forward(PROMPT, with_features=True).features
    proposal = draft.propose(PROMPT + [11], features, 3, temperature=0.8)
    assert len(proposal.tokens) == 3 and proposal.probs.shape == (3, tiny_qwen3_model.config.vocab_size)
    torch.testing.assert_close(proposal.probs.sum(dim=-1), torch.ones(3))
    assert all(proposal.probs[i, token] > 0 for i, token in enumerate(proposal.tokens))


def test_a_draft_vocabulary_survives_the_checkpoint_and_limits_the_proposals(tiny_qwen3_model, vocab_draft):
    draft, vocabulary = vocab_draft
    assert draft.model.draft_vocab.tolist() == vocabulary
    verifier = TargetVerifier(tiny_qwen3_model, draft.layer_ids)
    verifier.reset()
    features = verifier.forward(PROMPT, with_features=True).features
    block = draft.model.block_input_ids(torch.tensor([[11]]))[0]
    positions = torch.arange(len(PROMPT) + 4)[None]
    full = draft.model.lm_head(draft.model(block, features[None], positions, _attend_all))
    restricted = draft.model.draft_logits(features[None], 11, len(PROMPT))
    torch.testing.assert_close(restricted, full[0][:, vocabulary])          # the head's rows, nothing retrained
    proposal = draft.propose(PROMPT + [11], features, 3, temperature=0.0)
    assert all(token in vocabulary for token in proposal.tokens)
    assert proposal.tokens == [vocabulary[i] for i in restricted[1:].argmax(dim=-1).tolist()]


def test_greedy_with_a_draft_vocabulary_is_lossless(tiny_qwen3_model, vocab_draft):
    draft, _ = vocab_draft
    settings = DecodeSettings(block_size=draft.block_size, max_new_tokens=20)
    plain = speculative_decode(TargetVerifier(tiny_qwen3_model), NoDrafter(), PROMPT, settings)
    drafted = speculative_decode(TargetVerifier(tiny_qwen3_model, draft.layer_ids), draft, PROMPT, settings)
    assert drafted.tokens == plain.tokens


def test_sampled_drafts_from_a_draft_vocabulary_put_no_mass_outside_it(tiny_qwen3_model, vocab_draft):
    draft, vocabulary = vocab_draft
    draft.generator = torch.Generator().manual_seed(0)
    verifier = TargetVerifier(tiny_qwen3_model, draft.layer_ids)
    verifier.reset()
    features = verifier.forward(PROMPT, with_features=True).features
    proposal = draft.propose(PROMPT + [11], features, 3, temperature=0.8)
    assert proposal.probs.shape == (3, tiny_qwen3_model.config.vocab_size)
    torch.testing.assert_close(proposal.probs.sum(dim=-1), torch.ones(3))
    outside = torch.ones(proposal.probs.shape[1], dtype=torch.bool)
    outside[vocabulary] = False
    assert float(proposal.probs[:, outside].sum()) == 0.0
    assert all(proposal.probs[i, token] > 0 for i, token in enumerate(proposal.tokens))


def sliding_drafter(target, window: int = 3):
    """Two layers, the first sliding with a window shorter than any prompt here, the second full."""
    from dflash.drafter.network import DFlashDrafter, drafter_config

    config = drafter_config(target.config, num_layers=2, block_size=4, target_layer_ids=[1, 2], mask_token_id=151669,
                            layer_types=("sliding_attention", "full_attention"), sliding_window=window)
    torch.manual_seed(3)
    drafter = DFlashDrafter(config).attach_target(target).eval()
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return drafter


class ComparingDraft(DFlashDraft):
    """Drafts with the context cache and checks each block against the uncached computation."""

    def propose(self, committed, features, k, temperature):
        fresh = self.model.draft_logits(features[None], int(committed[-1]), features.shape[0])
        torch.testing.assert_close(self._block_logits(features, int(committed[-1])), fresh, rtol=1e-5, atol=1e-5)
        self.bounded = [layer.keys.shape[2] for layer in self._cache.layers]
        return super().propose(committed, features, k, temperature)


def test_the_draft_cache_gives_the_uncached_drafts_and_is_lossless(tiny_qwen3_model):
    drafter = sliding_drafter(tiny_qwen3_model)
    settings = DecodeSettings(block_size=4, max_new_tokens=16)
    draft = ComparingDraft(model=drafter)
    result = speculative_decode(TargetVerifier(tiny_qwen3_model, drafter.target_layer_ids), draft, PROMPT, settings)
    assert result.tokens == target_greedy_tokens(tiny_qwen3_model, PROMPT, 16)
    assert draft._cache.length == len(PROMPT) + len(result.tokens) - 1 or len(result.tokens) == 16
    assert draft.bounded[0] == 3 and draft.bounded[1] == draft._cache.length     # the window bounds layer 0


def test_the_draft_cache_crops_and_rebuilds_when_the_context_goes_back(tiny_qwen3_model):
    drafter = sliding_drafter(tiny_qwen3_model, window=4)
    features = extract_taps(tiny_qwen3_model, torch.tensor([PROMPT + [11, 12, 13]]), drafter.target_layer_ids)[0]
    draft = DFlashDraft(model=drafter)
    draft._block_logits(features[:9], 42)
    assert draft._cache.length == 9 and draft._cache.layers[0].start == 5
    for length in (8, 3, 2):     # 8, 3: the sliding layer dropped positions they see, rebuilt; 2: cropped
        torch.testing.assert_close(draft._block_logits(features[:length], 42),
                                   drafter.draft_logits(features[None, :length], 42, length), rtol=1e-5, atol=1e-5)
        assert draft._cache.length == length
    assert draft._cache.crop(1) and draft._cache.layers[1].keys.shape[2] == 1


def test_a_published_format_sliding_window_yarn_drafter_decodes_losslessly(tiny_qwen3_model, tmp_path):
    """z-lab's format as published: auto_map, top-level rope_theta and legacy rope_scaling (YaRN,
    `type`), layer_types with sliding_window but no use_sliding_window, bf16 weights."""
    import json

    from safetensors.torch import save_file

    from dflash.drafter.checkpoint_files import config_document

    drafter = sliding_drafter(tiny_qwen3_model)
    document = config_document(drafter.config)
    for key in ("rope_parameters", "use_sliding_window", "dtype", "torch_dtype"):
        document.pop(key, None)
    document.update(auto_map={"AutoModel": "dflash.DFlashDraftModel"}, rope_theta=1e6,
                    rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})
    (tmp_path / "config.json").write_text(json.dumps(document))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    draft = load_dflash_draft(str(tmp_path), tiny_qwen3_model)
    assert [(r.window, r.causal) for r in draft.model.layer_rules] == [(3, True), (None, False)]
    assert draft.model.config.rope_parameters["rope_type"] == "yarn" and draft.model.rotary_emb.attention_scaling > 1
    settings = DecodeSettings(block_size=4, max_new_tokens=12)
    result = speculative_decode(TargetVerifier(tiny_qwen3_model, draft.layer_ids), draft, PROMPT, settings)
    assert result.tokens == target_greedy_tokens(tiny_qwen3_model, PROMPT, 12)


def test_only_the_proposed_slots_go_through_the_draft_vocabulary_head(vocab_draft, tiny_qwen3_model):
    """propose's logits of slots 1..k (the head's draft-vocabulary rows gathered once) are the
    block's logits' rows 1..k; a drafter reused for another prompt gives the same ones."""
    draft, vocabulary = vocab_draft
    features = extract_taps(tiny_qwen3_model, torch.tensor([PROMPT]), draft.layer_ids)[0]
    block = draft._block_logits(features[:-1], PROMPT[-1])
    assert block.shape[-1] == len(vocabulary)
    for k in (1, 3):
        torch.testing.assert_close(draft._slot_logits(features[:-1], PROMPT[-1], k), block[1:1 + k], rtol=1e-5, atol=1e-5)
    assert draft.head().weight.shape == (len(vocabulary), tiny_qwen3_model.config.hidden_size)


def test_fewer_draft_tokens_draft_the_shorter_block_and_stay_lossless(tiny_qwen3_model, saved_draft):
    """draft_tokens k: each step proposes at most k tokens, drafted from `[anchor, MASK x k]` (what
    vLLM drafts with num_speculative_tokens k), and the output is still the target's greedy output."""
    full = load_dflash_draft(str(saved_draft), tiny_qwen3_model)
    short = load_dflash_draft(str(saved_draft), tiny_qwen3_model, draft_tokens=2)
    assert (full.proposed, short.proposed) == (3, 2)
    recording = RecordingDraft(short.model)
    recording.draft_tokens = 2
    settings = DecodeSettings(block_size=4, max_new_tokens=14)
    result = speculative_decode(TargetVerifier(tiny_qwen3_model, short.layer_ids), recording, PROMPT, settings)
    assert result.tokens == target_greedy_tokens(tiny_qwen3_model, PROMPT, 14)
    assert max(result.proposed) == 2 and max(result.taus) <= 3
    features = extract_taps(tiny_qwen3_model, torch.tensor([PROMPT]), short.layer_ids)[0][:-1]
    torch.testing.assert_close(short._block_logits(features, PROMPT[-1]),
                               short.model.draft_logits(features[None], PROMPT[-1], features.shape[0], 3), rtol=1e-5, atol=1e-5)
    assert short._block_logits(features, PROMPT[-1]).shape[0] == 3 < full._block_logits(features, PROMPT[-1]).shape[0]
