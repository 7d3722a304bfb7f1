"""Seeing what ran: Gantt charts of timelines and the README's figures.

* `plot.gantt` draws a simulated and a measured `Timeline` alike;
* `figures` regenerates ``images/`` (``python -m pipeline_lib.viz.figures images/``).
"""
