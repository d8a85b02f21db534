"""Per-replica throughput model fitted online: step_time(x) ≈ a + b·x, tokens/s f(n) = x(n) / step_time(x(n)).

Why a line: a decode step costs a fixed part (weights streamed once per step, kernel launches) plus a part
that grows with the tokens in the batch (KV reads, activations); so tokens/s rises with concurrency and
saturates at 1/b. That concavity is what makes "give the next sequence to the replica with the largest
marginal gain" meaningful. Train steps follow the same shape in tokens per micro-batch.

The fit is recency-weighted least squares over (x, step_time) samples, plus a fixed pseudo-observation prior
(two points on the prior line) so the model is sane before any data and never degenerate when every sample
sits at one x. A role keeps a shared model that sees every sample of its replicas; a new replica starts
from a copy of it (`ThroughputModel.spawn`), so it is not assumed to be the cold prior.
"""

from __future__ import annotations

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
    prior_x: float = 64.0
    # Recency-weighted sufficient statistics of the measured samples (sum of w, w·x, w·x², w·t, w·x·t).
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)
    _kx: list[float] = field(default_factory=lambda: [0.0, 0.0])  # weighted (x, n) for tokens per seq
    samples: int = 0
    a: float = 0.0
    b: float = 0.0

    def __post_init__(self) -> None:
        self.prior_a = max(float(self.prior_a), _MIN_A)
        self.prior_b = max(float(self.prior_b), _MIN_B)
        self._refit()

    # -- learning ---------------------------------------------------------------------------------------
    def observe(self, concurrency: int, step_time_s: float, tokens: float | None = None) -> None:
        """Record one engine step: `concurrency` sequences, `tokens` work (defaults to one per sequence)."""
        if concurrency <= 0 or not step_time_s > 0.0:
            return
        x = float(tokens) if tokens is not None else concurrency * self.tokens_per_seq_step
        if x <= 0:
            return
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

    def _refit(self) -> None:
        # Prior as two pseudo-points on the prior line at x=1 and x=prior_x, weight prior_weight/2 each.
        w = self.prior_weight / 2.0
        p0 = 2 * w
        p1 = w * (1.0 + self.prior_x)
        p2 = w * (1.0 + self.prior_x**2)
        t1 = self.prior_a + self.prior_b
        tx = self.prior_a + self.prior_b * self.prior_x
        p3 = w * (t1 + tx)
        p4 = w * (t1 + self.prior_x * tx)
        s0, s1, s2, s3, s4 = (self._s[0] + p0, self._s[1] + p1, self._s[2] + p2, self._s[3] + p3,
                              self._s[4] + p4)
        det = s0 * s2 - s1 * s1
        degenerate = det <= 1e-12 * max(s0 * s2, 1e-300)
        b = self.prior_b if degenerate else (s0 * s4 - s1 * s3) / det
        b = max(b, _MIN_B)
        a = max((s3 - b * s1) / s0, _MIN_A)
        self.a, self.b = a, b
        if self._kx[1] > 0:
            self.tokens_per_seq_step = self._kx[0] / self._kx[1]

    def spawn(self) -> ThroughputModel:
        """A model for a new replica: starts from this (role-shared) fit, then learns on its own."""
        child = ThroughputModel(self.a, self.b, self.tokens_per_seq_step, self.decay, self.prior_weight,
                                self.prior_x)
        return child

    # -- prediction -------------------------------------------------------------------------------------
    def step_time(self, n: float) -> float:
        return self.a + self.b * n * self.tokens_per_seq_step

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
