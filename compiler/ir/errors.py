"""meshc's exception and warning types, and `warn`, which points a warning at the user's code.

Every error meshc raises on purpose is a `MeshcError`. Bad input raises `MeshcValueError` or
`MeshcTypeError` (also a ValueError / TypeError, as before), phrased "<rule>: expected A, got B" and
saying what to do instead (DESIGN.md §5.6). A broken internal invariant raises MeshcInternalError.
"""
from __future__ import annotations

import os
import sys
import warnings


class MeshcError(Exception):
    """Base of every error meshc raises on purpose: `except meshc.MeshcError` catches them all."""


class MeshcValueError(MeshcError, ValueError):
    """Bad input (a size, a Plan field, a placement, a file): the message names the rule and the fix."""


class MeshcTypeError(MeshcError, TypeError):
    """Input of the wrong type: the message names what was expected and what came."""


class MeshcRuntimeError(MeshcError, RuntimeError):
    """Something went wrong while running (not a bug in meshc, not bad input to a constructor): an op used
    outside its job, a sharded parameter used eagerly, a failed measurement, a failed peer in a save."""


class MeshcInternalError(MeshcError, RuntimeError):
    """An invariant that meshc itself should have kept was found broken: a bug in meshc."""


class TraceError(MeshcValueError):
    """The model could not be traced to an ATen graph; the message names the cause and where."""

    def __init__(self, message: str, original: BaseException | None = None):
        super().__init__(message)
        self.original = original  # torch's own exception, for those who want the full story


class MeshcWarning(UserWarning):
    """Correct but costly: e.g. an op without a sharding rule, whose inputs were replicated."""


# The folders of meshc's packages (pyproject maps five folders to meshc.*), found from the loaded
# modules, so an installed copy works as a checkout does. torch's own frames are skipped as well: under
# torch.compile the caller of meshc's backend is Dynamo, whose caller is the user's code.
_PACKAGES = ("meshc", "meshc.compiler", "meshc.passes", "meshc.kernels", "meshc.runtime")


def meshc_folders() -> tuple[str, ...]:
    """The folders of meshc's own packages, each ending in os.sep."""
    folders = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # compiler/, where this file is
    for name in _PACKAGES:
        for path in getattr(sys.modules.get(name), "__path__", ()):
            folders.add(os.path.abspath(path))
    return tuple(folder + os.sep for folder in folders)


def internal_folders() -> tuple[str, ...]:
    """meshc's folders and torch's: what lies between the user's code and an error meshc reports."""
    import torch

    return (*meshc_folders(), *(os.path.abspath(p) + os.sep for p in torch.__path__))


def user_stacklevel() -> int:
    """The `stacklevel` that makes a warnings.warn called by the caller of this function report the first
    frame outside meshc and torch (and outside FX's generated code): the user's line that led there."""
    folders = internal_folders()
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and is_internal(frame.f_code.co_filename, folders):
        frame, level = frame.f_back, level + 1
    return level


def is_internal(filename: str, folders: tuple[str, ...]) -> bool:
    """Whether a frame's file is meshc's or torch's (`folders`: internal_folders()), or FX's generated code."""
    return filename.startswith("<eval_with_key>") or os.path.abspath(filename).startswith(folders)


def warn(message: str, category: type[Warning] = MeshcWarning) -> None:
    """warnings.warn(message, category), reported at the user's line that led into meshc."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
