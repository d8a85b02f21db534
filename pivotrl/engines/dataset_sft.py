"""The bootstrap's SFT data for a dataset task: tiny policy and judge models that speak its chat format.

Why: the worked example (and any user's dataset without checkpoints) needs a version-0 policy that answers
in the dataset's format and a judge that reads the configured judge template and writes a verdict the
configured parser reads. Both are trained here on prompts rendered by the run's own `PromptRenderer`, so
the models see in SFT exactly the ids they see in RL. The judge's labels come from the task's verifier
(never by hand): the policy's demonstration (correct) or the same with its final number changed (wrong).
Only the train split is used: the held-out rows are never seen by either model.
"""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path
from typing import Any

from pivotrl.errors import UserError
from pivotrl.tasks.base import Problem, normalize
from pivotrl.tasks.verifiers import extract_answer, reference_answer

DATA_FORMAT = 3  # bump when the SFT data construction changes, so cached dataset models are rebuilt
_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?!.*\d)", re.DOTALL)
_ANY_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def file_digest(path: str | Path | None) -> str | None:
    """A content hash of a dataset file: the bootstrap's cache key changes when the data does."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        return None
    h = hashlib.sha256()
    with p.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def dataset_settings(cfg: Any, role: str) -> dict[str, Any]:
    """Every setting of a dataset task that shapes a bootstrap model's weights (its cache key)."""
    t = cfg.task
    out: dict[str, Any] = {
        "format": DATA_FORMAT,
        "dataset": file_digest(t.dataset),
        "eval_dataset": file_digest(t.eval_dataset),
        "split": [t.on_bad_row, t.eval_fraction, t.verifier],
        "rollout": [cfg.rollout.system_prompt, cfg.rollout.chat_template, cfg.rollout.chat_template_kwargs],
    }
    if role == "genrm":
        out["judge"] = cfg.reward.judge.model_dump()
    return out


def demonstration(problem: Problem) -> str:
    """What the bootstrap policy learns to write: the row's ``solution`` when it has one, else the answer."""
    solution = problem.meta.get("solution")
    return (
        normalize(solution) if isinstance(solution, str) and solution.strip() else normalize(problem.answer)
    )


def corrupt_final(response: str, rng: random.Random) -> str:
    """`response` with its result changed wherever it is stated (after the first ``=`` and at the end), or
    a wrong number appended. Why everywhere: a demonstration whose working says 19 and whose answer says 20
    would teach the judge to compare the response with itself instead of with the reference."""
    m = _LAST_NUMBER.search(response)
    if m is None:
        return f"{response} {rng.randint(0, 99)}"
    value = m.group()
    number = float(value) if "." in value else int(value)
    wrong = str(number + rng.choice([-10, -2, -1, 1, 2, 10]))
    cut = response.find("=") + 1  # the working's operands (before the first "=") are kept
    tail = re.sub(rf"(?<![\d.]){re.escape(value)}(?!\d|\.\d)", wrong, response[cut:])
    return response[:cut] + tail


def _shift(value: str, rng: random.Random) -> str:
    number = float(value) if "." in value else int(value)
    return str(number + rng.choice([-10, -2, -1, 1, 2, 10]))


def corrupt_answer_only(response: str, rng: random.Random) -> str:
    """`response` with only its last number changed: the working and the answer then disagree, the way a
    weak policy's often do."""
    m = _LAST_NUMBER.search(response)
    if m is None:
        return f"{response} {rng.randint(0, 99)}"
    return response[: m.start()] + _shift(m.group(), rng) + response[m.end() :]


def corrupt_working(response: str, rng: random.Random) -> str:
    """`response` with one number other than its last changed: the final answer (all the verifier reads)
    stays, so a judge must not reject it for its working."""
    numbers = list(_ANY_NUMBER.finditer(response))[:-1]
    if not numbers:
        return response
    m = rng.choice(numbers)
    return response[: m.start()] + _shift(m.group(), rng) + response[m.end() :]


def rationale(problem: Problem, response: str, verifier: str) -> str:
    """The short critique a perfect judge writes before its verdict: the two answers side by side."""
    if verifier == "math":
        got, want = extract_answer(response) or "none", reference_answer(problem.answer)
    else:
        got, want = normalize(response), normalize(problem.answer)
    return f"final {got} reference {want}."


def policy_data(
    task: Any, renderer: Any, problems: list[Problem], eos: int
) -> list[tuple[list[int], list[int]]]:
    tok = renderer.policy.tokenizer
    targets = tok([demonstration(p) for p in problems], add_special_tokens=False)["input_ids"]
    return [(renderer.rollout_ids(p), [*t, eos]) for p, t in zip(problems, targets, strict=True)]


def judge_data(
    task: Any, renderer: Any, problems: list[Problem], eos: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """(rendered judge prompt, critique + ``verdict: yes|no`` + <eos>), half of them about wrong answers.

    Responses vary every way a weak policy's do — right answers with wrong working (`corrupt_working`),
    near misses stated consistently (`corrupt_final`) or only in the answer (`corrupt_answer_only`), and
    another problem's demonstration (numbers unrelated to the reference) — so the only thing that predicts
    the verifier's label is the response's final answer against the reference: the critique must copy it
    rather than echo the reference, and the verdict must compare the two.
    The configured parser must read the two verdicts as 1 and 0, or the bootstrap judge would be trained to
    write what the run cannot parse."""
    if not task.measurable:
        raise UserError(
            "task.verifier: none gives the bootstrap judge nothing to learn from; set models.genrm.path"
        )
    rng = random.Random(f"dataset-judge:{seed}")
    tok = renderer.judge.tokenizer
    out = []
    for p in problems:
        good = demonstration(p)
        u = rng.random()
        if u < 0.35:
            response = good
        elif u < 0.5:
            response = corrupt_working(good, rng)
        elif u < 0.65:
            response = corrupt_final(good, rng)
        elif u < 0.8:
            response = corrupt_answer_only(good, rng)
        else:
            other = demonstration(problems[rng.randrange(len(problems))])
            response = other if rng.random() < 0.5 else corrupt_working(other, rng)
        ok = task.verify(p, response)
        text = f"{rationale(p, response, task.verifier)} verdict: {'yes' if ok else 'no'}"
        if renderer.read(text) != (1.0 if ok else 0.0):
            raise UserError(
                f"reward.judge.verdict: the bootstrap judge writes '... verdict: yes|no', which this "
                f"parser reads as {renderer.read(text)} for {'yes' if ok else 'no'}; "
                "match it or give models.genrm.path"
            )
        target = tok(text, add_special_tokens=False)["input_ids"]
        out.append((renderer.judge_ids(p, response), [*target, eos]))
    return out


def sft_data(cfg: Any, role: str, sft_cfg: Any, seed: int) -> tuple[list[Any], Any]:
    """SFT data of a dataset task and the tokenizer (with its chat template) the model is saved with."""
    from pivotrl.engines.checkpoints import TINY_CHAT_TEMPLATE, build_tokenizer
    from pivotrl.engines.prompts import PromptRenderer
    from pivotrl.tasks import build_task

    if sft_cfg.sloppy > 0:
        raise UserError("train.sft.sloppy: the sloppy teacher is defined for the sort task only")
    task = build_task(cfg.task)
    tokenizer = build_tokenizer(TINY_CHAT_TEMPLATE)
    renderer = PromptRenderer.from_config(cfg, tokenizer, tokenizer)
    problems = task.sample(sft_cfg.examples, seed=seed)
    eos = int(tokenizer.eos_token_id)
    if role == "policy":
        return policy_data(task, renderer, problems, eos), tokenizer
    return judge_data(task, renderer, problems, eos, seed=seed), tokenizer


def planned_tokenizer(cfg: Any) -> Any:
    """The tokenizer a bootstrap model of `cfg` is saved with (no model built, no weights read)."""
    from pivotrl.engines.checkpoints import TINY_CHAT_TEMPLATE, build_tokenizer

    return build_tokenizer(TINY_CHAT_TEMPLATE if cfg.task.dataset is not None else None)
