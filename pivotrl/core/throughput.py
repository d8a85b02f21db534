"""Per-replica throughput model fitted online: step_time(x) ≈ a + b·x, tokens/s f(n) = x(n) / step_time(x(n)).

Why a line: a decode step costs a fixed part (weights streamed once per step, kernel launches) plus a part
that grows with the tokens in the batch (KV reads, activations); so tokens/s rises with concurrency and
saturates at 1/b. That concavity is what makes "give the next sequence to the replica with the largest
marginal gain" meaningful. Train steps follow the same shape in tokens per micro-batch.

Context. A decode step also reads every cached token of its rows, so it slows as they grow: a + b·x +
c·context. Where the role knows c (`RoleSpec.step_context_s`) and the engine reports a step's context, the
sample is first moved to the line's reference context per row (`context_ref`), so the line holds at that
context whatever mix of short and long rows the samples came from. Its readers move it to the context
they price: the planner to the rows running now (`pivotrl.core.views`), the iteration model to the
context its lengths give (`pivotrl.core.iteration.at_context`).

The fit is recency-weighted least squares over (x, step_time) samples. Before any data it is the prior line;
while the samples show too little spread in x to see a slope (an engine that always runs full), it keeps the
prior's shape scaled to match the measured step time, so it is never degenerate.
A role keeps a shared model that sees every sample of its replicas; a new replica starts
from a copy of it (`ThroughputModel.spawn`), so it is not assumed to be the cold prior.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

_MIN_A = 1e-6
_MIN_B = 1e-9


@dataclass
class ThroughputModel:
    prior_a: float
    prior_b: float
    tokens_per_seq_step: float = 1.0
    decay: float = 0.95
    prior_weight: float = 2.0
    context_s: float = 0.0  # seconds per step per context token of the rows (0: context not priced)
    context_ref: float = 0.0  # context per row the fitted line holds at
    # Recency-weighted sufficient statistics of the measured samples (sum of w, w·x, w·x², w·t, w·x·t).
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)
    _kx: list[float] = field(default_factory=lambda: [0.0, 0.0])  # weighted (x, n) for tokens per seq
    # Recency-weighted (seconds beyond the line, tokens) of steps that prefilled newcomers.
    _pf: list[float] = field(default_factory=lambda: [0.0, 0.0])
    samples: int = 0
    a: float = 0.0
    b: float = 0.0

    def __post_init__(self) -> None:
        self.prior_a = max(float(self.prior_a), _MIN_A)
        self.prior_b = max(float(self.prior_b), _MIN_B)
        self._refit()

    # -- learning ---------------------------------------------------------------------------------------
    def observe(self, concurrency: int, step_time_s: float, tokens: float | None = None,
                context: float | None = None) -> None:
        """Record one engine step: `concurrency` sequences, `tokens` work (defaults to one per sequence),
        `context` tokens held by its rows (None: not reported)."""
        if concurrency <= 0 or not step_time_s > 0.0:
            return
        x = float(tokens) if tokens is not None else concurrency * self.tokens_per_seq_step
        if x <= 0:
            return
        moved = self._at_reference(concurrency, step_time_s, context)
        if moved is None:
            return
        step_time_s = moved
        d = self.decay
        s = self._s
        for i in range(5):
            s[i] *= d
        s[0] += 1.0
        s[1] += x
        s[2] += x * x
        s[3] += step_time_s
        s[4] += x * step_time_s
        self._kx[0] = self._kx[0] * d + x
        self._kx[1] = self._kx[1] * d + concurrency
        self.samples += 1
        self._refit()

    def _at_reference(self, concurrency: int, step_time_s: float, context: float | None) -> float | None:
        """The step time moved to the reference context; unchanged where context is not priced or not
        reported. None where the move leaves nothing of the step: a context that says the step should have
        cost more than it took is no sample of the line."""
        if self.context_s <= 0.0 or context is None or context < 0.0:
            return step_time_s
        moved = step_time_s - self.context_s * (float(context) - concurrency * self.context_ref)
        return moved if moved > 0.0 else None

    def observe_prefill(self, concurrency: int, step_time_s: float, prefill_tokens: float,
                        tokens: float | None = None, context: float | None = None) -> None:
        """Record a step that also prefilled `prefill_tokens` of newcomers' prompts. Its time beyond the line
        (the decode of its `concurrency` rows) is the prefill's; the line itself learns from pure decode
        steps only. A batch admitted at once prefills thousands of tokens in one step, which a line over
        rows would read as a slow decode step; the split keeps both costs, as the simulator prices them."""
        if prefill_tokens <= 0 or not step_time_s > 0.0:
            return
        x = float(tokens) if tokens is not None else concurrency * self.tokens_per_seq_step
        moved = self._at_reference(concurrency, step_time_s, context)
        if moved is None:
            return
        beyond = max(0.0, moved - (self.a + self.b * x))
        d = self.decay
        self._pf[0] = self._pf[0] * d + beyond
        self._pf[1] = self._pf[1] * d + float(prefill_tokens)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prefill tokens per second measured so far (None before any prefill, or when it cost nothing)."""
        seconds, tokens = self._pf
        return tokens / seconds if seconds > 0 and tokens > 0 else None

    def prefill_statistics(self) -> list[float]:
        """The prefill estimate's weighted sums, for a checkpoint."""
        return list(self._pf)

    def restore_prefill_statistics(self, pf: Iterable[float]) -> None:
        self._pf = checked_prefill_statistics(pf)

    def _refit(self) -> None:
        s0, s1, s2, s3, s4 = self._s
        if s0 <= 0:
            self.a, self.b = self.prior_a, self.prior_b
        else:
            mx, mt = s1 / s0, s3 / s0
            var = max(s2 / s0 - mx * mx, 0.0)
            if s0 >= self.prior_weight and var > (0.05 * mx) ** 2:
                a, b = _least_squares(mx, mt, var, s4 / s0)
            else:
                # Too little spread in x to see a slope: keep the prior's shape, scaled to match the data.
                scale = mt / (self.prior_a + self.prior_b * mx)
                a, b = self.prior_a * scale, self.prior_b * scale
            self.a, self.b = max(a, _MIN_A), max(b, _MIN_B)
        if self._kx[1] > 0:
            self.tokens_per_seq_step = self._kx[0] / self._kx[1]

    def statistics(self) -> tuple[list[float], list[float], int]:
        """What the fit is computed from (the weighted sums, the tokens-per-sequence sums, the sample
        count): a checkpoint keeps these, so a resumed run refits to exactly the same line."""
        return list(self._s), list(self._kx), self.samples

    def restore_statistics(self, sums: list[float], kx: list[float], samples: int) -> None:
        """Replace the measured statistics with a checkpoint's (`statistics`) and refit."""
        if len(sums) != 5 or len(kx) != 2:
            raise ValueError(f"throughput statistics: 5 sums and 2 kx values, got {len(sums)} and {len(kx)}")
        self._s, self._kx, self.samples = [float(x) for x in sums], [float(x) for x in kx], int(samples)
        self._refit()

    def spawn(self) -> ThroughputModel:
        """A model for a new replica: starts from this (role-shared) fit, then learns on its own."""
        return ThroughputModel(self.a, self.b, self.tokens_per_seq_step, self.decay, self.prior_weight,
                               self.context_s, self.context_ref)

    # -- prediction -------------------------------------------------------------------------------------
    def step_time(self, n: float) -> float:
        return self.a + self.b * n * self.tokens_per_seq_step

    def b_at(self, context_per_row: float) -> float:
        """The line's slope at `context_per_row` tokens of context per row instead of the reference."""
        extra = self.context_s * (context_per_row - self.context_ref) / max(self.tokens_per_seq_step, 1e-12)
        return max(self.b + extra, _MIN_B)

    def rate(self, n: float) -> float:
        """Tokens/s with `n` sequences running (0 when idle)."""
        if n <= 0:
            return 0.0
        x = n * self.tokens_per_seq_step
        return x / (self.a + self.b * x)

    def marginal_gain(self, n: int) -> float:
        """f(n+1) − f(n): what one more sequence adds. Positive and decreasing in n (f is concave)."""
        return self.rate(n + 1) - self.rate(n)

    @property
    def peak_rate(self) -> float:
        """Tokens/s as concurrency grows without bound (1/b)."""
        return 1.0 / self.b


def checked_prefill_statistics(pf: Iterable[float]) -> list[float]:
    """`pf` as the prefill estimate's two weighted sums (seconds, tokens), or ValueError: the one check of a
    checkpoint's `pf`, whether it is read or restored."""
    values = [float(x) for x in pf]
    if len(values) != 2:
        raise ValueError(f"prefill statistics: 2 values, got {len(values)}")
    return values


def _least_squares(mx: float, mt: float, var: float, mxt: float) -> tuple[float, float]:
    """The line t = a + b·x from the means of x, t and x·t and the variance of x (> 0). Where the data says
    "no fixed cost" (a below its floor) the line goes through the mean with the least fixed cost."""
    b = max((mxt - mx * mt) / var, _MIN_B)
    a = mt - b * mx
    if a < _MIN_A:
        a = _MIN_A
        b = max((mt - a) / mx, _MIN_B)
    return a, b


@dataclass
class StepTotals:
    """Unweighted sums over every step a role has run since the controller started: a profile of a whole
    run (`benchmarks.fidelity` fits a run's step line from them, `fit_totals`). Measurement only: every
    decision reads `ThroughputModel`'s recency-weighted fit, whose window (about 1 / (1 − decay) steps) is
    the last few steps, at the end of an iteration its tail, which is no line for a whole run.

    ``decode``: n, Σx, Σx², Σt, Σx·t over pure decode steps (x the step's work, t its seconds);
    ``prefill``: n, Σx, Σt, Σ prompt tokens over the steps that also prefilled newcomers."""

    decode: list[float] = field(default_factory=lambda: [0.0] * 5)
    prefill: list[float] = field(default_factory=lambda: [0.0] * 4)

    def add(self, x: float, step_time_s: float, prefill_tokens: float = 0.0) -> None:
        if x <= 0 or not step_time_s > 0.0:
            return
        if prefill_tokens > 0:
            p = self.prefill
            p[0] += 1.0
            p[1] += x
            p[2] += step_time_s
            p[3] += float(prefill_tokens)
        else:
            d = self.decode
            d[0] += 1.0
            d[1] += x
            d[2] += x * x
            d[3] += step_time_s
            d[4] += x * step_time_s

    def as_dict(self) -> dict[str, list[float]]:
        return {"decode": list(self.decode), "prefill": list(self.prefill)}


def fit_totals(decode: Iterable[float], prefill: Iterable[float]) -> tuple[float, float, float | None] | None:
    """The least-squares line t = a + b·x through `StepTotals` sums (or differences of two snapshots of
    them) and the prefill rate beyond it (tokens per second; None where the prefilling steps took no more
    than the line). None where the decode steps show no spread in x to see a slope from."""
    n, sx, sxx, st, sxt = (float(v) for v in decode)
    if n < 2:
        return None
    mx, mt = sx / n, st / n
    var = sxx / n - mx * mx
    if not var > 1e-12 * mx * mx:  # one batch size (up to rounding): no slope to see
        return None
    a, b = _least_squares(mx, mt, var, sxt / n)
    pn, psx, pst, ptok = (float(v) for v in prefill)
    beyond = pst - pn * a - b * psx
    return a, b, (ptok / beyond if pn > 0 and ptok > 0 and beyond > 0 else None)
