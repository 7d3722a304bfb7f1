"""Sliders for a function that draws: ipywidgets' ``interact``, without the stall that
``interact`` causes in notebook runners.

``interact(f, ...)`` runs ``f`` at once inside an ipywidgets ``Output`` widget (``with
out: f(...)``). nbclient, under ``jupyter nbconvert --execute`` and ``nbgrader
autograde``, imitates a frontend's side of that widget: for each output captured into it,
it sends a message back to the kernel on the shell socket while it waits there for the
cell's reply, and that send can swallow the reply's wake-up: the cell then waits out its
whole timeout, or forever without one (jupyter/nbclient#312; tests/notebook_client.py
tells the whole story).

`explorer` shows the same controls and the same output, but never captures output into
the widget while a cell runs: it records what the function prints and displays, and
sets the ``Output`` widget's outputs to that, a state the kernel sends to the frontend
(nbclient's imitation only reads it). A runner without a frontend then
gets the cell's reply on time; in JupyterLab, moving a control draws again, the same
way. Without ipywidgets nothing is shown: the function's output for its defaults,
displayed in a cell of its own, is what such readers see.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import traceback
from collections.abc import Callable
from typing import Any

from IPython.display import display


def explorer(function: Callable[..., Any], **controls: Any) -> None:
    """Display controls for ``function``'s parameters above what it prints and draws;
    without ipywidgets, nothing. Called as ``interact`` is (a notebook's
    ``from ipywidgets import interact`` can become ``from pipeline_lib.viz.explorer
    import explorer as interact``).

    ``controls`` are ``interact``'s abbreviations: ``(2, 8)`` an integer slider, ``(1.0,
    3.0, 0.25)`` a float slider with its step, a list a dropdown; a parameter's default is
    the control's first value. As with ``interact``, a parameter with a default that
    ``controls`` does not name gets the control its default abbreviates (``True`` a
    checkbox, a string a text box), and the controls follow the parameters' order.
    ``function`` prints and draws (``plt.show()``) as it would in a cell; its return value
    is ignored. An error it raises for the defaults is the cell's error; one it raises
    after a control moved is shown in place of its output.
    """
    try:
        import ipywidgets
    except ImportError:
        return

    from IPython import get_ipython

    widgets = _widgets(function, controls)
    if get_ipython() is None:   # a plain Python run (a notebook exported as a script)
        function(**{name: widget.value for name, widget in widgets.items()})
        return
    out = ipywidgets.Output()

    def values() -> dict[str, Any]:
        return {name: widget.value for name, widget in widgets.items()}

    def draw(change: Any = None) -> None:
        try:
            out.outputs = _outputs(function, values())
        except Exception:                       # shown where the chart would be
            out.outputs = ({"output_type": "stream", "name": "stderr",
                            "text": traceback.format_exc()},)

    out.outputs = _outputs(function, values())  # for the defaults: errors are the cell's
    for widget in widgets.values():
        widget.observe(draw, names="value")
    box = ipywidgets.VBox([*widgets.values(), out])
    box.add_class("widget-interact")            # interact's own box class: its look, its selectors
    display(box)


def _widgets(function: Callable[..., Any], controls: dict[str, Any]) -> dict[str, Any]:
    """A named control per parameter, as ``interact`` makes them; a control for no
    parameter, a parameter without a value, or a value no control shows raise
    ValueError naming it."""
    import ipywidgets

    parameters = inspect.signature(function).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = [name for name in controls if name not in parameters and not takes_any]
    if unknown:
        raise ValueError(f"explorer: {function.__name__} has no parameter {unknown[0]!r} "
                         f"(its parameters: {', '.join(parameters) or 'none'}); name a "
                         f"control after one of them")
    defaults = {name: p.default for name, p in parameters.items()
                if p.default is not inspect.Parameter.empty}
    unset = [name for name, p in parameters.items() if name not in {**defaults, **controls}
             and p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                inspect.Parameter.VAR_KEYWORD)]
    if unset:
        raise ValueError(f"explorer: parameter {unset[0]!r} of {function.__name__} has no "
                         f"default and no control: give one, e.g. {unset[0]}=(1, 8)")
    widgets = {}
    for name, abbrev in {**defaults, **controls}.items():
        widget = ipywidgets.interactive.widget_from_abbrev(abbrev, defaults.get(name))
        if widget is None:
            raise ValueError(f"explorer: no control shows {name}={abbrev!r}: give (min, max) "
                             f"or (min, max, step) for a slider, a list for a dropdown, a "
                             f"bool, a string, a number or a widget")
        widget.description = name
        widgets[name] = widget
    return widgets


def _outputs(function: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[dict, ...]:
    """What ``function(**kwargs)`` prints and displays, in order, as an Output widget's
    outputs (nbformat's output dicts)."""
    from IPython import get_ipython
    from IPython.core.displaypub import DisplayPublisher

    outputs: list[dict] = []

    class Printed(io.TextIOBase):
        def write(self, text: str) -> int:
            if outputs and outputs[-1]["output_type"] == "stream":
                outputs[-1]["text"] += text
            else:
                outputs.append({"output_type": "stream", "name": "stdout", "text": text})
            return len(text)

    class Displayed(DisplayPublisher):
        def publish(self, data: dict, metadata: dict | None = None, *args: Any,
                    **kwargs: Any) -> None:
            outputs.append({"output_type": "display_data", "data": data,
                            "metadata": metadata or {}})

    shell = get_ipython()
    publisher, shell.display_pub = shell.display_pub, Displayed()
    try:
        with contextlib.redirect_stdout(Printed()):
            function(**kwargs)
    finally:
        shell.display_pub = publisher
    return tuple(outputs)
