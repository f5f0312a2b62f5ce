"""The draft vocabulary: which tokens, and a loss that only counts them."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from dflash.drafter.draft_vocab import count_loss_tokens, coverage, draft_vocabulary
from dflash.drafter.loss import block_loss, decay_weights
from dflash.drafter.network import DFlashDrafter, drafter_config, forward_blocks
from dflash.train.rank.data import collate_rows
from dflash.train.rank.step import step_targets
from tests.train.conftest import MASK_ID


def test_the_most_frequent_loss_tokens_are_chosen_ties_to_the_lower_id():
    import datasets

    rows = datasets.Dataset.from_dict({
        "input_ids": [[5, 7, 7, 9, 9, 9, 3], [9, 4, 4, 2, 8, 8]],
        "loss_mask": [[1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]],      # the prompt's 3 and 9 do not count
    })
    counts = count_loss_tokens(rows, max_length=6)                     # row 0 cut at 6: its 3 is gone anyway
    assert counts == Counter({9: 3, 7: 2, 4: 2, 8: 2, 5: 1, 2: 1})
    assert draft_vocabulary(counts, 3) == [4, 7, 9]                     # 7, 4, 8 tie: 4 and 7 win
    assert draft_vocabulary(counts, 100) == [2, 4, 5, 7, 8, 9]          # fewer distinct tokens than asked
    assert coverage(counts, [4, 7, 9]) == pytest.approx(7 / 11)
    with pytest.raises(ValueError, match="no loss tokens"):
        draft_vocabulary(Counter(), 4)


def test_labels_outside_the_draft_vocabulary_carry_no_loss(tiny_target_model):
    config = drafter_config(tiny_target_model.config, num_layers=1, block_size=4, target_layer_ids=[1],
                            mask_token_id=MASK_ID, draft_vocab_size=3)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).attach_target(tiny_target_model)
    drafter.set_draft_vocab(torch.tensor([1001, 1002, 1005]))
    ids = [[1000, 1001, 1002, 1003, 1004, 1005, 1001, 1002]]
    batch = collate_rows(ids, [[0, 1, 1, 1, 1, 1, 1, 1]], [0], num_anchors=8, seed=0, epoch=0)
    targets = step_targets(drafter, batch)
    labels_in_target_ids = torch.tensor([1001, 1002, 1005])[targets.labels]
    raw = torch.gather(batch.input_ids, 1, (batch.anchors[:, :, None] + torch.arange(1, 4)).clamp(max=7).flatten(1))
    raw = raw.view_as(targets.labels)
    in_vocab = (raw == 1001) | (raw == 1002) | (raw == 1005)
    assert torch.equal(targets.label_mask > 0, in_vocab & (targets.label_mask > 0))
    assert bool((targets.label_mask[~in_vocab] == 0).all()) and bool((targets.label_mask[in_vocab] > 0).any())
    assert torch.equal(labels_in_target_ids[targets.label_mask > 0], raw[targets.label_mask > 0])
    hidden = forward_blocks(drafter, batch.input_ids, batch.anchors, torch.randn(1, 8, 64), "sdpa")
    parts = block_loss(hidden, drafter.logits, targets, decay_weights(4, 3.0))
    logits = drafter.logits(hidden[:, :, 1:])                                         # [1, N, 3, 3 columns]
    assert logits.shape[-1] == 3
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    picked = -log_probs.gather(-1, targets.labels[..., None])[..., 0]
    weights = targets.label_mask * decay_weights(4, 3.0)
    torch.testing.assert_close(parts.weighted_ce, (picked * weights).sum())
