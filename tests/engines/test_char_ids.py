"""The bootstrap's fast encoding: `char_ids` is the built-in tokenizer's encoding, and `Tokenised.build`
lays every example out as a loop over rows would."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.engines.bootstrap import Tokenised
from pivotrl.engines.checkpoints import CHARACTERS, SPECIAL_TOKENS, build_tokenizer, char_ids

TOK = build_tokenizer()
# known characters, characters the tokenizer does not know, and the special tokens' spellings
pieces = st.one_of(st.sampled_from(CHARACTERS), st.characters(), st.sampled_from(SPECIAL_TOKENS))
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
