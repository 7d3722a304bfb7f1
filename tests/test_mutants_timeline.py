"""Tests that kill the mutants of pipeline_lib/timeline.py the other tests let live (make mutants)."""
