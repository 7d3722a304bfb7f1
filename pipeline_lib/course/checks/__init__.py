"""The notebooks' exercise checks, one module per notebook, called by its check cells and by the tests."""
