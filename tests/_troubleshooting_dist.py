"""Two gloo ranks on loopback that make each multi-rank message docs/troubleshooting.md quotes; rank 0 writes
``{situation: the message raised}`` as JSON to argv[1] (tests/test_troubleshooting.py runs this file)."""

import json
import os
import socket
import sys

import torch
import torch.multiprocessing as mp


def run(rank, world, port, path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    import lossscale
    from lossscale import distributed as ls_dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}

    def clip(grads, **kw):
        params = [torch.nn.Parameter(torch.zeros(2)) for _ in grads]
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.SGD(params, lr=0.1)
        s = lossscale.GradScaler(process_group=None)
        s.scale(torch.ones((), requires_grad=True))
        s.clip_grad_norm_(opt, 1.0, **kw)

    def attempt(key, call):
        try:
            call()
        except Exception as error:
            out[key] = str(error)

    whole = DeviceMesh("cpu", list(range(world)))
    reversed_ = DeviceMesh("cpu", list(reversed(range(world))))  # the same ranks in another order

    def replicated(mesh):
        return DTensor.from_local(torch.ones(2), mesh, [Replicate()])

    attempt("several meshes", lambda: clip([replicated(whole), replicated(reversed_)]))
    attempt("mix", lambda: clip([replicated(whole), torch.ones(2)]))
    attempt("partial", lambda: clip([DTensor.from_local(torch.ones(2), whole, [Partial()])]))
    mesh3 = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("pp", "a", "b"))
    sub = mesh3["a", "b"]  # a 2-D mesh of one rank, in a world of two
    attempt("k-D mesh", lambda: clip([DTensor.from_local(torch.ones(2), sub, [Replicate(), Replicate()])]))
    others = dist.new_group([r for r in range(world) if r != 0])
    if rank == 0:
        attempt("not in norm_group", lambda: clip([torch.ones(2)], norm_group=others))
    s = lossscale.GradScaler(init_scale=2.0 ** (10 + rank))  # ranks that disagree
    s.scale(torch.ones((), requires_grad=True))
    attempt("differs", lambda: ls_dist.check_consistency(s))
    if rank == 0:
        with open(path, "w") as fh:
            json.dump(out, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    mp.spawn(run, args=(2, port, sys.argv[1]), nprocs=2)
