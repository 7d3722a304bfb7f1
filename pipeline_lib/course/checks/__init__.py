"""Exercise checks, one module per notebook: its check cells and tests/test_checks_nb*.py call them."""
