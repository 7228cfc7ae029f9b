"""meshc: turn one PyTorch training program into a distributed one, as a compiler.

    mesh = meshc.mesh(dp=2)
    job = meshc.compile(model, mesh, example_inputs=(x,))
    opt = job.optimizer(torch.optim.AdamW, lr=3e-4)
    loss = job.step(x, y, loss_fn); opt.step(); opt.zero_grad()
    print(job.explain())

The facade's names are imported on first use (PEP 562), so `import meshc` (and `meshc plan`, which needs
only the cost model) does not pay for the runtime, Dynamo and torch.distributed.pipelining.
"""
from typing import TYPE_CHECKING

from meshc.compiler.ir.errors import MeshcError, MeshcInternalError, MeshcWarning, TraceError

if TYPE_CHECKING:
    from meshc.api import compile
    from meshc.dynamo_backend import backend, last_compiled
    from meshc.compiler.ir.plan import Plan
    from meshc.compiler.ir.show import show
    from meshc.job import Job
    from meshc.runtime.checkpoint.init_weights import init_weights
    from meshc.runtime.mesh import Mesh, mesh
    from torch.distributed.pipelining import pipe_split  # a cut marker for model code: meshc.pipe_split()

__all__ = ["compile", "backend", "last_compiled", "mesh", "Plan", "Job", "Mesh", "show", "MeshcError", "TraceError",
           "MeshcInternalError", "MeshcWarning", "pipe_split", "init_weights"]
__version__ = "0.1.0"


def _load(name: str):  # noqa: C901 - one branch per lazy name
    if name == "compile":
        from meshc.api import compile as value
    elif name == "backend":
        from meshc.dynamo_backend import backend as value
    elif name == "last_compiled":
        from meshc.dynamo_backend import last_compiled as value
    elif name == "Plan":
        from meshc.compiler.ir.plan import Plan as value
    elif name == "show":
        from meshc.compiler.ir.show import show as value
    elif name == "Job":
        from meshc.job import Job as value
    elif name == "Mesh":
        from meshc.runtime.mesh import Mesh as value
    elif name == "mesh":
        from meshc.runtime.mesh import mesh as value
    elif name == "init_weights":
        from meshc.runtime.checkpoint.init_weights import init_weights as value
    elif name == "pipe_split":
        from torch.distributed.pipelining import pipe_split as value
    else:
        raise AttributeError(f"module 'meshc' has no attribute {name!r}")
    return value


def __getattr__(name: str):
    value = _load(name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

