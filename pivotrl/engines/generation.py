"""Continuous-batching generation engine on one torch device (CPU here, CUDA unchanged).

Why: rollout (policy) and reward (GenRM judge) are both token generation, and the shift-aware scheduler
must be able to add sequences at any step, abort any sequence and get back what it generated so far, and
resume that partial sequence on *another* device. This engine does exactly that:

* **Continuous batching.** Every `step()` admits waiting sequences into free slots (FIFO, within the KV
  budget), prefills them in one batch packed back to back (no padding: prompts are long-tailed), decodes
  one token for every sequence already running, and samples all rows at once. A finished sequence leaves
  in the same step and its slot is reused.
* **Fast decode.** Weights packed once on CPU (for the native matmul, fp32 on AVX-512 and bf16 on
  AVX512-BF16; otherwise for oneDNN), fused q/k/v and gate/up matmuls, and native fused kernels for the
  rest of the step (`kernels.py`; built on first use, torch ops where they cannot build); the packed
  weights on huge pages where the kernel allows (`malloc.huge_pages`). `dtype=torch.bfloat16` casts the
  weights once at build; sampling and log-probs stay fp32, computed from the logits. fp32 is the default.
* **KV cache.** One pre-allocated slot cache, `[layers, 2, max_batch, kv_heads, cap, head_dim]` (see
  `kv_cache.KVSlots`; keys in transposed blocks of 16 positions). Running sequences are kept compact in slots
  0..B-1 (a finished row is replaced by the last row), so decode attends to a plain view, never a gather.
  `cap` starts small and doubles when a sequence needs more room — a rare, amortised copy, never a
  per-step reallocation.
* **KV budget.** `kv_budget_tokens` bounds the sum over running sequences of their *reservation*
  ``min(len(prompt) + max_new_tokens, max_seq_len)``, i.e. the most tokens each could ever cache. Admission
  waits until a reservation fits, so the cache can never overflow the budget mid-flight.
* **Sampling.** Per sequence temperature (0 = greedy), top-p, max_new_tokens, stop ids and seed. The random
  number for generated token *i* of a sequence is a hash of (seed, i) — no RNG state — so a sequence
  resumed elsewhere draws the same numbers, and batch composition never changes what a sequence samples.
  Give each sequence of a group its own seed if the samples must differ.
* **Log-probs.** For every sampled token the engine returns its log-prob under the *raw* model distribution
  (log-softmax of the logits at temperature 1, before top-p truncation), in fp32. That is what the trainer
  recomputes with a teacher-forced forward pass, so the two are directly comparable whatever the sampling
  parameters were.
* **Abort / resume.** `abort(ids)` returns partial `GenResult`s; `GenRequest(..., generated_ids=partial)`
  continues them on any engine: prompt + generated are prefilled and decoding goes on from the next token.
  With greedy decoding the continued sequence ends identical to an uninterrupted run.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from pivotrl.engines import kernels
from pivotrl.engines.checkpoints import from_pretrained
from pivotrl.engines.kv_cache import KVSlots
from pivotrl.engines.model import CausalLM
from pivotrl.engines.requests import FinishReason, GenRequest, GenResult, RequestBook, SamplingParams
from pivotrl.engines.sampling import keyed_uniform, sample_tokens

__all__ = [
    "FinishReason",
    "GenRequest",
    "GenResult",
    "GenerationEngine",
    "RequestBook",
    "SamplingParams",
    "keyed_uniform",
    "sample_tokens",
]


def _inference(method):
    """Run an engine method inside `torch.inference_mode`.

    Why every method that touches the engine's tensors needs it: `step()` runs in inference mode, so what it
    allocates there (a grown KV cache, a wider stop-id table) are inference tensors, and an in-place update
    of an inference tensor outside inference mode raises. `abort`/`offload` move rows in place, so they must
    run in the same mode as the step that may have regrown the state.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with torch.inference_mode():
            return method(self, *args, **kwargs)

    return wrapper


@dataclass
class _Running:
    req: GenRequest
    reserve: int


class GenerationEngine(RequestBook):
    """Continuous batching over a compact model on one device. See the module docstring.

    The engine takes over `model` (moves it to `device`, sets eval mode, packs its weights on CPU): give it
    its own instance rather than the one a trainer is updating.
    """

    def __init__(
        self,
        model: CausalLM | str | Path,
        *,
        kv_budget_tokens: int,
        max_batch: int,
        device: str | torch.device = "cpu",
        max_seq_len: int | None = None,
        max_prefill_tokens: int = 8192,
        dtype: torch.dtype | None = None,
        initial_cache_len: int = 256,
        max_samples: int = 4096,
        pack_weights: bool = True,
        native_kernels: bool = True,
    ) -> None:
        if kv_budget_tokens < 1 or max_batch < 1:
            raise ValueError("kv_budget_tokens and max_batch must be >= 1")
        self.device = torch.device(device)
        if isinstance(model, (str, Path)):
            model = from_pretrained(model, device=self.device, dtype=dtype or torch.float32)
        self.model = model.to(self.device).eval()
        if dtype is not None:
            self.model.to(dtype)
        self.config = model.config
        self.dtype = next(self.model.parameters()).dtype
        # The fused native decode kernels (`kernels.py`) where they build; else the same math in torch ops.
        # CPU kernels: a CUDA engine neither needs nor builds them.
        cpu = torch.device(self.device).type == "cpu"
        self.model.native = kernels.native() if native_kernels and cpu else None
        self.native_kernels = self.model.native is not None
        # Weights packed once on CPU (`cpu_pack.PackedWeight`: the native matmul, else oneDNN's): faster
        # decode matmuls; refreshed when weights change.
        self.packed = self.model.pack_for_inference(pack_weights)
        self.kv_budget_tokens = kv_budget_tokens
        self.max_batch = max_batch
        pos_limit = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.max_seq_len = min(max_seq_len or pos_limit, pos_limit, kv_budget_tokens)
        self.max_prefill_tokens = max_prefill_tokens
        cap = min(self.max_seq_len, max(16, initial_cache_len))
        self.cache: KVSlots | None = KVSlots(self.config, max_batch, cap, self.device, self.dtype)

        s, d = max_batch, self.device
        # Per-slot state, compact in rows 0..B-1 like the cache.
        self.lens = torch.zeros(s, dtype=torch.long, device=d)  # tokens cached (= position of next input)
        self.last_tok = torch.zeros(s, dtype=torch.long, device=d)  # next decode input
        self.n_gen = torch.zeros(s, dtype=torch.long, device=d)
        self.max_new = torch.zeros(s, dtype=torch.long, device=d)
        self.temperature = torch.zeros(s, dtype=torch.float32, device=d)
        self.top_p = torch.ones(s, dtype=torch.float32, device=d)
        self.seed = torch.zeros(s, dtype=torch.long, device=d)
        self.stop = torch.full((s, 1), -1, dtype=torch.long, device=d)
        self.gen_buf = torch.zeros(s, self.max_seq_len, dtype=torch.long, device=d)
        self.lp_buf = torch.zeros(s, self.max_seq_len, dtype=torch.float32, device=d)

        self.running: list[_Running] = []
        self.waiting: deque[GenRequest] = deque()
        self.reserved_tokens = 0
        self._ready: list[GenResult] = []  # finished without running (e.g. resumed at max length)
        # Counters.
        self.tokens_generated = 0
        self.prefill_tokens = 0
        self.busy_time_s = 0.0
        self.steps = 0
        self.samples: deque[tuple[int, float]] = deque(maxlen=max_samples)
        self.peak_reserved_tokens = 0
        self.peak_cached_tokens = 0

    # -- public API ---------------------------------------------------------------------------------------
    def add(self, req: GenRequest) -> None:
        """Queue a request (new or partial). It joins the batch at the next step with room for it."""
        self._check_live()
        if not req.prompt_ids:
            raise ValueError(f"{req.seq_id}: empty prompt")
        if len(req.generated_ids) != len(req.logprobs):
            raise ValueError(f"{req.seq_id}: generated_ids and logprobs differ in length")
        if len(req.prompt_ids) + len(req.generated_ids) >= self.max_seq_len:
            raise ValueError(f"{req.seq_id}: prompt+generated does not fit max_seq_len={self.max_seq_len}")
        if self.reservation(req) > self.kv_budget_tokens:
            raise ValueError(f"{req.seq_id}: needs {self.reservation(req)} KV tokens > budget")
        if any(r.req.seq_id == req.seq_id for r in self.running) or any(
            w.seq_id == req.seq_id for w in self.waiting
        ):
            raise ValueError(f"{req.seq_id}: already queued on this engine")
        gen = req.generated_ids
        if len(gen) >= req.sampling.max_new_tokens or (gen and gen[-1] in req.sampling.stop_ids):
            reason: FinishReason = "stop" if gen and gen[-1] in req.sampling.stop_ids else "length"
            self._ready.append(
                GenResult(req.seq_id, list(req.prompt_ids), list(gen), list(req.logprobs), reason)
            )
            return
        self.waiting.append(req)

    @_inference
    def step(self) -> list[GenResult]:
        """Admit, prefill the newcomers, decode one token for the others; return sequences finished now."""
        self._check_live()
        done, self._ready = self._ready, []
        if not self.running and not self.waiting:
            return done
        t0 = time.perf_counter()
        n_old = len(self.running)
        admitted = self._admit()
        parts = []
        if n_old:
            parts.append(self._decode(n_old))
        if admitted:
            parts.append(self._prefill(n_old, admitted))
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        done += self._sample_and_finish(logits.float(), n_old)
        dt = time.perf_counter() - t0
        rows = logits.shape[0]
        self.busy_time_s += dt
        self.steps += 1
        self.tokens_generated += rows
        if not admitted:
            self.samples.append((rows, dt))
        return done

    @_inference
    def abort(self, seq_ids) -> list[GenResult]:
        """Stop these sequences now; return each with what it generated so far (unknown ids ignored)."""
        wanted = set(seq_ids)
        out = self._take_queued(wanted)
        rows = [i for i, r in enumerate(self.running) if r.req.seq_id in wanted]
        if rows:
            out += self._release(rows, ["abort"] * len(rows))
        return out

    @_inference
    def partials(self) -> dict[str, tuple[list[int], list[float]]]:
        """seq_id -> (generated ids, their log-probs) so far, for every running sequence, without stopping
        any: a caller can keep a copy so that a lost device loses only the tokens since (resumed through
        `GenRequest(..., generated_ids=...)`). Resumed tokens are included, as `abort` would return them."""
        counts = self.n_gen[: len(self.running)].tolist()
        return {
            run.req.seq_id: (self.gen_buf[row, :n].tolist(), self.lp_buf[row, :n].tolist())
            for row, (run, n) in enumerate(zip(self.running, counts))
        }

    def load_state_dict(self, state_dict) -> None:
        """Swap weights in place (a new policy version). Running sequences keep their cached KV."""
        self._check_live()
        self.model.load_state_dict(state_dict)
        if self.packed:
            self.model.repack()

    @_inference
    def offload(self) -> list[GenResult]:
        """Abort all, free the KV cache and weights; returns the partials. The engine is dead after."""
        partials = self.abort([r.req.seq_id for r in self.running] + [w.seq_id for w in self.waiting])
        partials += self._ready
        self._ready = []
        self.cache = None
        self.model.pack_for_inference(False)  # drop the packed weight copies held on the model
        self.model.native = None
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return partials

    def stats(self) -> dict:
        """Counters for the runtime and core's throughput model.

        `samples` holds (concurrency, step_time_s) of recent pure-decode steps (no prefill in them), i.e. the
        points a `step_time(n) ≈ a + b·n` fit wants; prefill work is counted separately.
        """
        return {
            "tokens_generated": self.tokens_generated,
            "prefill_tokens": self.prefill_tokens,
            "busy_time_s": self.busy_time_s,
            "tokens_per_s": self.tokens_generated / self.busy_time_s if self.busy_time_s else 0.0,
            "steps": self.steps,
            "running": self.num_running,
            "waiting": self.num_waiting,
            "reserved_tokens": self.reserved_tokens,
            "kv_budget_tokens": self.kv_budget_tokens,
            "peak_reserved_tokens": self.peak_reserved_tokens,
            "peak_cached_tokens": self.peak_cached_tokens,
            "samples": list(self.samples),
        }

    # -- internals ----------------------------------------------------------------------------------------
    def _check_live(self) -> None:
        if self.cache is None:
            raise RuntimeError("engine was offloaded; build a new one")

    def _admit(self) -> list[GenRequest]:
        """Pop waiting requests (FIFO) while a slot, the KV budget and the prefill cap allow."""
        admitted: list[GenRequest] = []
        tokens = 0  # prefill is packed (no padding): its cost follows the sum of the lengths
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            req = self.waiting[0]
            need = self.reservation(req)
            if self.reserved_tokens + need > self.kv_budget_tokens:
                break
            n_tok = len(req.prompt_ids) + len(req.generated_ids)
            if admitted and tokens + n_tok > self.max_prefill_tokens:
                break
            tokens += n_tok
            self.waiting.popleft()
            self.reserved_tokens += need
            admitted.append(req)
        self.peak_reserved_tokens = max(self.peak_reserved_tokens, self.reserved_tokens)
        return admitted

    def _ensure_capacity(self, length: int) -> None:
        """Double the cache length (rarely) so positions < `length` fit."""
        cache = self.cache
        if length <= cache.max_len:
            return
        cap = cache.max_len
        while cap < length:
            cap *= 2
        cap = min(cap, self.max_seq_len)
        self.cache = cache.grown(cap, len(self.running))

    def _prefill(self, row0: int, reqs: list[GenRequest]) -> torch.Tensor:
        seqs = [r.prompt_ids + r.generated_ids for r in reqs]
        lengths = [len(s) for s in seqs]
        self._ensure_capacity(max(lengths) + 1)
        lens = torch.tensor(lengths, dtype=torch.long, device=self.device)
        logits = self._prefill_shared(row0, seqs)

        rows = slice(row0, row0 + len(reqs))
        self.lens[rows] = lens
        n_stop = max(len(r.sampling.stop_ids) for r in reqs)
        if n_stop > self.stop.shape[1]:
            pad = torch.full(
                (self.max_batch, n_stop - self.stop.shape[1]), -1, dtype=torch.long, device=self.device
            )
            self.stop = torch.cat([self.stop, pad], dim=1)
        stop = torch.full((len(reqs), self.stop.shape[1]), -1, dtype=torch.long)
        for i, r in enumerate(reqs):
            if r.sampling.stop_ids:
                stop[i, : len(r.sampling.stop_ids)] = torch.tensor(r.sampling.stop_ids, dtype=torch.long)
        self.stop[rows] = stop.to(self.device)
        params = torch.tensor(
            [[r.sampling.temperature, r.sampling.top_p] for r in reqs],
            dtype=torch.float32,
            device=self.device,
        )
        self.temperature[rows], self.top_p[rows] = params[:, 0], params[:, 1]
        ints = torch.tensor(
            [[r.sampling.seed, r.sampling.max_new_tokens, len(r.generated_ids)] for r in reqs],
            dtype=torch.long,
            device=self.device,
        )
        self.seed[rows], self.max_new[rows], self.n_gen[rows] = ints[:, 0], ints[:, 1], ints[:, 2]
        for i, r in enumerate(reqs):
            if r.generated_ids:
                k = len(r.generated_ids)
                self.gen_buf[row0 + i, :k] = torch.tensor(r.generated_ids, dtype=torch.long)
                self.lp_buf[row0 + i, :k] = torch.tensor(r.logprobs, dtype=torch.float32)
            self.running.append(_Running(r, self.reservation(r)))
        self.prefill_tokens += sum(lengths)
        return logits

    def _prefill_shared(self, row0: int, seqs: list[list[int]]) -> torch.Tensor:
        """Prefill `seqs` into rows row0..; a sequence equal to an earlier one is not computed again: its
        row gets a copy of the first one's cached keys and values, and the first one's logits.

        Why: a GRPO group's samples share their prompt, so a batch of rollouts holds each prompt G times
        (8–16), and all but one of those prefills would compute what the first one did."""
        first: dict[tuple[int, ...], int] = {}
        which = [first.setdefault(tuple(s), i) for i, s in enumerate(seqs)]
        if len(first) == len(seqs):
            return self.model.prefill_packed(seqs, self.cache, slot0=row0)
        own = list(first.values())
        logits = self.model.prefill_packed([seqs[i] for i in own], self.cache, slot0=row0,
                                           slots=[row0 + i for i in own])
        dups = [i for i, j in enumerate(which) if j != i]
        for length in {len(seqs[i]) for i in dups}:
            same = [i for i in dups if len(seqs[i]) == length]
            self.cache.copy_slots([row0 + which[i] for i in same], [row0 + i for i in same], length)
        at = {i: k for k, i in enumerate(own)}
        return logits[torch.tensor([at[j] for j in which], device=logits.device)]

    def _decode(self, n: int) -> torch.Tensor:
        lens = self.lens[:n]
        span = int(lens.max()) + 1
        self._ensure_capacity(span)
        logits = self.model.decode(self.last_tok[:n], lens, self.cache, span)
        self.lens[:n] += 1
        return logits

    def _sample_and_finish(self, logits: torch.Tensor, n_old: int) -> list[GenResult]:
        b = logits.shape[0]
        n_gen = self.n_gen[:b]
        tokens = sample_tokens(logits, self.temperature[:b], self.top_p[:b], self.seed[:b], n_gen)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        rows = self.cache.rows[:b]
        self.gen_buf[rows, n_gen] = tokens
        self.lp_buf[rows, n_gen] = logprobs
        self.n_gen[:b] += 1
        self.last_tok[:b] = tokens
        stopped = (tokens[:, None] == self.stop[:b]).any(1)
        # The next decode would write position lens; it must stay inside max_seq_len.
        too_long = (self.n_gen[:b] >= self.max_new[:b]) | (self.lens[:b] >= self.max_seq_len)
        finished = stopped | too_long
        self.peak_cached_tokens = max(self.peak_cached_tokens, int(self.lens[:b].sum()))
        if not bool(finished.any()):
            return []
        idx = finished.nonzero().squeeze(1).tolist()
        stop_flags = stopped[idx].tolist()
        return self._release(idx, ["stop" if s else "length" for s in stop_flags])

    def _release(self, rows: list[int], reasons: list[FinishReason]) -> list[GenResult]:
        """Build results for `rows`, free their reservation and refill the holes from the tail."""
        counts = self.n_gen[rows].tolist()
        out = []
        for row, count, reason in zip(rows, counts, reasons):
            run = self.running[row]
            out.append(
                GenResult(
                    run.req.seq_id,
                    list(run.req.prompt_ids),
                    self.gen_buf[row, :count].tolist(),
                    self.lp_buf[row, :count].tolist(),
                    reason,
                )
            )
            self.reserved_tokens -= run.reserve
        gone = set(rows)
        keep_n = len(self.running) - len(gone)
        holes = [r for r in rows if r < keep_n]
        movers = [r for r in range(keep_n, len(self.running)) if r not in gone]
        if holes:
            self._move_rows(movers, sorted(holes))
        running = self.running
        for src, dst in zip(movers, sorted(holes)):
            running[dst] = running[src]
        del running[keep_n:]
        return out

    def _move_rows(self, src: list[int], dst: list[int]) -> None:
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        self.cache.copy_slots(s, d, int(self.lens[s].max()))
        for t in (
            self.lens,
            self.last_tok,
            self.n_gen,
            self.max_new,
            self.temperature,
            self.top_p,
            self.seed,
        ):
            t[d] = t[s]
        for t in (self.stop, self.gen_buf, self.lp_buf):
            t[d] = t[s]
