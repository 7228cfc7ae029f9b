"""meshc: turn one PyTorch training program into a distributed one, as a compiler.

    mesh = meshc.mesh(dp=2)
    job = meshc.compile(model, mesh, example_inputs=(x,))
    opt = job.optimizer(torch.optim.AdamW, lr=3e-4)
    loss = job.step(x, y, loss_fn); opt.step(); opt.zero_grad()
    print(job.explain())
"""
from meshc.api import compile
from meshc.backend import backend, last_compiled
from meshc.compiler.ir.errors import MeshcError, MeshcInternalError, MeshcWarning, TraceError
from meshc.compiler.ir.plan import Plan
from meshc.compiler.show import show
from meshc.job import Job
from meshc.runtime.mesh import Mesh, mesh
from torch.distributed.pipelining import pipe_split  # a cut marker for model code: meshc.pipe_split()

__all__ = ["compile", "backend", "last_compiled", "mesh", "Plan", "Job", "Mesh", "show", "MeshcError", "TraceError",
           "MeshcInternalError", "MeshcWarning", "pipe_split"]
__version__ = "0.1.0"
