"""Seeing what ran: Gantt charts of timelines, memory measurement, the README's figures.

* `plot.gantt` draws a simulated and a measured `Timeline` alike;
* `memory` counts the activation bytes autograd saves per stage, and peak tensor memory;
* `figures` regenerates ``images/`` (``python -m pipeline_lib.viz.figures images/``).
"""
