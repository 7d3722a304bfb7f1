"""WikiText-2 as one long stream of token ids, cut into batch-first (input, target) pairs.

The pipeline splits every batch into micro-batches along dim 0, so unlike the classic
tutorial (which kept tensors sequence-first, ``[T, B]``) everything here is batch-first:
``batchify`` gives ``[B, N]`` and ``get_batch`` gives ``[B, T]`` inputs and targets.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import ssl
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pipeline_lib.lm.tokenizer import Vocab, basic_english

SPLITS = ("train", "valid", "test")
# The copy of WikiText-2 (v1, tokenized) that pytorch/examples ships with its word
# language model; a stable URL without the zip/S3 hosting the old tutorials relied on.
URL_TEMPLATE = (
    "https://raw.githubusercontent.com/pytorch/examples/main/"
    "word_language_model/data/wikitext-2/{split}.txt"
)
# Git blob ids (what ``git hash-object FILE`` prints) of those files. A blob id rather
# than a sha256 because it can be checked against the repository's own tree listing.
BLOB_IDS = {
    "train": "2d84b35af79e411d73ea7cae83c73964c6ac83b4",
    "valid": "eec944eb2d9e46061cd34a6913528797db6842fc",
    "test": "6f3fc88e4cd88456ea892971f9f12243e8428624",
}
ENV_VAR = "PIPELINE_LIB_DATA"
_HOW_TO_PROVIDE = (
    f"To use local files instead, set the environment variable {ENV_VAR} (or pass "
    "root=...) to a folder containing train.txt, valid.txt and test.txt."
)
# What a failing connection raises. Other OSErrors while downloading come from our own
# disk (full, read-only, no permission) and must not be reported as "are you offline?".
_NETWORK_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError,
                   TimeoutError, ssl.SSLError)


@dataclass(frozen=True)
class WikiText2:
    """The three splits as 1-D LongTensors of token ids, numbered by ``vocab``."""

    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    vocab: Vocab


def git_blob_id(path: Path) -> str:
    """sha1 of ``b"blob <size>\\0" + content``: the id git gives the file's contents."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def default_cache_dir() -> Path:
    """Where downloads go when neither ``root`` nor ``$PIPELINE_LIB_DATA`` is given."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "pipeline_lib" / "wikitext-2"


def download_split(split: str, folder: Path, progress: bool = True) -> Path:
    """Download one canonical split into ``folder``, keeping it only if its blob id matches.

    The bytes go to a temporary file in the same folder and are renamed into place only
    after verification, so an interrupted or corrupted download never leaves a
    ``train.txt`` behind that a later run would trust. (A killed process leaves its
    ``.part`` file; `find_wikitext2` removes those before the next download.)
    """
    url = URL_TEMPLATE.format(split=split)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{split}.", suffix=".part")
    except OSError as err:
        raise OSError(
            err.errno,
            f"Could not create a file in {folder}, where WikiText-2 is downloaded to "
            f"({err}). Is XDG_CACHE_HOME ({os.environ.get('XDG_CACHE_HOME', 'not set')}) "
            f"a file or a read-only folder? Set XDG_CACHE_HOME to a folder you can write. "
            f"{_HOW_TO_PROVIDE}",
        ) from err
    tmp = Path(tmp_name)
    try:
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
                size = int(response.headers.get("Content-Length") or 0) or None
                with tqdm(total=size, unit="B", unit_scale=True, desc=f"{split}.txt",
                          disable=not progress) as bar:
                    for chunk in iter(lambda: response.read(1 << 16), b""):
                        out.write(chunk)
                        bar.update(len(chunk))
        except _NETWORK_ERRORS as err:
            raise RuntimeError(
                f"Could not download WikiText-2 {split}.txt from {url} ({err}). "
                f"Are you offline? {_HOW_TO_PROVIDE}"
            ) from err
        except OSError as err:
            raise OSError(
                err.errno,
                f"Could not save WikiText-2 {split}.txt into {folder} ({err}). "
                "Is the disk full or the folder read-only? Free some space, or set "
                f"XDG_CACHE_HOME to a folder with room. {_HOW_TO_PROVIDE}",
            ) from err
        got = git_blob_id(tmp)
        if got != BLOB_IDS[split]:
            raise RuntimeError(
                f"Checksum mismatch for {split}.txt downloaded from {url}: expected git "
                f"blob id {BLOB_IDS[split]}, got {got}. The file was discarded. "
                + _HOW_TO_PROVIDE
            )
        final = folder / f"{split}.txt"
        os.replace(tmp, final)
        return final
    finally:
        tmp.unlink(missing_ok=True)


def find_wikitext2(root: str | os.PathLike | None = None, download: bool = True) -> Path:
    """Return a folder holding train/valid/test.txt, downloading into the cache if needed.

    Lookup order: ``root``, then ``$PIPELINE_LIB_DATA``, then :func:`default_cache_dir`.
    Files in a folder the user pointed at are trusted as they are (CI uses a smaller
    re-split copy whose ids differ), so only files we download ourselves are verified,
    and only the cache is ever downloaded into: we never mix our files into a user's folder.
    """
    if root is not None:
        folder, source = Path(root), "root"
    elif os.environ.get(ENV_VAR):
        folder, source = Path(os.environ[ENV_VAR]), f"${ENV_VAR}"
    else:
        folder, source = default_cache_dir(), "the download cache"
    missing = [s for s in SPLITS if not (folder / f"{s}.txt").is_file()]
    if missing and folder == default_cache_dir() and download:
        # Left by a download that was killed before it could clean up. (Only the cache
        # is ever downloaded into, so these are ours.)
        for stale in folder.glob(".*.part"):
            stale.unlink(missing_ok=True)
        for split in missing:
            download_split(split, folder)
        return folder
    if missing:
        fix = (
            "Call with download=True to fetch them."
            if folder == default_cache_dir()
            else f"Point {ENV_VAR} or root at a folder that has all of train.txt, "
            f"valid.txt and test.txt, or leave both unset to download into {default_cache_dir()}."
        )
        raise FileNotFoundError(
            f"{', '.join(f'{s}.txt' for s in missing)} not found in {folder} "
            f"(chosen from {source}). {fix}"
        )
    return folder


def tokenize_lines(lines: Iterable[str], vocab: Vocab, source: str = "the text") -> torch.Tensor:
    """Turn lines of text into one flat stream of ids: the tutorial's ``data_process``.

    Each line is tokenised separately, lines with no tokens are dropped and the rest are
    concatenated with nothing in between, so the model sees article text run on across
    line breaks exactly as in the PyTorch tutorials. ``source`` names the text in errors.
    """
    per_line = [torch.tensor(vocab.lookup_indices(basic_english(line)), dtype=torch.long)
                for line in lines]
    non_empty = [ids for ids in per_line if ids.numel() > 0]
    if not non_empty:
        raise ValueError(f"{source} contains no tokens; is the file empty?")
    return torch.cat(non_empty)


def load_wikitext2(root: str | os.PathLike | None = None, download: bool = True) -> WikiText2:
    """Load WikiText-2 (see :func:`find_wikitext2` for where it looks) as token-id tensors.

    The vocabulary is built from the train split only, as in the tutorials, so words that
    occur only in valid/test map to ``<unk>``.
    """
    folder = find_wikitext2(root, download)
    paths = {s: folder / f"{s}.txt" for s in SPLITS}
    lines = {s: _read_lines(paths[s]) for s in SPLITS}
    vocab = Vocab(basic_english(line) for line in lines["train"])
    ids = {s: tokenize_lines(lines[s], vocab, source=str(paths[s])) for s in SPLITS}
    return WikiText2(train=ids["train"], valid=ids["valid"], test=ids["test"], vocab=vocab)


def _read_lines(path: Path) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return list(f)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {err.start}: {err.reason}). WikiText-2 is "
            "UTF-8: replace the file with the original, or convert it with iconv."
        ) from err


def batchify(data: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Cut a 1-D token stream into ``batch_size`` equal rows, shape ``[batch_size, n]``.

    Row ``b`` is the ``b``-th contiguous chunk of the text, so moving along dim 1 reads
    on through the text; the few tokens that don't fill a whole column are dropped.
    """
    if data.dim() != 1:
        raise ValueError(f"batchify expects a 1-D token stream, got shape {tuple(data.shape)}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    n = data.numel() // batch_size
    if n < 2:
        raise ValueError(
            f"Cannot make {batch_size} rows of at least 2 tokens (one input and its target) "
            f"from {data.numel()} tokens; use a smaller batch_size."
        )
    return data[: n * batch_size].view(batch_size, n)


def get_batch(source: torch.Tensor, i: int, bptt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns ``i .. i+bptt-1`` of ``source`` as input and the next token of each as target.

    Both come back as ``[B, T]`` with ``T = min(bptt, n - 1 - i)``, so the last chunk may be
    shorter. Keeping target in the same layout as input means ``logits.flatten(0, 1)`` and
    ``target.flatten()`` line up position for position.
    """
    if source.dim() != 2:
        raise ValueError(
            f"get_batch expects a [batch, n] tensor from batchify, got shape {tuple(source.shape)}."
        )
    if bptt < 1:
        raise ValueError(f"bptt must be >= 1, got {bptt}.")
    n = source.size(1)
    if not 0 <= i < n - 1:
        raise ValueError(
            f"Start column i={i} leaves no target: it must be in [0, {n - 2}] for a "
            f"source with {n} columns (iterate range(0, source.size(1) - 1, bptt))."
        )
    seq_len = min(bptt, n - 1 - i)
    return source[:, i : i + seq_len], source[:, i + 1 : i + 1 + seq_len]
