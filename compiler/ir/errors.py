"""meshc's exception types.

Bad input raises ValueError/TypeError subclasses phrased "<rule>: expected A, got B" and saying what to
do instead (DESIGN.md §5.6). A broken internal invariant raises MeshcInternalError.
"""


class MeshcInternalError(RuntimeError):
    """An invariant that meshc itself should have kept was found broken: a bug in meshc."""


class TraceError(ValueError):
    """The model could not be traced to an ATen graph; the message names the cause and where."""

    def __init__(self, message: str, original: BaseException | None = None):
        super().__init__(message)
        self.original = original  # torch's own exception, for those who want the full story


class MeshcWarning(UserWarning):
    """Correct but costly: e.g. an op without a sharding rule, whose inputs were replicated."""
