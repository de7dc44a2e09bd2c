"""ParameterServer on 3 CPU ranks (servers 0 and 1 also train, rank 2 only trains).

sync must equal synchronous SGD bitwise (each rank replays it alone: every rank can draw every
rank's batch); bounded(s) must never answer a pull more than s clocks ahead of the slowest
live worker, from the server's own log; bounded and async updates must equal, pull by pull,
a one-process replay of the server's log; async must reach the least-squares optimum; a dead
worker is named and the rest finish; a dead server is named on every worker.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.nn as nn
from mp_pool import RankDied, run_ranks, shm_leaks

from dist_kernels.param_server import Consistency, shard_ranges

SEED = 4242
WORLD = 3
SERVERS = [0, 1]
TIMEOUT = datetime.timedelta(seconds=20)

# ----------------------------------------------------------------------------- pure planning


@pytest.mark.parametrize("numel,servers", [(1, [0]), (10, [0, 1, 2]), (7, [3, 1]), (64, [0])])
def test_shards_are_contiguous_and_cover_the_buffer(numel, servers):
    shards = shard_ranges(numel, 4, servers)
    assert [s.server for s in shards] == servers
    assert shards[0].start == 0 and shards[-1].stop == numel
    assert all(a.stop == b.start for a, b in zip(shards, shards[1:]))
    assert max(s.numel for s in shards) - min(s.numel for s in shards) <= 1
    assert shards[-1].byte_range[1] == 4 * numel


def test_consistency_rules_and_bad_options():
    assert Consistency("async").may_answer(10, 0)
    assert Consistency("sync").may_answer(3, 3) and not Consistency("sync").may_answer(4, 3)
    bounded = Consistency("bounded", 2)
    assert bounded.may_answer(5, 3) and not bounded.may_answer(6, 3)
    for bad in [("lazy", 0), ("bounded", -1), ("sync", 2), ("bounded", 1.5)]:
        with pytest.raises(ValueError, match="mode|max_staleness"):
            Consistency(*bad)
    with pytest.raises(ValueError, match="cannot be cut"):
        shard_ranges(1, 4, [0, 1])


# ----------------------------------------------------------------------------- helpers


def _model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(SEED + 100 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _grads(model, rank, step):
    model.zero_grad()
    x, y = _batch(rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ps(model, comm, **kw):
    import dist_kernels as dk

    kw.setdefault("servers", SERVERS)
    return dk.ParameterServer(model, comm, _sgd, timeout=TIMEOUT, **kw)


# ----------------------------------------------------------------------------- sync = SGD


def _synchronous_sgd(world, steps, drop_rank=None):
    """Synchronous data-parallel SGD in one process: grads summed in rank order, / world."""
    model = _model()
    opt = _sgd(model.parameters())
    ranks = [r for r in range(world) if r != drop_rank]
    for step in range(steps):
        per_rank = [_grads(model, r, step) for r in ranks]
        for i, p in enumerate(model.parameters()):
            total = per_rank[0][i].clone()
            for g in per_rank[1:]:
                total += g[i]
            total /= len(ranks)
            p.grad = total
        opt.step()
    return _flat(model)


def _sync_run(steps):
    import torch.distributed as dist

    import dist_kernels as dk

    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"seed {SEED}")
    with dk.Communicator() as comm:
        model = _model()
        with _ps(model, comm, mode="sync") as ps:
            ps.pull()
            for step in range(steps):
                _grads(model, rank, step)
                ps.step()
        stats = ps.staleness()  # after close: every worker's pulls are in the log
    return {
        "equal": torch.equal(_flat(model), _synchronous_sgd(world, steps)),
        "equal_without_rank_2": torch.equal(_flat(model), _synchronous_sgd(world, steps, 2)),
        "stats": stats,
    }


def test_sync_equals_synchronous_sgd_bitwise():
    results = run_ranks(WORLD, _sync_run, 4, timeout=120)
    for rank, r in enumerate(results):
        assert r["equal"], (rank, r)
        assert not r["equal_without_rank_2"], (rank, r)  # the check sees a dropped rank
    for rank in SERVERS:
        assert results[rank]["stats"]["pushes"] == 4 * WORLD
        assert results[rank]["stats"]["max_gap"] == 0
    assert shm_leaks() == []


# ----------------------------------------------------------------------------- bounded / async


def _straggler_run(mode, max_staleness, steps, slow_rank, delay_s):
    """Trains with one slow rank; returns the servers' logs, and what each worker pushed and
    pulled, by clock: enough to replay every server in one process."""
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    pushed, pulled = {}, {}
    with dk.Communicator() as comm:
        model = _model()
        with _ps(model, comm, mode=mode, max_staleness=max_staleness) as ps:
            ps.pull()
            pulled[0] = _flat(model)
            for step in range(steps):
                grads = _grads(model, rank, step)
                pushed[step + 1] = torch.cat([g.reshape(-1) for g in grads])
                if rank == slow_rank:
                    time.sleep(delay_s)
                ps.step()
                pulled[ps.clock] = _flat(model)
        stats, log = ps.staleness(), ps.log
        shards = {s.server: (s.start, s.stop) for s in ps.shards}
    return {
        "stats": stats,
        "gaps": [e["gap"] for e in log if e["event"] == "pull"],
        "log": log,
        "shards": shards,
        "pushed": pushed,
        "pulled": pulled,
    }


def _replay(server, results):
    """Replays ``server``'s log in one process: its shard, a fresh optimizer, every logged push
    applied in log order as the gradient that worker pushed at that clock divided by the number
    of workers (bounded and async: one round of pushes moves the parameters as far as one
    synchronous step). Every logged pull must have returned, bitwise, the replay's shard at the
    version the log gives. Returns the number of pushes and pulls checked."""
    start, stop = results[server]["shards"][server]
    param = nn.Parameter(_flat(_model())[start:stop].clone())
    opt = _sgd([param])
    versions = [param.detach().clone()]  # versions[v]: the shard after v applied pushes
    checked = {"push": 0, "pull": 0}
    for e in results[server]["log"]:
        worker = results[e["worker"]]
        if e["event"] == "push":
            param.grad = worker["pushed"][e["clock"]][start:stop] / WORLD
            opt.step()
            versions.append(param.detach().clone())
        elif e["event"] == "pull":
            assert e["version"] == len(versions) - 1, (server, e)  # pulls see every push before
            got = worker["pulled"][e["clock"]][start:stop]
            assert torch.equal(got, versions[e["version"]]), (server, e)
        checked[e["event"]] += 1
    return checked


def test_bounded_never_answers_beyond_s_and_async_does():
    s = 1
    bounded = run_ranks(WORLD, _straggler_run, "bounded", s, 8, 2, 0.05, timeout=120)
    free = run_ranks(WORLD, _straggler_run, "async", 0, 8, 2, 0.05, timeout=120)
    for rank in SERVERS:
        gaps = bounded[rank]["gaps"]
        assert len(gaps) == 9 * WORLD and max(gaps) <= s, (rank, gaps)
        assert max(gaps) == s, (rank, gaps)  # the bound was reached, so it was enforced
        assert bounded[rank]["stats"]["max_staleness"] > 0
        assert max(free[rank]["gaps"]) > s, free[rank]  # without the bound it is exceeded


@pytest.mark.parametrize("mode, s", [("bounded", 1), ("async", 0)])
def test_updates_equal_a_replay_of_the_server_log(mode, s):
    """Step by step: every pull a worker got equals a one-process replay of the server's log
    (the pushes in the order applied, each divided by the worker count), with a straggler so
    that pushes are applied stale and out of rank order."""
    print(f"seed {SEED}")
    results = run_ranks(WORLD, _straggler_run, mode, s, 6, 2, 0.03, timeout=120)
    for server in SERVERS:
        checked = _replay(server, results)
        assert checked == {"push": 6 * WORLD, "pull": 7 * WORLD}, (server, checked)
        assert results[server]["stats"]["max_staleness"] > 0  # some push was applied stale


def _least_squares_run(steps):
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(60, 4, generator=g, dtype=torch.float64)
    w_star = torch.randn(4, 1, generator=g, dtype=torch.float64)
    y = x @ w_star  # noise-free: the optimum is w_star
    mine = slice(rank * 20, (rank + 1) * 20)
    model = nn.Linear(4, 1, bias=False).double()
    with dk.Communicator() as comm:
        ps = dk.ParameterServer(
            model, comm, lambda p: torch.optim.SGD(p, lr=0.2), servers=SERVERS, mode="async"
        )
        with ps:
            ps.pull()
            for _ in range(steps):
                model.zero_grad()
                nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
                ps.step()
    start = (nn.Linear(4, 1, bias=False).weight.detach().t().double() - w_star).norm().item()
    return {"error": (model.weight.detach().t() - w_star).norm().item(), "start": start}


def test_async_converges_to_the_least_squares_optimum():
    print(f"seed {SEED}")
    for r in run_ranks(WORLD, _least_squares_run, 150, timeout=120):
        assert r["start"] > 0.5 and r["error"] < 1e-4, r  # it moved, to the optimum


# ----------------------------------------------------------------------------- faults


def _worker_killed(victim, steps, kill_at):
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with dk.Communicator() as comm:
        model = _model()
        with _ps(model, comm, mode="bounded", max_staleness=1) as ps:
            ps.pull()
            for step in range(steps):
                if rank == victim and step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                _grads(model, rank, step)
                ps.step()
        dead = ps.dead_workers
    return {"steps": steps, "dead": dead}


def test_dead_worker_in_bounded_mode_is_named_and_the_rest_finish():
    victim = 2
    results = run_ranks(WORLD, _worker_killed, victim, 8, 3, timeout=120, expect_death=True)
    assert isinstance(results[victim], RankDied), results
    for rank in SERVERS:
        assert list(results[rank]["dead"]) == [victim], results[rank]
        assert f"worker rank {victim}" in results[rank]["dead"][victim]
    assert shm_leaks() == []


def _server_killed(victim, delay_s):
    import torch.distributed as dist

    import dist_kernels as dk

    rank = dist.get_rank()
    with dk.Communicator() as comm:
        model = _model()
        ps = _ps(model, comm, servers=[victim], workers=[0, 1], mode="sync")
        if rank == victim:
            threading.Timer(delay_s, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
            ps.close()  # serves until it dies
            return "survived"
        try:
            for step in range(10_000):
                _grads(model, rank, step)
                ps.step()
        except dk.CommError as e:
            return str(e)
        return "no error"


def test_dead_server_raises_comm_error_naming_it_on_every_worker():
    victim = 2
    results = run_ranks(WORLD, _server_killed, victim, 0.5, timeout=120, expect_death=True)
    assert isinstance(results[victim], RankDied), results
    for rank in (0, 1):
        assert f"server rank {victim}" in results[rank] and "died" in results[rank], results
    assert shm_leaks() == []
