"""dk.checkpoint: resharding saves/loads, atomicity under a killed rank, corrupt files."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mp_pool import RankDied, run_ranks  # noqa: E402
from test_zero import SEED, batch, make_comm, make_model, max_rel_diff, reference_run  # noqa: E402

import dist_kernels.checkpoint as ckpt  # noqa: E402
from dist_kernels.optim import FusedAdamW  # noqa: E402

SAVE_AT, TOTAL = 3, 6
OPTIMIZERS = {
    "fused": (FusedAdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def _engine(stage, opt_name, seed=SEED):
    import dist_kernels as dk

    comm = make_comm()
    model = make_model(seed)
    cls, kwargs = OPTIMIZERS[opt_name]
    extra = {"module": model} if stage == 3 else {}
    opt = dk.ShardedOptimizer(
        model.parameters(), cls, comm, stage=stage, bucket_cap_mb=0.001, **extra, **kwargs
    )
    return comm, model, opt


def _train(comm, model, opt, steps):
    for step in steps:
        x, y = batch(step, comm.world_size, comm.rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _save_after(path, stage, opt_name, steps):
    comm, model, opt = _engine(stage, opt_name)
    _train(comm, model, opt, range(steps))
    ckpt.save(path, model=model, optimizer=opt, extra={"step": steps})
    with opt.full_parameters():
        values = [p.detach().clone() for p in model.parameters()]
    opt.close()
    comm.close()
    return values


def _load_and_continue(path, stage, opt_name, start, stop):
    # a different initialisation: everything must come from the checkpoint
    comm, model, opt = _engine(stage, opt_name, seed=SEED + 99)
    extra = ckpt.load(path, model=model, optimizer=opt)
    step = float(next(iter(opt.optim.state.values()))["step"])
    _train(comm, model, opt, range(start, stop))
    ref, _ = reference_run(opt_name, comm.world_size, stop)
    with opt.full_parameters():
        diff = max_rel_diff(model, ref)
    opt.close()
    comm.close()
    return {"extra": extra, "step": step, "diff": diff}


def test_save_at_4_load_at_2_and_3_continues_like_an_uninterrupted_run(tmp_path):
    opt_name = "adamw"  # torch's AdamW: the generic state path (FusedAdamW: the kill test)
    path = str(tmp_path / "ckpt")
    print(f"seed {SEED}: save at step {SAVE_AT} on 4 ranks (stage 2), continue to {TOTAL}")
    saved = run_ranks(4, _save_after, path, 2, opt_name, SAVE_AT, timeout=120)
    layout = json.load(open(os.path.join(path, json.load(open(f"{path}/manifest.json"))["layout"])))
    assert layout["world_size"] == 4 and layout["stage"] == 2 and layout["step"] == SAVE_AT
    for world_size, stage in ((3, 2), (2, 1)):
        rows = run_ranks(
            world_size, _load_and_continue, path, stage, opt_name, SAVE_AT, TOTAL, timeout=120
        )
        diff = max(r["diff"] for r in rows)
        print(
            f"load at {world_size} ranks, stage {stage}: max rel diff vs uninterrupted {diff:.2e}"
        )
        assert all(r["extra"] == {"step": SAVE_AT} and r["step"] == SAVE_AT for r in rows)
        assert diff < 1e-5
    # without an optimizer the full parameters are assembled, in this very process
    plain = make_model(SEED + 7)
    assert ckpt.load(path, model=plain) == {"step": SAVE_AT}
    for p, q in zip(plain.parameters(), saved[0]):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "saved_at, loaded_at", [((4, 3), (2, 1)), ((2, 1), (3, 3))], ids=["3to1", "1to3"]
)
def test_stage3_checkpoint_reshards_to_other_stages_and_world_sizes(tmp_path, saved_at, loaded_at):
    """Saved at stage 3 on 4 ranks, loaded at stage 1 on 2 (and back: 1 on 2 -> 3 on 3); the
    continued run equals an uninterrupted one."""
    path, opt_name = str(tmp_path / "ckpt"), "fused"
    (save_ranks, save_stage), (load_ranks, load_stage) = saved_at, loaded_at
    saved = run_ranks(save_ranks, _save_after, path, save_stage, opt_name, SAVE_AT, timeout=120)
    rows = run_ranks(
        load_ranks, _load_and_continue, path, load_stage, opt_name, SAVE_AT, TOTAL, timeout=120
    )
    diff = max(r["diff"] for r in rows)
    print(
        f"seed {SEED}: stage {save_stage} on {save_ranks} ranks -> stage {load_stage} on "
        f"{load_ranks}: max rel diff vs uninterrupted {diff:.2e}"
    )
    assert all(r["extra"] == {"step": SAVE_AT} and r["step"] == SAVE_AT for r in rows)
    assert diff < 1e-5
    plain = make_model(SEED + 7)  # and the full parameters assemble in one process
    ckpt.load(path, model=plain)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), saved[0]))


def _save_twice_die_in_second(path):
    comm, model, opt = _engine(2, "fused")
    _train(comm, model, opt, range(2))
    ckpt.save(path, model=model, optimizer=opt, extra="first")
    _train(comm, model, opt, range(2, 3))
    if comm.rank == 0:

        def die(directory, manifest):
            with open(os.path.join(directory, "manifest.json.tmp-partial"), "w") as f:
                f.write(json.dumps(manifest)[:40])  # a half-written manifest, then death
            os.kill(os.getpid(), signal.SIGKILL)

        ckpt._publish_manifest = die
    try:
        ckpt.save(path, model=model, optimizer=opt, extra="second")
    except Exception as e:  # noqa: BLE001 - the surviving rank sees its peer die
        return f"raised {type(e).__name__}"
    finally:
        comm.close()
    return "saved"


def _load_only(path):
    comm, model, opt = _engine(2, "fused", seed=SEED + 5)
    extra = ckpt.load(path, model=model, optimizer=opt)
    ref, _ = reference_run("fused", comm.world_size, 2)
    opt.close()
    comm.close()
    return extra, max_rel_diff(model, ref)


def test_rank_killed_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_ranks(2, _save_twice_die_in_second, path, timeout=120, expect_death=True)
    print("save under a kill:", results)
    assert isinstance(results[0], RankDied)
    rows = run_ranks(2, _load_only, path, timeout=120)
    print("after the kill, loaded:", rows)
    assert all(extra == "first" and diff < 1e-5 for extra, diff in rows)


def _model_only_checkpoint(path):
    model = make_model()
    ckpt.save(path, model=model, extra=1)
    return model


def test_corrupt_or_mismatched_checkpoint_raises_and_changes_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    source = _model_only_checkpoint(path)
    target = make_model(SEED + 1)
    before = [p.detach().clone() for p in target.parameters()]
    assert ckpt.load(path, model=target) == 1
    assert all(torch.equal(p, q) for p, q in zip(target.parameters(), source.parameters()))

    manifest = json.load(open(os.path.join(path, "manifest.json")))
    victim = os.path.join(path, manifest["meta"])
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    fresh = make_model(SEED + 1)
    with pytest.raises(ckpt.CheckpointError, match="corrupt"):
        ckpt.load(path, model=fresh)
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), before))

    with pytest.raises(ckpt.CheckpointError, match="no checkpoint"):
        ckpt.load(str(tmp_path / "nowhere"), model=fresh)


def _mismatch(path):
    comm, model, opt = _engine(1, "fused")
    _train(comm, model, opt, range(1))
    ckpt.save(path, model=model, optimizer=opt)
    other = torch.nn.Sequential(torch.nn.Linear(13, 36), torch.nn.Tanh(), torch.nn.Linear(36, 5))
    import dist_kernels as dk

    other_opt = dk.ShardedOptimizer(other.parameters(), FusedAdamW, comm, stage=1)
    before = [p.detach().clone() for p in other.parameters()]
    try:
        ckpt.load(path, model=other, optimizer=other_opt)
        message = "loaded"
    except ckpt.CheckpointError as e:
        message = str(e)
    unchanged = all(torch.equal(p, q) for p, q in zip(other.parameters(), before))
    # a flipped byte in one rank's shard: every rank raises, nothing changes
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    if comm.rank == 0:
        victim = os.path.join(path, manifest["shards"][1])
        data = bytearray(open(victim, "rb").read())
        data[-100] ^= 0x01
        open(victim, "wb").write(bytes(data))
    comm.barrier()
    fresh_model = make_model(SEED + 3)
    fresh_before = [p.detach().clone() for p in fresh_model.parameters()]
    fresh_opt = dk.ShardedOptimizer(fresh_model.parameters(), FusedAdamW, comm, stage=2)
    try:
        ckpt.load(path, model=fresh_model, optimizer=fresh_opt)
        corrupt = "loaded"
    except ckpt.CheckpointError as e:
        corrupt = str(e)
    # rank 0's parameters were broadcast at construction: compare with rank 0's initial values
    fresh_unchanged = all(torch.equal(p, q) for p, q in zip(fresh_model.parameters(), fresh_before))
    for o in (opt, other_opt, fresh_opt):
        o.close()
    comm.close()
    return message, unchanged, corrupt, fresh_unchanged


def test_mismatched_model_and_corrupt_shard_raise_on_every_rank(tmp_path):
    rows = run_ranks(2, _mismatch, str(tmp_path / "ckpt"), timeout=120)
    for message, unchanged, corrupt, fresh_unchanged in rows:
        print(message, "|", corrupt)
        assert "does not match the model" in message and "0.weight" in message
        assert unchanged and fresh_unchanged
        assert "corrupt" in corrupt or "another rank failed" in corrupt
