"""train.loss: D-PACE and distillation on the target's own logits, each against a direct formula on a
tiny case (values and gradients), the target's logits at the block slots' positions against its own
full forward, and one real training step of each through the trainer (`build_state`, `run_next_step`).
The "ce" objective is the one tests/train/test_drafter.py holds against the per-block reference."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter.loss import BlockTargets, LossObjective, TeacherRows, block_loss, decay_weights, dpace_weights, normaliser_weights
from tests.train.conftest import write_dataset, write_profile

ALPHA = 0.5


def direct_dpace(ce: list[float], mask: list[int], alpha: float) -> list[float]:
    """Eq. 7-8 written out: w_j = sum over supervised m >= j of prod over supervised i <= m of q~_i."""
    smooth = [(1 - alpha) * math.exp(-c) + alpha if s else 1.0 for c, s in zip(ce, mask)]
    prefix = [math.prod(smooth[:m + 1]) for m in range(len(ce))]
    return [sum(prefix[m] for m in range(j, len(ce)) if mask[m]) if mask[j] else 0.0 for j in range(len(ce))]


def test_dpace_weights_follow_the_paper_formula():
    ce = [0.1, 2.0, 0.5, 0.0, 3.0]
    for mask in ([1, 1, 1, 1, 1], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0]):
        got = dpace_weights(torch.tensor([ce]), torch.tensor([mask], dtype=torch.float32), ALPHA)[0]
        assert torch.allclose(got, torch.tensor(direct_dpace(ce, mask, ALPHA)), atol=1e-6), mask
    # all confident (CE 0): q~ = 1 everywhere, w_j counts the supervised slots from j on
    flat = dpace_weights(torch.zeros(1, 4), torch.ones(1, 4), ALPHA)[0]
    assert flat.tolist() == [4.0, 3.0, 2.0, 1.0]


@pytest.fixture
def tiny_case():
    """Two blocks of 4 slots (3 supervised slots each, one label missing), an 8-token vocabulary."""
    torch.manual_seed(0)
    head = torch.nn.Linear(5, 8, bias=False)
    hidden = torch.randn(1, 2, 4, 5, requires_grad=True)
    labels = torch.tensor([[[1, 2, 3], [4, 5, 6]]])
    mask = torch.tensor([[[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]]])
    return head, hidden, BlockTargets(labels=labels, label_mask=mask)


def test_dpace_loss_value_and_gradient_against_the_direct_formula(tiny_case):
    head, hidden, targets = tiny_case
    decay = decay_weights(4, 3.0)
    parts = block_loss(hidden, head, targets, decay, chunk_rows=2, objective=LossObjective("dpace", ALPHA))
    got = torch.autograd.grad(parts.weighted_ce, hidden)[0]

    total = torch.zeros(())
    for block in range(2):
        ce = F.cross_entropy(head(hidden[0, block, 1:]), targets.labels[0, block], reduction="none")
        mask = targets.label_mask[0, block].tolist()
        weights = direct_dpace(ce.detach().tolist(), mask, ALPHA)          # no gradient through the weights
        total = total + sum(w * c for w, c in zip(weights, ce))
    expected = torch.autograd.grad(total, hidden)[0]
    assert math.isclose(float(parts.weighted_ce), float(total), rel_tol=1e-5)
    assert torch.allclose(got, expected, atol=1e-6)
    assert float(parts.weight_sum) == 5.0      # the normaliser: the supervised positions, not a weight sum
    assert normaliser_weights(decay, LossObjective("dpace")).tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(normaliser_weights(decay, LossObjective("ce")), decay)


def test_distill_loss_value_and_gradient_against_the_direct_formula(tiny_case):
    head, hidden, targets = tiny_case
    decay = decay_weights(4, 3.0)
    teacher_head = torch.nn.Linear(5, 8, bias=False)
    teacher = torch.randn(1, 2, 3, 5)
    parts = block_loss(hidden, head, targets, decay, chunk_rows=2, objective=LossObjective("distill"),
                       teacher=teacher, teacher_head=teacher_head)
    got = torch.autograd.grad(parts.weighted_ce, hidden)[0]

    total = torch.zeros(())
    for block in range(2):
        for k in range(3):
            if targets.label_mask[0, block, k]:
                p = torch.softmax(teacher_head(teacher[0, block, k]), -1).detach()
                log_q = torch.log_softmax(head(hidden[0, block, k + 1]), -1)
                total = total + decay[k] * (p * (p.log() - log_q)).sum()
    expected = torch.autograd.grad(total, hidden)[0]
    assert math.isclose(float(parts.weighted_ce), float(total), rel_tol=1e-5)
    assert torch.allclose(got, expected, atol=1e-6)
    assert math.isclose(float(parts.weight_sum), float(decay.sum() + decay[0] + decay[2]), rel_tol=1e-6)
    itself = block_loss(hidden, head, targets, decay, chunk_rows=2, objective=LossObjective("distill"),
                        teacher=hidden[:, :, 1:].detach(), teacher_head=head)
    assert abs(float(itself.weighted_ce)) < 1e-6           # a drafter equal to its teacher: KL 0


def test_teacher_rows_are_the_positions_before_each_slot():
    hidden = torch.arange(10, dtype=torch.float32).view(1, 10, 1)
    rows = TeacherRows(hidden).at_slots(torch.tensor([[2, 8]]), 3)
    assert rows[..., 0].tolist() == [[[2.0, 3.0, 4.0], [8.0, 9.0, 9.0]]]   # slot k: anchor + k - 1 (clamped past the end)


def test_the_target_logits_at_the_slots_are_its_own_full_forward(tiny_target_model):
    from dflash.drafter.taps import extract_taps, extract_taps_and_last, split_last

    ids = torch.randint(100, 5000, (2, 12))
    features, last = split_last(extract_taps_and_last(tiny_target_model, ids, [1, 2]), tiny_target_model.config.hidden_size)
    assert torch.equal(features, extract_taps(tiny_target_model, ids, [1, 2]))
    with torch.no_grad():
        logits = tiny_target_model(input_ids=ids).logits
        rows = TeacherRows(last).at_slots(torch.tensor([[3], [6]]), 3)
        head = tiny_target_model.get_output_embeddings()(tiny_target_model.model.norm(rows))
    assert torch.allclose(head[0, 0], logits[0, 3:6], atol=1e-5) and torch.allclose(head[1, 0], logits[1, 6:9], atol=1e-5)


@pytest.mark.parametrize("loss", ["dpace", "distill"])
def test_a_training_step_with_each_loss(tmp_path, tiny_qwen3_target, loss):
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import build_state
    from dflash.train.rank.step import run_next_step
    from launcher_core.profile import load_profile

    profile = load_profile(str(write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "data", rows=8),
                                             tmp_path / "run", machine={"nproc_per_node": 1}, max_steps=2, loss=loss,
                                             drafter={"target_layer_ids": [1]})))
    state = build_state(profile, Path(profile.paths.run_dir), WorkerEnv(0, 1, 0), resume=False)
    assert len(state.target.model.layers) == (4 if loss == "distill" else 2)    # distill runs the target to its end
    before = [p.detach().clone() for p in state.drafter.parameters()]
    stats = [run_next_step(state)[0] for _ in range(2)]
    assert all(math.isfinite(s.loss) and s.loss > 0 and not s.skipped for s in stats)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, state.drafter.parameters()))


def test_the_loss_rule_names_the_key():
    from launcher_core.profile import load_profile
    from launcher_core.schema import loss_fits_the_run

    demo = load_profile("cpu-demo")
    dflash2 = dataclasses.replace(demo, drafter=dataclasses.replace(demo.drafter, kind="dflash2", draft_vocab_size=0))

    def problems(profile, **train):
        return [key for key, _ in loss_fits_the_run(dataclasses.replace(profile, train=dataclasses.replace(profile.train, **train)))]

    assert problems(demo, loss="dpace") == [] and problems(demo, loss="distill", feature_cache=False) == []
    assert problems(demo, loss="distill") == ["train.feature_cache"]
    assert problems(demo, dpace_alpha=0.3) == ["train.dpace_alpha"]
    assert problems(dflash2) == [] and problems(dflash2, loss="dpace") == ["train.loss"]
