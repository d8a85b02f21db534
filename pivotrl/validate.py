"""`pivotrl-pipeline validate CONFIG`: a dry run before spending GPU hours.

Loads the config, the dataset (rows, bad rows, split sizes), the model configs and tokenizers — never the
weights — and renders one rollout prompt and one judge prompt exactly as the engines will see them (the
ids decoded with their special tokens), with token counts, and checks that prompt plus generation budget
fits each model's context. Exit 0 when all is well, 2 with one line naming the field or file otherwise.
"""

from __future__ import annotations

import argparse
import heapq
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotrl.config import PipelineConfig, add_override_argument
from pivotrl.errors import UserError

SCAN_ROWS = 256  # rows rendered to find the longest prompts (a sample: a char tokenizer is slow per row)


@dataclass(frozen=True)
class ModelInfo:
    """What validate learns of one model without its weights."""

    key: str  # "policy" | "genrm"
    source: str  # the directory, or how the bootstrap model would be made
    config: Any
    tokenizer: Any

    def line(self) -> str:
        c = self.config
        chat = (
            "with a chat template" if getattr(self.tokenizer, "chat_template", None) else "no chat template"
        )
        return (
            f"models.{self.key}: {self.source}: {getattr(c, 'model_type', '?')}, "
            f"{getattr(c, 'num_hidden_layers', '?')} layers, hidden {getattr(c, 'hidden_size', '?')}, "
            f"vocab {getattr(c, 'vocab_size', '?')}, context {self.context()}; tokenizer {chat}"
        )

    def context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))


def model_info(cfg: PipelineConfig, key: str) -> ModelInfo:
    """The model's HF config and tokenizer: from `models.<key>.path`, the bootstrap cache, or (not built
    yet) the config and tokenizer the bootstrap would make."""
    from pivotrl.engines.checkpoints import load_config, load_tokenizer

    ref = getattr(cfg.models, key)
    if ref.path:
        p = Path(ref.path)
        if not (p / "config.json").is_file():
            raise UserError(f"models.{key}.path: {p} is not a Hugging Face model directory (no config.json)")
        try:
            return ModelInfo(key, str(p), load_config(p), load_tokenizer(p))
        except (OSError, ValueError) as exc:
            raise UserError(f"models.{key}.path: {p}: cannot load its config or tokenizer ({exc})") from None
    from pivotrl.engines.bootstrap import build_config, model_dir
    from pivotrl.engines.dataset_sft import planned_tokenizer

    cached = model_dir(cfg, key)
    if (cached / "bootstrap.json").is_file():
        return ModelInfo(key, f"bootstrap model {cached}", load_config(cached), load_tokenizer(cached))
    sft = cfg.train.sft if key == "policy" else cfg.reward.sft
    return ModelInfo(key, "bootstrap model (not built yet)", build_config(sft), planned_tokenizer(cfg))


def check_vocab(info: ModelInfo) -> None:
    size = int(getattr(info.config, "vocab_size", 0) or 0)
    if size and len(info.tokenizer) > size:
        raise UserError(
            f"models.{info.key}: its tokenizer has {len(info.tokenizer)} tokens but the model only {size}"
        )


def show(title: str, ids: list[int], tokenizer: Any) -> None:
    print(f"--- {title} ({len(ids)} tokens) ---")
    print(tokenizer.decode(ids, skip_special_tokens=False))
    print("---")


def fits(field: str, key: str, prompt: int, budget: int, context: int, row: str = "") -> None:
    if prompt + budget > context:
        raise UserError(
            f"{field}: prompt {prompt} + {budget} new tokens exceed the {context}-token context "
            f"of models.{key}{row}"
        )


def rows_to_scan(task: Any) -> list[Any]:
    """The rows whose rendered prompts are longest, without rendering every row: a dataset's
    `SCAN_ROWS` longest train and held-out rows by characters (the rollout prompt; the judge prompt, which
    also holds the reference and a response of about its size), so that one overlong row anywhere in the
    file is found, not only in its first rows; a synthetic task's `SCAN_ROWS` samples."""
    if getattr(task, "stats", None) is None:
        return list(task.sample(SCAN_ROWS, seed=0))
    rows = [*task.train, *task.held_out]
    picked = {id(p): p for p in heapq.nlargest(SCAN_ROWS, rows, key=lambda p: len(p.prompt))}
    for p in heapq.nlargest(SCAN_ROWS, rows, key=lambda p: len(p.prompt) + 2 * len(p.answer)):
        picked.setdefault(id(p), p)
    return list(picked.values())


@dataclass(frozen=True)
class Lengths:
    """The longest rendered prompts over the scanned rows, in tokens."""

    rows: int
    rollout: int
    judge: int  # with the reference answer as the response


def check_lengths(cfg: PipelineConfig, task: Any, infos: dict[str, ModelInfo], renderer: Any) -> Lengths:
    """Every scanned row's rollout prompt with its budget fits the policy's context and the rollout KV
    budget, and its judge prompt with a response as long as the rollout budget and the judge's own budget
    fits the judge's context and the reward KV budget; else a `UserError` naming the field and the row."""
    from pivotrl.pipeline import check_kv_budget

    problems = rows_to_scan(task)
    ro, rw = cfg.rollout.sampling.max_new_tokens, cfg.reward.sampling.max_new_tokens
    n_rollout, rollout = max(((len(renderer.rollout_ids(p)), p) for p in problems), key=lambda t: t[0])
    n_judge, judge = max(((len(renderer.judge_ids(p, p.answer)), p) for p in problems), key=lambda t: t[0])
    fits("rollout.sampling.max_new_tokens", "policy", n_rollout, ro, infos["policy"].context(),
         f" (row uid {rollout.uid})")
    fits("reward.sampling.max_new_tokens", "genrm", n_judge + ro, rw, infos["genrm"].context(),
         f" (row uid {judge.uid}, with a response of {ro} tokens)")
    check_kv_budget("rollout", n_rollout, ro, cfg.rollout.engine.kv_budget_tokens, rollout.uid)
    check_kv_budget("reward", n_judge + ro, rw, cfg.reward.engine.kv_budget_tokens, judge.uid)
    return Lengths(len(problems), n_rollout, n_judge)


def model_infos(
    cfg: PipelineConfig, log: Callable[[str], None] = lambda line: None
) -> tuple[dict[str, ModelInfo], Any]:
    """Both models' `ModelInfo` (each logged, then its vocabulary checked) and the run's prompt renderer
    over their tokenizers."""
    from pivotrl.engines.prompts import PromptRenderer

    infos = {key: model_info(cfg, key) for key in ("policy", "genrm")}
    for info in infos.values():
        log(info.line())
        check_vocab(info)
    return infos, PromptRenderer.from_config(cfg, infos["policy"].tokenizer, infos["genrm"].tokenizer)


def check_before_bootstrap(cfg: PipelineConfig, task: Any) -> Lengths:
    """What a run checks of its prompts before it trains or loads a model (`pivotrl.run`): the lengths,
    as `validate` does, so that an overlong row fails the run in seconds, not after the bootstrap."""
    infos, renderer = model_infos(cfg)
    return check_lengths(cfg, task, infos, renderer)


def run_validate(cfg: PipelineConfig) -> int:
    from pivotrl.tasks import build_task

    task = build_task(cfg.task)
    n = cfg.task.prompts_per_iteration
    stats = getattr(task, "stats", None)
    if stats is not None:
        print(stats.line())
        for example in stats.skipped_examples:
            print(f"  skipped: {example}")
        epochs = cfg.run.iterations * n / len(task.train)
        print(f"run: {cfg.run.iterations} iterations × {n} prompts = {epochs:.2f} epochs of the train split")
        example = task.train[0]
    else:
        print(f"task {cfg.task.name}: synthetic")
        example = task.sample(1, seed=0)[0]
    infos, renderer = model_infos(cfg, print)
    rollout = renderer.rollout_ids(example)
    show(f"rollout prompt, uid {example.uid}", rollout, infos["policy"].tokenizer)
    judge = renderer.judge_ids(example, example.answer)
    show(
        "judge prompt (the reference answer as the response, for illustration)",
        judge,
        infos["genrm"].tokenizer,
    )
    ro, rw = cfg.rollout.sampling.max_new_tokens, cfg.reward.sampling.max_new_tokens
    lengths = check_lengths(cfg, task, infos, renderer)
    print(
        f"tokens over {lengths.rows} rows: rollout prompt ≤ {lengths.rollout} (+{ro} new), "
        f"judge prompt ≤ {lengths.judge} + the response (≤ {ro}) (+{rw} new)"
    )
    print("ok")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="pipeline config (YAML), e.g. configs/examples/jsonl-math.yaml")
    add_override_argument(parser, "task.dataset=data/train.jsonl")


def run(args: argparse.Namespace) -> int:
    from pivotrl.config import load_config

    return run_validate(load_config(args.config, PipelineConfig, args.overrides))
