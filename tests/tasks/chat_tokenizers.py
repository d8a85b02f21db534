"""Test tokenizers with chat templates, built here (nothing is downloaded).

`qwen_style_dir` writes a Hugging Face directory (config.json + tokenizer files, *no weights*) whose BPE
tokenizer has ChatML special tokens and a Qwen3-like template (a ``enable_thinking`` switch), and whose
plain encoding adds a ``<s>`` like Llama's does — so a renderer that lets the tokenizer add its special
tokens on top of the template's output shows up as a doubled or stray token.
"""

from __future__ import annotations

from pathlib import Path

QWEN_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

CORPUS = [
    "Problem: Ana has 12 apples and gets 7 more. How many apples does Ana have now?",
    "Reference: 19 Response: 12 + 7 = 19. answer: 19 Is the final answer right? verdict: yes",
    "You are a careful grader. Think, then write Verdict: CORRECT or Verdict: INCORRECT.",
] * 20


def qwen_style_dir(out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    specials = ["<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = QWEN_STYLE_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    Qwen2Config(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    ).save_pretrained(out)
    return out
