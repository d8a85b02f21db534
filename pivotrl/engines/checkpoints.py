"""Checkpoints in Hugging Face format: tiny models created here from a seed, the character-level
tokenizer, and loading/saving model directories (`from_pretrained`, `save_hf`).

Why HF format: the same loading code (config.json + model.safetensors + tokenizer.json) takes a tiny model
made on this CPU box and a real Qwen2.5/Llama checkpoint on a GPU box, and vLLM reads the same directory.
Nothing is downloaded: every model is built deterministically from (size, seed, arch). This module sits
above the model (`model.py` knows nothing of files), so the two never import each other.

The tokenizer is character level so that the synthetic tasks (digits, a few letters, spaces) need no
trained merges: ids 0..3 are the specials ``<pad> <bos> <eos> <unk>``, then "\\n" and the 95 printable ASCII
characters. Encoding prepends ``<bos>`` (``add_special_tokens=True``, the default), like Llama/Qwen chat
prompts do; decoding concatenates characters without separators. A tokenizer may carry a chat template
(`TINY_CHAT_TEMPLATE`, the tiny models of dataset tasks): it is saved as ``chat_template.jinja`` like any HF
tokenizer's, and `load_tokenizer` restores it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import string
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pivotrl.engines.model import CausalLM
from pivotrl.model_shapes import MODEL_SIZES

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))
assert set(string.printable) - set("\t\r\x0b\x0c") <= set(CHARACTERS)

ARCHS = ("qwen2", "llama")

# The chat template of the tiny models made for dataset tasks: short role markers (every character is a
# token here), <bos> first and <eos> after an assistant turn, as Llama/Qwen templates do.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}S: {{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}U: {{ m['content'] }}\n"
    "{% else %}A: {{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}A: {% endif %}"
)


#: The built-in tokenizer's id of every character it knows (`build_tokenizer`).
CHAR_IDS = {ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(CHARACTERS)}


def char_ids(texts: Sequence[str], tokenizer, bos: bool) -> list[list[int]]:
    """What `build_tokenizer()`'s tokenizer encodes each of `texts` to (with <bos> first when `bos`),
    computed by a lookup per character where that is what it does: a text with no special token's
    spelling in it. The others go through `tokenizer`, which matches special tokens in raw text.

    Why: the bootstrap encodes tens of thousands of examples per model before its first step, and the
    tokenizer's per-character regex split took seconds of that, on the demo's critical path."""
    get = CHAR_IDS.get
    head = [BOS_ID] if bos else []
    out: list[list[int] | None] = [
        None if "<" in t and any(sp in t for sp in SPECIAL_TOKENS) else [*head, *(get(c, UNK_ID) for c in t)]
        for t in texts
    ]
    special = [i for i, ids in enumerate(out) if ids is None]
    if special:
        done = tokenizer([texts[i] for i in special], add_special_tokens=bos)["input_ids"]
        for i, ids in zip(special, done, strict=True):
            out[i] = list(ids)
    return out  # type: ignore[return-value]


def is_builtin_tokenizer(tokenizer) -> bool:
    """Whether `tokenizer` encodes and decodes as `build_tokenizer()`'s does: the same backend (vocabulary,
    per-character split, post-processor and decoder; a chat template lives outside it), so that
    `char_ids` and `char_text` stand in for it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        return backend.to_str() == _builtin_backend()
    except Exception:  # a backend that cannot be serialised is not ours
        return False


@functools.cache
def _builtin_backend() -> str:
    return build_tokenizer().backend_tokenizer.to_str()


#: The built-in tokenizer's character of every id that decodes to one (special tokens decode to nothing).
ID_CHARS = {i: ch for ch, i in CHAR_IDS.items()}


def char_text(ids: Sequence[int]) -> str:
    """What `build_tokenizer()`'s tokenizer decodes `ids` to with ``skip_special_tokens=True``."""
    get = ID_CHARS.get
    return "".join([get(i, "") for i in ids])


def build_tokenizer(chat_template: str | None = None):
    """Character-level `PreTrainedTokenizerFast` built with the `tokenizers` library (no training), with
    `chat_template` when given."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {**{tok: i for i, tok in enumerate(SPECIAL_TOKENS)}, **CHAR_IDS}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character (newline included) is its own pre-token; WordLevel then maps it to its id.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        out.chat_template = chat_template
    return out


def saved_chat_template(model_dir: str | Path) -> str | None:
    """The chat template saved with a tokenizer (``chat_template.jinja``, or the older
    ``tokenizer_config.json`` key), or None."""
    d = Path(model_dir)
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        value = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
        return value if isinstance(value, str) else None
    return None


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of a model directory. Models made here use the character tokenizer, rebuilt in code
    (with the chat template saved beside it): its tokenizer.json does not round-trip through
    `AutoTokenizer` (spaces and newlines are lost), which would silently corrupt every prompt. Real
    checkpoints load with `AutoTokenizer`. Reads no weights."""
    from transformers import AutoTokenizer

    if int(getattr(load_config(model_dir), "vocab_size", -1)) == vocab_size():
        return build_tokenizer(saved_chat_template(model_dir))
    return AutoTokenizer.from_pretrained(str(model_dir))


def vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(CHARACTERS)


def make_config(size: str, arch: str = "qwen2"):
    """The HF config (`Qwen2Config` or `LlamaConfig`) of a named size."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)}")
    common = dict(
        MODEL_SIZES[size],
        vocab_size=vocab_size(),
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        rope_theta=10000.0,
    )
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")


def init_state_dict(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic initial weights: N(0, initializer_range) matrices, zero biases, unit norms.

    Built from a private `torch.Generator` over sorted parameter names, so the result depends only on
    (config, seed) — not on HF's init code or the global RNG.
    """
    shapes = {k: v.shape for k, v in CausalLM.from_config(config, device="meta").state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02))
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * std
    if getattr(config, "tie_word_embeddings", False):
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def save_hf(model_or_state_dict, config, tokenizer, out_dir: str | Path) -> Path:
    """Write an HF model directory: config.json, model.safetensors, tokenizer files.

    A tied `lm_head.weight` is left out of the file (as HF does); `load_state_dict` restores it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = model_or_state_dict if isinstance(model_or_state_dict, dict) else model_or_state_dict.state_dict()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def load_config(path: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Weights of an HF directory (or a .safetensors file), with the tied `lm_head.weight` filled in."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors file in {path}")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        cfg_file = path / "config.json"
        tied = cfg_file.exists() and json.loads(cfg_file.read_text()).get("tie_word_embeddings", False)
    else:
        sd, tied = load_file(str(path)), False
    if "lm_head.weight" not in sd and (tied or path.is_file()) and "model.embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def from_pretrained(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
    """The compact model with the weights of an HF directory (or .safetensors file next to its config),
    in eval mode."""
    model = CausalLM.from_config(load_config(path), device=device, dtype=dtype)
    model.load_state_dict(load_state_dict(path))
    return model.eval()


def create_model(size: str, out_dir: str | Path, seed: int = 0, arch: str = "qwen2") -> Path:
    """Create a deterministic HF model directory for `size` ("debug" | "small") and return its path."""
    config = make_config(size, arch)
    return save_hf(init_state_dict(config, seed), config, build_tokenizer(), out_dir)


def ensure_model(storage_root: str | Path, name: str, size: str, seed: int = 0, arch: str = "qwen2") -> Path:
    """`storage_root/models/<name>`, created once; reused when its config.json and weights exist."""
    out = Path(storage_root) / "models" / name
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    # Build in a private temp dir and rename: concurrent callers never see a half-written model.
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    create_model(size, tmp, seed=seed, arch=arch)
    if (out / "model.safetensors").exists():  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    shutil.rmtree(out, ignore_errors=True)  # an incomplete leftover
    tmp.replace(out)
    return out
