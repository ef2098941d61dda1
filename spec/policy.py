"""Adaptive K: a `KPolicy` for `spec.loop.speculate` that picks each round's K from running estimates.

Its estimates are ratios of exponentially decayed sums, so they mostly reflect the last `memory` observations:

- alpha: drafts accepted / drafts judged. A round with n accepted of K judged n + 1 positions if it stopped at a
  rejection, n if all K were accepted; positions after the first rejection are never judged.
- c: seconds per draft step / seconds per target step. Target steps are timed on K = 0 rounds (one 1-token forward),
  draft steps on rounds whose drafter had no text to catch up on.
- s, the verify slope: a round of K drafts, less its draft steps, costs (1 + s K) target steps.
- l, the lead: seconds a round's first draft forward costs beyond a draft step when it reads two tokens, which it
  does after a round that kept all its drafts (the last draft was never fed to the drafter, and the bonus follows).
  Such a round teaches c its draft time less the lead, so that c stays the price of a draft step.

The lead comes from the real Qwen pair on an H200 (benchmarks/h200/real-qwen/, session 14), where the policy settled
on K = 1-2 at 1.05x while K = 4 ran 1.30x and K = 6 1.42x. Its rounds, timed: led by one token, a round drafts in
0.88 / 1.55 / 2.19 ms at K = 1 / 2 / 3; led by two, 0.28 ms more (target step 1.71 ms). At K = 1 almost every round
keeps its draft and so leads with two tokens, and priced as a draft step that made c read 0.54-0.67 instead of 0.51.
The rest of the gap is what a round pays once (0.23 ms of drafting, 0.17 ms of verifying beyond a plain step), which
c and s spread over the K they were timed at, so every K above it looks a little dear; fitting it apart (B + A K)
needs rounds at several Ks, and a fit that trusted too few of them locked K at 1 after a machine sped up (a review's
simulation), so it is left out (docs/tuning.md).

Every round it picks the K in 0..max_k that maximises the predicted speedup `spec.calc.speedup(alpha, K, c,
1 + s K + alpha^K l)` (l in target steps).
K = 0 (speculation off) wins when no K beats plain decoding even with alpha one standard error above its estimate
(`hopeful_alpha`): off is decided on evidence, not on the first few positions judged. Times are whole rounds
(`total_s`), so the loop's own overhead is counted where it falls.

Estimates only learn from what is run, so the policy probes the other side now and then, within `probe_budget` of
the time (2% by default). While speculation is on, a K = 0 round refreshes the target step, spaced by its predicted
loss. While it is off, a K = 1 round refreshes alpha; each plain round earns `probe_budget` target steps of credit,
a probe is run once the credit covers its expected cost, and it then pays what it really cost beyond plain decoding.
That cost includes the drafter catching up on the text it skipped while off: b target steps per skipped token, one
more estimate, learned from the probes. On a GPU b is about 0 (a forward over many tokens costs what one costs);
on a CPU it is not, and a later probe costs more than an early one. If b exceeds the budget, no spacing pays for
probes and they stop. While speculation is off the loop does not even prefill the drafter (`reads_prompt`): a
useless draft then costs nothing per request, and the prompt joins the text a probe catches up on.
Timings are robust to one-off stalls: a CUDA graph captured or a kernel compiled on first use makes one round tens
to hundreds of times slower than the rest. Left in, one such draft step made c look far above 1 on an H200 (the real
Qwen pair's sweep: speculation switched off, and no probe affordable again: 0.92x). So a first draft step above
`STALL` target steps is timed again and the faster of the two kept (`StepTime`); after that, a round slower
than `STALL` times what the estimates predict teaches acceptance but no timing, unless it is the `STALL_RUN`-th or
later of such rounds in a row (the machine changed: those are learned until a round fits the estimates again).
Everything is deterministic: no randomness, only the rounds it is shown.

Times must be real: on a GPU run the loop with timing=True (its default), which synchronises before each clock read.
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable

from spec import calc
from spec.loop import KPolicy, Round
from spec.tree import MAX_NODES, branches, widths

PRIOR_ALPHA_WEIGHT = 2.0  # judged positions the prior alpha is worth; real rounds outweigh it within a few rounds
OPTIMISM = 1.0  # standard errors added to alpha's estimate when choosing K (`AdaptiveK.hopeful_alpha`)
STALL = 4.0  # a round this many times slower than predicted is a stall (a graph capture, a compile): not timed
STALL_RUN = 4  # ... unless this many rounds in a row were: then the machine changed, and the estimates follow


class Decayed:
    """sum(w_i x_i) / sum(w_i y_i) with w_i = (1 - 1/memory)^age: a running ratio that forgets old observations."""

    def __init__(self, memory: float):
        self.decay = 1 - 1 / memory
        self.num = self.den = 0.0

    def add(self, num: float, den: float) -> None:
        self.num = self.num * self.decay + num
        self.den = self.den * self.decay + den

    @property
    def value(self) -> float | None:
        return self.num / self.den if self.den > 0 else None


class StepTime(Decayed):
    """Seconds per step, decayed like `Decayed`; of its first two observations it keeps the faster one, since a
    first step may pay for a one-off capture or compile."""

    def __init__(self, memory: float):
        super().__init__(memory)
        self.count = 0

    def add(self, seconds: float, steps: float) -> None:
        self.count += 1
        if self.count == 2:
            if seconds / steps >= self.value:
                return  # the first stands
            self.num = self.den = 0.0  # the first paid for a warm-up: start from this one
        super().add(seconds, steps)


class AdaptiveK:
    """Chooses K each round to maximise the predicted speedup; turns speculation off when it cannot pay.

    max_k: the largest K it may choose. memory: how many observations an estimate mostly reflects.
    probe_budget: the share of time probes may cost. prior_alpha: the acceptance assumed before any round.

    The first rounds measure what the formula needs: K = 1 (a draft step, timed once the drafter is in step with the
    text: right after the prefill, or, behind a plain first round (speculate's first_alone), at the K = 1 round
    after the one that catches up) and K = 0 (a target step). From then on every choice comes from the estimates.
    """

    def __init__(self, max_k: int = 8, memory: float = 32, probe_budget: float = 0.02, prior_alpha: float = 0.5):
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if memory < 1:
            raise ValueError(f"memory must be >= 1, got {memory}")
        if not 0 < probe_budget < 1:
            raise ValueError(f"probe_budget must be in (0, 1), got {probe_budget}")
        if not 0 <= prior_alpha <= 1:
            raise ValueError(f"prior_alpha must be in [0, 1], got {prior_alpha}")
        self.max_k = max_k
        self.probe_budget = probe_budget
        self.alpha = Decayed(memory)
        self.alpha.add(prior_alpha * PRIOR_ALPHA_WEIGHT, PRIOR_ALPHA_WEIGHT)
        self.target_step = StepTime(memory)  # seconds per K = 0 round
        self.draft_step = StepTime(memory)  # seconds per draft step
        self.slope = Decayed(memory)  # extra target steps per draft, beyond the draft steps themselves
        self.lead = Decayed(memory)  # l: seconds more when a round's first draft forward reads two tokens
        self.catch_up = Decayed(memory)  # b: target steps per skipped token the drafter spends catching up
        self._lag = 0  # tokens emitted by K = 0 rounds since the drafter last ran (it will have to read them)
        self._unread_prompt = 0  # prompt tokens the drafter skipped at this generation's prefill
        self._credit = 0.0  # target steps that probes may still spend while speculation is off
        self._since_probe = 0  # rounds since the last K = 0 probe while speculation is on
        self._probing = False
        self._stalls = 0  # rounds in a row slower than STALL x their prediction

    def estimates(self) -> tuple[float, float, float] | None:
        """(alpha, c, s), or None until a draft step and a target step have been timed."""
        t_target, t_draft = self.target_step.value, self.draft_step.value
        if t_target is None or t_draft is None:
            return None
        return self.alpha.value, t_draft / t_target, max(0.0, self.slope.value or 0.0)

    def snapshot(self) -> dict:
        """The estimates as they stand (None where not yet measured), and the K they choose: for reports."""
        estimates = self.estimates()
        alpha, c, s = estimates if estimates else (self.alpha.value, None, None)
        k, gain = self.choice() if estimates else (None, None)
        return {"alpha": alpha, "c": c, "s": s, "lead": self.lead.value, "catch_up": self.catch_up.value,
                "target_step_s": self.target_step.value, "draft_step_s": self.draft_step.value, "k": k,
                "predicted_x": gain}

    def choice(self) -> tuple[int, float]:
        """The formula's best K for the current estimates, and its predicted speedup."""
        estimates = self.estimates()
        if estimates is None:
            raise RuntimeError("no estimates yet: the policy has not seen a draft step and a target step")
        alpha, c, _ = estimates
        verify = self._verify_costs()
        best = calc.best_k(alpha, c, self.max_k, verify)
        return best if best[0] else calc.best_k(self.hopeful_alpha(), c, self.max_k, verify)

    def _verify_costs(self) -> dict[int, float]:
        """{K: 1 + s K + alpha^K l} in target steps: what a round of K drafts costs beyond its K draft steps."""
        alpha, _, s = self.estimates()
        lead = (self.lead.value or 0.0) / self.target_step.value
        return {k: 1 + s * k + alpha ** k * lead for k in range(1, self.max_k + 1)}

    def hopeful_alpha(self) -> float:
        """Alpha plus OPTIMISM standard errors of its estimate, sqrt(a (1 - a) / n) over the n judged positions it
        rests on (decayed, the prior's weight included): what decides that speculation goes off (while it is on, K is
        the estimate's own best). While speculation is off only probes judge positions, and they are rationed
        (`probe_budget`, and each pays for the drafter reading the text it skipped), so an estimate taken from a few
        early rejections -- a warm-up, a prompt's opening -- would keep a good draft off for whole generations: on an
        H100 the real Qwen pair's sweep ran three of four code prompts plain after its warm-up left alpha at 0.34 (true
        value 0.92), 0.95x plain against 1.30x at K = 4 (benchmarks/h100/). The bonus shrinks as positions are judged
        (about 0.03 at K = 4 with `memory` 32) and is 0 for an alpha of 0 or 1. In simulated generations with the H100's
        costs (tests/test_policy.py, 10 seeds) the two generations after such a warm-up run at 1.14x plain instead of
        1.02x, and a useless draft still costs under 5 %."""
        a, n = self.alpha.value, self.alpha.den
        return min(1.0, a + OPTIMISM * math.sqrt(a * (1 - a) / n))

    def next_k(self) -> int:
        if self.draft_step.count == 0 or self._retime_draft():
            return 1
        if self.target_step.count == 0:
            return 0
        k, gain = self.choice()
        if k == 0:
            self._credit += self.probe_budget
            if self._credit >= self._expected_probe_cost():
                self._probing = True
                return 1
            return 0
        self._since_probe += 1
        if self._since_probe > self._on_probe_interval(k, gain):
            self._since_probe = 0
            return 0
        return k

    def reads_prompt(self, prompt_tokens: int) -> bool:
        """Skip the drafter's prefill while speculation is off: a useless draft then costs nothing per request, and
        a later probe pays for catching up on the prompt like any other skipped text (the catch-up estimate)."""
        if self.estimates() is not None and self.choice()[0] == 0:
            self._unread_prompt = prompt_tokens
            return False
        self._unread_prompt = 0
        return True

    def _expected_probe_cost(self) -> float:
        """Target steps a K = 1 probe would cost beyond plain decoding: c + 1 + s steps plus catching up on the
        skipped tokens, for 1 + alpha tokens that plain decoding makes in 1 + alpha steps."""
        alpha, c, s = self.estimates()
        return c + s + (self.catch_up.value or 0.0) * self._lag - alpha

    def _on_probe_interval(self, k: int, gain: float) -> int:
        """Rounds between K = 0 probes while speculating: one plain round makes a token in one step instead of
        1/gain steps, and should cost at most `probe_budget` of the `interval` rounds it follows."""
        cost = calc.round_cost(k, self.estimates()[1], self._verify_costs())
        return max(1, math.ceil((1 - 1 / gain) / (self.probe_budget * cost)))

    def _retime_draft(self) -> bool:
        """A first draft step above STALL target steps is most likely a stall (no K pays beyond c = 1 anyway): time
        one more before speculation is judged off on it."""
        return (self.draft_step.count == 1 and self.target_step.count >= 1
                and self.draft_step.value > STALL * self.target_step.value)

    def _stalled(self, rnd: Round) -> bool:
        """Whether this round is a one-off stall: slower than STALL x the estimates' prediction for it, and not the
        STALL_RUN-th such round in a row. Until both steps are timed (and a suspect first draft step re-timed), none
        is."""
        if self.estimates() is None or self._retime_draft():
            return False
        _, c, s = self.estimates()
        t_target = self.target_step.value
        predicted = t_target * (rnd.drafted * c + 1 + s * rnd.drafted + (self.catch_up.value or 0.0) * self._lag)
        if rnd.total_s <= STALL * predicted:
            self._stalls = 0
            return False
        self._stalls += 1
        return self._stalls < STALL_RUN  # from the STALL_RUN-th on, slow rounds are the new normal: learned

    def observe(self, rnd: Round) -> None:
        t_target, t_draft = self.target_step.value, self.draft_step.value
        probing, self._probing = self._probing, False
        if rnd.prefill_s:
            # A new generation: the drafter has just read the whole prompt, unless it was told to skip it.
            self._lag, self._unread_prompt = self._unread_prompt, 0
        if self._stalled(rnd):
            if rnd.drafted:
                self.alpha.add(rnd.accepted, rnd.accepted + (1 if rnd.accepted < rnd.drafted else 0))
                self._lag = 0
            else:
                self._lag += len(rnd.tokens)
            return
        if rnd.drafted == 0:
            self.target_step.add(rnd.total_s, 1)
            self._lag += len(rnd.tokens)
            return
        rejected = 1 if rnd.accepted < rnd.drafted else 0
        self.alpha.add(rnd.accepted, rnd.accepted + rejected)
        if self._lag == 0:
            draft_s = rnd.draft_s
            if rnd.forwards[:1] == (2,) and t_draft and self.draft_step.count > 1:  # led by two tokens: the last
                # round kept all its drafts (spec.drafters.ModelDrafter). Its extra is the lead; c learns the rest.
                self.lead.add(max(0.0, rnd.draft_s - rnd.drafted * t_draft), 1)
                draft_s = max(rnd.draft_s - self.lead.value, 0.5 * rnd.draft_s)
            self.draft_step.add(draft_s, rnd.drafted)
        elif t_target and t_draft:
            # Capped at one draft step per skipped token (reading them one by one); a hiccup above it is noise.
            extra = max(0.0, rnd.draft_s - rnd.drafted * t_draft) / t_target
            self.catch_up.add(min(extra, self._lag * t_draft / t_target), self._lag)
        if t_target:
            # Capped at s = 1 (verifying K + 1 tokens costs at most K + 1 steps) for the same reason.
            self.slope.add(min((rnd.total_s - rnd.draft_s) / t_target - 1, rnd.drafted), rnd.drafted)
            if probing:
                self._credit -= rnd.total_s / t_target - len(rnd.tokens)
        self._lag = 0


# ---- Token trees: a static shape a round, chosen from measurements ----------------------------------------------


class LineFit:
    """y ~ a x1 + b x2 with a, b >= 0, by least squares over decayed observations (weights (1 - 1/memory)^age).
    Until the observations tell the two terms apart (x2 / x1 constant so far) it keeps b = 0: the x1 term alone."""

    def __init__(self, memory: float):
        self.decay = 1 - 1 / memory
        self.sums = [0.0] * 6  # x1 x1, x1 x2, x2 x2, x1 y, x2 y, y y

    def add(self, x1: float, x2: float, y: float) -> None:
        for i, v in enumerate((x1 * x1, x1 * x2, x2 * x2, x1 * y, x2 * y, y * y)):
            self.sums[i] = self.sums[i] * self.decay + v

    def coef(self) -> tuple[float, float] | None:
        s11, s12, s22, s1y, s2y, syy = self.sums
        if s11 <= 0 and s22 <= 0:
            return None
        det = s11 * s22 - s12 * s12
        if det > 1e-9 * s11 * s22:
            a, b = (s22 * s1y - s12 * s2y) / det, (s11 * s2y - s12 * s1y) / det
            if a >= 0 and b >= 0:
                return a, b
        fits = [(max(0.0, s1y / s11), 0.0)] if s11 > 0 else []
        if det > 1e-9 * s11 * s22 or s11 <= 0:  # the x2 term alone, once it can be told apart
            fits.append((0.0, max(0.0, s2y / s22)))

        def residual(ab):
            a, b = ab
            return syy - 2 * a * s1y - 2 * b * s2y + a * a * s11 + 2 * a * b * s12 + b * b * s22

        return min(fits, key=residual)


class SlotHazards:
    """How often the target's token is the draft's rank-r choice at a node of depth d - 1 (children at depth d),
    from Round.slots: h(d, r) = P(slot r taken | slots 0 .. r - 1 not), decayed. A node that offered m children
    and was left by none says only that the slot is m or more (censored): it counts for ranks below m, so offering
    fewer children never biases the estimate. Each depth's estimate is shrunk toward the rank's estimate over all
    depths, and that toward `prior`, each with the weight of PRIOR_ALPHA_WEIGHT observations."""

    def __init__(self, memory: float, prior: float):
        self.memory, self.prior = memory, prior
        self.cells: dict[tuple[int, int], Decayed] = {}
        self.ranks: dict[int, Decayed] = {}

    def add(self, slots: list[tuple[int, int]]) -> None:
        for depth, (slot, offered) in enumerate(slots, 1):
            for rank in range(min(slot + 1, offered)):
                hit = 1.0 if rank == slot else 0.0
                self.cells.setdefault((depth, rank), Decayed(self.memory)).add(hit, 1.0)
                self.ranks.setdefault(rank, Decayed(self.memory)).add(hit, 1.0)

    def hazard(self, depth: int, rank: int) -> float:
        pooled = self.ranks.get(rank)
        h = self.prior if pooled is None else (pooled.num + PRIOR_ALPHA_WEIGHT * self.prior) / (
            pooled.den + PRIOR_ALPHA_WEIGHT)
        cell = self.cells.get((depth, rank))
        return h if cell is None else (cell.num + PRIOR_ALPHA_WEIGHT * h) / (cell.den + PRIOR_ALPHA_WEIGHT)

    def leave(self, depth: int, b: int) -> float:
        """Probability that a node of depth `depth` - 1 offering its top b children is left by one of them."""
        stay = 1.0
        for rank in range(b):
            stay *= 1 - self.hazard(depth, rank)
        return 1 - stay


def is_tree(rnd: Round) -> bool:
    """Whether a round drafted a tree: more nodes than draft forwards (a chain's forwards each add one node)."""
    return rnd.drafted > len(rnd.forwards) > 0


class TreePolicy:
    """Chooses each round's token tree — a static shape, a chain, or K = 0 — to maximise predicted tokens per second,
    from running estimates of what the rounds it observes show (pass it as `k=` to spec.loop.speculate with a
    `ModelDrafter`; `--tree auto`).

    - Acceptance: `SlotHazards` from each round's slots (which child the rule took at each node it visited), per
      depth and rank; a static shape then emits `calc.tree_tokens_by_depth` tokens a round.
    - Draft cost: a draft forward over w tokens costs a_d + b_d w seconds, fitted (`LineFit`) to each round's draft
      time against its forwards (how many, and the tokens they read: the catch-up, then each fed depth's width); a
      shape's prediction counts the catch-up its full rounds cause (`calc.tree_round_cost`'s `full`).
    - Verify cost: a target forward over n tokens costs a_v + b_v n seconds, fitted to each round's verify time (the
      forward and the rule) against the tokens it read; n = 1 is a plain step, the unit of `calc.tree_round_cost`.
    - Overhead: the rest of a round (bookkeeping, the caches' compaction), a decayed mean per round, one for chains
      (and plain steps) and one for trees, which pay more of it (their masks, the compaction of a scattered path: on
      an H100 a tree round took 0.13-0.20 target steps more than its forwards beyond a chain's in five of session
      20's six tree_sweep fits, 0.02 in the sixth); until a tree round has been seen, a tree is charged a chain's.

    Every round it predicts every shape of `calc.tree_shapes(max_nodes, max_depth)` (branching at most 4,
    non-increasing) and a plain step, and picks the fastest; a tree must beat plain decoding to be chosen, and ties
    go to fewer nodes. Trees are chosen only if rank-1 hazards make their extra nodes pay, so when branches are never
    taken it falls back to the chain, and when no draft pays, to K = 0. While off it probes a K = 1 chain within
    `probe_budget` of the time, as AdaptiveK does (the probe's catch-up included), so that acceptance and the draft's
    cost stay current; a round slower than STALL x its prediction teaches acceptance but no timing, unless STALL_RUN
    come in a row. The first three rounds measure: a K = 1 chain, a plain step, and a (2, 1) tree (two widths of
    draft forward, three sizes of verify). Deterministic: no randomness, only the rounds it is shown.
    """

    def __init__(self, max_depth: int = 8, max_nodes: int = 16, memory: float = 32, probe_budget: float = 0.02,
                 prior: float = 0.5):
        if max_depth < 1 or not 1 <= max_nodes <= 64:
            raise ValueError(f"max_depth must be >= 1 and max_nodes in 1..64, got {max_depth}, {max_nodes}")
        if not 0 < probe_budget < 1:
            raise ValueError(f"probe_budget must be in (0, 1), got {probe_budget}")
        self.max_k = max_depth  # what the models prepare for (harness.warm_up, the server)
        self.max_nodes = max_nodes
        self.shapes = calc.tree_shapes(max_nodes, max_depth)
        self.probe_budget = probe_budget
        self.hazards = SlotHazards(memory, prior)
        self.draft = LineFit(memory)  # seconds = a_d forwards + b_d tokens
        self.verify = LineFit(memory)  # seconds = a_v + b_v tokens
        self.overhead = Decayed(memory)  # a chain's round (or a plain step's), seconds
        self.tree_overhead = Decayed(memory)  # a tree's round
        self._boot = [(1,), 0, (2, 1) if max_depth > 1 and max_nodes >= 3 else (min(2, max_nodes),)]
        self._asked = False  # next_k was called since the last round observed (a round it did not choose: False)
        self._lag = 0  # tokens plain rounds emitted since the drafter last ran (its next forward reads them)
        self._credit = 0.0
        self._probing = False
        self._stalls = 0

    def reads_prompt(self, prompt_tokens: int) -> bool:
        return True

    def costs(self) -> tuple[dict, dict, float, float] | None:
        """(draft forward of w tokens, target forward of n tokens, overhead a chain's round, overhead a tree's), in
        target steps (a target forward of 1 token), or None until both kinds of forward have been timed."""
        draft, verify = self.draft.coef(), self.verify.coef()
        if draft is None or verify is None or self.overhead.value is None or verify[0] + verify[1] <= 0:
            return None
        step = verify[0] + verify[1]
        widest = max(2, *(max(widths(shape)[:-1], default=1) for shape in self.shapes))  # 2: the catch-up
        draft_cost = {w: (draft[0] + draft[1] * w) / step for w in range(1, widest + 1)}
        verify_cost = {n: (verify[0] + verify[1] * n) / step for n in range(1, MAX_NODES + 2)}
        return draft_cost, verify_cost, self._overhead_s(False) / step, self._overhead_s(True) / step

    def _overhead_s(self, tree: bool) -> float | None:
        """A round's overhead in seconds: a tree's, once a tree round has been seen; else a chain's."""
        if tree and self.tree_overhead.value is not None:
            return self.tree_overhead.value
        return self.overhead.value

    def snapshot(self) -> dict:
        """The cost estimates in target steps (a draft forward of 1 / 2 / 4 tokens, a target forward of 1 / 5 / 17
        tokens, the overhead a round; None until timed), a chain's acceptance per depth (the top child taken), and the
        shape they choose: for reports."""
        costs = self.costs()
        out = {"draft_cost": None, "verify_cost": None, "overhead": None, "tree_overhead": None, "choice": None,
               "predicted": None,
               "chain_acceptance_by_depth": [round(self.hazards.leave(d, 1), 4) for d in range(1, self.max_k + 1)]}
        if costs is not None:
            draft_cost, verify_cost, overhead, tree_overhead = costs
            shape, predicted = self.choice()
            out.update(draft_cost={w: draft_cost[w] for w in (1, 2, 4) if w in draft_cost},
                       verify_cost={n: verify_cost[n] for n in (1, 5, 17) if n in verify_cost},
                       overhead=overhead, tree_overhead=tree_overhead, choice=list(shape), predicted=predicted)
        return out

    def predictions(self) -> list[tuple[tuple[int, ...], float]] | None:
        """(shape, predicted tokens per target step) for every shape, and () for a plain step; None until timed."""
        costs = self.costs()
        if costs is None:
            return None
        draft_cost, verify_cost, overhead, tree_overhead = costs
        out = [((), 1 / (1 + overhead))]
        for shape in self.shapes:
            reach = calc.tree_reach_by_depth(shape, self.hazards.leave)
            cost = calc.tree_round_cost(shape, draft_cost, verify_cost, full=reach[-1])
            cost += tree_overhead if branches(shape) else overhead
            out.append((shape, (1 + sum(reach)) / cost))
        return out

    def choice(self) -> tuple[tuple[int, ...], float]:
        """The fastest predicted shape (() = a plain step) and its tokens per target step. Ties: fewer nodes."""
        predicted = self.predictions()
        if predicted is None:
            raise RuntimeError("no estimates yet: the policy has not timed a draft and a target forward")
        return max(predicted, key=lambda item: (item[1], -sum(widths(item[0]))))

    def next_k(self) -> int | tuple[int, ...]:
        self._asked = True
        if self._boot:
            return self._boot[0]
        shape, _ = self.choice()
        if shape:
            return shape
        self._credit += self.probe_budget
        if self._credit >= self._probe_cost():
            self._probing = True
            return (1,)
        return 0

    def _probe_cost(self) -> float:
        """Target steps a K = 1 probe costs beyond plain decoding: its round, less the 1 + alpha steps plain decoding
        takes for its 1 + alpha tokens (the catch-up over the lag is in its first forward)."""
        draft_cost, verify_cost, overhead, _ = self.costs()
        catch_up = self.draft.coef()[1] * self._lag / (self.verify.coef()[0] + self.verify.coef()[1])
        tokens = calc.tree_tokens_by_depth((1,), self.hazards.leave)
        return calc.tree_round_cost((1,), draft_cost, verify_cost) + catch_up + overhead - tokens * (1 + overhead)

    def _predicted_s(self, rnd: Round) -> float | None:
        draft, verify = self.draft.coef(), self.verify.coef()
        if draft is None or verify is None or self.overhead.value is None:
            return None
        return (draft[0] * len(rnd.forwards) + draft[1] * sum(rnd.forwards) + verify[0] + verify[1] * rnd.verified
                + self._overhead_s(is_tree(rnd)))

    def _stalled(self, rnd: Round) -> bool:
        predicted = self._predicted_s(rnd)
        if predicted is None or rnd.total_s <= STALL * predicted:
            self._stalls = 0
            return False
        self._stalls += 1
        return self._stalls < STALL_RUN

    def observe(self, rnd: Round) -> None:
        if self._boot and self._asked:  # a round the loop ran on its own (speculate's first_alone) measures no boot
            self._boot.pop(0)
        self._asked = False
        probing, self._probing = self._probing, False
        self.hazards.add(rnd.slots)
        if not self._stalled(rnd):
            if rnd.forwards:
                self.draft.add(len(rnd.forwards), sum(rnd.forwards), rnd.draft_s)
            self.verify.add(1.0, rnd.verified or rnd.drafted + 1, rnd.verify_s)
            overhead = self.tree_overhead if is_tree(rnd) else self.overhead
            overhead.add(max(0.0, rnd.total_s - rnd.draft_s - rnd.verify_s), 1.0)
            verify = self.verify.coef()
            if probing and verify and verify[0] + verify[1] > 0:
                self._credit -= rnd.total_s / (verify[0] + verify[1]) - len(rnd.tokens)
        self._lag = 0 if rnd.forwards else self._lag + len(rnd.tokens)


class KSpecError(ValueError, argparse.ArgumentTypeError):
    """A bad K specification. A ValueError for library callers (the server answers 400); as an ArgumentTypeError,
    argparse prints its message when parse_k is an argument's `type`."""


def parse_k(text: str) -> int | Callable[[], KPolicy]:
    """Read a K setting: "4" -> 4 drafts per round; "auto" -> a factory of AdaptiveK() (max K 8); "auto:6" -> of
    AdaptiveK(max_k=6). Pass the policy as `k=` to spec.loop.speculate. A policy learns as it goes and its estimates
    stay valid from one request to the next (same models, same machine): make one per server and decoding mode
    (greedy or sampling, whose acceptance differs) and reuse it, rather than one per request that relearns each time."""
    text = text.strip().lower()
    if text == "auto" or text.startswith("auto:"):
        _, _, limit = text.partition(":")
        max_k = 8
        if limit:
            if not limit.isdigit() or int(limit) < 1:
                raise KSpecError(f"'auto:N' needs a whole number N >= 1 (the largest K), got {text!r}")
            max_k = int(limit)
        return functools.partial(AdaptiveK, max_k=max_k)
    if not text.isdigit():
        raise KSpecError(f"K must be a whole number >= 0, 'auto' or 'auto:N', got {text!r}")
    return int(text)
