"""Typed, validated configuration: YAML files plus `--set a.b=c` overrides, checked by pydantic v2.

Every section forbids unknown keys, so a typo is an error rather than a silently ignored setting. Errors are
raised as `UserError` with one line naming the file and the dotted field, e.g.
``configs/x.yaml: train.lr: Input should be greater than 0 (got -1)``.

Sections that belong to one sub-system (the simulator's workload and cost profiles, say) define their own
pydantic models and load them through the same `load_config`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from pivotrl.config_base import SafeName, Section, StorageRoot
from pivotrl.config_judge import JudgeConfig, RegexVerdict, ScoreVerdict
from pivotrl.errors import FieldError, UserError, not_text, shown_key
from pivotrl.model_shapes import check_shape
from pivotrl.tasks.datasets import dataset_format_error
from pivotrl.tasks.synthetic import length_distribution

__all__ = ["JudgeConfig", "PipelineConfig", "RegexVerdict", "ScoreVerdict", "Section"]

M = TypeVar("M", bound=BaseModel)


#: Bounds on counts that size memory at once (problems sampled, sequences per iteration, the bootstrap's
#: tokenised examples): far above any run on these machines, and low enough that a typo such as an extra
#: six zeros is one clear error at load time, not an exhausted machine.
MAX_PROMPTS = 1_000_000
MAX_GROUP = 4096
MAX_SFT_EXAMPLES = 1_000_000


# ----------------------------------------------------------------------------------------------------
# Sections of a pipeline config
# ----------------------------------------------------------------------------------------------------


class RunConfig(Section):
    name: SafeName = "run"
    seed: int = 0
    iterations: int = Field(8, ge=1)
    time_budget_s: float | None = Field(
        None, gt=0, description="stop starting new iterations after this many seconds of training"
    )
    storage_root: StorageRoot = "storage"
    stall_warn_s: float | None = Field(
        300.0, gt=0.0,
        description="warn (and repeat) when the devices send nothing back for this long while work is in "
        "flight, with what the scheduler holds; None: never",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=2,
        description="iterations a rollout's policy may lag on-policy (0: on-policy; k: iteration i+1's "
        "rollouts start on devices iteration i's tail leaves idle, trained k versions late at most)",
    )


class ModelRef(Section):
    """A model: a Hugging Face directory (`path`), or, without one, the bootstrap model built here (its
    shape comes from `train.sft` for the policy and `reward.sft` for the judge)."""

    name: SafeName = Field(..., description="name in the Global Parameter Storage (a path component)")
    size: Literal["debug", "small"] | None = Field(
        None,
        description="not read: the bootstrap preset is train.sft.base_size / reward.sft.base_size; "
        "any value is an error",
    )
    path: str | None = Field(None, description="a Hugging Face model directory; None: the bootstrap model")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class ModelsConfig(Section):
    policy: ModelRef = ModelRef(name="policy")
    genrm: ModelRef = ModelRef(name="genrm")


class TaskConfig(Section):
    name: str = "sort"
    prompts_per_iteration: int = Field(32, ge=1, le=MAX_PROMPTS)
    group_size: int = Field(4, ge=1, le=MAX_GROUP)
    eval_prompts: int = Field(200, ge=0, le=MAX_PROMPTS)
    dataset: str | None = Field(
        None, description="a JSONL or parquet file of {prompt, answer, uid?, ...} rows; None: task.name"
    )
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="a bad dataset row: one error naming file:line, or skipped and counted"
    )
    eval_dataset: str | None = Field(None, description="the held-out rows (a file like task.dataset)")
    eval_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="without eval_dataset: the share of task.dataset held out, by uid"
    )
    verifier: Literal["exact", "math", "none"] | None = Field(
        None, description="dataset only (measures, never rewards); None: exact for a dataset"
    )
    generate: Literal["arith-word-problems"] | None = Field(
        None, description="examples only: write task.dataset with this built-in generator when it is missing"
    )
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_dataset_fields(self) -> TaskConfig:
        """The dataset-only fields are errors without a dataset: a known key must never be ignored."""
        if self.dataset is None:
            for name in ("eval_dataset", "verifier", "generate"):
                if getattr(self, name) is not None:
                    raise ValueError(f"[{name}] needs task.dataset (task.name {self.name!r} is synthetic)")
            if self.eval_fraction or self.on_bad_row != "error":
                which = "eval_fraction" if self.eval_fraction else "on_bad_row"
                raise ValueError(f"[{which}] needs task.dataset (task.name={self.name!r} is synthetic)")
            try:
                length_distribution(self.options, "options")
            except FieldError as exc:
                raise ValueError(f"[options.{shown_key(exc.key)}] {exc.why}") from None
        elif self.eval_dataset is not None and self.eval_fraction:
            raise ValueError("[eval_fraction] set task.eval_dataset or task.eval_fraction, not both")
        elif self.options:
            raise ValueError("[options] synthetic tasks only (a dataset task has no options)")
        for name, jsonl_only in (("dataset", self.generate is not None), ("eval_dataset", False)):
            path = getattr(self, name)
            why = None if path is None else dataset_format_error(path, jsonl_only)
            if why is not None:
                raise ValueError(f"[{name}] {path!r}: {why}")
        return self


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(128, ge=1)


class EngineConfig(Section):
    backend: Literal["torch", "vllm"] = "torch"
    kv_budget_tokens: int = Field(65536, ge=1)
    max_batch: int = Field(64, ge=1)


class RolloutConfig(Section):
    sampling: SamplingConfig = SamplingConfig()
    engine: EngineConfig = EngineConfig()
    chat_template: Literal["auto", "none"] = Field(
        "auto", description="auto: render prompts with the policy tokenizer's chat template when it has one"
    )
    system_prompt: str | None = Field(None, description="a system message (needs a chat template)")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra chat-template variables, e.g. {enable_thinking: false}"
    )


class SFTConfig(Section):
    """Bootstrap supervised fine-tuning of one model (the weak policy or the judge), from scratch.

    ``shape`` overrides fields of the engine's ``base_size`` preset (e.g. ``hidden_size``), so CPU runs can
    use a model sized to the task rather than only the two presets.
    """

    base_size: Literal["debug", "small"] = "debug"
    shape: dict[str, int] = Field(default_factory=dict)
    steps: int = Field(300, ge=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0.0)
    examples: int = Field(20000, ge=1, le=MAX_SFT_EXAMPLES)
    seed: int = 0
    init: Literal["scratch", "policy"] = Field(
        "scratch", description="judge only: start from random weights or from the bootstrap policy (like RMs)"
    )
    sloppy: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="policy only: share of demonstrations from a sloppy teacher that drops repeated digits",
    )
    data_options: dict[str, Any] = Field(
        default_factory=dict,
        description="task options for this model's SFT problems only, over task.options (e.g. a judge that "
        "sees long lists more often than the RL prompts do: {median: 5})",
    )

    @model_validator(mode="after")
    def _check_shape(self) -> SFTConfig:
        try:
            check_shape(self.base_size, self.shape)
        except FieldError as exc:
            raise ValueError(f"[shape.{shown_key(exc.key)}] {exc.why}") from None
        return self


class RewardConfig(Section):
    sampling: SamplingConfig = SamplingConfig(temperature=0.0, max_new_tokens=96)
    engine: EngineConfig = EngineConfig()
    default_reward: float = Field(0.0, description="reward of an unparseable judgment")
    truncated_reward: float | None = Field(
        None,
        description="reward of a rollout cut off at its token budget (DAPO overlong); None: judge it",
    )
    budget_per_item: int = Field(
        0,
        ge=0,
        description="rollout budget per prompt item (tokens); 0: the fixed rollout.sampling.max_new_tokens",
    )
    budget_slack: int = Field(2, ge=0, description="extra tokens of the per-prompt rollout budget")
    sft: SFTConfig = SFTConfig(steps=1200, batch_size=64)
    judge: JudgeConfig = JudgeConfig()


class TrainConfig(Section):
    lr: float = Field(1e-4, gt=0.0)
    clip_eps: float = Field(0.2, gt=0.0)
    kl_coef: float = Field(0.0, ge=0.0)
    log_ref_kl: bool = Field(True, description="measure KL to the bootstrap policy even when kl_coef is 0")
    micro_batch: int = Field(16, ge=1)
    grad_clip: float = Field(1.0, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up, in optimizer steps")
    minibatches: int = Field(1, ge=1, description="optimizer steps per iteration, on disjoint sample slices")
    optimizer_owner: Literal["driver", "sharded"] = Field(
        "driver", description="driver: the driver process steps AdamW; sharded: the train devices form a "
        "torch.distributed group and step a ZeRO-1-sharded AdamW (the driver holds no weights)")
    sft: SFTConfig = SFTConfig(steps=200, batch_size=64)


class ClusterConfig(Section):
    workers: int | None = Field(None, ge=1, description="device workers; default one per core")
    scheduler: str | None = Field(None, description="tcp://host:port of an existing Dask scheduler")
    host: str = "127.0.0.1"
    dashboard_address: str | None = Field(":8787", description="None: no dashboard")
    torch_threads: int = Field(1, ge=1)


class SchedulerPriors(Section):
    """What core assumes before it has measured anything (the throughput fit and the shift-cost model
    then learn online). CPU-sized defaults."""

    rollout_step_a_s: float = Field(
        0.01, gt=0.0, description="rollout: a of step_time(n) ≈ a + b·n s, n sequences, before measurements"
    )
    rollout_step_b_s: float = Field(
        0.0005, ge=0.0, description="rollout: b of step_time(n) ≈ a + b·n s, before measurements"
    )
    reward_step_a_s: float = Field(
        0.01, gt=0.0, description="reward: a of step_time(n) ≈ a + b·n s, n sequences, before measurements"
    )
    reward_step_b_s: float = Field(
        0.0005, ge=0.0, description="reward: b of step_time(n) ≈ a + b·n s, before measurements"
    )
    train_step_a_s: float = Field(
        0.01, gt=0.0, description="train: a of step_time(n) ≈ a + b·n s, n sequences, before measurements"
    )
    train_step_b_s: float = Field(
        0.0002, ge=0.0, description="train: b of step_time(n) ≈ a + b·n s, before measurements"
    )
    shift_s: float = Field(
        1.0, gt=0.0, description="assumed shift duration (seconds) before any shift was measured"
    )


class SchedulerConfig(Section):
    mode: Literal["colocated", "disaggregated", "shiftable"] = "shiftable"
    static_split: dict[str, int] | None = None
    static_groups: list[list[Literal["rollout", "reward", "train"]]] | None = Field(
        None, description="disaggregated with fewer devices than roles: the fixed roles of each device"
    )
    horizon_s: float = Field(10.0, gt=0.0)
    hysteresis: float = Field(0.05, ge=0.0)
    cooldown_s: float = Field(2.0, ge=0.0)
    cooldown_shift_multiple: float = Field(
        3.0, ge=0.0, description="after a shift, a device is locked for the shorter of cooldown_s and this "
        "multiple of the shift's measured duration; 0: cooldown_s after every shift")
    tick_s: float = Field(0.25, gt=0.0)
    priors: SchedulerPriors = SchedulerPriors()


class GPSConfig(Section):
    root: str | None = Field(None, description="persistent tier; default <storage_root>/gps")
    host_tier: str | None = Field(None, description="node-local fast tier, e.g. /dev/shm/pivotrl")
    device_tier_bytes: int = Field(2 << 30, ge=0)
    keep_last: int = Field(
        3, ge=1, description="policy versions kept in the store besides the pinned ones (version 0)"
    )
    node_local: bool = Field(
        False,
        description="each node keeps its own tiers (`{node}` in root/host_tier is the node's name: "
        "$PIVOTRL_NODE, default the host name); a worker lacking a version pulls it from the nearest peer",
    )


UNREAD_FIELDS: dict[str, str] = {
    # dotted field -> why it may not be set (to anything but its default)
    "models.policy.size": "not read (the bootstrap preset is train.sft.base_size)",
    "models.genrm.size": "not read (the bootstrap preset is reward.sft.base_size)",
    "train.sft.init": "not read (judge only: reward.sft.init)",
    "reward.sft.sloppy": "not read (policy only: train.sft.sloppy)",
}


class PipelineConfig(Section):
    """A whole pipeline run: what `pivotrl-pipeline submit CONFIG` reads."""

    run: RunConfig = RunConfig()
    models: ModelsConfig = ModelsConfig()
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    train: TrainConfig = TrainConfig()
    cluster: ClusterConfig = ClusterConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    gps: GPSConfig = GPSConfig()

    @model_validator(mode="after")
    def _check_unread(self) -> PipelineConfig:
        """A known key that is silently ignored is worse than an unknown one: fields nothing reads yet are
        accepted only at their defaults."""
        for dotted, why in UNREAD_FIELDS.items():
            *path, name = dotted.split(".")
            section: BaseModel = self
            for part in path:
                section = getattr(section, part)
            default = type(section).model_fields[name].default
            if getattr(section, name) != default:
                raise ValueError(f"{dotted}: {why}; remove it")
        return self

    @model_validator(mode="after")
    def _check_dataset(self) -> PipelineConfig:
        for role in ("train", "reward"):
            data_options = getattr(self, role).sft.data_options
            if self.task.dataset is not None and data_options:
                raise ValueError(f"{role}.sft.data_options: synthetic tasks only (task.dataset is set)")
            if self.task.dataset is None:  # over task.options, as the bootstrap samples its problems
                length_distribution({**self.task.options, **data_options}, f"{role}.sft.data_options")
        return self

    @model_validator(mode="after")
    def _check_split(self) -> PipelineConfig:
        split = self.scheduler.static_split
        if split is not None:
            bad = sorted(set(split) - {"rollout", "reward", "train"})
            if bad:
                raise ValueError(f"static_split has unknown role(s) {bad}; roles are rollout, reward, train")
            if any(v < 0 for v in split.values()):
                raise ValueError("static_split counts must be >= 0")
            workers = self.cluster.workers
            if workers is not None and sum(split.values()) > workers:
                need = sum(split.values())
                raise ValueError(f"scheduler.static_split needs {need} devices; cluster.workers is {workers}")
        return self


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: plain YAML keeps the
    last one, so a duplicated section would silently drop the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, turning every failure into a one-line `UserError` naming the file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as exc:
        raise UserError(f"{p}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"{p}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line, whatever yaml says
        raise UserError(f"{p}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: top level must be a mapping, got {type(data).__name__}")
    return data


def add_override_argument(parser: Any, example: str = "train.lr=1e-4") -> None:
    """The repeatable `--set KEY=VALUE` flag every command shares; values land in `args.overrides`."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config field, e.g. {example} (repeatable)",
    )


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides in place; values are parsed as YAML scalars (so `3`, `0.1`, `true`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. train.lr=1e-4")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"--set {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def _format_error(source: str, exc: ValidationError) -> str:
    err = exc.errors()[0]
    # a key with a newline or other control character is quoted: the error stays one line
    field = ".".join(str(p) if str(p).isprintable() else repr(str(p)) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    named = re.match(r"\[([^\]]+)\] (.*)", msg)  # a section-level check naming one of its fields
    if named:
        return f"{source}: {f'{field}.' if field else ''}{named[1]}: {named[2]}"
    if not field and err["type"] == "value_error":  # a whole-config check: its message names the field
        return f"{source}: {msg}"
    field = field or "<root>"
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    got = err.get("input")
    quiet = err["type"] in ("extra_forbidden", "missing") or isinstance(got, dict)
    got_txt = "" if quiet else f" (got {got!r})"
    more = f" [+{len(exc.errors()) - 1} more]" if len(exc.errors()) > 1 else ""
    return f"{source}: {field}: {msg}{got_txt}{more}"


def validate(data: dict[str, Any], cls: type[M], source: str = "<config>") -> M:
    """Validate a mapping into `cls`, or raise a one-line `UserError` naming `source` and the field."""
    bad = not_text(data)
    if bad is not None:
        raise UserError(f"{source}: {shown_key(bad[0])}: not text (a lone surrogate at character {bad[1]})")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise UserError(_format_error(source, exc)) from None


def load_config(
    path: str | Path | None,
    cls: type[M] = PipelineConfig,  # type: ignore[assignment]
    overrides: list[str] | tuple[str, ...] = (),
) -> M:
    """Load `path` (or the defaults when None), apply `--set` overrides, validate into `cls`."""
    data = read_yaml(path) if path is not None else {}
    apply_overrides(data, overrides)
    return validate(data, cls, source=str(path) if path is not None else "<defaults>")
