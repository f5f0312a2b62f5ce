"""The DFlash 2 drafter (dflash.drafter.dflash2) and its training objective (dflash.drafter.loss):
the convolution's formula and its block-causality, the identity start, the selector's walks, the
loss (unary + alpha x selector CE, the true token put into the loss's candidates, stop-gradient)
and the figures that see the selector."""
from __future__ import annotations

import pytest
import torch

from dflash.drafter.dflash2 import DFlash2Options, drafter_for_config, grouped_causal_conv, inverse_cdf, with_dflash2
from dflash.drafter.loss import HeadRows, SelectorObjective, accepted_runs, block_loss, block_targets, decay_weights, drafter_loss, figure_width, read_selector_stats, selector_terms
from dflash.drafter.network import DFlashDrafter, drafter_config, forward_blocks

BLOCK = 4
OPTIONS = DFlash2Options(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def configs(target, options: DFlash2Options = OPTIONS, block: int = BLOCK):
    def config():
        made = drafter_config(target.config, num_layers=2, block_size=block, target_layer_ids=[1, 2], mask_token_id=151669)
        made.num_target_layers = target.config.num_hidden_layers
        return made

    return config(), with_dflash2(config(), options)


@pytest.fixture(scope="module")
def pair(tiny_target_model):
    """A DFlash drafter and a fresh DFlash 2 drafter holding the same backbone weights."""
    plain, dflash2 = configs(tiny_target_model)
    torch.manual_seed(0)
    dflash = DFlashDrafter(plain).attach_target(tiny_target_model)
    second = drafter_for_config(dflash2).attach_target(tiny_target_model)
    assert not second.load_state_dict(dflash.state_dict(), strict=False).unexpected_keys
    return dflash, second


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 1060, (2, 30), generator=generator)
    anchors = torch.tensor([[3, 10, 20], [5, 7, 25]])
    features = torch.randn(2, 30, 2 * 64, generator=generator)
    targets = block_targets(ids, torch.ones_like(ids), anchors, torch.ones_like(anchors, dtype=torch.bool), BLOCK)
    return ids, anchors, features, targets


def naive_conv(x, delta, base, group, block):
    """out[t, c] = sum_j (base[j, c] + delta[t, j, c // group]) * x[t - j, c], t - j inside t's block."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(base.shape[0]):
            if t % block >= j:
                coefficient = base[j] + delta[t, j].repeat_interleave(group)
                out[t] += coefficient * x[t - j]
    return out


def test_the_convolution_is_its_formula():
    torch.manual_seed(1)
    x, delta, base = torch.randn(12, 32), torch.randn(12, 3, 4), torch.randn(3, 32)
    torch.testing.assert_close(grouped_causal_conv(x[None], delta[None], base, 8, 4)[0], naive_conv(x, delta, base, 8, 4))


def test_the_convolution_is_causal_inside_a_block_and_never_crosses_into_the_next():
    torch.manual_seed(2)
    x, delta, base = torch.randn(1, 12, 32), torch.randn(1, 12, 2, 4), torch.randn(2, 32)
    moved = x.clone()
    moved[0, 5] += 1.0                                                  # block 1, slot 1
    changed = (grouped_causal_conv(moved, delta, base, 8, 4) - grouped_causal_conv(x, delta, base, 8, 4)).abs().sum(-1)[0]
    assert changed.nonzero().flatten().tolist() == [5, 6]               # itself and the next slot, nothing before
    moved = x.clone()
    moved[0, 7] += 1.0                                                  # block 1's last slot
    blockwise = grouped_causal_conv(moved, delta, base, 8, 4) - grouped_causal_conv(x, delta, base, 8, 4)
    assert blockwise[0, 8].abs().sum() == 0                             # block 2's first slot does not see it
    one_block = grouped_causal_conv(moved, delta, base, 8, 12) - grouped_causal_conv(x, delta, base, 8, 12)
    assert one_block[0, 8].abs().sum() > 0                              # negative control: without the boundary it leaks


def test_a_fresh_dflash2_drafter_drafts_exactly_as_its_dflash_backbone(pair):
    dflash, second = pair
    ids, anchors, features, _ = batch()
    with torch.no_grad():
        plain, fresh = forward_blocks(dflash, ids, anchors, features, "sdpa"), forward_blocks(second, ids, anchors, features, "sdpa")
        torch.testing.assert_close(fresh, plain, rtol=0, atol=0)
        walk = second.selector.walk(second.logits(fresh[0, 0, 1:]), fresh[0, 0, 1:], int(ids[0, 3]))
        assert walk.tokens.tolist() == dflash.logits(plain[0, 0, 1:]).argmax(-1).tolist()     # zero successor codebook
        layer = second.layers[0]
        saved = layer.mlp_conv.kernel_projection.weight.clone()
        layer.mlp_conv.kernel_projection.weight.normal_(std=0.1)
        moved = forward_blocks(second, ids, anchors, features, "sdpa")
        layer.mlp_conv.kernel_projection.weight.copy_(saved)
    assert not torch.allclose(moved, plain, atol=1e-3)                 # the dynamic kernel is live


def strong_selector(drafter, seed: int = 3):
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for parameter in drafter.candidate_selector.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))


def test_the_greedy_walk_takes_the_best_edge_from_the_verified_anchor(tiny_target_model):
    _, config = configs(tiny_target_model)
    drafter = drafter_for_config(config).attach_target(tiny_target_model)
    strong_selector(drafter)
    selector = drafter.selector
    hidden, unary = torch.randn(3, 64), torch.randn(3, 151936)
    walk = selector.walk(unary, hidden, anchor_id=7)
    previous, expected = 7, []
    for slot in range(3):
        values, candidates = unary[slot].topk(4)
        edge = (selector.predecessor_codebook[previous] * (selector.hidden_projection.weight @ hidden[slot])) @ \
            selector.successor_codebook[candidates].T
        previous = int(candidates[(values + edge).argmax()])
        expected.append(previous)
    assert walk.tokens.tolist() == expected and walk.q is None
    assert walk.candidates.tolist() == unary.topk(4).indices.tolist()
    assert walk.tokens.tolist() != unary.argmax(-1).tolist()              # the selector overruled the head here
    assert any(selector.walk(unary, hidden, anchor).tokens.tolist() != expected for anchor in range(8, 40))   # the anchor conditions it


def test_the_sampled_walk_draws_by_inverse_cdf_and_returns_q(tiny_target_model):
    q = torch.tensor([0.2, 0.5, 0.3])
    assert [int(inverse_cdf(q, torch.tensor(u))) for u in (0.0, 0.1999, 0.2, 0.6999, 0.7, 0.9999)] == [0, 0, 1, 1, 2, 2]
    _, config = configs(tiny_target_model)
    drafter = drafter_for_config(config).attach_target(tiny_target_model)
    strong_selector(drafter)
    hidden, unary = torch.randn(3, 64), torch.randn(3, 151936)
    walk = drafter.selector.walk(unary, hidden, 7, temperature=0.7, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(walk.q.sum(-1), torch.ones(3))
    assert walk.tokens.tolist() == walk.candidates.gather(1, walk.picked[:, None])[:, 0].tolist()
    previous = 7
    for slot in range(3):                                               # q is the walked slot's softmax(scores / T)
        values = unary[slot].topk(4).values
        scores = drafter.selector.scores(values, hidden[slot], torch.tensor(previous), walk.candidates[slot])
        torch.testing.assert_close(walk.q[slot], torch.softmax(scores / 0.7, -1))
        previous = int(walk.tokens[slot])


def losses(drafter, alpha: float, stop: bool = False):
    ids, anchors, features, targets = batch()
    hidden = forward_blocks(drafter, ids, anchors, features, "sdpa")
    return drafter_loss(drafter, hidden, targets, torch.gather(ids, 1, anchors), decay_weights(BLOCK, 3.0), 5,
                        SelectorObjective(alpha, stop))


def test_the_loss_is_the_dflash_loss_plus_alpha_times_the_selector_ce(pair):
    dflash, second = pair
    strong_selector(second)
    ids, anchors, features, targets = batch()
    with torch.no_grad():
        plain = block_loss(forward_blocks(dflash, ids, anchors, features, "sdpa"), dflash.logits, targets,
                           decay_weights(BLOCK, 3.0), 5)
        one, two = losses(second, 1.0), losses(second, 2.0)
    torch.testing.assert_close(one.selector.unary_ce, plain.weighted_ce)      # the DFlash loss on the unary logits
    torch.testing.assert_close(one.weighted_ce, plain.weighted_ce + one.selector.selector_ce)
    torch.testing.assert_close(two.weighted_ce, plain.weighted_ce + 2 * one.selector.selector_ce)
    assert float(one.selector.selector_ce) > 0 and torch.equal(one.weight_sum, plain.weight_sum)


def test_the_true_token_takes_the_kth_place_only_when_the_top_k_misses_it(pair):
    _, second = pair
    strong_selector(second)
    selector = second.selector
    rows, predecessors = torch.randn(2, 64), torch.tensor([5, 6])
    top_ids, top_values = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]]), torch.tensor([[4.0, 3, 2, 1], [4.0, 3, 2, 1]])
    labels, gold = torch.tensor([11, 99]), torch.tensor([3.0, 0.5])            # row 0: in the top K; row 1: missed
    head = HeadRows(torch.tensor(0.0), torch.zeros(2), top_values, top_ids, gold)
    ce, right, recall = selector_terms(selector, rows, labels, predecessors, head, torch.ones(2), False)
    assert recall.tolist() == [True, False]
    trans_0 = selector.transitions(rows[0], predecessors[0], top_ids[0])
    trans_1 = selector.transitions(rows[1], predecessors[1], torch.tensor([20, 21, 22, 99]))
    expected = (torch.nn.functional.cross_entropy(top_values[0] + trans_0, torch.tensor(1))
                + torch.nn.functional.cross_entropy(torch.cat([top_values[1, :3], gold[1:]]) + trans_1, torch.tensor(3)))
    torch.testing.assert_close(ce, expected)
    strict_0 = top_values[0] + trans_0
    assert bool(right[0]) == (int(top_ids[0, strict_0.argmax()]) == 11) and not right[1]   # picks from the strict top K


def test_stop_gradient_gives_the_backbone_exactly_the_dflash_gradient(pair):
    _, second = pair
    strong_selector(second)

    def gradients(alpha: float, stop: bool) -> dict[str, torch.Tensor]:
        second.zero_grad(set_to_none=True)
        losses(second, alpha, stop).weighted_ce.backward()
        return {name: p.grad.clone() for name, p in second.named_parameters() if p.grad is not None}

    unary_only, stopped, coupled = gradients(0.0, False), gradients(1.0, True), gradients(1.0, False)
    backbone = [name for name in unary_only if not name.startswith("candidate_selector.")]
    assert backbone and all(torch.equal(stopped[name], unary_only[name]) for name in backbone)
    assert float(stopped["candidate_selector.successor_codebook"].abs().sum()) > 0   # the selector still learns
    assert any(not torch.allclose(coupled[name], unary_only[name]) for name in backbone)  # coupled: it reaches the backbone


def test_accepted_runs_count_blocks_through_each_slot():
    correct = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    run, alive = accepted_runs(correct, valid)
    assert run.tolist() == [3, 2, 0] and alive.tolist() == [4, 3, 1]


def test_a_fresh_selector_has_no_lift_and_a_trained_one_is_measured_apart(pair):
    _, second = pair
    with torch.no_grad():
        second.selector.successor_codebook.zero_()
        fresh = losses(second, 1.0)
        strong_selector(second)
        strong = losses(second, 1.0)
    assert fresh.figure_sums().numel() == figure_width(BLOCK, selector=True)
    stats = read_selector_stats(fresh.figure_sums(), BLOCK)
    assert stats.lift == 0 and stats.selector_accept == stats.unary_accept    # no transitions: the unary chain
    moved = read_selector_stats(strong.figure_sums(), BLOCK)
    assert moved.unary_accept == stats.unary_accept and moved.candidate_recall == stats.candidate_recall
    assert moved.selector_loss != stats.selector_loss and all(0 <= share <= 1 for share in moved.candidate_recall)
    assert read_selector_stats(block_loss_sums(), BLOCK) is None             # a DFlash drafter has none


def test_a_dflash2_blocks_accepted_run_is_its_selector_paths(pair, monkeypatch):
    """The held-out tau (dflash.train.rank.validation) counts a DFlash 2 block's leading slots on the
    selector's path, the one its decoder drafts: a selector right everywhere accepts every slot,
    whatever the unary head got right."""
    import dflash.drafter.loss as loss_module

    _, second = pair
    real = loss_module.selector_terms
    with torch.no_grad():
        measured = losses(second, 1.0)
        assert measured.selector is not None and measured.accepted is not None and measured.blocks is not None
        assert float(measured.accepted) == float(measured.selector.selector_run.sum())    # blocks right through k, summed
        assert float(measured.blocks) == float(measured.selector.selector_alive[0]) == 6   # 2 rows x 3 anchors
        monkeypatch.setattr(loss_module, "selector_terms",
                            lambda *args: (lambda ce, right, recall: (ce, torch.ones_like(right), recall))(*real(*args)))
        perfect = losses(second, 1.0)
    assert float(perfect.accepted) == 6 * (BLOCK - 1) != float(perfect.selector.unary_run.sum())


def block_loss_sums() -> torch.Tensor:
    return torch.zeros(figure_width(BLOCK, selector=False), dtype=torch.float64)


def test_bf16_compute_under_fsdp2_runs_the_convolutions_in_bf16_and_the_selector_is_its_own_unit(pair):
    """train.compute_dtype = "bfloat16" under FSDP2: the forward on the bf16-gathered weights, its
    float32 gradients reach the convolutions' float32 shards; the selector, which the loss calls after
    the drafter's forward, is its own FSDP2 unit (gathered when the loss calls it)."""
    from dflash.train.rank.parallel import drafter_mesh, is_sharded, shard_drafter

    _, second = pair
    ids, anchors, features, _ = batch()
    with torch.no_grad():
        full = forward_blocks(second, ids, anchors, features, "sdpa")
    sharded = shard_drafter(_reattached(second), drafter_mesh(torch.device("cpu"), "gloo"), compute_dtype="bfloat16")
    assert is_sharded(sharded.candidate_selector) and is_sharded(sharded)
    low = forward_blocks(sharded, ids, anchors, features, "sdpa")
    assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), full, rtol=0.05, atol=0.05)
    low.float().pow(2).mean().backward()
    grad = sharded.layers[0].attention_conv.kernel_projection.weight.grad
    assert grad is not None and grad.dtype == torch.float32


def _reattached(drafter):
    """A deep copy of `drafter` with the same (frozen, unregistered) target parts attached."""
    import copy

    frozen = drafter._frozen
    drafter._frozen = None
    try:
        twin = copy.deepcopy(drafter)
    finally:
        drafter._frozen = frozen
    twin._frozen = frozen
    return twin
