import errno
import http.client
import os
import shutil
import subprocess
import urllib.error
from pathlib import Path

import pytest
import torch

from pipeline_lib.lm import data
from pipeline_lib.lm.data import (
    BLOB_IDS,
    SPLITS,
    batchify,
    default_cache_dir,
    get_batch,
    git_blob_id,
    load_wikitext2,
    tokenize_lines,
)
from pipeline_lib.lm.tokenizer import Vocab, basic_english

from conftest import MINI, needs_mini


@pytest.fixture(scope="module")
def mini():
    return load_wikitext2(MINI)


@pytest.fixture
def empty_env(tmp_path, monkeypatch):
    """No $PIPELINE_LIB_DATA and a fresh cache, so loading must go through the cache."""
    monkeypatch.delenv("PIPELINE_LIB_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """Serve three small splits over file:// and register their blob ids as canonical."""
    served = tmp_path / "server"
    served.mkdir()
    texts = {
        "train": " = Title = \n\n the cat sat on the mat . \n",
        "valid": " the dog sat . \n",
        "test": " a cat ! \n",
    }
    for split, text in texts.items():
        (served / f"{split}.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(data, "URL_TEMPLATE", served.as_uri() + "/{split}.txt")
    monkeypatch.setattr(data, "BLOB_IDS", {s: git_blob_id(served / f"{s}.txt") for s in SPLITS})
    return texts


@needs_mini
def test_load_mini_wikitext2(mini):
    first_line_tokens = ["=", "robert", "<unk>", "="]
    assert mini.vocab.lookup_tokens(mini.train[:4].tolist()) == first_line_tokens
    assert mini.vocab.itos[0] == "<unk>"
    with open(MINI / "train.txt", encoding="utf-8") as f:
        n_tokens = sum(len(basic_english(line)) for line in f)
    assert mini.train.shape == (n_tokens,) and mini.train.dtype == torch.long
    for split in (mini.valid, mini.test):  # numbered with the train vocabulary
        assert split.dim() == 1 and 0 <= split.min() and split.max() < len(mini.vocab)


@needs_mini
def test_pipeline_lib_data_env_var_is_used(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINE_LIB_DATA", str(MINI))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert data.find_wikitext2() == MINI
    assert not any(tmp_path.iterdir())  # nothing was downloaded


@needs_mini
def test_git_blob_id_matches_canonical_file():
    # Per its README, the mini train.txt is the canonical test.txt byte for byte.
    assert git_blob_id(MINI / "train.txt") == BLOB_IDS["test"]


def test_git_blob_id_matches_git(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    path = tmp_path / "f.txt"
    path.write_bytes("héllo\nworld\0\n".encode())
    expected = subprocess.run(
        ["git", "hash-object", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert git_blob_id(path) == expected


def test_cache_dir_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "pipeline_lib" / "wikitext-2"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "pipeline_lib" / "wikitext-2"


def test_download_verifies_and_caches(empty_env, fake_server):
    ds = load_wikitext2()
    cache = default_cache_dir()
    assert sorted(p.name for p in cache.iterdir()) == ["test.txt", "train.txt", "valid.txt"]
    for split, text in fake_server.items():
        assert (cache / f"{split}.txt").read_text(encoding="utf-8") == text
    assert ds.vocab.lookup_tokens(ds.valid.tolist()) == ["the", "<unk>", "sat", "."]
    # The cached copy is now found without the network.
    assert torch.equal(load_wikitext2(download=False).train, ds.train)


def test_checksum_mismatch_discards_the_bad_file(empty_env, fake_server, monkeypatch):
    monkeypatch.setitem(data.BLOB_IDS, "valid", "0" * 40)
    expected = r"valid\.txt.*expected git blob id 0{40}, got [0-9a-f]{40}"
    with pytest.raises(RuntimeError, match=expected) as err:
        load_wikitext2()
    assert "PIPELINE_LIB_DATA" in str(err.value)
    left = sorted(p.name for p in default_cache_dir().iterdir())
    assert left == ["train.txt"]  # the verified split stays, the bad one and its temp file don't


@pytest.mark.parametrize("error", [
    urllib.error.URLError("Temporary failure in name resolution"),
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    TimeoutError("The read operation timed out"),
    http.client.IncompleteRead(b"partial"),
])
def test_offline_download_explains_how_to_provide_files(empty_env, monkeypatch, error):
    def offline(url, timeout):
        raise error

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    with pytest.raises(RuntimeError, match="raw.githubusercontent.com.*PIPELINE_LIB_DATA"):
        load_wikitext2()
    assert not any(default_cache_dir().iterdir())


def test_user_folder_missing_files_is_an_error_not_a_download(empty_env, monkeypatch):
    def no_network(url, timeout):
        raise AssertionError(f"must not download into a user's folder, tried {url}")

    monkeypatch.setattr(data.urllib.request, "urlopen", no_network)
    folder = empty_env / "mine"
    folder.mkdir()
    (folder / "train.txt").write_text("hello\n")
    with pytest.raises(FileNotFoundError, match=r"valid\.txt, test\.txt not found in .*mine"):
        load_wikitext2(folder)
    with pytest.raises(FileNotFoundError, match="download=True"):
        load_wikitext2(download=False)


def test_tokenize_lines_concatenates_non_empty_lines():
    vocab = Vocab([["a", "b"]])
    ids = tokenize_lines([" a b \n", "\n", "   \n", "b zzz\n"], vocab)
    assert vocab.lookup_tokens(ids.tolist()) == ["a", "b", "b", "<unk>"]
    with pytest.raises(ValueError, match="no tokens"):
        tokenize_lines(["\n", " "], vocab)


def test_batchify_is_batch_first_and_trims():
    out = batchify(torch.arange(11), 3)
    assert out.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # each row reads on through the text
    with pytest.raises(ValueError, match="smaller batch_size"):
        batchify(torch.arange(5), 3)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        batchify(torch.arange(5), 0)
    with pytest.raises(ValueError, match="1-D"):
        batchify(torch.zeros(2, 5), 1)


def test_get_batch_targets_are_inputs_shifted_by_one():
    source = batchify(torch.arange(40), 4)  # 4 rows x 10 columns
    inputs, targets = get_batch(source, 0, 4)
    assert inputs.shape == targets.shape == (4, 4)
    assert torch.equal(targets, inputs + 1)
    inputs, targets = get_batch(source, 8, 4)  # only one column left before the end
    assert inputs.tolist() == [[8], [18], [28], [38]] and torch.equal(targets, inputs + 1)


def test_get_batch_rejects_bad_arguments():
    source = batchify(torch.arange(40), 4)
    with pytest.raises(ValueError, match=r"must be in \[0, 8\]"):
        get_batch(source, 9, 4)
    with pytest.raises(ValueError, match="bptt must be >= 1"):
        get_batch(source, 0, 0)
    with pytest.raises(ValueError, match="from batchify"):
        get_batch(torch.arange(40), 0, 4)


def test_a_full_disk_is_not_reported_as_offline(empty_env, fake_server, monkeypatch):
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full, where every write fails with ENOSPC")
    real_mkstemp = data.tempfile.mkstemp

    def on_full_disk(**kwargs):
        fd, name = real_mkstemp(**kwargs)
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(data.tempfile, "mkstemp", on_full_disk)
    with pytest.raises(OSError, match="disk full") as err:
        load_wikitext2()
    assert err.value.errno == errno.ENOSPC
    assert "offline" not in str(err.value) and str(default_cache_dir()) in str(err.value)
    assert not any(default_cache_dir().iterdir())  # no half-written file is left


def test_a_part_file_left_by_a_killed_download_is_removed(empty_env, fake_server):
    cache = default_cache_dir()
    cache.mkdir(parents=True)
    (cache / ".valid.k1ll3d.part").write_text("half a file")
    load_wikitext2()
    assert sorted(p.name for p in cache.iterdir()) == ["test.txt", "train.txt", "valid.txt"]


def write_splits(folder: Path, **contents: bytes) -> Path:
    folder.mkdir()
    for split in SPLITS:
        (folder / f"{split}.txt").write_bytes(contents.get(split, b" the cat sat . \n"))
    return folder


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    folder = write_splits(tmp_path / "latin1", valid=" caf\xe9 au lait \n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.valid\.txt is not UTF-8 text"):
        load_wikitext2(folder)


@pytest.mark.parametrize("split", SPLITS)
def test_an_empty_file_is_named(tmp_path, split):
    folder = write_splits(tmp_path / "data", **{split: b" \n\n"})
    with pytest.raises(ValueError, match=rf"data.{split}\.txt contains no tokens"):
        load_wikitext2(folder)


@pytest.mark.parametrize("where", ["a file", "read-only"])
def test_a_cache_that_cannot_be_written_is_named(empty_env, fake_server, monkeypatch, where):
    """mkdir and the temporary file were outside the try: a raw OSError."""
    cache_home = empty_env / "xdg"
    if where == "a file":
        cache_home.write_text("not a folder")
    else:
        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied")
        monkeypatch.setattr(data.tempfile, "mkstemp", refuse)
    with pytest.raises(OSError, match=r"Could not create a file in .*XDG_CACHE_HOME .* a "
                                      r"file or a read-only folder\? Set XDG_CACHE_HOME to a "
                                      r"folder you can write") as err:
        load_wikitext2()
    assert str(cache_home) in str(err.value) and "PIPELINE_LIB_DATA" in str(err.value)
