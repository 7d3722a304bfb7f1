"""Word-level tokenizer and vocabulary: a small stand-in for the parts of torchtext we need.

torchtext is no longer maintained and its last release does not import with current
PyTorch, but the classic tutorials this project follows are written against its
``get_tokenizer("basic_english")`` and ``build_vocab_from_iterator``. Reproducing the
two here keeps our token ids, vocabulary sizes and losses comparable with those tutorials.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

# (pattern, replacement) pairs, applied in this order, copied from
# torchtext/data/utils.py (``_patterns`` / ``_replacements``).
_BASIC_ENGLISH_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(pattern), replacement)
    for pattern, replacement in [
        (r"\'", " '  "),
        (r"\"", ""),
        (r"\.", " . "),
        (r"<br \/>", " "),
        (r",", " , "),
        (r"\(", " ( "),
        (r"\)", " ) "),
        (r"\!", " ! "),
        (r"\?", " ? "),
        (r"\;", " "),
        (r"\:", " "),
        (r"\s+", " "),
    ]
]


def basic_english(line: str) -> list[str]:
    """Split a line into lowercase word tokens exactly as torchtext's ``basic_english`` did.

    Rules, applied in this order after lowercasing (same order as torchtext's source;
    lowercasing first is why ``<BR />`` is dropped too):

    1. ``'``  -> ``" '  "``  (apostrophe becomes its own token: ``don't`` -> ``don ' t``)
    2. ``"``  -> ``""``      (double quotes are deleted)
    3. ``.``  -> ``" . "``
    4. ``<br />`` -> ``" "`` (HTML line breaks are dropped; ``<br/>`` is not matched)
    5. ``,``  -> ``" , "``
    6. ``(``  -> ``" ( "`` and 7. ``)`` -> ``" ) "``
    8. ``!``  -> ``" ! "`` and 9. ``?`` -> ``" ? "``
    10. ``;`` -> ``" "`` and 11. ``:`` -> ``" "`` (deleted)
    12. any whitespace run -> ``" "``

    then ``str.split()``. Everything else (``@-@``, ``<unk>``, ``-``, unicode letters and
    punctuation such as ``“``) stays inside tokens, which is why WikiText's own ``<unk>``
    marker survives and maps onto the vocabulary's ``<unk>`` entry.
    """
    line = line.lower()
    for pattern, replacement in _BASIC_ENGLISH_RULES:
        line = pattern.sub(replacement, line)
    return line.split()


class Vocab:
    """Bidirectional token <-> index map with a fallback index for unknown tokens.

    Order of indices (same as torchtext >= 0.12 ``build_vocab_from_iterator``, so ids
    match the tutorials): the ``specials`` first, in the order given, then every other
    token by descending frequency, **ties broken alphabetically**. The alphabetical
    tie-break (rather than first appearance) makes the vocabulary a function of the
    token counts alone, so shuffling or re-splitting the corpus cannot renumber it.

    Tokens seen fewer than ``min_freq`` times are left out and so map to
    ``default_index``, which is the index of ``"<unk>"``; without an ``"<unk>"`` special
    there is no fallback and looking up an unknown token raises ``KeyError``.
    """

    def __init__(
        self,
        token_lists: Iterable[Iterable[str]],
        specials: Sequence[str] = ("<unk>",),
        min_freq: int = 1,
    ) -> None:
        if isinstance(token_lists, str):
            raise TypeError(
                "Vocab expects an iterable of token lists, e.g. [basic_english(line) "
                "for line in lines], not a single string."
            )
        if min_freq < 1:
            raise ValueError(f"min_freq must be >= 1, got {min_freq}.")
        if len(set(specials)) != len(specials):
            raise ValueError(f"specials must be distinct, got {list(specials)}.")
        counts: Counter[str] = Counter()
        for tokens in token_lists:
            if isinstance(tokens, str):
                raise TypeError(
                    f"Vocab expects each item to be a list of tokens, got the string "
                    f"{tokens[:30]!r}; tokenise it first, e.g. basic_english(line)."
                )
            counts.update(tokens)
        for special in specials:
            counts.pop(special, None)
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        self.itos: list[str] = list(specials) + [t for t, n in ranked if n >= min_freq]
        self.stoi: dict[str, int] = {token: i for i, token in enumerate(self.itos)}
        self.default_index: int | None = self.stoi.get("<unk>")

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, token: object) -> bool:
        return token in self.stoi

    def __getitem__(self, token: str) -> int:
        index = self.stoi.get(token, self.default_index)
        if index is None:
            raise KeyError(
                f"Token {token!r} is not in the vocabulary and there is no '<unk>' "
                "special to map it to; build the Vocab with specials=['<unk>', ...]."
            )
        return index

    def lookup_indices(self, tokens: Iterable[str]) -> list[int]:
        return [self[token] for token in tokens]

    def lookup_tokens(self, indices: Iterable[int]) -> list[str]:
        tokens = []
        for index in indices:
            if not 0 <= index < len(self.itos):
                raise IndexError(f"Index {index} is outside the vocabulary [0, {len(self)}).")
            tokens.append(self.itos[index])
        return tokens

    def __repr__(self) -> str:
        return f"Vocab(size={len(self)}, specials_first={self.itos[:3]})"
