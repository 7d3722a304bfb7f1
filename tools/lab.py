"""Start JupyterLab on notebooks/ so that it works wherever a class runs it (`make lab`).

A plain `jupyter lab` stops or misleads on three common machines:

* as root (Docker images, cloud notebooks, classroom VMs) it refuses to start without
  ``--allow-root``, so that flag is passed, but only to root;
* on a server with no display it tries to open a browser (a text one in the terminal if
  one is installed) instead of only printing the URL, so it gets ``--no-browser`` there;
* when its port is taken it quietly moves to the next free one, so the URL it prints,
  with its token, is the one to open, and the banner says so;
* a port beyond 65535 wraps (99999 listens on 34463) while the URL it prints says 99999,
  so a port is checked however it comes: ``--port``, Jupyter's ``--ServerApp.port=``
  (``--LabApp.port=``, ...) or ``JUPYTER_PORT``.

Any other arguments go to JupyterLab unchanged; the browser test starts the lab through
this very file, so what it checks is what a learner runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# Jupyter's own ways to give the port: --ServerApp.port=N (or --NotebookApp.port,
# --LabApp.port, which it moves to ServerApp, ...), with "=N" or N as the next argument
JUPYTER_PORT_OPTION = re.compile(r"--\w+\.port(=.*)?")


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def has_display() -> bool:
    """Whether a browser window can open here: macOS and Windows always, Linux only under X or Wayland."""
    if not sys.platform.startswith("linux"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def lab_command(port: int | None = None, extra: list[str] | None = None,
                folder: Path = NOTEBOOKS) -> list[str]:
    """The command line `make lab` runs, in this interpreter's environment."""
    cmd = [sys.executable, "-m", "jupyterlab", str(folder)]
    if port is not None:
        cmd.append(f"--port={port}")
    if is_root():
        cmd.append("--allow-root")
    if not has_display():
        cmd.append("--no-browser")
    return cmd + list(extra or [])


def port_number(text: str) -> int:
    """A TCP port, 1 to 65535, or 0 for any free one (the system picks it, and Jupyter
    prints the URL it listens on): Jupyter would wrap a larger one (99999 listens on
    34463) and print a URL nothing serves, and fail on a negative one with a traceback."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number; give a whole "
                                         f"number from 1 to 65535, e.g. --port 8888") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: ports run from 1 to 65535; "
                                         f"give one in that range, e.g. --port 8888 (or 0 "
                                         f"for any free one)")
    return port


def check_jupyters_port(parser: argparse.ArgumentParser, extra: list[str],
                        environ: dict[str, str] | os._Environ) -> None:
    """Check a port given in Jupyter's own ways as `port_number` checks ``--port``: an
    option (``--ServerApp.port=N``, ``--LabApp.port N``, ...) or, if no option gives
    one, ``JUPYTER_PORT`` in ``environ``. Unchecked, 99999 wraps to 34463 while Jupyter
    prints :99999, an address nothing serves."""
    given = [(a, a.partition("=")[2] if "=" in a else next(iter(extra[k + 1:]), ""))
             for k, a in enumerate(extra) if JUPYTER_PORT_OPTION.fullmatch(a)]
    if "JUPYTER_PORT" in environ and not given:
        given.append((f"JUPYTER_PORT={environ['JUPYTER_PORT']} (in the environment)",
                      environ["JUPYTER_PORT"]))
    for spelled, value in given:
        try:
            port_number(value)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"give the port as --port N (1 to 65535), not {spelled}: {exc}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=port_number,
                        help="port to try first, 1 to 65535, or 0 for any free one (default: "
                        "Jupyter's, 8888)")
    parser.add_argument("--folder", type=Path, default=NOTEBOOKS,
                        help="folder to open (default: notebooks/; student/ after make student)")
    args, extra = parser.parse_known_args(argv)
    check_jupyters_port(parser, extra, {} if args.port is not None else os.environ)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder (make student writes student/)")
    cmd = lab_command(args.port, extra, args.folder.resolve())
    print(
        "Starting JupyterLab. Open the http://127.0.0.1:PORT/lab?token=... URL it prints below;\n"
        "if the port is taken it picks the next free one, so use the URL as printed.\n"
        "On a remote server, forward the port first: ssh -L PORT:localhost:PORT you@server",
        file=sys.stderr,
        flush=True,
    )
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
