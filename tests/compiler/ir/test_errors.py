"""meshc's errors are MeshcErrors (and the builtin they are); its warnings point at the user's line."""
from __future__ import annotations

import os
import warnings

import pytest

import meshc
import meshc.passes
from meshc.compiler.ir import errors
from meshc.compiler.ir.errors import MeshcError, MeshcWarning
from meshc.compiler.ir.mesh_spec import MeshSpec, parse_sizes
from meshc.compiler.ir.schedule import ScheduleError
from meshc.runtime.monitor.failures import RankFailure


def test_bad_plan_is_a_meshc_value_error():
    with pytest.raises(MeshcError, match="Plan.zero: expected a ZeRO stage") as caught:
        meshc.Plan(zero=5)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(TypeError) as caught:
        meshc.Plan(tp=["up"])
    assert isinstance(caught.value, MeshcError)


def test_bad_mesh_size_is_a_meshc_value_error():
    with pytest.raises(MeshcError, match="expected tp to be a positive int, got 0") as caught:
        MeshSpec({"tp": 0})
    assert isinstance(caught.value, ValueError)
    with pytest.raises(ValueError, match="'axis=size' pairs") as caught:
        parse_sizes("dp:2")
    assert isinstance(caught.value, MeshcError)


def test_every_error_class_is_a_meshc_error():
    assert meshc.MeshcError is MeshcError and "MeshcError" in meshc.__all__
    for cls, builtin in [(errors.MeshcValueError, ValueError), (errors.MeshcTypeError, TypeError),
                         (errors.TraceError, ValueError), (ScheduleError, ValueError),
                         (errors.MeshcInternalError, RuntimeError), (RankFailure, RuntimeError)]:
        assert issubclass(cls, MeshcError) and issubclass(cls, builtin), cls


def _warn_from_inside_meshc():
    """Call errors.warn from two frames whose code lies in meshc's passes/ folder, as a pass would."""
    inside = os.path.join(meshc.passes.__path__[0], "_fake_pass.py")  # never written: only frames' file names
    scope = {"warn": errors.warn, "MeshcWarning": MeshcWarning}
    exec(compile("def inner():\n    warn('costly', MeshcWarning)\ndef outer():\n    inner()\n",
                 os.path.abspath(inside), "exec"), scope)
    scope["outer"]()


def test_warning_points_at_the_users_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_from_inside_meshc()
    assert [w.category for w in caught] == [MeshcWarning]
    # the first frame outside meshc is this test file's helper (the frames above it are "in passes/"): its
    # call of outer(), on the helper's last line
    helper = _warn_from_inside_meshc.__code__
    assert caught[0].filename == __file__
    assert caught[0].lineno == max(line for _, _, line in helper.co_lines() if line is not None)
