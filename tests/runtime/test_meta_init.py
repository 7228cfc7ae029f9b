"""Models built on the meta device: job.init_weights(seed) against meshc.init_weights(model, seed) in one process.

The procedure (runtime/checkpoint/init_weights.py) draws each tensor from its own seed, so every plan must assemble
the same weights bit for bit: compared with torch.equal, no tolerance. The training that follows is held to
the parity tests' bounds (tests/parity.py: losses within 2e-5: the plans sum in another order).
Each case also asserts that the rank holds only its shards (local shapes below the global ones).
"""
from __future__ import annotations

import math

import pytest
import torch

import meshc
from tests import parity, zoo
from tests.harness import run_ranks

SEED, STEPS, BATCH = 7, 3, 8
FAST = {"trace": "non-strict"}


def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return zoo.build(name)


def _reference(name: str) -> dict:
    model = meshc.init_weights(_meta(name), seed=SEED)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=parity.LR)
    losses = []
    for x, y in zoo.batches(STEPS, BATCH):
        loss = zoo.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"state": state, "losses": losses, "numel": numel}


def meta_rank(name: str, mesh_sizes: dict, plan: dict) -> dict:
    mesh = meshc.mesh(timeout_s=90, **mesh_sizes)
    data = zoo.batches(STEPS, BATCH)
    job = meshc.compile(_meta(name), mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                        plan=meshc.Plan(**FAST, **plan))
    refused = ""
    try:
        job.step(mesh.shard_batch(data[0][0]), mesh.shard_batch(data[0][1]), zoo.lm_loss)
    except meshc.MeshcError as error:
        refused = str(error)
    job.init_weights(seed=SEED)
    state = {k: v.clone() for k, v in job.state_dict().items()}  # state_dict aliases live tensors, as torch's
    shapes = {f: (tuple(p.shape), tuple(job.program.params[f].shape)) for f, p in job.named_parameters()}
    opt = job.optimizer(torch.optim.AdamW, lr=parity.LR)
    losses = []
    for x, y in data:
        losses.append(job.step(mesh.shard_batch(x), mesh.shard_batch(y), zoo.lm_loss).item())
        opt.step()
        opt.zero_grad()
    return {"state": state, "losses": losses, "shapes": shapes, "refused": refused}


CASES = [("llama", {"dp": 2}, {"zero": 3}), ("llama", {"tp": 2}, {}), ("llama", {"pp": 2}, {"microbatches": 2}),
         ("llama", {"dp": 2, "tp": 2}, {"zero": 1}), ("gpt2", {"dp": 2}, {"zero": 3}),
         ("gpt2", {"pp": 2}, {"microbatches": 2}), ("gpt", {"tp": 2}, {}), ("gpt", {"dp": 2, "tp": 2}, {"zero": 3})]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'x'.join(f'{k}{v}' for k, v in c[1].items())}"
                         + "".join(f"-{k}{v}" for k, v in c[2].items()))
def test_meta_model_initializes_like_one_process(case):
    name, mesh_sizes, plan = case
    ref = _reference(name)
    results = run_ranks(meta_rank, math.prod(mesh_sizes.values()), name, mesh_sizes, plan, timeout=240)
    for rank, out in enumerate(results):
        assert "job.init_weights(seed)" in out["refused"], f"rank {rank} stepped on uninitialized weights"
        assert set(out["state"]) == set(ref["state"]), sorted(set(out["state"]) ^ set(ref["state"]))
        for key, value in ref["state"].items():
            assert torch.equal(out["state"][key], value), f"rank {rank}: {key} differs from meshc.init_weights"
        worst = max(abs(a - b) for a, b in zip(out["losses"], ref["losses"]))
        assert worst < 2e-5, (rank, out["losses"], ref["losses"])
        held = sum(math.prod(local) for local, _ in out["shapes"].values())
        assert held < ref["numel"], f"rank {rank} holds {held} of {ref['numel']} parameter elements: nothing split"


def test_init_follows_each_model_documented_init():
    """Statistics of meshc.init_weights on meta-built models: the models' own init, not torch's defaults."""
    gpt2 = dict(meshc.init_weights(_meta("gpt2"), seed=0).named_parameters())
    layers = len([k for k in gpt2 if k.endswith("mlp.c_proj.weight")])
    assert abs(gpt2["transformer.h.0.attn.c_attn.weight"].std().item() - 0.02) < 0.002
    # GPT-2's residual projections: 0.02 / sqrt(2 * layers), set by the parent block's init over the child
    assert abs(gpt2["transformer.h.0.mlp.c_proj.weight"].std().item() - 0.02 / math.sqrt(2 * layers)) < 0.002
    assert torch.equal(gpt2["transformer.ln_f.weight"], torch.ones(32))
    assert torch.equal(gpt2["transformer.h.0.attn.c_attn.bias"], torch.zeros(96))
    llama = meshc.init_weights(_meta("llama"), seed=0)
    cpu = zoo.build("llama")
    for name, b in cpu.named_buffers():  # rotary inv_freq: recomputed exactly as the constructor computes it
        assert torch.equal(dict(llama.named_buffers())[name], b), name
    assert abs(llama.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 0.002
    assert torch.equal(llama.model.norm.weight, torch.ones(32))
    gpt = meshc.init_weights(_meta("gpt"), seed=0)
    assert gpt.head.weight is gpt.tok.weight  # still tied
    assert abs(gpt.tok.weight.std().item() - 0.02) < 0.002 and torch.equal(gpt.ln_f.weight, torch.ones(32))
    again = meshc.init_weights(_meta("gpt"), seed=0).state_dict()
    other = meshc.init_weights(_meta("gpt"), seed=1).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in gpt.state_dict().items())
    assert not torch.equal(other["tok.weight"], again["tok.weight"])


def test_tensor_no_initializer_writes_is_refused():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.ones(4))  # set in __init__ only: no init method knows it

        def forward(self, x):
            return self.lin(x) * self.scale
    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(meshc.MeshcError, match=r"no initializer wrote scale .*reset_parameters"):
        meshc.init_weights(model, seed=0)


def test_meta_model_without_values_refuses_to_run():
    mesh = meshc.mesh()
    x, _ = zoo.batches(1, 2)[0]
    job = meshc.compile(_meta("gpt"), mesh, example_inputs=(x,), plan=meshc.Plan(**FAST))
    assert job.pending() and all(p.device.type == "cpu" for p in job.parameters())
    with pytest.raises(meshc.MeshcError, match=r"job\(x\): .*built on the meta device.*init_weights"):
        job(x)
    job.init_weights(seed=0)
    assert not job.pending() and job(x).shape == (2, zoo.SEQ, zoo.VOCAB)


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * torch.tensor([1.0, 2.0, 3.0, 4.0], device=self.lin.weight.device)


def test_tensor_made_in_forward_on_meta_keeps_its_value():
    """A tensor literal created in forward on the parameters' device is a graph constant. A meta-built model is traced
    on fake tensors of the rank's device, which keep a literal's value: the constant holds it, and the job computes
    what the model does once its weights have values."""
    with torch.device("meta"):
        model = _Scaled()
    job = meshc.compile(model, meshc.mesh(), example_inputs=(torch.randn(2, 4),))
    job.init_weights(seed=SEED)
    eager = meshc.init_weights(_Scaled(), seed=SEED)  # on cpu: the same weights, bit for bit
    x = torch.randn(2, 4)
    assert torch.equal(job(x), eager(x))
    assert [v.tolist() for _, v in job.named_buffers()] == [[1.0, 2.0, 3.0, 4.0]]


def test_tensor_made_in_forward_without_a_value_is_refused():
    """Traced for a device this machine lacks (a simulated GPU mesh on a CPU), a meta-built model runs on meta
    tensors, where the literal has no value and no initializer can give it one: refused by name instead of
    running garbage."""
    from meshc.compiler.ir.mesh_spec import MeshSpec
    from meshc.compiler.trace.export import trace

    if torch.cuda.is_available():
        pytest.skip("needs a machine without the simulated device")
    with torch.device("meta"):
        model = _Scaled()
    with pytest.raises(meshc.TraceError, match=r"lifted_tensor_0 on the meta device.*register it as a buffer"):
        trace(model, (torch.randn(2, 4),), mesh=MeshSpec({"dp": 1}, device_type="cuda"), plan=meshc.Plan(), rank=0)


def test_new_input_shapes_are_traced_on_the_ranks_device(single_mesh):
    """A job retraces new input shapes from its meta copy of the model. Traced on meta, model code that reads a
    tensor's device took the wrong branch: transformers' experts count tokens with histc on float on a CPU and on
    int elsewhere, and a CPU ran the int one ("histogram_cpu" not implemented for 'torch.int32') on any new
    shape of Mixtral, until 2026-12-06. Traced on fake tensors of the rank's device, the shorter sequence runs and
    gives what the model gives (same ops, same order: bitwise)."""
    model = zoo.build("mixtral")
    x, _ = zoo.batches(1, 2)[0]
    job = meshc.compile(model, single_mesh, example_inputs=(x,), plan=meshc.Plan(**FAST))
    short = x[:, : x.shape[1] // 2]
    with torch.no_grad():
        assert torch.equal(job(short).logits, model(short).logits)
    assert len(job._programs) == 2  # the new shape was traced again, not served by the first program


class _KeepsState(torch.nn.Module):
    """Stores what its forward computed on itself, as recurrent models keep their state (RecurrentGemma)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.state = None

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        self.state = [h[:, -1]]  # made by autograd: deepcopy refuses it
        return h


def test_a_state_the_forward_stored_on_the_model_is_copied_detached(single_mesh):
    """The job keeps a meta copy of the model to retrace new input shapes; a tensor autograd made, stored on the
    model by a forward run before compiling, made that copy fail (deepcopy: "Only Tensors created explicitly by the
    user support the deepcopy protocol"), so such a model could not be compiled at all, until 2026-12-07."""
    model = _KeepsState()
    x = torch.randn(2, 3, 4)
    model(x)
    assert model.state[0].grad_fn is not None
    job = meshc.compile(model, single_mesh, example_inputs=(x,), plan=meshc.Plan(**FAST))
    short = x[:, :2]
    with torch.no_grad():
        assert torch.equal(job(short), model(short))
    assert len(job._programs) == 2  # the new shape was traced again, from the copy
