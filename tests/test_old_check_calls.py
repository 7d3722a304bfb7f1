"""A learner's notebook written by an earlier ``make student`` still checks its answers.

Before issue 38 the checks took the notebook's ``globals()`` as ``namespace`` (by position
in most check cells, by keyword in 03, 03b and 07), where `withheld` swapped the names it
refused. The function object now refuses under every name, so the checks no longer need
it; but ``make student`` never overwrites a learner's notebook, so the locked check cells
of an old copy still pass it. Each such check ignores it, with one `DeprecationWarning`,
and goes on to check the answer. Below, each check cell as commit 1b457d2's notebooks
wrote it, with a stub for the learner's answer that shows the check got as far as calling it.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from pipeline_lib.course.checks import nb01, nb02, nb02b, nb03, nb03b, nb06, nb07
from pipeline_lib.course.checks.nb04 import check_4_1, check_4_2, check_4_3
from pipeline_lib.course.checks.nb05 import check_5_1, check_5_2, check_5_3
from pipeline_lib.course.exercises import ExerciseFailed, exercise, ignores_namespace
from pipeline_lib.lm.model import transformer_lm


class Called(Exception):
    """The learner's answer ran: the check got past its arguments."""


def answer(*args, **kwargs):
    raise Called


def model_and_source():
    torch.manual_seed(0)
    return transformer_lm(40, "cpu", d_model=16, d_hid=32, nlayers=1, nhead=2), \
        torch.randint(40, (3, 4 * 5 + 2 + 11))


NOTEBOOK = {"__name__": "__main__"}        # what globals() gives: a dict
MEASURED = {"with the loss": [1.0, 2.0, 3.0, 4.0], "without the loss": [1.0, 2.0, 3.0, 2.0]}

OLD_CHECK_CELLS = {
    "1.1": lambda: nb01.check_split_and_gather(answer, answer, NOTEBOOK),
    "1.2": lambda: nb01.check_accumulate(answer, NOTEBOOK),
    "1.3": lambda: nb01.check_bubble_formulas(answer, answer, NOTEBOOK),
    "1.4": lambda: nb01.check_unequal_gpipe(answer, NOTEBOOK),
    "2.1": lambda: nb02.check_gpipe(answer, NOTEBOOK),
    "2.2": lambda: nb02.check_one_f_one_b(answer, NOTEBOOK),
    "2.3": lambda: nb02.check_stage_loop(answer, NOTEBOOK),
    "2.4": lambda: nb02.check_peak_held(answer, NOTEBOOK),
    "2.5": lambda: nb02.check_interleaved(answer, NOTEBOOK),
    "2b.1": lambda: nb02b.check_zb_h1_bubble(answer, NOTEBOOK),
    "2b.2": lambda: nb02b.check_my_zb_h1(answer, NOTEBOOK),
    "2b.3": lambda: nb02b.check_input_then_weight(answer, NOTEBOOK),
    "3.1": lambda: nb03.check_fastest_balance(answer, MEASURED, 2, namespace=NOTEBOOK),
    "3.2": lambda: nb03.check_partitioner(answer, namespace=NOTEBOOK),
    "3.3": lambda: nb03.check_token_weighted_loss(answer, *model_and_source(), 5,
                                                  namespace=NOTEBOOK),
    "3b.2": lambda: nb03b.check_running_means(answer, namespace=NOTEBOOK),
    "4.1": lambda: check_4_1(answer, NOTEBOOK),
    "4.2": lambda: check_4_2(answer, NOTEBOOK),
    "4.3": lambda: check_4_3(answer, NOTEBOOK),
    "5.1": lambda: check_5_1(answer, NOTEBOOK),
    "5.2": lambda: check_5_2(answer, NOTEBOOK),
    "5.3": lambda: check_5_3(answer, NOTEBOOK),
    "7.1": lambda: nb07.check_stage_memory(answer, namespace=NOTEBOOK),
    "7.2": lambda: nb07.check_faster_layout(answer, namespace=NOTEBOOK),
}


@pytest.mark.parametrize("number", list(OLD_CHECK_CELLS))
def test_an_old_check_cell_checks_the_answer_with_one_warning(number):
    with warnings.catch_warnings(record=True) as caught, \
            pytest.raises(ExerciseFailed, match=f"Exercise {number}: your code raised Called"):
        warnings.simplefilter("always")
        with exercise(f"Exercise {number}"):
            OLD_CHECK_CELLS[number]()
    said = [str(w.message) for w in caught if w.category is DeprecationWarning]
    assert len(said) == 1 and "(namespace=...) is no longer needed" in said[0], said
    assert caught[0].filename == __file__      # where the old cell called the check


def test_6_2_takes_the_namespace_notebook_06_still_passes():
    """Notebook 06's check cell still passes it (its own engineer drops it, and then the
    check warns as the others do); the check ignores it."""
    with pytest.raises(ExerciseFailed, match="your code raised Called"):
        with exercise("Exercise 6.2"):
            nb06.check_from_lowered(answer, namespace=NOTEBOOK)


def test_only_a_dict_at_the_old_position_is_taken_for_the_namespace():
    @ignores_namespace(1)
    def check(answer, seconds=10.0, seed=None):
        return answer, seconds, seed

    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # no warning without a namespace
        assert check("a", 5.0) == ("a", 5.0, None)
        assert check("a", seconds=5.0, seed=3) == ("a", 5.0, 3)
    with pytest.warns(DeprecationWarning, match=r"check\(namespace=...\) is no longer"):
        assert check("a", {"x": 1}, 5.0) == ("a", 5.0, None)
    with pytest.warns(DeprecationWarning):
        assert check("a", 5.0, namespace={}) == ("a", 5.0, None)
