"""The DFlash 2 drafter in the in-process decoder: it drafts its selector's path (greedy and
sampled, q over the K candidates), with the draft context cache, losslessly wherever the DFlash
drafter is (tiny Qwen3, sliding windows, the flagship twin, sampled distribution); its unary
argmax decodes beside it as `dflash_unary`; candidate recall is counted; `eval` reports both."""
from __future__ import annotations

import json

import pytest
import torch
from eval_helpers import small_vocab_model
from test_dflash_drafter import PROMPT, target_greedy_tokens
from test_specdec import chi_square_p_value, exact_second_third_distribution

from dflash.eval.dflash2_drafter import DFlash2Draft, load_draft, unary_draft
from dflash.eval.specdec import DecodeSettings, Proposal, TargetVerifier, speculative_decode


def dflash2_drafter(target, *, layers=("sliding_attention", "full_attention"), window: int = 3, taps=(1, 2),
                    block: int = 4, rank: int = 8, top_k: int = 4, group: int = 16, mask: int = 151669, seed: int = 3):
    """A DFlash 2 drafter with every part off its start and a selector strong enough to overrule the head."""
    from dflash.drafter.dflash2 import DFlash2Options, drafter_for_config, with_dflash2
    from dflash.drafter.network import drafter_config

    config = drafter_config(target.config, num_layers=len(layers), block_size=block, target_layer_ids=list(taps),
                            mask_token_id=mask, layer_types=layers, sliding_window=window if "sliding_attention" in layers else 0)
    config.num_target_layers = target.config.num_hidden_layers
    config = with_dflash2(config, DFlash2Options(conv_group_size=group, selector_rank=rank, selector_top_k=top_k))
    torch.manual_seed(seed)
    drafter = drafter_for_config(config).attach_target(target).eval()
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            scale = 1.0 if "candidate_selector" in name else 0.3 if "_conv." in name else 0.05
            parameter.add_(scale * torch.randn_like(parameter))
    return drafter


@pytest.fixture(scope="module")
def saved_dflash2(tiny_qwen3_model, tmp_path_factory):
    from dflash.drafter.checkpoint_files import save_checkpoint

    run_dir = tmp_path_factory.mktemp("dflash2-run")
    save_checkpoint(run_dir, dflash2_drafter(tiny_qwen3_model), step=3, state={})
    return run_dir / "train" / "checkpoints"


class CheckedDraft(DFlash2Draft):
    """Checks each cached block against the uncached computation, and each proposal against the walk."""

    def propose(self, committed, features, k, temperature):
        anchor = int(committed[-1])
        cached = self._block_hidden(features, anchor)
        # float32 rounding of the two paths' different matmul shapes: up to 1.2e-5 seen; a stale or
        # shifted context differs by ~1e-1
        torch.testing.assert_close(cached, self.model.draft_hidden(features[None], anchor, features.shape[0]),
                                   rtol=1e-4, atol=1e-4)
        proposal = super().propose(committed, features, k, temperature)
        k = min(k, self.proposed)                   # eval.draft_tokens: the path's first k tokens
        if temperature <= 0:
            unary = self.model.logits(cached[1:1 + k])
            assert proposal.tokens == self.drafter.selector.walk(unary, cached[1:1 + k], anchor).tokens.tolist()
        return proposal


def test_greedy_selector_drafts_are_lossless_with_the_context_cache(tiny_qwen3_model, saved_dflash2):
    draft = load_draft(str(saved_dflash2), tiny_qwen3_model)
    assert isinstance(draft, DFlash2Draft) and draft.name == "dflash"
    checked = CheckedDraft(model=draft.model)
    settings = DecodeSettings(block_size=4, max_new_tokens=20)
    result = speculative_decode(TargetVerifier(tiny_qwen3_model, checked.layer_ids), checked, PROMPT, settings)
    assert result.tokens == target_greedy_tokens(tiny_qwen3_model, PROMPT, 20)
    tally = checked.tally_of_last(1)
    assert sum(tally.overrides) > 0, "the selector never overruled the head: the test would not exercise its walk"
    assert checked._cache.layers[0].keys.shape[2] == 3                      # the sliding layer's window bounds its cache
    assert sum(tally.verified) == sum(min(tau, 3) for tau in result.taus[:-1])   # every verified slot but the last step's
    assert all(0 <= h <= n for h, n in zip(tally.hits, tally.verified))


def test_the_unary_argmax_beside_it_is_the_head_and_lossless(tiny_qwen3_model, saved_dflash2):
    draft = load_draft(str(saved_dflash2), tiny_qwen3_model)
    unary = unary_draft(draft)
    settings = DecodeSettings(block_size=4, max_new_tokens=20)
    verifier = TargetVerifier(tiny_qwen3_model, draft.layer_ids)
    verifier.reset()
    features = verifier.forward(PROMPT, with_features=True).features
    hidden = draft.model.draft_hidden(features[None], 11, len(PROMPT))
    assert unary.name == "dflash_unary"
    assert unary.propose(PROMPT + [11], features, 3, 0.0).tokens == draft.model.logits(hidden[1:]).argmax(-1).tolist()
    result = speculative_decode(verifier, unary, PROMPT, settings)
    assert result.tokens == target_greedy_tokens(tiny_qwen3_model, PROMPT, 20)


def test_fewer_draft_tokens_walk_the_shorter_block_and_stay_lossless(tiny_qwen3_model, saved_dflash2):
    """eval.draft_tokens k reaches a DFlash 2 drafter and its unary twin: each step proposes at most
    k tokens, the selector walking the `[anchor, MASK x k]` block, and the output is the target's."""
    draft = load_draft(str(saved_dflash2), tiny_qwen3_model, draft_tokens=2)
    assert isinstance(draft, DFlash2Draft) and draft.proposed == 2 and unary_draft(draft).proposed == 2
    checked = CheckedDraft(model=draft.model, draft_tokens=2)
    settings = DecodeSettings(block_size=4, max_new_tokens=20)
    result = speculative_decode(TargetVerifier(tiny_qwen3_model, checked.layer_ids), checked, PROMPT, settings)
    assert result.tokens == target_greedy_tokens(tiny_qwen3_model, PROMPT, 20)
    assert max(result.proposed) == 2 and max(result.taus) <= 3
    unary = unary_draft(draft)      # the eval's `dflash_unary` beside it drafts the whole block too (its convolutions)
    assert unary.drafted_length == draft.drafted_length == 4
    result = speculative_decode(TargetVerifier(tiny_qwen3_model, unary.layer_ids), unary, PROMPT, settings)
    assert result.tokens == target_greedy_tokens(tiny_qwen3_model, PROMPT, 20) and max(result.proposed) == 2
    assert load_draft(str(saved_dflash2), tiny_qwen3_model).proposed == 3      # the default: B - 1


def test_sampled_drafts_carry_q_over_the_candidates(tiny_qwen3_model, saved_dflash2):
    draft = load_draft(str(saved_dflash2), tiny_qwen3_model)
    draft.generator = torch.Generator().manual_seed(0)
    verifier = TargetVerifier(tiny_qwen3_model, draft.layer_ids)
    verifier.reset()
    features = verifier.forward(PROMPT, with_features=True).features
    draft.reset()
    proposal = draft.propose(PROMPT + [11], features, 3, temperature=0.8)
    candidates = draft._last_block[1]
    assert proposal.probs.shape == (3, tiny_qwen3_model.config.vocab_size)
    torch.testing.assert_close(proposal.probs.sum(dim=-1), torch.ones(3))
    torch.testing.assert_close(proposal.probs.gather(1, candidates).sum(-1), torch.ones(3))    # no mass elsewhere
    assert all(proposal.probs[i, token] > 0 and token in candidates[i] for i, token in enumerate(proposal.tokens))


def test_the_flagship_twin_decodes_the_selector_path_losslessly(twin_model):
    drafter = dflash2_drafter(twin_model, layers=("sliding_attention", "full_attention"), taps=(1, 5), window=4,
                              block=6, mask=248070)
    draft = DFlash2Draft(model=drafter)
    settings = DecodeSettings(block_size=6, max_new_tokens=16)
    result = speculative_decode(TargetVerifier(twin_model, drafter.target_layer_ids), draft, PROMPT, settings)
    assert result.tokens == target_greedy_tokens(twin_model, PROMPT, 16)
    assert sum(draft.tally_of_last(1).overrides) > 0


class WrongQDraft(DFlash2Draft):
    """Negative control: draws by the selector's q, but reports uniform q over the candidates."""

    def propose(self, committed, features, k, temperature):
        proposal = super().propose(committed, features, k, temperature)
        candidates = self._last_block[1]
        probs = torch.zeros_like(proposal.probs).scatter_(1, candidates, 1.0 / candidates.shape[1])
        return Proposal(tokens=proposal.tokens, probs=probs)


def sampled_counts(draft_class, temperature: float = 1.0, samples: int = 2000):
    model = small_vocab_model()
    drafter = dflash2_drafter(model, layers=("full_attention",), taps=(1,), rank=4, top_k=3, mask=7, seed=5)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.mul_(3.0)            # q far from the head's softmax
    draft = draft_class(model=drafter, generator=torch.Generator().manual_seed(7))
    prompt, vocab = [1, 5, 2], model.config.vocab_size
    verifier, generator = TargetVerifier(model, drafter.target_layer_ids), torch.Generator().manual_seed(1234)
    settings = DecodeSettings(block_size=4, max_new_tokens=3, temperature=temperature)
    counts, accepted = torch.zeros(vocab, vocab, dtype=torch.float64), 0
    for _ in range(samples):
        result = speculative_decode(verifier, draft, prompt, settings, generator=generator)
        counts[result.tokens[1], result.tokens[2]] += 1
        accepted += result.taus[0] > 1
    exact = exact_second_third_distribution(model, prompt, temperature)
    return chi_square_p_value(counts.flatten(), exact.flatten().double() * samples), accepted / samples


@pytest.mark.slow
def test_sampled_selector_decoding_preserves_the_targets_distribution():
    p_value, accepted = sampled_counts(DFlash2Draft)
    assert accepted > 0.1, "too few drafts accepted to exercise the acceptance test"
    assert p_value > 0.001, f"speculative samples differ from the target's distribution (p={p_value:.2e})"


@pytest.mark.slow
def test_a_wrong_q_breaks_it():
    """Negative control of the test above, on a quarter of its samples: p is below 1e-40 already (a
    property of this seeded run), far under the threshold it must fail."""
    p_value, _ = sampled_counts(WrongQDraft, samples=500)
    assert p_value < 0.001


def test_recall_is_one_when_the_candidates_are_the_whole_vocabulary():
    model = small_vocab_model()
    everything = dflash2_drafter(model, layers=("full_attention",), taps=(1,), rank=4, top_k=8, mask=7)
    few = dflash2_drafter(model, layers=("full_attention",), taps=(1,), rank=4, top_k=1, mask=7)
    recalls = []
    for drafter in (everything, few):
        draft = DFlash2Draft(model=drafter)
        speculative_decode(TargetVerifier(model, drafter.target_layer_ids), draft, [1, 5, 2], DecodeSettings(4, 30))
        recalls.append(draft.tally_of_last(1).candidate_recall())
    assert all(share == 1.0 for share in recalls[0] if share is not None)
    assert any(share is not None and share < 1.0 for share in recalls[1])        # K = 1: the head's argmax misses


def test_eval_reports_the_selector_path_beside_the_unary_argmax(tiny_qwen3_target, saved_dflash2, tmp_path):
    from test_eval_command import write_eval_profile

    import launcher
    from dflash.eval.report_schema import read_report
    from launcher_core.manifest import read_manifest, update_stage

    profile = write_eval_profile(tmp_path, tiny_qwen3_target, "num_prompts = 2\nmax_new_tokens = 12")
    update_stage(tmp_path / "run", "train", "done", steps=3, last_loss=4.0)
    assert launcher.main(["eval", "--profile", str(profile), "--draft", str(saved_dflash2)]) == 0
    report = read_report(tmp_path / "run" / "eval" / "report.json")
    assert set(report.methods) == {"target", "dflash", "dflash_unary", "prompt_lookup"}
    path, unary = report.methods["dflash"], report.methods["dflash_unary"]
    assert path.identical_to_target and unary.identical_to_target
    assert len(path.candidate_recall) == 3 and unary.candidate_recall is None
    assert report.selector_lift() == pytest.approx(path.mean_tau - unary.mean_tau)
    assert read_manifest(tmp_path / "run")["stages"]["eval"]["selector_lift"] == round(report.selector_lift(), 3)
    assert "## DFlash 2 selector" in (tmp_path / "run" / "eval" / "report.md").read_text()
    assert json.loads((tmp_path / "run" / "eval" / "report.json").read_text())["methods"]["dflash"]["selector_overrides"]


def test_a_published_format_dflash2_directory_decodes_losslessly(tiny_qwen3_model, tmp_path):
    from tests.train.test_dflash2_train import published_dflash2

    directory, _ = published_dflash2(tiny_qwen3_model, tmp_path / "published")
    draft = load_draft(str(directory), tiny_qwen3_model)
    assert isinstance(draft, DFlash2Draft) and [(r.window, r.causal) for r in draft.model.layer_rules] == [(3, True), (None, True)]
    result = speculative_decode(TargetVerifier(tiny_qwen3_model, draft.layer_ids), draft, PROMPT, DecodeSettings(4, 12))
    assert result.tokens == target_greedy_tokens(tiny_qwen3_model, PROMPT, 12)
