"""Tests that kill the mutants of pipeline_lib/schedules.py the other tests let live (make mutants)."""
