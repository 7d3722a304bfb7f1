"""The notebooks as a learner meets them: in JupyterLab, in a real browser.

nbval runs each notebook in a bare kernel; it never starts JupyterLab, renders a widget or
clicks a menu. Here JupyterLab is started the way `make lab` starts it (tools/lab.py, same
environment, as the same user), on a free port with a token, and Playwright drives the
system's Chromium (Debian's ``chromium`` package: Playwright's own browser download is never
used). The lab lists every notebook. In notebook 02 the test clears the saved outputs,
selects the explorer's cell and the cells it needs (`notebook_slice`), runs them with
Run > Run Selected Cells, waits for the kernel, fails on any error or traceback, checks that
the explorer is drawn, then turns its schedule dropdown and a slider and checks that the
chart is redrawn and the printed numbers are the simulator's for the new settings. Every
explorer is `pipeline_lib.viz.explorer` with other controls: test_explorer.py turns each
kind (slider, dropdown, checkbox) in a kernel, and nbval runs every cell, 07's ``explore()``
included; running them here too would only add minutes to CI.

A screenshot per notebook goes to out/browser/ (CI keeps it). Every wait has a timeout, and
the server, its kernels and everything they started are stopped at the end whatever
happens; a process left behind fails the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import nbformat
import pytest

from notebook_slice import needed

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def widget_cells(path: Path) -> list[int]:
    """The cells that display ipywidgets (an explorer), read from the notebook's source."""
    cells = nbformat.read(path, as_version=4).cells
    return [i for i, cell in enumerate(cells) if cell.cell_type == "code"
            and ("ipywidgets" in cell.source or "explorer(" in cell.source)]


EXPLORER = next(nb for nb in NOTEBOOKS if nb.name.startswith("02_"))
SCREENSHOTS = ROOT / "out" / "browser"
MARKER = "PIPELINE_LIB_LAB_TEST"        # set in the server's environment, inherited by all it starts
SERVER_START_S = 180
KERNEL_START_S = 180
RUN_S = 600                             # one notebook's cells, on a slow shared machine
UI_S = 60                               # a click, a page load, a redraw
STOP_S = 60


def missing(what: str) -> None:
    """Skip loudly where the browser test cannot run; under CI, fail instead of skipping."""
    message = f"BROWSER TEST NOT RUN: {what}"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (CI=true, so this is a failure; .ci/run installs it)")
    pytest.skip(message)


class LabServer:
    """JupyterLab on notebooks/ as `make lab` starts it, plus what a test needs to drive it.

    Test-only settings: a fixed token, a free port, no browser, autosave off (so running the
    notebooks never writes into the repository) and private settings, workspace and runtime
    folders. MPLBACKEND is dropped because a learner's lab has none (CI sets Agg for nbval);
    the kernel then picks the inline backend itself.
    """

    def __init__(self, home: Path):
        self.home = home
        self.token = uuid.uuid4().hex
        self.marker = uuid.uuid4().hex
        self.log = home / "server.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> None:
        settings = self.home / "settings" / "@jupyterlab"
        for plugin, value in [("docmanager-extension/plugin", {"autosave": False}),
                              ("apputils-extension/notification", {"fetchNews": "false"})]:
            path = settings / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        runtime = self.home / "runtime"
        env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
        env.update({MARKER: self.marker, "JUPYTER_RUNTIME_DIR": str(runtime),
                    "JUPYTER_CONFIG_DIR": str(self.home / "config"),
                    "JUPYTERLAB_SETTINGS_DIR": str(self.home / "settings"),
                    "JUPYTERLAB_WORKSPACES_DIR": str(self.home / "workspaces")})
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "tools" / "lab.py"), "--port=0", "--no-browser",
                 "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                 "--LabApp.expose_app_in_browser=True"],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        info = runtime / f"jpserver-{self.proc.pid}.json"   # lab.py execs: same pid
        deadline = time.monotonic() + SERVER_START_S
        while (port := self.port(info)) is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"JupyterLab did not start in {SERVER_START_S} s:\n{self.tail()}")
            time.sleep(0.5)
        self.url = f"http://127.0.0.1:{port}"
        self.api("GET", "/api/status")

    @staticmethod
    def port(info: Path) -> int | None:
        """The port the server's info file names, None until it is written whole (the
        server creates the file, then writes it: it can be read empty in between)."""
        try:
            return json.loads(info.read_text())["port"]
        except (OSError, ValueError, KeyError):
            return None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.is_file() else ""

    def api(self, method: str, path: str):
        request = urllib.request.Request(self.url + path, method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=UI_S) as response:
            body = response.read()
        return json.loads(body) if body else None

    def stop_kernels(self) -> None:
        """Shut every session's kernel and wait until none is left: one kernel at a time."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")
        deadline = time.monotonic() + STOP_S
        while kernels := self.api("GET", "/api/kernels"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"kernels still running {STOP_S} s after shutdown: {kernels}")
            time.sleep(0.5)

    def stop(self) -> list[str]:
        """Stop the server (politely, then by signal) and kill anything it left behind.

        Returns the command lines of the processes that outlived the server: kernels or
        their workers that nothing else would ever stop.
        """
        if self.proc is None:
            return []
        if self.proc.poll() is None:
            try:
                if self.url:                          # else it never said where it is
                    self.api("POST", "/api/shutdown")     # also shuts its kernels down
            except OSError:
                pass
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    self.proc.wait(timeout=STOP_S)
                    break
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=STOP_S)
        leftovers = []
        for pid, cmdline in self.processes():
            leftovers.append(cmdline)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return leftovers

    def processes(self) -> list[tuple[int, str]]:
        """Our own processes still alive: those whose environment carries this server's marker."""
        needle = f"{MARKER}={self.marker}".encode()
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if proc.stat().st_uid != os.getuid():
                    continue
                if needle in (proc / "environ").read_bytes().split(b"\0"):
                    cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
                    found.append((int(proc.name), cmdline.decode(errors="replace")))
            except OSError:                           # gone, or not ours to read
                pass
        return found


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    server = LabServer(tmp_path_factory.mktemp("lab"))
    try:
        server.start()
        yield server
    finally:
        leftovers = server.stop()
    assert not leftovers, f"processes outlived the JupyterLab server (killed now): {leftovers}"


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        missing("no Chromium found. Install the system package: "
                "apt-get install chromium (Debian/Ubuntu); Playwright's own browsers are not used")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("the playwright package is not installed: pip install -r requirements.txt")
    with sync_playwright() as playwright:
        chrome = playwright.chromium.launch(executable_path=chromium, timeout=UI_S * 1000)
        try:
            yield chrome
        finally:
            chrome.close()


def test_lab_serves_the_notebooks(lab):
    """`make lab`'s command starts for this user (root included) and serves notebooks/."""
    listed = {item["name"] for item in lab.api("GET", "/api/contents")["content"]}
    assert {nb.name for nb in NOTEBOOKS} <= listed


# What the open notebook holds, read from JupyterLab's own models (exposed to the page
# by expose_app_in_browser, as JupyterLab's own browser check does).
NOTEBOOK_STATE = """() => {
  const panel = window.jupyterapp?.shell.currentWidget;
  if (!panel?.content?.model || !panel.sessionContext) return null;
  const cells = [...panel.content.model.cells].map((c, i) => [i, c])
    .filter(([, c]) => c.type === 'code');
  const outputs = c => [...Array(c.outputs.length).keys()].map(j => c.outputs.get(j).toJSON());
  return {
    path: panel.context.path,
    kernel: panel.sessionContext.session?.kernel?.status ?? null,
    running: cells.filter(([, c]) => c.executionState === 'running').length,
    unrun: cells.filter(([, c]) => c.executionCount === null).map(([i]) => i),
    errors: cells.flatMap(([i, c]) => outputs(c)
      .filter(o => o.output_type === 'error'
                || String(o.text ?? '').includes('Traceback (most recent call last)'))
      .map(o => `cell ${i}: ` + (o.output_type === 'error'
                ? `${o.ename}: ${o.evalue}` : `a traceback on ${o.name}`))),
  };
}"""
# Select these cells (indices among all cells) and run them as Run > Run Selected Cells does.
RUN_SELECTED = """(indices) => {
  const app = window.jupyterapp, notebook = app.shell.currentWidget.content;
  notebook.deselectAll();
  notebook.activeCellIndex = indices[0];
  for (const i of indices) notebook.select(notebook.widgets[i]);
  app.commands.execute('notebook:run-cell');
}"""
SCROLL_TO_FIRST_ERROR = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cell = panel.content.widgets.find(w => w.model.type === 'code' && [...Array(w.model.outputs.length).keys()]
      .some(j => w.model.outputs.get(j).type === 'error'));
  cell?.node.scrollIntoView();
}"""


def wait_for(page, done, seconds: float, what: str) -> dict:
    """Poll the notebook's state until ``done(state)``; fail with the last state on timeout."""
    deadline = time.monotonic() + seconds
    while True:
        state = page.evaluate(NOTEBOOK_STATE)
        if state and state["kernel"] in ("dead", "autorestarting"):
            pytest.fail(f"the kernel died while waiting for {what}: {state}")
        if state and done(state):
            return state
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {seconds:.0f} s waiting for {what}; last state {state}")
        time.sleep(0.5)


def menu(page, top: str, item: str) -> None:
    """Click a menu bar entry, then one of its items, by their exact labels."""
    page.locator(".lm-MenuBar-itemLabel").get_by_text(top, exact=True).click()
    page.locator(".lm-Menu-itemLabel").get_by_text(item, exact=True).click()


def open_notebook(page, lab, notebook: Path) -> dict:
    page.goto(f"{lab.url}/lab/tree/{notebook.name}?reset&token={lab.token}", timeout=UI_S * 1000)
    return wait_for(page, lambda s: s["path"] == notebook.name and s["kernel"] == "idle",
                    KERNEL_START_S, f"{notebook.name} to open with an idle kernel")


def run_for_widgets(page, lab, notebook: Path) -> dict:
    """Run the widget cells and the cells they need, from cleared outputs."""
    cells = needed(nbformat.read(notebook, as_version=4), widget_cells(notebook))
    open_notebook(page, lab, notebook)
    menu(page, "Edit", "Clear Outputs of All Cells")   # so every count and output is from this run
    wait_for(page, lambda s: set(cells) <= set(s["unrun"]), UI_S, "the outputs to clear")
    page.evaluate(RUN_SELECTED, cells)
    return wait_for(page, lambda s: s["kernel"] == "idle" and not s["running"]
                    and (not set(cells) & set(s["unrun"]) or s["errors"]), RUN_S,
                    f"cells {cells} of {notebook.name} to run")


def expected_peaks(schedule: str, p: int, m: int, v: int, backward_ratio: float) -> str:
    """The line notebook 02's explorer prints for these settings, from the simulator."""
    from pipeline_lib import simulate
    from pipeline_lib.schedules import build

    plan = build(schedule, p, m, v)
    v = plan.virtual_stages
    peaks = simulate(plan, forward=1 / v, backward=backward_ratio / v).peak_in_flight()
    return (f"peak in-flight micro-batches per rank, per virtual stage: {peaks}; "
            f"in stage-equivalents (a virtual stage is 1/{v} of a stage): "
            f"{[n / v for n in peaks]}")


def check_explorer(page) -> None:
    """Notebook 02's explorer redraws its chart and reprints its numbers for new settings."""
    from playwright.sync_api import expect

    explorer = page.locator(".widget-interact")
    explorer.scroll_into_view_if_needed(timeout=UI_S * 1000)
    output = explorer.locator(".widget-output")
    chart = output.locator("img")

    def control(label: str):
        return explorer.locator(f".widget-inline-hbox:has(> .widget-label:text-is('{label}'))")

    settings = dict(schedule="interleaved_1f1b", p=4, m=8, v=2, backward_ratio=2.0)
    expect(output).to_contain_text(expected_peaks(**settings), timeout=UI_S * 1000)
    expect(chart).to_have_count(1, timeout=UI_S * 1000)
    for change, new in [(lambda: control("schedule").locator("select").select_option("1f1b"),
                         {"schedule": "1f1b"}),
                        (lambda: control("p").locator(".noUi-handle").press("ArrowRight"),
                         {"p": settings["p"] + 1})]:
        before, old_text = chart.get_attribute("src"), expected_peaks(**settings)
        settings |= new
        assert expected_peaks(**settings) != old_text, "pick a change that moves the numbers"
        change()
        expect(output).to_contain_text(expected_peaks(**settings), timeout=UI_S * 1000)
        expect(chart).to_have_count(1, timeout=UI_S * 1000)
        assert chart.get_attribute("src") != before, f"the chart was not redrawn for {new}"
    expect(control("p").locator(".widget-readout")).to_have_text(str(settings["p"]))


def screenshot(page, notebook: Path) -> None:
    """Best effort: a failing page must not hide the failure that brought us here."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    try:
        page.evaluate(SCROLL_TO_FIRST_ERROR)
        page.screenshot(path=SCREENSHOTS / f"{notebook.stem}.png", timeout=UI_S * 1000)
    except Exception as err:                     # noqa: BLE001 (reported, never raised)
        print(f"no screenshot of {notebook.name}: {err}")


def test_notebook_02_has_its_explorer():
    """A rename that hid it from `widget_cells` would silently leave nothing to turn."""
    assert len(widget_cells(EXPLORER)) == 1


@pytest.mark.timeout(RUN_S + SERVER_START_S + 4 * UI_S)
def test_notebook_02s_explorer_turns_in_lab(lab, browser):
    from playwright.sync_api import expect

    with lab_page(lab, browser, EXPLORER) as page:
        state = run_for_widgets(page, lab, EXPLORER)
        assert not state["errors"], f"{EXPLORER.name} failed in JupyterLab: {state['errors']}"
        expect(page.locator(".widget-interact")).to_have_count(1)
        check_explorer(page)


@contextlib.contextmanager
def lab_page(lab, browser, notebook: Path):
    """A page of the lab for ``notebook``: screenshot and kernels stopped after, and the
    file never rewritten."""
    saved = notebook.read_bytes()
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(UI_S * 1000)
    page = context.new_page()
    try:
        yield page
    finally:
        screenshot(page, notebook)
        context.close()
        lab.stop_kernels()
    assert notebook.read_bytes() == saved, f"opening {notebook.name} in the lab rewrote it"
