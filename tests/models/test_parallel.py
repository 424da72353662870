"""megatron_dapo.parallel: size validation and the world-1 setup."""

import dataclasses

import pytest
import torch

from megatron_dapo.parallel import init_parallel, validate_parallel_sizes


def test_validate_parallel_sizes_returns_dp_and_expert_dp():
    assert validate_parallel_sizes(16, tp=2, pp=2) == (4, 4)
    assert validate_parallel_sizes(16, tp=2, pp=2, ep=4, etp=1) == (4, 2)
    assert validate_parallel_sizes(8, tp=2, cp=2, ep=2) == (2, 2)


@pytest.mark.parametrize("kwargs,message", [
    ({"world_size": 6, "tp": 4}, r"world_size=6 is not divisible by tp\*pp\*cp = 4\*1\*1"),
    ({"world_size": 8, "tp": 2, "pp": 3}, r"tp\*pp\*cp = 2\*3\*1"),
    ({"world_size": 2, "tp": 2, "ep": 2}, r"not divisible by etp\*ep\*pp = 2\*2\*1"),
    ({"world_size": 4, "tp": 0}, "parallel size tp must be a positive int"),
    ({"world_size": 4, "etp": 1.5}, "parallel size etp must be a positive int"),
])
def test_validate_parallel_sizes_names_the_size_that_does_not_divide(kwargs, message):
    with pytest.raises(ValueError, match=message):
        validate_parallel_sizes(**kwargs)


def test_world1_groups_have_size_one_and_init_is_reentrant(pgs):
    assert (pgs.world_size, pgs.tp_size, pgs.pp_size, pgs.ep_size, pgs.dp_size) == (1, 1, 1, 1, 1)
    assert pgs.backend == "gloo" and pgs.device == torch.device("cpu")
    assert pgs.tp.size() == 1 and pgs.expt_dp.size() == 1 and pgs.embd is None
    assert pgs.collection.tp is pgs.tp
    assert pgs.is_first_pp_stage and pgs.is_last_pp_stage
    assert init_parallel() is pgs
    with pytest.raises(ValueError, match="already initialised"):
        init_parallel(tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pgs.tp_size = 2
