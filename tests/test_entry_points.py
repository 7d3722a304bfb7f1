"""The two entry points a learner meets first: `make lab` (tools/lab.py) and `make test`.

That the lab really starts as this user and serves the notebooks is checked in
test_browser.py; here, what its command line becomes on other machines, and that
`make test` without WikiText-2 stops once, up front, with what to do.
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MINI, needs_mini

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lab", ROOT / "tools" / "lab.py")
lab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lab)


@pytest.mark.parametrize("uid, allowed", [(0, True), (1000, False)])
def test_lab_passes_allow_root_only_to_root(monkeypatch, uid, allowed):
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    assert ("--allow-root" in lab.lab_command()) == allowed


@pytest.mark.parametrize("platform, display, opens_browser", [
    ("linux", None, False),             # a server over ssh, a container
    ("linux", ":0", True),
    ("darwin", None, True),             # macOS opens browsers without X
])
def test_lab_opens_a_browser_only_where_one_can_open(monkeypatch, platform, display,
                                                     opens_browser):
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    if display is None:
        monkeypatch.delenv("DISPLAY", raising=False)
    else:
        monkeypatch.setenv("DISPLAY", display)
    assert ("--no-browser" not in lab.lab_command()) == opens_browser


def test_lab_opens_notebooks_or_the_student_versions(tmp_path, capsys):
    assert lab.lab_command()[3] == str(ROOT / "notebooks")
    assert lab.lab_command(folder=tmp_path)[3] == str(tmp_path)
    with pytest.raises(SystemExit):
        lab.main(["--folder", str(tmp_path / "student")])      # make student not run yet
    assert "make student writes student/" in capsys.readouterr().err


def test_lab_port_is_passed_only_when_asked():
    assert "--port=9000" in lab.lab_command(9000)
    assert not any(arg.startswith("--port") for arg in lab.lab_command())   # JUPYTER_PORT, config


@pytest.mark.parametrize("port", ["99999", "-5", "65536", "eighty"])
def test_lab_refuses_a_port_outside_1_to_65535(monkeypatch, capsys, port):
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("started jupyter"))
    with pytest.raises(SystemExit) as exit_:
        lab.main([f"--port={port}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--port" in err and "1 to 65535" in err, err


def test_lab_takes_port_0_for_any_free_port(monkeypatch):
    """Jupyter's own meaning of 0 (the system picks a free port, the URL printed is the one
    it listens on): what the browser test starts JupyterLab with."""
    started = []
    monkeypatch.setattr(os, "execv", lambda path, argv: started.append(argv))
    lab.main(["--port=0"])
    assert "--port=0" in started[0]


def run_pytest(*args: str, data: Path | None, cache: Path) -> subprocess.CompletedProcess:
    """This repository's pytest, as `make test` runs it, offline: the download cannot connect."""
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("pipeline_lib_data", "no_proxy", "https_proxy", "all_proxy")}
    env.update(XDG_CACHE_HOME=str(cache), https_proxy="http://127.0.0.1:9")  # nothing listens
    if data is not None:
        env["PIPELINE_LIB_DATA"] = str(data)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args,
         "--nbval", "--nbval-current-env"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_make_test_without_data_or_network_stops_once_before_running_anything(tmp_path):
    result = run_pytest("tests/test_tokenizer.py", "notebooks/03_transformer_pipeline.ipynb",
                        data=None, cache=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert out.count("could not be found or downloaded") == 1, out
    assert "03_transformer_pipeline.ipynb" in out and "Could not download" in out, out
    assert "PIPELINE_LIB_DATA=/path/to/wikitext-2 make test" in out, out
    assert "no tests ran" in out, out                   # not even the tokenizer tests


def test_data_check_lets_through_notebooks_that_need_no_data(tmp_path):
    result = run_pytest("--collect-only", "notebooks/01_naive_model_parallelism.ipynb",
                        data=None, cache=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_mini
def test_data_check_passes_with_pipeline_lib_data(tmp_path):
    result = run_pytest("--collect-only", "notebooks/03_transformer_pipeline.ipynb",
                        data=MINI, cache=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
