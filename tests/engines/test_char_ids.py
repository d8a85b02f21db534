"""The bootstrap's fast encoding: `char_ids` is the built-in tokenizer's encoding, and `Tokenised.build`
lays every example out as a loop over rows would."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.engines.bootstrap import Tokenised
from pivotrl.engines.checkpoints import CHARACTERS, SPECIAL_TOKENS, build_tokenizer, char_ids

TOK = build_tokenizer()
# known characters, characters the tokenizer does not know, and the special tokens' spellings; no lone
# surrogates: not text (the tokenizer refuses them, and a config or dataset holding one is refused first:
# `pivotrl.errors.not_text`, `pivotrl.tasks.datasets`)
pieces = st.one_of(st.sampled_from(CHARACTERS), st.characters(exclude_categories=("Cs",)),
                   st.sampled_from(SPECIAL_TOKENS))
texts = st.lists(pieces, max_size=30).map("".join)


@settings(max_examples=200, deadline=None)
@given(batch=st.lists(texts, min_size=1, max_size=6), bos=st.booleans())
def test_char_ids_are_the_tokenizers_ids(batch, bos):
    assert char_ids(batch, TOK, bos=bos) == [list(x) for x in TOK(batch, add_special_tokens=bos)["input_ids"]]


def _rows_one_by_one(data, pad_id):
    lengths = [len(p) + len(t) for p, t in data]
    ids = torch.full((len(data), max(lengths, default=1)), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for row, (p, t) in enumerate(data):
        ids[row, : len(p) + len(t)] = torch.tensor(p + t, dtype=torch.long)
        labels[row, len(p) : len(p) + len(t)] = torch.tensor(t, dtype=torch.long)
    return ids, labels, torch.tensor(lengths), torch.tensor([len(t) for _, t in data])


ids_list = st.lists(st.integers(0, 99), max_size=12)


@settings(max_examples=200, deadline=None)
@given(data=st.lists(st.tuples(ids_list, ids_list).filter(lambda pt: len(pt[0]) + len(pt[1]) > 0),
                     min_size=1, max_size=8), pad_id=st.integers(0, 3))
def test_the_table_is_what_a_loop_over_rows_builds(data, pad_id):
    table = Tokenised.build(data, pad_id)
    ids, labels, lengths, targets = _rows_one_by_one(data, pad_id)
    assert torch.equal(table.ids, ids) and torch.equal(table.labels, labels)
    assert torch.equal(table.lengths, lengths) and torch.equal(table.targets, targets)


def _tokenizer_side(side):
    """The same `ChatSide` going through the tokenizer (its built-in lookup switched off)."""
    from pivotrl.engines.prompts import ChatSide

    slow = ChatSide(side.tokenizer, side.chat, side.system_prompt, dict(side.template_kwargs))
    slow.__dict__["builtin"] = False
    return slow


@settings(max_examples=200, deadline=None)
@given(text=texts, chat=st.booleans(), ids=st.lists(st.integers(0, 120), max_size=30))
def test_a_chat_side_with_the_builtin_tokenizer_encodes_and_decodes_as_the_tokenizer(text, chat, ids):
    """The driver's lookup per character gives the tokenizer's prompt ids and response text, with the chat
    template or without, for known, unknown and special-token characters, and ids past the vocabulary
    (the engines' ids are never negative)."""
    from pivotrl.engines.checkpoints import TINY_CHAT_TEMPLATE
    from pivotrl.engines.prompts import ChatSide

    side = ChatSide(build_tokenizer(TINY_CHAT_TEMPLATE) if chat else TOK, chat=chat)
    assert side.builtin
    slow = _tokenizer_side(side)
    assert side.ids(text) == slow.ids(text)
    assert side.decode(ids) == slow.decode(ids)


def test_only_the_builtin_tokenizer_takes_the_lookup(tmp_path):
    """A tokenizer saved and loaded again is still the built-in one; one with another vocabulary or split
    is not."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoTokenizer

    from pivotrl.engines.checkpoints import is_builtin_tokenizer

    TOK.save_pretrained(tmp_path / "t")
    assert is_builtin_tokenizer(AutoTokenizer.from_pretrained(tmp_path / "t"))
    other = build_tokenizer()
    other.add_tokens(["sort"])
    assert not is_builtin_tokenizer(other)
    split = build_tokenizer()
    split.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s"), behavior="isolated")
    assert not is_builtin_tokenizer(split)
    assert not is_builtin_tokenizer(object())
