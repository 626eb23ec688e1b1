"""The edges of the front door's ``torch_neuronx.testing.assert_close`` and NxD utilities
(``nxd_moe/nxd_compat/testing.py``, ``utils.py``) that test_nxd_unit_test_equivalents.py's broad cases leave open:
each comparison at its boundary, the message word for word, integer and bool tensors, the logger's rank-0 filter,
the ``xla`` backend's registration and its gloo group (in this process, with torch.distributed's registry
patched, so the real registry stays untouched). Found by mutation testing (benchmarks/mutation.py)."""

from __future__ import annotations

import datetime
import logging
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nxd_moe.nxd_compat import testing, utils
from nxd_moe.nxd_compat.testing import assert_close

INF, NAN = float("inf"), float("nan")


# ----------------------------------------------------------------------------------------------------------
# assert_close


@pytest.mark.parametrize("actual,expected,name,type_name", [
    ([1.0], torch.ones(1), "actual", "list"),
    (torch.ones(1), 1.0, "expected", "float"),
])
def test_assert_close_names_the_argument_that_is_not_a_tensor(actual, expected, name, type_name):
    with pytest.raises(TypeError, match=f"^assert_close: {name} must be a torch.Tensor, got {type_name}$"):
        assert_close(actual, expected)


def test_integer_and_bool_tensors_compare_exactly_by_default():
    assert_close(torch.tensor([3, -7]), torch.tensor([3, -7]))
    for off in (torch.tensor([3, -6]), torch.tensor([4, -7])):  # off by one in either element (rtol or atol of 1)
        with pytest.raises(AssertionError, match="Mismatched elements: 1 / 2"):
            assert_close(off, torch.tensor([3, -7]))
    flags = torch.tensor([True, False, True])
    assert_close(flags, flags.clone())  # bool tensors are compared as numbers (bool has no abs or subtraction)
    with pytest.raises(AssertionError, match="Mismatched elements: 1 / 3"):
        assert_close(torch.tensor([True, True, True]), flags)


def test_the_bound_is_inclusive():
    # |0.75 - 0.25| = 0.5 = atol exactly (every value here is a binary fraction: no rounding)
    assert_close(torch.tensor([0.75, 4.0]), torch.tensor([0.25, 4.0]), rtol=0.0, atol=0.5)
    assert_close(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 4.0]), rtol=0.25, atol=0.0)  # 1 = 0.25 * max 4
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 4.0]), rtol=0.125, atol=0.0)


def test_infinities_match_only_the_same_infinity():
    assert_close(torch.tensor([-INF, 1.0]), torch.tensor([-INF, 1.0]))
    for actual, expected in (([-INF, 1.0], [INF, 1.0]), ([INF, 1.0], [1.0, 1.0]), ([1.0, 1.0], [INF, 1.0])):
        with pytest.raises(AssertionError, match="Mismatched elements: 1 / 2"):
            assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1.0, atol=1e30)


def test_equal_nan_matches_nan_with_nan_only_and_keeps_the_other_elements():
    assert_close(torch.tensor([NAN, 1.0, 2.0]), torch.tensor([NAN, 1.0, 2.0]), equal_nan=True)
    with pytest.raises(AssertionError, match="Mismatched elements: 1 / 2"):
        assert_close(torch.tensor([NAN, 1.0]), torch.tensor([1.0, 1.0]), equal_nan=True)
    with pytest.raises(AssertionError, match="Mismatched elements: 1 / 2"):
        assert_close(torch.tensor([1.0, 1.0]), torch.tensor([NAN, 1.0]), equal_nan=True)


def test_the_message_names_the_count_the_worst_element_and_the_bound():
    with pytest.raises(AssertionError) as info:
        assert_close(torch.tensor([1.0, 2.5, 4.0]), torch.tensor([1.0, 2.0, 8.0]), rtol=0.0625, atol=0.0)
    assert str(info.value) == (
        "Tensor-likes are not close (Neuron allclose)!\n"
        "Mismatched elements: 1 / 3\n"
        "Greatest mismatch at index (2,): actual 4.0, expected 8.0 (|difference| 4 > atol 0 + rtol 0.0625 * "
        "max|expected| 8)")
    with pytest.raises(AssertionError) as info:
        assert_close(torch.tensor([[1.0, 5.0], [3.0, 2.0]]), torch.tensor([[1.0, 2.0], [3.0, 2.0]]),
                     msg="the second row's experts")
    assert str(info.value).splitlines()[:3] == [
        "the second row's experts", "Mismatched elements: 1 / 4",
        "Greatest mismatch at index (0, 1): actual 5.0, expected 2.0 (|difference| 3 > atol 1e-05 + rtol 1.3e-06 "
        "* max|expected| 3)"]


def test_a_nan_is_the_greatest_mismatch_and_no_finite_expected_value_scales_by_zero():
    with pytest.raises(AssertionError, match=re.escape("at index (0,): actual nan, expected 1.0")):
        assert_close(torch.tensor([NAN, 9.0]), torch.tensor([1.0, 1.0]), rtol=0.0, atol=0.5)
    with pytest.raises(AssertionError, match=re.escape("(|difference| inf > atol 2 + rtol 3 * max|expected| 0)")):
        assert_close(torch.tensor([5.0]), torch.tensor([INF]), rtol=3.0, atol=2.0)


def test_the_difference_is_taken_in_float64():
    # 2^-24 apart at 1: in float32 that is one ulp of 1 - 2^-24 (exact); the bound 2^-24 - 2^-60 rounds to 2^-24 in
    # float32 but not in float64, where the element fails.
    actual, expected = torch.tensor([1.0]), torch.tensor([1.0 - 2.0 ** -24])
    with pytest.raises(AssertionError):
        assert_close(actual, expected, rtol=0.0, atol=2.0 ** -24 - 2.0 ** -60)
    assert testing._DEFAULT_TOLERANCES[torch.float32] == (1.3e-6, 1e-5)


# ----------------------------------------------------------------------------------------------------------
# utils


@pytest.fixture
def fresh_loggers():
    names = ("nxd_moe_test_logger[0]", "nxd_moe_test_logger[]")

    def clear():
        for name in names:
            logging.getLogger(name).filters.clear()

    clear()
    yield
    clear()


def test_get_logger_levels_names_and_one_rank_zero_filter(monkeypatch, fresh_loggers):
    monkeypatch.delenv("NXD_LOG_LEVEL", raising=False)
    logger = utils.get_logger("nxd_moe_test_logger")
    assert (logger.name, logger.level) == ("nxd_moe_test_logger[0]", logging.INFO)
    assert utils.get_logger("nxd_moe_test_logger") is logger
    assert [type(f).__name__ for f in logger.filters] == ["_RankZero"]  # added once
    every = utils.get_logger("nxd_moe_test_logger", rank0_only=False)
    assert (every.name, every.level, every.filters) == ("nxd_moe_test_logger[]", logging.INFO, [])
    for value, level in (("OFF", logging.CRITICAL + 1), ("fatal", logging.CRITICAL), ("Error", logging.ERROR),
                         ("debug", logging.DEBUG), ("trace", logging.DEBUG)):
        monkeypatch.setenv("NXD_LOG_LEVEL", value)
        assert utils.get_logger("nxd_moe_test_logger", False).level == level


@pytest.mark.parametrize("available,initialized,rank,passes", [
    (False, False, None, True),  # no torch.distributed: every record
    (True, False, None, True),  # not initialized: every record (get_rank would raise)
    (False, True, None, True),
    (True, True, 0, True),
    (True, True, 1, False),
    (True, True, 3, False),
])
def test_rank_zero_filter(monkeypatch, available, initialized, rank, passes):
    def get_rank():
        if rank is None:
            raise RuntimeError("get_rank without a process group")
        return rank

    monkeypatch.setattr(utils, "dist", SimpleNamespace(is_available=lambda: available,
                                                       is_initialized=lambda: initialized, get_rank=get_rank))
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hi", None, None)
    assert utils._RankZero().filter(record) is passes


def test_seed_and_device_move_checks():
    utils.model_parallel_xla_manual_seed(0)
    drawn = torch.rand(2)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(2))
    with pytest.raises(ValueError, match=r"^seed must be in \[0, inf\], got -1$"):
        utils.model_parallel_xla_manual_seed(-1)
    with pytest.raises(TypeError, match="^seed must be an int, got float 1.5$"):
        utils.model_parallel_xla_manual_seed(1.5)
    with pytest.raises(TypeError, match="^move_model_to_device: model must be a torch.nn.Module, got Tensor$"):
        utils.move_model_to_device(torch.ones(1), "cpu")
    layer = torch.nn.Linear(2, 3)
    utils.move_model_to_device(layer, "meta")
    assert layer.weight.device.type == "meta" and layer.bias.device.type == "meta"


def test_serve_xla_backend_registers_gloo_under_xla(monkeypatch):
    registered = []
    monkeypatch.setattr(utils.importlib.util, "find_spec",
                        lambda name: None if name == "torch_xla" else pytest.fail(f"find_spec({name!r})"))
    monkeypatch.setattr(dist.Backend, "backend_list", [b for b in dist.Backend.backend_list if b != "xla"])
    monkeypatch.setattr(dist.Backend, "register_backend",
                        lambda name, func, devices=None: registered.append((name, func, devices)))
    assert utils.serve_xla_backend() == "gloo"
    assert registered == [("xla", utils._gloo_group, ["cpu"])]
    monkeypatch.setattr(dist.Backend, "backend_list", [*dist.Backend.backend_list, "xla"])
    assert utils.serve_xla_backend() == "gloo" and len(registered) == 1  # already registered: not again


def test_serve_xla_backend_imports_torch_xlas_where_installed(monkeypatch):
    imported = []
    monkeypatch.setattr(utils.importlib.util, "find_spec", lambda name: object() if name == "torch_xla" else None)
    monkeypatch.setattr(utils.importlib, "import_module", imported.append)
    monkeypatch.setattr(dist.Backend, "register_backend", lambda *a, **k: pytest.fail("registered a backend"))
    assert utils.serve_xla_backend() == "torch_xla"
    assert imported == ["torch_xla.distributed.xla_backend"]


def test_the_xla_backends_gloo_group(monkeypatch):
    made = []
    store, timeout = object(), datetime.timedelta(seconds=7)
    monkeypatch.setattr(dist, "ProcessGroupGloo", lambda *args: made.append(args) or "group")
    assert utils._gloo_group(store, 2, 5, timeout) == "group"
    assert made == [(store, 2, 5, timeout)]
    monkeypatch.undo()
    group = utils._gloo_group(dist.HashStore(), 0, 1, timeout)  # a real one: a world of one
    assert isinstance(group, dist.ProcessGroupGloo) and (group.rank(), group.size()) == (0, 1)
    t = torch.tensor([2.0, 3.0])
    group.allreduce([t]).wait()
    assert t.tolist() == [2.0, 3.0]
