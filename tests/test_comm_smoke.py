import torch
from mp_pool import run_ranks, shm_leaks


def _smoke(n):
    import torch.distributed as dist

    import dist_kernels as dk

    r = dist.get_rank()
    out = []
    with dk.Communicator() as comm:
        for algo in ["ring", "tree"]:
            t = torch.arange(n, dtype=torch.float32) * (r + 1)
            comm.all_reduce(t, algorithm=algo)
            ref = torch.arange(n, dtype=torch.float32) * 3
            out.append(bool(torch.equal(t, ref)))
        b = comm.empty((n,))
        b.copy_(torch.arange(n, dtype=torch.float32) * (r + 1))
        comm.all_reduce(b)
        out.append(bool(torch.equal(b, torch.arange(n, dtype=torch.float32) * 3)))
    return out


def test_smoke():
    for n in [0, 1, 7, 1000, 2**20 + 7]:
        res = run_ranks(2, _smoke, n, timeout=60)
        print(n, res)
        assert all(all(x) for x in res), (n, res)
    assert shm_leaks() == []
