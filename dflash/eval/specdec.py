"""Speculative decoding: a drafter proposes a block, the target verifies it in one forward.

Each step drafts up to `block_size - 1` tokens after the anchor (the last committed token, not yet
seen by the target), feeds `[anchor, d1, ..., dk]` to the target in ONE cached forward, commits
the longest accepted prefix plus one token from the target (the bonus token), and rolls the cache
back to the committed length (`TargetVerifier.rollback`: KV cropped; the linear-attention state of
a hybrid target such as Qwen3.5/3.6 restored from a snapshot). tau (acceptance length) of a step = accepted + 1, so a
drafter that is always right gets tau = block_size and one that is always wrong gets tau = 1.

Greedy (temperature 0): a draft token is accepted when it equals the target's argmax; the output
is the target's own greedy decoding, token for token. Temperature > 0: the standard speculative
rejection rule (accept x with probability min(1, p(x)/q(x)), else resample from
norm(max(0, p - q))), which leaves the target's sampling distribution unchanged.

The verify forward also returns the target's tap features of the verified positions, so a DFlash
drafter's context is extended with the target's features of the committed tokens.
"""
from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

from dflash.drafter.taps import TapCapture

if TYPE_CHECKING:
    import torch
    from transformers import Cache, PreTrainedModel

    from dflash.eval.target_cache import LinearSnapshot




@dataclass
class Proposal:
    """Draft tokens for one block; `probs` [len(tokens), V] are the draft distributions q.

    `probs` None means the tokens were chosen deterministically (q is one-hot), as prompt
    lookup does; rejection sampling then accepts token x with probability p(x). `logits`
    [len(tokens), V'] (a greedy drafter's scores, V' its vocabulary; `vocab` the target id of each
    of its rows, None when V' is the target's) let the loop measure each step's margins (`draft_margin`).
    """

    tokens: list[int]
    probs: Optional["torch.Tensor"] = None
    logits: Optional["torch.Tensor"] = None
    vocab: Optional["torch.Tensor"] = None


def draft_margin(proposal: Proposal, accepted: int, bonus: int) -> Optional[float]:
    """The smallest logit margin by which the drafter decided this step's acceptance: over the accepted
    drafts, each one's lead over the drafter's next choice (a kernel that flips it accepts fewer), and
    over the rejected draft, its lead over the target's token `bonus` (a kernel that flips it accepts
    more). None where the proposal carries no scores (prompt lookup) or no slot was decisive."""
    logits = proposal.logits
    if logits is None:
        return None
    margins = [_lead(logits[slot]) for slot in range(min(accepted, logits.shape[0]))]
    row = _draft_row(proposal, bonus) if accepted < logits.shape[0] else None
    if row is not None:
        margins.append(float(logits[accepted].max() - logits[accepted, row]))
    return min(margins, default=None)


def _draft_row(proposal: Proposal, token: int) -> Optional[int]:
    """The drafter's row of target token `token` (None where its vocabulary lacks it)."""
    assert proposal.logits is not None
    if proposal.vocab is None:
        return token if token < proposal.logits.shape[1] else None
    rows = (proposal.vocab == token).nonzero()
    return int(rows[0, 0]) if rows.numel() else None


def target_margin(out: VerifyOutput, accepted: int) -> float:
    """The smallest lead of the target's greedy token over its runner-up at the positions this step's
    acceptance read (0..accepted): where it is small, another engine's kernels may pick the other token."""
    return min(_lead(out.row(index)) for index in range(accepted + 1))


def _lead(logits: "torch.Tensor") -> float:
    """How far the best of a row of logits leads the second best."""
    import torch

    best = torch.topk(logits, 2).values
    return float(best[0] - best[1])


class Drafter(Protocol):
    """What the decoding loop needs from a drafter."""

    name: str
    uses_features: bool  # True: the loop must pass the target's tap features of committed tokens

    def reset(self) -> None:
        """Forget per-prompt state before a new prompt."""

    def propose(self, committed: Sequence[int], features: Optional["torch.Tensor"], k: int,
                temperature: float) -> Proposal:
        """Up to k tokens to follow `committed`; `features` [len(committed)-1, F] or None."""


class NoDrafter:
    """Proposes nothing: the loop then is plain target-only decoding (one token per forward)."""

    name = "target"
    uses_features = False

    def reset(self) -> None:
        pass

    def propose(self, committed: Sequence[int], features: Optional[torch.Tensor], k: int,
                temperature: float) -> Proposal:
        return Proposal(tokens=[])


@dataclass
class VerifyOutput:
    logits: "torch.Tensor"                      # [n, V] float32 (the last n fed positions'; none when lazy)
    features: Optional["torch.Tensor"] = None   # [n, L*H] tap features, when taps were asked for
    hidden: Optional["torch.Tensor"] = None     # lazy: [n, H] the lm_head's input, its rows put through on demand
    head: Optional[Callable[["torch.Tensor"], "torch.Tensor"]] = None

    def row(self, index: int) -> "torch.Tensor":
        """Logits [V] (float32) of fed position `index`. A lazy output computes rows as they are
        asked for: the first request rows 0 and 1 together (the first draft token's acceptance
        decides whether row 1 is read, and one matmul over two rows costs about one over one),
        later ones alone."""
        if self.hidden is None or index < self.logits.shape[0]:
            return self.logits[index]
        import torch

        assert self.head is not None, "a lazy output carries the lm_head"
        end = index + 1 if self.logits.shape[0] else min(2, self.hidden.shape[0])
        with torch.inference_mode():
            fresh = self.head(self.hidden[self.logits.shape[0]:end]).float()
        self.logits = torch.cat([self.logits, fresh]) if self.logits.shape[0] else fresh
        return self.logits[index]


ROLLBACKS = ("snapshot", "snapshot-rerun", "reprefill")


@dataclass(frozen=True)
class _Asked:
    """What one target forward returns: logits of its last `logits_for` positions (0: none) and,
    with `capture_hidden`, the final norm's output (the lm_head's input)."""

    logits_for: int = 1
    capture_hidden: bool = False


class TargetVerifier:
    """The target behind its cache: forward a few tokens, read logits and tap features, roll back.

    `layer_ids` are tap layers (layer k = output of decoder layer k = HF hidden_states[k + 1]);
    None: no features (prompt lookup and target-only decoding do not need them).

    Rolling back rejected draft tokens: attention layers crop their KV cache. Linear-attention
    layers (Qwen3.5/3.6 Gated DeltaNet) hold a recurrent and a conv state that cannot be cropped;
    the `rollback` argument chooses how they go back:
      * "snapshot" (default): their states are copied right before each verify block and
        restored after a rejection; the accepted tokens are fed again at the front of the next
        verify forward (no extra forward), whose linear layers take them first and copy their
        state before taking the new block (`target_cache.linear_attention_plan`);
      * "snapshot-rerun": the same, but the accepted tokens are fed again at once (one extra forward);
      * "reprefill": no snapshot; after a rejection the whole committed sequence is fed again.
    Every mode gives the target's exact output; they differ in time (benchmarks/bench_eval_rollback.py).
    """

    def __init__(self, model: PreTrainedModel, layer_ids: Optional[Sequence[int]] = None, rollback: str = "snapshot"):
        from dflash.compat import check_transformers, linear_state_continues
        from dflash.eval.target_cache import cache_keyword
        from dflash.target_model import linear_attention_layers

        if rollback not in ROLLBACKS:
            raise ValueError(f"rollback {rollback!r}; valid: {', '.join(ROLLBACKS)}")
        version = check_transformers()
        self.model = model
        self.layer_ids = tuple(layer_ids) if layer_ids is not None else None
        self.device = next(model.parameters()).device
        self.rollback_mode = rollback
        self.hybrid = bool(linear_attention_layers(model.config))
        self.sequential_linear = self.hybrid and not linear_state_continues(version)
        self.cache_keyword = cache_keyword(model)
        self.logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.final_norm = final_norm(model) if self.logits_to_keep else None
        # lazy logits on a CPU (checked at the first prefill); on a GPU all rows of a block cost about one
        self.lazy_logits: Optional[bool] = None if self.final_norm is not None and self.device.type == "cpu" else False
        self.cache: Optional[Cache] = None
        self._cached: list[int] = []     # tokens whose state the cache holds
        self._pending: list[int] = []    # committed tokens to feed again before the next tokens
        self._snapshot: Optional[tuple[int, LinearSnapshot]] = None   # (cached length, linear states) before the last forward
        self._asked = _Asked()          # what the next forward returns besides the taps

    def reset(self) -> None:
        self.cache, self._cached, self._pending, self._snapshot = None, [], [], None

    @property
    def length(self) -> int:
        """Committed positions (those in the cache and those waiting to be fed again)."""
        return len(self._cached) + len(self._pending)

    def forward(self, token_ids: Sequence[int], with_features: bool = False,
                logits_for: Optional[int] = None, lazy: bool = False) -> VerifyOutput:
        """Feed `token_ids` after the committed prefix; taps of every fed position and logits of the
        last `logits_for` of them (None: all; the prefill needs the last one only): the lm_head, a
        vocabulary-wide matmul per position, runs only for those. `lazy` (greedy verification):
        no logits yet; `VerifyOutput.row(i)` puts position i alone through the lm_head when the
        acceptance reaches it (where this target's logits are the lm_head of its final norm's
        output: checked once, at the first prefill)."""
        count = len(token_ids)
        taps = with_features and self.layer_ids is not None
        fed = self._pending + list(token_ids)
        if lazy and self.lazy_logits:
            self._asked = _Asked(logits_for=0, capture_hidden=True)
            _, features, hidden = self._run(fed, taps)
            assert hidden is not None, "the final norm's hook captured its output"
            return VerifyOutput(logits=hidden.new_zeros(0, 0), features=None if features is None else features[-count:],
                                hidden=hidden[-count:], head=self.model.get_output_embeddings())
        wanted = count if logits_for is None else max(1, min(logits_for, count))
        self._asked = _Asked(logits_for=wanted, capture_hidden=self.lazy_logits is None)
        logits, features, hidden = self._run(fed, taps)
        if hidden is not None:
            self._check_lazy_logits(hidden[-1:], logits[-1])
        return VerifyOutput(logits=logits[-wanted:], features=None if features is None else features[-count:])

    def _check_lazy_logits(self, hidden: "torch.Tensor", logits: "torch.Tensor") -> None:
        """Lazy rows are right when the lm_head of the final norm's output gives the model's logits
        (not, e.g., for a model that soft-caps or scales them after the head)."""
        import torch

        with torch.inference_mode():
            own = self.model.get_output_embeddings()(hidden)[0].float()
        self.lazy_logits = bool(torch.allclose(own, logits, rtol=1e-4, atol=1e-4))

    def _run(self, fed: list[int], want_taps: bool) -> tuple["torch.Tensor", Optional["torch.Tensor"], Optional["torch.Tensor"]]:
        """One forward of `fed` (pending tokens first) -> the logits of its last `logits_for` positions
        (0: none), the taps, and with `capture_hidden` the final norm's output [n, H] (`_asked`, set
        by `forward`, then back to one logits row). On a hybrid target the linear-attention state
        right after the pending tokens, i.e. right before the new ones, is kept for `rollback`."""
        import torch

        logits_for, capture_hidden = self._asked.logits_for, self._asked.capture_hidden
        self._asked = _Asked()

        from dflash.eval.target_cache import LinearPlan, linear_attention_plan, output_cache, snapshot_linear_state

        start, split = len(self._cached), len(self._pending)
        keep = self.hybrid and self.cache is not None and self.rollback_mode != "reprefill"
        plan = LinearPlan(split_at=split if keep else 0, token_by_token=self.sequential_linear and start > 0)
        ids = torch.tensor([fed], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(fed), device=self.device)[None]
        cache = {self.cache_keyword: self.cache} if self.cache is not None else {}
        kept: object = logits_for if logits_for else torch.zeros(0, dtype=torch.long, device=self.device)
        keep_logits = {"logits_to_keep": kept} if self.logits_to_keep else {}
        captured: list["torch.Tensor"] = []
        with torch.inference_mode(), contextlib.ExitStack() as stack:
            before = snapshot_linear_state(self._live_cache()) if keep and not split else None
            capture = stack.enter_context(TapCapture(self.model, self.layer_ids or ())) if want_taps else None
            stack.enter_context(linear_attention_plan(self.model, plan))
            if capture_hidden and self.final_norm is not None:
                hook = self.final_norm.register_forward_hook(lambda _m, _i, output: captured.append(output))
                stack.callback(hook.remove)
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **cache, **keep_logits)
        self._snapshot = (start + split, before if before is not None else plan.snapshot()) if keep else None
        self.cache = output_cache(out) if self.cache is None else self.cache
        self._cached, self._pending = self._cached + fed, []
        features = capture.features()[0] if capture is not None else None
        logits = out.logits[0, -logits_for:].float() if logits_for else out.logits[0, :0].float()
        return logits, features, (captured[-1][0] if captured else None)

    def rollback(self, length: int) -> None:
        """Forget every position from `length` on (rejected draft tokens go)."""
        import torch

        extra = self.length - length
        assert 0 <= extra <= len(self._cached), f"cannot roll back to {length} from {self.length}"
        if not extra:
            return
        with torch.inference_mode():
            self._drop_after(length)
        if self.rollback_mode == "snapshot-rerun" and self._pending:
            self._run(list(self._pending), want_taps=False)

    def _live_cache(self) -> Cache:
        assert self.cache is not None, "no forward since the reset: nothing is cached"
        return self.cache

    def _drop_after(self, length: int) -> None:
        from dflash.eval.target_cache import crop_attention, restore_linear_state

        if not self.hybrid:
            crop_attention(self._live_cache(), length)
            self._cached = self._cached[:length]
        elif self._snapshot is None or self._snapshot[0] > length:      # "reprefill"
            self.cache, self._pending, self._cached = None, self._cached[:length], []
        else:
            start, states = self._snapshot
            restore_linear_state(states)
            crop_attention(self._live_cache(), start)
            self._cached, self._pending, self._snapshot = self._cached[:start], self._cached[start:length], None


@dataclass
class DecodeResult:
    """One prompt decoded by one method."""

    tokens: list[int]                        # new tokens (prompt excluded)
    taus: list[int] = field(default_factory=list)       # acceptance length of each draft step
    proposed: list[int] = field(default_factory=list)   # draft tokens proposed at each step
    wall_s: float = 0.0
    draft_margins: list[Optional[float]] = field(default_factory=list)    # greedy, per step: draft_margin
    target_margins: list[Optional[float]] = field(default_factory=list)   # greedy, per step: target_margin
    drafts: list[list[int]] = field(default_factory=list)                # the draft tokens proposed at each step

    @property
    def mean_tau(self) -> float:
        return sum(self.taus) / len(self.taus) if self.taus else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class DecodeSettings:
    block_size: int
    max_new_tokens: int
    temperature: float = 0.0
    eos_ids: tuple[int, ...] = ()


def pick_token(logits: "torch.Tensor", temperature: float, generator: Optional["torch.Generator"]) -> int:
    """argmax at temperature 0, else a sample from softmax(logits / temperature)."""
    import torch

    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_greedy(draft: Sequence[int], logits: "torch.Tensor") -> tuple[int, int]:
    """(accepted, bonus): leading draft tokens equal to the target's argmax, then its next argmax.

    `logits[i]` is the target's prediction for the token after block position i (anchor = 0).
    """
    targets = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return accepted, targets[accepted]


def accept_greedy_rows(draft: Sequence[int], out: VerifyOutput) -> tuple[int, int]:
    """`accept_greedy` reading the target's logits one position at a time (`VerifyOutput.row`):
    a lazy verify output puts through the lm_head only the positions the acceptance reaches."""
    accepted = 0
    while True:
        target = int(out.row(accepted).argmax())
        if accepted < len(draft) and draft[accepted] == target:
            accepted += 1
            continue
        return accepted, target


def final_norm(model: "PreTrainedModel") -> Optional["torch.nn.Module"]:
    """The decoder's final norm (its output is the lm_head's input), or None where it has none."""
    import torch

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    return norm if isinstance(norm, torch.nn.Module) else None


def accept_sampling(proposal: Proposal, logits: "torch.Tensor", temperature: float,
                    generator: Optional["torch.Generator"]) -> tuple[int, int]:
    """(accepted, bonus) by the speculative rejection rule; preserves the target's distribution."""
    import torch

    target_probs = torch.softmax(logits / temperature, dim=-1)
    for i, token in enumerate(proposal.tokens):
        p = target_probs[i]
        q = _draft_distribution(proposal, i, p)
        ratio = float(p[token] / q[token]) if q[token] > 0 else 0.0
        if float(torch.rand((), generator=generator)) < min(1.0, ratio):
            continue
        residual = torch.clamp(p - q, min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = p
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    bonus = torch.multinomial(target_probs[len(proposal.tokens)], 1, generator=generator)
    return len(proposal.tokens), int(bonus)


def _draft_distribution(proposal: Proposal, index: int, like: "torch.Tensor") -> "torch.Tensor":
    import torch

    if proposal.probs is not None:
        return proposal.probs[index].to(like)
    one_hot = torch.zeros_like(like)
    one_hot[proposal.tokens[index]] = 1.0
    return one_hot


def speculative_decode(verifier: TargetVerifier, drafter: Drafter, prompt_ids: Sequence[int],
                       settings: DecodeSettings, generator: Optional["torch.Generator"] = None) -> DecodeResult:
    """Decode one prompt; with `NoDrafter` this is plain target-only decoding."""
    assert settings.block_size >= 1 and len(prompt_ids) > 0
    started = time.perf_counter()
    verifier.reset()
    drafter.reset()
    prefill = verifier.forward(prompt_ids, with_features=drafter.uses_features, logits_for=1)
    committed = list(prompt_ids) + [pick_token(prefill.logits[-1], settings.temperature, generator)]
    state = _LoopState(committed=committed, features=prefill.features, prompt_len=len(prompt_ids),
                       prefill_margin=_lead(prefill.logits[-1]) if settings.temperature <= 0 else None)
    while not state.finished(settings):
        _step(verifier, drafter, state, settings, generator)
    tokens = state.new_tokens(settings)
    return DecodeResult(tokens=tokens, taus=state.taus, proposed=state.proposed,
                        wall_s=time.perf_counter() - started, draft_margins=state.draft_margins,
                        target_margins=state.target_margins, drafts=state.drafts)


@dataclass
class _LoopState:
    committed: list[int]
    features: Optional["torch.Tensor"]
    prompt_len: int
    taus: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    draft_margins: list[Optional[float]] = field(default_factory=list)
    target_margins: list[Optional[float]] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    prefill_margin: Optional[float] = None     # the first token's lead, counted into the first step's target margin

    def new_tokens(self, settings: DecodeSettings) -> list[int]:
        """Generated tokens, cut after the first EOS and at max_new_tokens."""
        tokens = self.committed[self.prompt_len:][: settings.max_new_tokens]
        for i, token in enumerate(tokens):
            if token in settings.eos_ids:
                return tokens[: i + 1]
        return tokens

    def finished(self, settings: DecodeSettings) -> bool:
        tokens = self.new_tokens(settings)
        return len(tokens) >= settings.max_new_tokens or (bool(tokens) and tokens[-1] in settings.eos_ids)


def _step(verifier: TargetVerifier, drafter: Drafter, state: _LoopState, settings: DecodeSettings,
          generator: Optional["torch.Generator"]) -> None:
    """Draft one block, verify it in one target forward, commit, roll the cache back."""
    import torch

    proposal = drafter.propose(state.committed, state.features, settings.block_size - 1, settings.temperature)
    proposal.tokens = list(proposal.tokens)[: settings.block_size - 1]
    greedy = settings.temperature <= 0
    out = verifier.forward([state.committed[-1]] + proposal.tokens, with_features=drafter.uses_features, lazy=greedy)
    if greedy:
        accepted, bonus = accept_greedy_rows(proposal.tokens, out)
        state.draft_margins.append(draft_margin(proposal, accepted, bonus))
        margin = target_margin(out, accepted)
        if not state.target_margins and state.prefill_margin is not None:
            margin = min(margin, state.prefill_margin)
        state.target_margins.append(margin)
    else:
        accepted, bonus = accept_sampling(proposal, out.logits, settings.temperature, generator)
    state.committed += proposal.tokens[:accepted] + [bonus]
    verifier.rollback(len(state.committed) - 1)
    if out.features is not None:
        assert state.features is not None, "the prefill gave features when the drafter uses them"
        state.features = torch.cat([state.features, out.features[: accepted + 1]], dim=0)
    state.taus.append(accepted + 1)
    state.proposed.append(len(proposal.tokens))
    state.drafts.append(list(proposal.tokens))
