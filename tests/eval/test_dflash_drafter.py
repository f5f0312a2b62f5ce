"""The DFlash drafter adapter: checkpoint round trip, context = target taps of the committed prefix."""
from __future__ import annotations

import pytest
import torch

from dflash.eval.dflash_drafter import DFlashDraft, load_dflash_draft
from dflash.eval.specdec import DecodeSettings, NoDrafter, TargetVerifier, speculative_decode
from dflash.extract import extract_taps

PROMPT = [785, 6722, 315, 9625, 374, 12095, 13]


def save_random_drafter(run_dir, target, block_size: int = 4, seed: int = 0):
    """A random-weight drafter shaped for `target`, saved as a real training checkpoint."""
    from dflash.checkpoint import save_checkpoint
    from dflash.drafter import DFlashDrafter, drafter_config
    from dflash.extract import default_target_layer_ids

    config = drafter_config(target.config, num_layers=1, block_size=block_size,
                            target_layer_ids=default_target_layer_ids(target.config.num_hidden_layers, 1),
                            mask_token_id=151669)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).attach_target(target)
    return save_checkpoint(run_dir, drafter, step=3, state={})


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
