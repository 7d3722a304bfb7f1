"""The notebooks' exercise checks, one module per notebook, called by its check cells and by
tests/test_checks_nb*.py with plausible wrong answers."""
