"""The slice keeps what the chosen cells read, in the order Python binds it."""
import nbformat

from notebook_slice import names, needed


def test_a_cell_reads_only_what_it_did_not_bind_first():
    bound, read = names("for p in ps:\n    print(p, q)\nx = 1\nprint(x, y)\nw += 1\n"
                        "def f(a, b=c):\n    v = a + g\n    return [t for t in v if t > h]\n"
                        "k = lambda t: t + u\n%matplotlib inline\n")
    assert bound == {"p", "x", "w", "f", "k"}
    assert read == {"ps", "print", "q", "y", "w", "c", "g", "h", "u", "get_ipython"}


def test_the_slice_keeps_every_binding_of_a_needed_name_and_nothing_else():
    cells = ["%matplotlib inline", "import math\nx = 1", "slow = sum(range(10**6))",
             "x += math.pi", "for i in range(3):\n    print(i)", "assert x > 4"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    assert needed(nb, [5]) == [0, 1, 3, 5]
    assert needed(nb, [5], keep=[2]) == [0, 1, 2, 3, 5]
