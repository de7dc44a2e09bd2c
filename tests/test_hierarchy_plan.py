"""The pure parts of the hierarchical path: host layout and block orders, chunking, the
wavefront issue order, the call queue, and the cost model's fit and choices."""

from __future__ import annotations

import random
import threading
import time

import pytest

from dist_kernels.comm import cost_model as cm
from dist_kernels.comm.call_queue import CallQueue
from dist_kernels.comm.host_layout import HostLayout, split_even
from dist_kernels.comm.stage_pipeline import run_stages, wavefront

SEED = 27


def _layout(hosts_per_rank, rank=0):
    return HostLayout.of(hosts_per_rank, rank)


# ------------------------------------------------------------------ layout


def test_host_major_two_by_two():
    layout = _layout(["a", "a", "b", "b"], rank=3)
    assert layout.cross_groups == [[0, 2], [1, 3]]
    assert (layout.my_host, layout.local_rank, layout.my_cross) == (1, 1, 1)
    assert layout.local_major_order() == [0, 2, 1, 3]


def test_interleaved_hosts_and_unequal_hosts():
    layout = _layout(["a", "b", "a", "b"], rank=1)
    assert layout.cross_groups == [[0, 1], [2, 3]] and layout.local_ranks == [1, 3]
    assert layout.local_major_order() == [0, 1, 2, 3]
    unequal = [_layout(["a", "a", "a", "b"], rank=r) for r in range(4)]
    assert not unequal[0].uniform and unequal[0].cross_groups == [[0, 3]]
    assert [u.my_cross for u in unequal] == [0, -1, -1, 0]


@pytest.mark.parametrize("hosts", range(1, 9))
def test_reduce_scatter_order_lands_every_chunk_on_its_rank(hosts):
    """Block b of the local-major order goes, after the host-level reduce-scatter (local rank
    l keeps blocks [l H, (l+1) H)) and the one on cross[l] (member h keeps block h of those),
    to rank order[b]: it must be that rank's own chunk, for any placement of ranks on hosts."""
    rng = random.Random(SEED + hosts)
    for per_host in range(1, 9):
        names = [f"h{h}" for h in range(hosts) for _ in range(per_host)]
        rng.shuffle(names)
        for rank in range(len(names)):
            layout = _layout(names, rank)
            order = layout.local_major_order()
            assert sorted(order) == list(range(len(names)))
            lr, h = layout.local_rank, layout.my_host
            assert order[lr * layout.num_hosts + h] == rank
            assert layout.cross_groups[layout.my_cross][h] == rank


def test_split_even_covers_the_count_in_granules():
    for count in (0, 1, 5, 64, 1003, 4099):
        for parts in (1, 2, 3, 7):
            for granule in (1, 2, 4):
                ranges = split_even(count, parts, granule)
                assert sum(n for _, n in ranges) == count
                assert all(n > 0 for _, n in ranges) and len(ranges) <= parts
                offsets = [o for o, _ in ranges]
                assert offsets == sorted(offsets)
                assert all(n % granule == 0 for _, n in ranges[:-1])
    with pytest.raises(ValueError, match="parts"):
        split_even(10, 0)


# ------------------------------------------------------------------ wavefront


@pytest.mark.parametrize("chunks, stages", [(1, 1), (1, 3), (4, 3), (9, 2), (5, 5)])
def test_wavefront_starts_each_stage_after_the_one_before(chunks, stages):
    order = list(wavefront(chunks, stages))
    assert sorted(order) == [(k, s) for k in range(chunks) for s in range(stages)]
    position = {step: i for i, step in enumerate(order)}
    for k in range(chunks):
        for s in range(1, stages):
            assert position[(k, s - 1)] < position[(k, s)]
    for s in range(stages):  # every engine sees the chunks in order
        assert [k for k, st in order if st == s] == list(range(chunks))


class _Handle:
    def __init__(self, log, key, delay):
        self.log, self.key, self.delay = log, key, delay

    def wait(self, timeout=None):
        time.sleep(self.delay)
        self.log.append(("done", self.key))


def test_run_stages_waits_for_the_previous_stage_of_the_chunk():
    log = []

    def stage(k, s):
        def start():
            log.append(("start", (k, s)))
            return _Handle(log, (k, s), 0.001 * ((k + s) % 3))

        return start

    run_stages([[stage(k, s) for s in range(3)] for k in range(4)])
    for k in range(4):
        for s in range(1, 3):
            assert log.index(("done", (k, s - 1))) < log.index(("start", (k, s)))
    assert {e for e in log if e[0] == "done"} == {
        ("done", (k, s)) for k in range(4) for s in range(3)
    }
    with pytest.raises(ValueError, match="same number of stages"):
        run_stages([[stage(0, 0)], [stage(1, 0), stage(1, 1)]])


# ------------------------------------------------------------------ call queue


def test_call_queue_runs_in_issue_order_and_hands_errors_to_wait():
    queue = CallQueue("test")
    seen = []
    pending = [
        queue.call(
            lambda i=i: (time.sleep(0.002), seen.append(i)) and None, f"call {i}", async_op=True
        )
        for i in range(5)
    ]
    queue.call(lambda: seen.append("sync"), "sync", async_op=False)  # waits for the queue
    assert seen == [0, 1, 2, 3, 4, "sync"]
    assert all(p.is_completed() for p in pending)

    def boom():
        raise RuntimeError("boom")

    failed = queue.call(boom, "boom", async_op=True)
    with pytest.raises(RuntimeError, match="boom"):
        failed.wait()
    queue.close()


def test_call_queue_completes_a_posted_transfer_with_its_handle():
    queue = CallQueue("test")
    released = threading.Event()

    class Transfer:
        def wait(self, timeout=None):
            assert released.wait(5)

        def is_completed(self):
            return released.is_set()

    pending = queue.call(Transfer, "recv", async_op=True)
    after = queue.call(lambda: None, "later", async_op=True)
    after.wait(5)  # a posted receive does not hold up the calls behind it
    assert not pending.is_completed()
    released.set()
    pending.wait(5)
    assert pending.is_completed()
    queue.close()


# ------------------------------------------------------------------ cost model


def test_fit_recovers_alpha_and_beta():
    rng = random.Random(SEED)
    truth = cm.Link(3.0, 1.0 / 5000.0)
    samples = []
    for n in (2, 4, 8):
        for size in (8, 4096, 1 << 16, 1 << 20, 1 << 24):
            for algorithm in ("ring", "tree"):
                steps, nbytes = cm.terms("all_reduce", algorithm, n, size)
                samples.append((steps, nbytes, truth.us(steps, nbytes)))
    fitted = cm.fit_link(samples)
    assert fitted.alpha_us == pytest.approx(truth.alpha_us, rel=1e-9)
    assert fitted.beta_us_per_byte == pytest.approx(truth.beta_us_per_byte, rel=1e-9)
    # 5% noise on every sample: the fit stays within the noise at every size
    noisy = [(x, y, t * (1 + rng.uniform(-0.05, 0.05))) for x, y, t in samples]
    assert max(abs(e) for e in cm.relative_errors(cm.fit_link(noisy), noisy)) < 0.11
    # a knee: 4x dearer bytes beyond 8 MiB on the critical path (caches left behind)
    kneed = cm.Link(3.0, 1.0 / 40000.0, float(8 << 20), 1.0 / 10000.0)
    data = [(s, b, kneed.us(s, b)) for s, b, _ in samples]
    refit = cm.fit_link(data)
    assert max(abs(e) for e in cm.relative_errors(refit, data)) < 0.02
    assert refit.knee_bytes > 0 and refit.beta_far_us_per_byte > 2 * refit.beta_us_per_byte
    # pure latency data: beta would come out negative; alpha alone fits exactly
    flat = [(2.0, float(b), 10.0) for b in (8, 64, 512)]
    fitted = cm.fit_link(flat)
    assert fitted.alpha_us == pytest.approx(5.0) and fitted.beta_us_per_byte < 1e-12


def test_terms_match_the_extensions_built_in_model():
    """Python prices shared memory with the C++ table (csrc/algorithm/select.cc)."""
    from dist_kernels import _C

    link = cm.builtin_shm_link(False)
    for n in (2, 3, 4, 8):
        for size in (8, 65536, 1 << 22):
            ring, tree, one_shot = _C._shm_all_reduce_cost_us(n, size, False)
            ours = [
                link.us(*cm.terms("all_reduce", a, n, size)) for a in ("ring", "tree", "one_shot")
            ]
            assert ours == pytest.approx([ring, tree, one_shot], rel=1e-12)
            ring_ag, one_ag = _C._shm_all_gather_cost_us(n, size, False)
            assert link.us(*cm.terms("all_gather", "ring", n, size)) == pytest.approx(ring_ag)
            assert link.us(*cm.terms("all_gather", "one_shot", n, size)) == pytest.approx(one_ag)


def test_choices_replicated_small_pipelined_multi_leader_large():
    settings = cm.HierarchySettings()
    small = settings.choose("all_reduce", 2, 2, 8, ["gloo"])
    large = settings.choose("all_reduce", 2, 2, 64 << 20, ["gloo"])
    assert small.kind == "replicated" and small.chunks == 1
    assert large.kind == "multi_leader" and large.chunks > 1
    # the pipeline formula: K chunks cost the first chunk's stages plus K-1 bottlenecks
    host, net = cm.stage_us(
        settings.model, "all_reduce", "multi_leader", 2, 2, (64 << 20) / 4, "gloo"
    )
    t4 = cm.hierarchical_us(settings.model, "all_reduce", "multi_leader", 2, 2, 64 << 20, 4, "gloo")
    assert t4 == pytest.approx(host + net + 3 * max(host, net))
    forced = cm.HierarchySettings(kind="flat").choose("all_gather", 2, 2, 1 << 20, ["gloo"])
    assert forced.kind == "flat"
    chunks = cm.HierarchySettings(kind="multi_leader", chunks=5).choose(
        "reduce_scatter", 2, 2, 1 << 20, ["gloo", "mpi"]
    )
    assert chunks.kind == "multi_leader" and chunks.chunks == 5
    only_mpi = cm.HierarchySettings(engine="mpi").choose(
        "all_reduce", 2, 2, 1 << 20, ["gloo", "mpi"]
    )
    assert only_mpi.engine == "mpi"
    crowded = cm.HierarchySettings(oversubscribed=True)  # MPI spins: auto leaves it out
    engines = {crowded.choose("all_reduce", 2, 2, n, ["gloo", "mpi"]).engine for n in (8, 1 << 24)}
    assert engines == {"gloo"}
    forced = cm.HierarchySettings(engine="mpi", oversubscribed=True)
    assert forced.choose("all_reduce", 2, 2, 8, ["gloo", "mpi"]).engine == "mpi"


def test_settings_from_env_are_checked_and_shared(monkeypatch, tmp_path):
    import datetime

    import torch.distributed as dist

    monkeypatch.setenv("DK_INTER_HOST_ALGO", "ring")
    with pytest.raises(ValueError, match="DK_INTER_HOST_ALGO='ring'"):
        cm.HierarchySettings.from_env(cm.CostModel())
    monkeypatch.setenv("DK_INTER_HOST_ALGO", "multi_leader")
    monkeypatch.setenv("DK_INTER_HOST_CHUNKS", "4")
    model = cm.CostModel(
        shm={2: {"all_reduce/ring": cm.Link(2.0, 1e-4)}}, inter={"gloo": cm.Link(50.0, 1e-3)}
    )
    path = cm.save_model(model, str(tmp_path / "model.json"))
    monkeypatch.setenv("DK_COST_MODEL", path)
    store, timeout = dist.HashStore(), datetime.timedelta(seconds=5)
    mine = cm.shared_settings(store, 0, timeout)
    monkeypatch.setenv("DK_INTER_HOST_CHUNKS", "9")  # another rank's environment is not read
    theirs = cm.shared_settings(store, 1, timeout)
    assert theirs.to_json() == mine.to_json()
    assert (theirs.kind, theirs.chunks) == ("multi_leader", 4)
    assert theirs.model.shm_link(2, "all_reduce", "ring") == cm.Link(2.0, 1e-4)
    builtin = cm.builtin_shm_link(False)  # not fitted: the extension's constants
    assert theirs.model.shm_link(2, "all_reduce", "tree") == builtin
    costs = theirs.model.fitted_costs(2)
    assert len(costs) == 4 * len(cm.FITTED_ORDER)
    assert costs[:8] == [2.0, 1e-4, 0.0, 0.0, builtin.alpha_us, builtin.beta_us_per_byte, 0.0, 0.0]
    assert theirs.model.fitted_costs(4) == []
    assert theirs.model.inter_link("gloo") == cm.Link(50.0, 1e-3)
