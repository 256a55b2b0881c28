"""Data parallelism: ``GroupedTopKRouter`` under ``DistributedDataParallel`` on two processes.

With two Hopper GPUs (NCCL, the CUDA kernels): grad_w after DDP's all-reduce equals a
single-GPU run on the concatenated batch, and the forward and backward of the router make no
host synchronisation (``torch.cuda.set_sync_debug_mode("error")`` raises on one), so the
all-reduce that DDP launches once the router's gradient is ready overlaps the rest of the
backward. Without two GPUs the same harness runs on CPU (gloo, the float64 reference
backend), which checks the test itself; the GPU variant is then skipped.
"""

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_routing import _lib
from moe_routing.module import GroupedTopKRouter

from test_router import config

HAS_TWO_HOPPERS = (
    _lib.find_library() is not None
    and torch.cuda.is_available()
    and torch.cuda.device_count() >= 2
    and all(torch.cuda.get_device_capability(i) == (9, 0) for i in range(2))
)

TOKENS = 1024  # per rank
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(c, device):
    """The global batch and the gradient of its routing weights, identical on every rank."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(WORLD * TOKENS, c.hidden_size, generator=gen).to(device)
    r = torch.randn(WORLD * TOKENS, c.num_experts_per_tok, generator=gen).to(device)
    return x, r


def _router(c, backend, device):
    torch.manual_seed(7)
    return GroupedTopKRouter(c, backend=backend).to(device)


def _loss(module, x, r):
    _, weights, idx = module(x)
    return (weights * r).sum(), idx


def _worker(rank, port, backend, result_dir):
    cuda = backend == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD)
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        c = config(hidden_size=5120)
        x, r = _batch(c, device)
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)

        model = torch.nn.parallel.DistributedDataParallel(
            _router(c, backend, device), device_ids=[rank] if cuda else None
        )
        xs = x[mine].clone().requires_grad_(True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
        loss, idx = _loss(model, xs, r[mine])
        loss.backward()
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        # DDP averages: the sum over ranks is grad_w of the whole batch.
        grad_w = model.module.weight.grad * WORLD

        single = _router(c, backend, device)
        xa = x.clone().requires_grad_(True)
        loss_all, idx_all = _loss(single, xa, r)
        loss_all.backward()

        torch.save(
            {
                "grad_w": grad_w.double().cpu(),
                "grad_w_single": single.weight.grad.double().cpu(),
                "idx": idx.cpu(),
                "idx_single": idx_all[mine].cpu(),
                "grad_x": xs.grad.double().cpu(),
                "grad_x_single": xa.grad[mine].double().cpu(),
            },
            os.path.join(result_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def _run(backend):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(_free_port(), backend, d), nprocs=WORLD, join=True)
        results = [torch.load(os.path.join(d, f"rank{i}.pt")) for i in range(WORLD)]
    # The forward splits the hidden dimension by batch size, so logits (and from them the
    # bf16 routing gradient) of a half batch and of the whole one may differ in the last bits:
    # the comparison has tolerances (a fifth of the default mode's error bounds), reported.
    errs = []
    for rank, res in enumerate(results):
        assert torch.equal(res["idx"], res["idx_single"]), f"rank {rank}: indices differ"
        ex = _rel(res["grad_x"], res["grad_x_single"])
        ew = _rel(res["grad_w"], res["grad_w_single"])
        print(f"rank {rank}: vs single run on the whole batch: grad_x {ex:.2e}, grad_w {ew:.2e}")
        assert ex <= 2e-3, f"rank {rank}: grad_x rel err {ex:.2e}"
        assert ew <= 1e-3, f"rank {rank}: grad_w after all-reduce, rel err {ew:.2e}"
        errs.append((ex, ew))
    return errs


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_ddp_harness_on_cpu_reference():
    _run("reference")


@pytest.mark.skipif(not HAS_TWO_HOPPERS, reason="needs two Hopper GPUs and libmoe_routing.so")
def test_ddp_two_gpus_matches_single_gpu_and_never_syncs():
    _run("cuda")
