"""Each notebook's exercise checks, as functions its check cells and the tests both call."""
