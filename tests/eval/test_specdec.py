"""Speculative decoding on tiny random targets: lossless greedy, tau bounds, rejection sampling.

The decoding-loop tests run on two targets: a tiny Qwen3 (a KV cache only) and the flagship twin
(Qwen3.5/3.6: Gated DeltaNet layers whose recurrent and conv state must be restored after every
rejected draft token, see dflash.eval.target_cache).
"""
from __future__ import annotations

import math

import pytest
import torch
from eval_helpers import small_vocab_model

from dflash.eval.oracle import OracleDrafter
from dflash.eval.prompt_lookup import PromptLookupDrafter
from dflash.eval.specdec import DecodeSettings, NoDrafter, Proposal, TargetVerifier, accept_greedy, speculative_decode

PROMPTS = ([9707, 11, 1879, 0], [785, 6722, 315, 9625, 374, 12095, 13, 785], [151644, 872, 198, 3838])


def greedy_without_cache(model, prompt: list[int], max_new: int) -> list[int]:
    """Reference: re-run the whole sequence for every token (no KV cache, no drafting); the head on the
    last position only (`logits_to_keep=1`: the whole vocabulary at every position was most of its time)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_new):
            ids.append(int(model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].argmax()))
    return ids[len(prompt):]


TARGETS = ["qwen3", "twin"]
_REFERENCES: dict[str, dict[int, list[int]]] = {}


@pytest.fixture(params=TARGETS)
def target(request):
    """Each decoding-loop test runs on the tiny Qwen3 and on the flagship twin."""
    return request.param, request.getfixturevalue("tiny_qwen3_model" if request.param == "qwen3" else "twin_model")


@pytest.fixture
def references(target) -> dict[int, list[int]]:
    name, model = target
    if name not in _REFERENCES:
        _REFERENCES[name] = {i: greedy_without_cache(model, prompt, 25) for i, prompt in enumerate(PROMPTS)}
    return _REFERENCES[name]


@pytest.mark.parametrize("block_size", [2, 4, 7, 16])
@pytest.mark.parametrize("wrong_every", [0, 1, 3])
def test_greedy_output_equals_target_greedy(target, references, block_size, wrong_every):
    model = target[1]
    verifier = TargetVerifier(model)
    vocab = model.config.vocab_size
    settings = DecodeSettings(block_size=block_size, max_new_tokens=25)
    for i, prompt in enumerate(PROMPTS):
        drafter = OracleDrafter(references[i], len(prompt), vocab, wrong_every=wrong_every)
        result = speculative_decode(verifier, drafter, prompt, settings)
        assert result.tokens == references[i], f"prompt {i}"


def test_greedy_matches_transformers_generate_with_eos(target, references):
    """Stopping at EOS mid-block: same tokens as `generate`, cut right after the EOS."""
    model = target[1]
    prompt = PROMPTS[1]
    eos = references[1][6]  # a token the target emits: decoding must stop right after it
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
    assert expected[-1] == eos and len(expected) <= 7
    verifier = TargetVerifier(model)
    drafter = OracleDrafter(references[1], len(prompt), model.config.vocab_size, wrong_every=4)
    result = speculative_decode(verifier, drafter, prompt, DecodeSettings(5, 25, eos_ids=(eos,)))
    assert result.tokens == expected


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_always_right_drafter_gets_tau_block_size(target, references, block_size):
    model = target[1]
    steps = 3
    prompt = PROMPTS[0]
    settings = DecodeSettings(block_size=block_size, max_new_tokens=1 + steps * block_size)
    drafter = OracleDrafter(references[0], len(prompt), model.config.vocab_size)
    result = speculative_decode(TargetVerifier(model), drafter, prompt, settings)
    assert result.taus == [block_size] * steps
    assert result.mean_tau == block_size


def test_always_wrong_drafter_gets_tau_one(target, references):
    model = target[1]
    prompt = PROMPTS[2]
    drafter = OracleDrafter(references[2], len(prompt), model.config.vocab_size, wrong_every=1)
    result = speculative_decode(TargetVerifier(model), drafter, prompt, DecodeSettings(6, 12))
    assert result.tokens == references[2][:12]
    assert result.taus == [1] * 11
    assert all(count == 5 for count in result.proposed)


def test_no_drafter_is_target_only_decoding(target, references):
    result = speculative_decode(TargetVerifier(target[1]), NoDrafter(), PROMPTS[0], DecodeSettings(8, 25))
    assert result.tokens == references[0]
    assert result.taus == [1] * 24


def test_verify_taps_follow_hidden_states_convention(target):
    """Tap layer k = output of decoder layer k = hidden_states[k + 1], concatenated in order."""
    model = target[1]
    verifier = TargetVerifier(model, layer_ids=(0, 2))
    verifier.reset()
    out = verifier.forward(PROMPTS[0], with_features=True)
    with torch.inference_mode():
        states = model(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.features, torch.cat([states[1][0], states[3][0]], dim=-1))


@pytest.mark.parametrize("keep", [5, 6])
def test_rollback_keeps_the_committed_prefix(target, keep):
    """After a rejected block goes, the next logits and taps equal a fresh forward of the prefix
    (keep 6: one token of the rejected block stays committed)."""
    model = target[1]
    junk = [1, 2, 3]
    verifier = TargetVerifier(model, layer_ids=(0, 2))
    verifier.reset()
    verifier.forward(PROMPTS[1][:5], with_features=True)
    verifier.forward(junk, with_features=True)
    verifier.rollback(keep)
    prefix = (PROMPTS[1][:5] + junk)[:keep]
    out = verifier.forward([PROMPTS[1][5]], with_features=True)
    with torch.inference_mode():
        fresh = model(torch.tensor([prefix + [PROMPTS[1][5]]]), output_hidden_states=True)
    torch.testing.assert_close(out.logits[-1], fresh.logits[0, -1], atol=1e-4, rtol=1e-4)
    taps = torch.cat([fresh.hidden_states[1][0, -1], fresh.hidden_states[3][0, -1]])
    torch.testing.assert_close(out.features[-1], taps, atol=1e-4, rtol=1e-4)


def test_accept_greedy_counts_leading_matches():
    logits = torch.zeros(4, 5)
    for position, token in enumerate([2, 3, 4, 1]):
        logits[position, token] = 1.0
    assert accept_greedy([2, 3, 0], logits) == (2, 4)
    assert accept_greedy([2, 3, 4], logits) == (3, 1)
    assert accept_greedy([1], logits) == (0, 2)


class RandomDistributionDrafter:
    """Samples drafts from a fixed random distribution q (far from the target's p)."""

    name = "random-q"
    uses_features = False

    def __init__(self, vocab: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(torch.randn(vocab, generator=generator) * 2.0, dim=-1)
        self.generator = generator

    def reset(self) -> None:
        pass

    def propose(self, committed, features, k, temperature) -> Proposal:
        tokens = torch.multinomial(self.q, k, replacement=True, generator=self.generator).tolist()
        return Proposal(tokens=tokens, probs=self.q.expand(k, -1))


class FixedTokenDrafter:
    """Always proposes token 0 deterministically (q one-hot)."""

    name = "fixed"
    uses_features = False

    def reset(self) -> None:
        pass

    def propose(self, committed, features, k, temperature) -> Proposal:
        return Proposal(tokens=[0] * k)


def exact_second_third_distribution(model, prompt: list[int], temperature: float) -> torch.Tensor:
    """p(x2, x3 | prompt) of the target at `temperature` (x1 summed out), by enumeration: [V, V].

    x1 comes from the prefill; x2 and x3 from the first draft step, so both the first and the
    second draft slot (and the residual/bonus paths) are under test.
    """
    vocab = model.config.vocab_size

    def next_probs(contexts: list[list[int]]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.softmax(model(torch.tensor(contexts)).logits[:, -1] / temperature, dim=-1)

    first = next_probs([prompt])[0]                                                    # [V]
    second = next_probs([prompt + [a] for a in range(vocab)])                          # [V, V]
    third = next_probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)])  # [V*V, V]
    joint = first[:, None, None] * second[:, :, None] * third.view(vocab, vocab, vocab)
    return joint.sum(dim=0)


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square test; cells with expected < 5 are pooled into one."""
    keep = expected >= 5
    obs = torch.cat([observed[keep], observed[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    statistic = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("drafter_kind,temperature", [("random-q", 1.0), ("fixed", 0.7)])
def test_rejection_sampling_preserves_target_distribution(drafter_kind, temperature):
    model = small_vocab_model()
    vocab, prompt, samples = model.config.vocab_size, [1, 5, 2], 2000
    exact = exact_second_third_distribution(model, prompt, temperature)
    drafter = RandomDistributionDrafter(vocab, seed=1) if drafter_kind == "random-q" else FixedTokenDrafter()
    verifier, generator = TargetVerifier(model), torch.Generator().manual_seed(1234)
    settings = DecodeSettings(block_size=4, max_new_tokens=3, temperature=temperature)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    accepted_any = False
    for _ in range(samples):
        result = speculative_decode(verifier, drafter, prompt, settings, generator=generator)
        counts[result.tokens[1], result.tokens[2]] += 1
        accepted_any |= result.taus[0] > 1
    assert accepted_any, "the drafter never got a token accepted: the test would not exercise acceptance"
    assert exact.max() < 0.5, "target too peaked for a meaningful test"
    p_value = chi_square_p_value(counts.flatten(), exact.flatten().double() * samples)
    assert p_value > 0.001, f"speculative samples differ from the target's distribution (p={p_value:.2e})"


def test_chi_square_detects_a_biased_sampler():
    """The statistical test has power: a sampler that skews p by a few percent is rejected."""
    exact = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    skewed = torch.tensor([0.45, 0.27, 0.18, 0.10], dtype=torch.float64)
    counts = torch.bincount(torch.multinomial(skewed, 3000, replacement=True,
                                              generator=torch.Generator().manual_seed(0)), minlength=4)
    assert chi_square_p_value(counts.double(), exact * 3000) < 0.001


def test_prompt_lookup_gets_tau_above_one_on_a_repetitive_prompt(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True).eval()
    prompt = tokenizer("red green blue yellow, " * 6 + "red green", add_special_tokens=False)["input_ids"]
    settings = DecodeSettings(block_size=8, max_new_tokens=32)
    lookup = speculative_decode(TargetVerifier(model), PromptLookupDrafter(), prompt, settings)
    plain = speculative_decode(TargetVerifier(model), NoDrafter(), prompt, settings)
    assert lookup.tokens == plain.tokens
    assert lookup.mean_tau > 2.0, lookup.taus
    assert not math.isnan(lookup.mean_tau)


def test_the_prefill_and_the_verify_compute_logits_only_where_they_are_read(target):
    """The prefill keeps the last position's logits, a verify after pending tokens only the new
    tokens' (the lm_head runs for those alone); the rows are the full forward's, and the output stays lossless."""
    name, model = target
    prompt = PROMPTS[1]
    with torch.inference_mode():
        full = model(torch.tensor([prompt])).logits[0].float()
    verifier = TargetVerifier(model)
    prefill = verifier.forward(prompt, logits_for=1)
    assert prefill.logits.shape == (1, full.shape[-1])
    torch.testing.assert_close(prefill.logits[0], full[-1], rtol=1e-4, atol=1e-4)
    verifier.reset()
    assert verifier.forward(prompt).logits.shape[0] == len(prompt)           # control: no logits_for, every position
    verifier.reset()
    verifier.forward(prompt[:4], logits_for=1)
    block = verifier.forward(prompt[4:])
    assert block.logits.shape[0] == len(prompt) - 4
    torch.testing.assert_close(block.logits, full[4:], rtol=1e-4, atol=1e-4)


def test_a_greedy_verify_puts_only_the_positions_it_reads_through_the_lm_head(target, references):
    """Lazy logits: a rejected first draft token costs two lm_head rows (rows 0 and 1 in one matmul,
    about the cost of one: VerifyOutput.row), not one per fed token (the control, lazy logits off,
    pays a row per fed token: 4 at block 4); the output is the same either way."""
    model = target[1]
    rows: list[int] = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda _m, inputs, _o: rows.append(inputs[0].shape[-2]))
    try:
        counts = {}
        for lazy in (True, False):
            verifier = TargetVerifier(model)
            drafter = OracleDrafter(references[0], len(PROMPTS[0]), model.config.vocab_size, wrong_every=1)
            rows.clear()
            verifier.forward(PROMPTS[0], logits_for=1)      # the first prefill checks the lazy path
            verifier.lazy_logits = lazy and verifier.lazy_logits
            result = speculative_decode(verifier, drafter, PROMPTS[0], DecodeSettings(block_size=4, max_new_tokens=25))
            assert result.tokens == references[0]
            counts[lazy] = sum(rows) / len(result.taus)
    finally:
        handle.remove()
    assert counts[True] < 2.5 and counts[False] >= 3.5, counts


def test_lazy_logits_are_used_only_where_the_head_of_the_final_norm_gives_the_logits(tiny_qwen3_model):
    verifier = TargetVerifier(tiny_qwen3_model)
    assert verifier.lazy_logits is None and verifier.final_norm is tiny_qwen3_model.model.norm
    verifier.forward(PROMPTS[1], logits_for=1)
    assert verifier.lazy_logits is True
    hidden = torch.randn(1, tiny_qwen3_model.config.hidden_size)
    with torch.inference_mode():
        logits = tiny_qwen3_model.get_output_embeddings()(hidden)[0]
    verifier._check_lazy_logits(hidden, logits * 0.5)                    # a model that scales its logits after the head
    assert verifier.lazy_logits is False
    verifier._check_lazy_logits(hidden, logits)                          # control
    assert verifier.lazy_logits is True


class ScoredOracle(OracleDrafter):
    """The oracle's drafts with scores: each draft leads every other token by `lead` logits."""

    def __init__(self, *args, lead: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.lead = lead

    def propose(self, committed, features, k, temperature):
        proposal = super().propose(committed, features, k, temperature)
        logits = torch.zeros(len(proposal.tokens), self.vocab)
        logits[range(len(proposal.tokens)), proposal.tokens] = self.lead
        return Proposal(tokens=proposal.tokens, logits=logits)


@pytest.mark.parametrize("lead", [5.0, 0.1])
def test_the_loop_records_each_steps_drafter_margin(target, references, lead):
    """The oracle's drafts lead every other token by `lead` logits: each step's drafter margin is that lead
    (whether its last draft read was accepted or the target's token rejected it). The output is the
    target's either way."""
    model = target[1]
    settings = DecodeSettings(block_size=4, max_new_tokens=25)
    drafter = ScoredOracle(references[1], len(PROMPTS[1]), model.config.vocab_size, wrong_every=3, lead=lead)
    result = speculative_decode(TargetVerifier(model), drafter, PROMPTS[1], settings)
    assert result.tokens == references[1]
    assert result.draft_margins == pytest.approx([lead] * len(result.taus)), (result.draft_margins, result.taus)
    assert len(result.target_margins) == len(result.taus) and min(result.target_margins) >= 0
