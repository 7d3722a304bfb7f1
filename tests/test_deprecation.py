"""Old keyword names keep working for one release, each with a warning naming the new one."""
import pytest
import torch
from torch import nn

from pipeline_lib.schedules import BUILDERS, V_SHAPED, build, plan
from pipeline_lib.stage import StageRunner


@pytest.mark.parametrize("name", sorted(set(BUILDERS) - set(V_SHAPED)))  # V: always ranks=
def test_builders_take_ranks_and_still_accept_stages_with_a_warning(name):
    new = BUILDERS[name](ranks=2, microbatches=4)
    with pytest.warns(DeprecationWarning, match=r"ranks=\.\.\. instead"):
        old = BUILDERS[name](stages=2, microbatches=4)
    assert (old.actions, old.ranks) == (new.actions, 2)


def test_build_and_plan_say_ranks():
    with pytest.warns(DeprecationWarning, match="ranks="):
        assert build("1f1b", stages=3, microbatches=4).ranks == 3
    with pytest.warns(DeprecationWarning, match="ranks="):
        assert plan("1f1b", pp=3, stages=3, microbatches=4).ranks == 3
    assert plan("zb_v", None, 4, 4).ranks == 2   # as many as the schedule says


def test_giving_the_old_and_the_new_name_is_an_error():
    with pytest.raises(TypeError, match="got both stages= and ranks="):
        build("gpipe", ranks=2, stages=2, microbatches=2)


def test_stage_runner_first_is_now_input_as_given():
    lin = nn.Linear(2, 2)
    with pytest.warns(DeprecationWarning, match=r"StageRunner\(first=.*input_as_given="):
        runner = StageRunner(0, lin, torch.device("cpu"), "never", 1, 0, first=True)
    x = torch.randn(3, 2)
    runner.forward(0, x)
    assert runner.input_as_given and runner.inputs[0] is x   # used as given: not detached
