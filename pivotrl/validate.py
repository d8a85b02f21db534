"""`pivotrl-pipeline validate CONFIG`: a dry run before spending GPU hours.

Loads the config, the dataset (rows, bad rows, split sizes), the model configs and tokenizers — never the
weights — and renders one rollout prompt and one judge prompt exactly as the engines will see them (the
ids decoded with their special tokens), with token counts, and checks that prompt plus generation budget
fits each model's context. Exit 0 when all is well, 2 with one line naming the field or file otherwise.
"""

from __future__ import annotations

import argparse
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


def fits(field: str, key: str, prompt: int, budget: int, context: int) -> None:
    if prompt + budget > context:
        raise UserError(
            f"{field}: prompt {prompt} + {budget} new tokens exceed the {context}-token context "
            f"of models.{key}"
        )


def run_validate(cfg: PipelineConfig) -> int:
    from pivotrl.engines.prompts import PromptRenderer
    from pivotrl.pipeline import check_kv_budget
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
        problems = task.train[:SCAN_ROWS]
    else:
        print(f"task {cfg.task.name}: synthetic")
        problems = task.sample(SCAN_ROWS, seed=0)
    infos = {key: model_info(cfg, key) for key in ("policy", "genrm")}
    for info in infos.values():
        print(info.line())
        check_vocab(info)
    renderer = PromptRenderer.from_config(cfg, infos["policy"].tokenizer, infos["genrm"].tokenizer)
    example = problems[0]
    rollout = renderer.rollout_ids(example)
    show(f"rollout prompt, uid {example.uid}", rollout, infos["policy"].tokenizer)
    judge = renderer.judge_ids(example, example.answer)
    show(
        "judge prompt (the reference answer as the response, for illustration)",
        judge,
        infos["genrm"].tokenizer,
    )
    longest_rollout = max(len(renderer.rollout_ids(p)) for p in problems)
    longest_judge = max(len(renderer.judge_ids(p, p.answer)) for p in problems)
    ro, rw = cfg.rollout.sampling.max_new_tokens, cfg.reward.sampling.max_new_tokens
    print(
        f"tokens over {len(problems)} rows: rollout prompt ≤ {longest_rollout} (+{ro} new), "
        f"judge prompt ≤ {longest_judge} + the response (≤ {ro}) (+{rw} new)"
    )
    fits("rollout.sampling.max_new_tokens", "policy", longest_rollout, ro, infos["policy"].context())
    fits("reward.sampling.max_new_tokens", "genrm", longest_judge + ro, rw, infos["genrm"].context())
    longest = max(problems, key=lambda p: len(renderer.rollout_ids(p)))
    check_kv_budget("rollout", longest_rollout, ro, cfg.rollout.engine.kv_budget_tokens, longest.uid)
    longest = max(problems, key=lambda p: len(renderer.judge_ids(p, p.answer)))
    check_kv_budget("reward", longest_judge + ro, rw, cfg.reward.engine.kv_budget_tokens, longest.uid)
    print("ok")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="pipeline config (YAML), e.g. configs/examples/jsonl-math.yaml")
    add_override_argument(parser, "task.dataset=data/train.jsonl")


def run(args: argparse.Namespace) -> int:
    from pivotrl.config import load_config

    return run_validate(load_config(args.config, PipelineConfig, args.overrides))
