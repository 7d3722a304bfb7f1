import random

import pytest

from pipeline_lib.lm.tokenizer import Vocab, basic_english


@pytest.mark.parametrize(
    "line, expected",
    [
        ("Hello World", ["hello", "world"]),
        ("don't", ["don", "'", "t"]),
        ("rock 'n' roll", ["rock", "'", "n", "'", "roll"]),
        ('He said "hi" twice', ["he", "said", "hi", "twice"]),
        ("a<br />b", ["a", "b"]),
        ("end.<BR />Next", ["end", ".", "next"]),  # lowercased before <br /> is matched
        ("a<br/>b", ["a<br/>b"]),  # only the exact "<br />" form is removed
        ("Wait...what?!", ["wait", ".", ".", ".", "what", "?", "!"]),
        ("x,y (z)", ["x", ",", "y", "(", "z", ")"]),
        ("a;b:c", ["a", "b", "c"]),  # ; and : are deleted, not split off
        ("  lots \t of\n\nspace  ", ["lots", "of", "space"]),
        ("Ünïcode café “quoted” – dash", ["ünïcode", "café", "“quoted”", "–", "dash"]),
        (" = Robert <unk> = \n", ["=", "robert", "<unk>", "="]),
        ("guest @-@ starring 1 @,@ 000", ["guest", "@-@", "starring", "1", "@", ",", "@", "000"]),
        ("", []),
        (" \n", []),
    ],
)
def test_basic_english_matches_torchtext_rules(line, expected):
    assert basic_english(line) == expected


def test_vocab_orders_specials_then_frequency_then_alphabet():
    lines = [["b", "a", "c", "c"], ["a", "d", "b", "c"]]  # c:3, a:2, b:2, d:1
    vocab = Vocab(lines, specials=["<unk>", "<pad>"])
    assert vocab.itos == ["<unk>", "<pad>", "c", "a", "b", "d"]
    assert [vocab[t] for t in vocab.itos] == list(range(len(vocab)))


def test_vocab_is_independent_of_corpus_order():
    words = [w for w, n in [("x", 3), ("y", 3), ("z", 3), ("w", 1)] for _ in range(n)]
    shuffled = words[:]
    random.Random(0).shuffle(shuffled)
    assert Vocab([words]).itos == Vocab([shuffled]).itos == ["<unk>", "x", "y", "z", "w"]


def test_unknown_and_rare_tokens_map_to_unk():
    vocab = Vocab([["a", "a", "b", "<unk>"]], min_freq=2)
    assert vocab.itos == ["<unk>", "a"]  # "<unk>" in the text is not counted twice
    assert vocab.default_index == vocab["<unk>"] == 0
    assert vocab.lookup_indices(["a", "b", "never-seen"]) == [1, 0, 0]
    assert "a" in vocab and "b" not in vocab


def test_lookup_round_trip():
    vocab = Vocab([basic_english("The cat sat on the mat.")])
    tokens = basic_english("the mat sat.")
    assert vocab.lookup_tokens(vocab.lookup_indices(tokens)) == tokens
    with pytest.raises(IndexError, match="outside the vocabulary"):
        vocab.lookup_tokens([len(vocab)])


def test_vocab_without_unk_refuses_unknown_tokens():
    vocab = Vocab([["a"]], specials=[])
    assert vocab.default_index is None
    with pytest.raises(KeyError, match="no '<unk>' special"):
        vocab["b"]


def test_vocab_rejects_untokenised_text():
    with pytest.raises(TypeError, match="iterable of token lists"):
        Vocab("some text")
    with pytest.raises(TypeError, match="tokenise it first"):
        Vocab(["a line of text"])
    with pytest.raises(ValueError, match="min_freq"):
        Vocab([["a"]], min_freq=0)
