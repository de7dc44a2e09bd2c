"""CPU tier: the NCCL search order and its error messages, with fake libraries and directories.

No NCCL is needed: fake candidates are empty files or libc, which must give clear errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dist_kernels import _C
from dist_kernels.comm import nccl as _nccl


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No DK_NCCL_LIBRARY, no nvidia package, an empty maps file, no NCCL loaded yet."""
    monkeypatch.delenv(_nccl.ENV_VAR, raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not _has_nvidia(p)])
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    _loaded_before_patch["value"] = _C.nccl_loaded()
    maps = tmp_path / "maps"
    maps.write_text("")
    monkeypatch.setattr(_nccl, "MAPS_PATH", str(maps))
    monkeypatch.setattr(_C, "nccl_loaded", lambda: None)
    return tmp_path


# What was loaded before clean_env patched _C.nccl_loaded. One NCCL per process: where a real
# one is already loaded (a GPU machine, after the gpu tests), a fake path can only be refused as
# "already loaded", so the tests that load fakes in this process skip there.
_loaded_before_patch = {}


def _skip_if_real_nccl_loaded() -> None:
    if _loaded_before_patch.get("value") is not None:
        pytest.skip(f"NCCL is already loaded in this process: {_loaded_before_patch['value']}")


def _has_nvidia(entry: str) -> bool:
    return (Path(entry or ".") / "nvidia").is_dir()


def _fake_wheel(monkeypatch, site: Path) -> Path:
    """A site directory holding nvidia/nccl/lib/libnccl.so.2 as an empty file."""
    lib = site / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    monkeypatch.syspath_prepend(str(site))
    return lib


def _write_maps(path: Path, libraries) -> None:
    lines = ["7f00-7f01 r--p 00000000 00:00 0 \n"]  # an anonymous mapping: no path
    for i, lib in enumerate(libraries):
        lines.append(f"7f{i}0-7f{i}1 r-xp 00000000 08:01 {1000 + i}    {lib}\n")
    path.write_text("".join(lines))


def _libc_path() -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and Path(fields[5].strip()).name.startswith("libc.so"):
                return fields[5].strip()
    pytest.skip("libc is not mapped from a file in this process")


def test_nothing_found_lists_every_path_tried(clean_env, monkeypatch):
    ghost = clean_env / "gone" / "libnccl.so.2"
    _write_maps(clean_env / "maps", [str(ghost), "/usr/lib/libm.so.6"])
    with pytest.raises(RuntimeError) as info:
        _nccl.load()
    message = str(info.value)
    assert "DK_NCCL_LIBRARY" in message and "nvidia-nccl-cu12" in message
    assert f"{ghost} (loaded by this process): not found" in message
    assert "libm" not in message


def test_wheel_comes_before_mapped_library(clean_env, monkeypatch):
    lib = _fake_wheel(monkeypatch, clean_env / "site")
    mapped = clean_env / "libnccl.so.2.99.0"
    _write_maps(clean_env / "maps", [str(mapped)])
    found = _nccl.candidates()
    paths = [path for _, path in found]
    assert str(lib) in paths and str(mapped) in paths
    assert paths.index(str(lib)) < paths.index(str(mapped))


def test_environment_variable_overrides_everything(clean_env, monkeypatch):
    _fake_wheel(monkeypatch, clean_env / "site")
    chosen = clean_env / "mine" / "libnccl.so.2"
    chosen.parent.mkdir()
    chosen.write_bytes(b"")
    monkeypatch.setenv(_nccl.ENV_VAR, str(chosen))
    assert _nccl.candidates() == [(_nccl.ENV_VAR, str(chosen))]


@pytest.mark.parametrize("value", ["libnccl.so.2", "relative/libnccl.so.2"])
def test_environment_variable_must_be_absolute(clean_env, monkeypatch, value):
    monkeypatch.setenv(_nccl.ENV_VAR, value)
    with pytest.raises(ValueError, match="must be an absolute path"):
        _nccl.load()


def test_environment_variable_must_exist(clean_env, monkeypatch):
    missing = clean_env / "nowhere" / "libnccl.so.2"
    monkeypatch.setenv(_nccl.ENV_VAR, str(missing))
    with pytest.raises(ValueError, match="no such file") as info:
        _nccl.load()
    assert str(missing) in str(info.value)


def test_empty_file_is_a_clear_error(clean_env, monkeypatch):
    _skip_if_real_nccl_loaded()
    fake = clean_env / "libnccl.so.2"
    fake.write_bytes(b"")
    monkeypatch.setenv(_nccl.ENV_VAR, str(fake))
    with pytest.raises(RuntimeError, match="cannot load NCCL from") as info:
        _nccl.load()
    assert str(fake) in str(info.value)


def test_library_without_nccl_symbols_names_the_symbol(clean_env, monkeypatch):
    _skip_if_real_nccl_loaded()
    libc = _libc_path()
    monkeypatch.setenv(_nccl.ENV_VAR, libc)
    with pytest.raises(RuntimeError, match="symbol ncclGetVersion not found") as info:
        _nccl.load()
    assert libc in str(info.value)


def test_fake_wheel_failure_is_listed_with_its_reason(clean_env, monkeypatch):
    _skip_if_real_nccl_loaded()
    lib = _fake_wheel(monkeypatch, clean_env / "site")
    with pytest.raises(RuntimeError) as info:
        _nccl.load()
    assert f"{lib} (nvidia-nccl wheel): " in str(info.value)
    assert "cannot load NCCL from" in str(info.value)


def test_describe_never_raises(clean_env, monkeypatch):
    assert _nccl.describe() == {"nccl_library": None, "nccl_version": None}
    monkeypatch.setenv(_nccl.ENV_VAR, "not/absolute")
    assert _nccl.describe() == {"nccl_library": None, "nccl_version": None}


def test_binding_rejects_relative_path():
    with pytest.raises(ValueError, match="absolute"):
        _C.nccl_load("libnccl.so.2")


def test_build_info_reports_nccl_keys():
    import dist_kernels

    info = dist_kernels.build_info()
    assert "nccl_library" in info and "nccl_version" in info
    if info["nccl_library"] is not None:
        assert info["nccl_version"].startswith("2.")


# -- a fake NCCL built from C: the success path, in a fresh process each (one NCCL per process) --

FAKE_NCCL_SOURCE = Path(__file__).resolve().parent / "fake_nccl.c"


def _build_fake_nccl(tmp_path: Path, name: str, *defines: str) -> Path:
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a fake NCCL")
    lib = tmp_path / name / "libnccl.so.2"
    lib.parent.mkdir()
    flags = [f"-D{d}" for d in defines]
    command = [compiler, "-shared", "-fPIC", "-pthread", *flags, "-o", str(lib)]
    subprocess.run([*command, str(FAKE_NCCL_SOURCE)], check=True)
    return lib


def _in_fresh_process(code: str, **env: str):
    import os
    import subprocess

    full_env = {**os.environ, **env}
    full_env.pop(_nccl.ENV_VAR, None)
    full_env.update(env)
    root = str(Path(__file__).resolve().parent.parent)
    full_env["PYTHONPATH"] = root + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120
    )


def test_fake_nccl_loads_and_reports_its_version(tmp_path):
    lib = _build_fake_nccl(tmp_path, "v22805", "VERSION=22805")
    other = _build_fake_nccl(tmp_path, "v22106", "VERSION=22106")
    code = (
        "from dist_kernels import _C\nfrom dist_kernels.comm import nccl as _nccl\n"
        "print(_nccl.load())\n"
        "print(_nccl.describe())\n"
        f"try:\n    _C.nccl_load({str(other)!r})\nexcept ValueError as e:\n    print('ERR', e)\n"
        f"print(_C.nccl_load({str(lib)!r}))\n"
    )
    result = _in_fresh_process(code, DK_NCCL_LIBRARY=str(lib))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == str((str(lib), "2.28.5"))
    assert lines[1] == str({"nccl_library": str(lib), "nccl_version": "2.28.5"})
    assert (
        lines[2].startswith("ERR") and "already loaded from" in lines[2] and str(other) in lines[2]
    )
    assert lines[3] == "2.28.5"  # the same path again is fine


def test_too_old_nccl_is_refused_with_its_version(tmp_path):
    lib = _build_fake_nccl(tmp_path, "v2708", "VERSION=2708")  # NCCL's pre-2.9 encoding
    result = _in_fresh_process(
        "from dist_kernels.comm import nccl; nccl.load()", DK_NCCL_LIBRARY=str(lib)
    )
    assert result.returncode != 0
    assert "NCCL 2.7.8" in result.stderr and "too old" in result.stderr


def test_fake_nccl_missing_a_symbol_names_it(tmp_path):
    lib = _build_fake_nccl(tmp_path, "partial", "VERSION=22805", "DROP_BROADCAST")
    result = _in_fresh_process(
        "from dist_kernels.comm import nccl; nccl.load()", DK_NCCL_LIBRARY=str(lib)
    )
    assert result.returncode != 0
    assert "symbol ncclBroadcast not found" in result.stderr and str(lib) in result.stderr


# -- NCCL's errors through the fake: abort, asynchronous errors, timeouts, NCCL's messages ------

_WATCH_PRELUDE = """
import ctypes, json, time
from dist_kernels import _C
from dist_kernels.comm import nccl as _nccl
from dist_kernels.comm.cuda import NcclWatch
from dist_kernels.errors import CommError
path, _ = _nccl.load()
fake = ctypes.CDLL(path)  # the same handle: the tests steer the library dist_kernels loaded
out = {}
def new_comm(rank=1):
    # Host memory (device -1, stream 0): no CUDA device is bound. One lane, 4 slots of 256 B.
    return _C.NcclCommunicator([_C.nccl_unique_id()], rank, 2, -1, 0, 256, 4)
def error_of(call):
    try:
        call()
    except CommError as error:
        return str(error)
    return None
"""


def _run_watch_case(tmp_path, body: str, *defines: str) -> dict:
    import json

    lib = _build_fake_nccl(tmp_path, "watch", "VERSION=22805", *defines)
    result = _in_fresh_process(
        _WATCH_PRELUDE + body + "\nprint(json.dumps(out))", DK_NCCL_LIBRARY=str(lib)
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_async_error_aborts_and_names_rank_operation_and_nccl_message(tmp_path):
    out = _run_watch_case(
        tmp_path,
        """
comm = new_comm(rank=1)
watch = NcclWatch(comm, comm.rank)
watch.check("all_reduce")  # nothing reported yet: no error
out["before"] = fake.fake_abort_count()
fake.fake_set_async_error(6)
fake.fake_set_last_error(b"socket to peer rank 0 closed")
out["error"] = error_of(lambda: watch.wait(lambda: False, 30.0, "all_reduce"))
out["aborts"] = fake.fake_abort_count()
out["closed"] = comm.closed
out["later"] = error_of(lambda: watch.check("broadcast"))
""",
    )
    assert out["before"] == 0
    error = out["error"]
    assert error.startswith("[rank 1] all_reduce: NCCL reported an asynchronous error"), error
    assert "NCCL error 6 (fake remote error)" in error, error
    assert "socket to peer rank 0 closed" in error, error  # ncclGetLastError's words
    assert "aborted" in error
    assert out["aborts"] == 1 and out["closed"] is True
    assert out["later"].startswith("[rank 1] broadcast: the communicator was aborted"), out
    assert "earlier failure" in out["later"]


def test_wait_times_out_aborts_and_raises_comm_error(tmp_path):
    out = _run_watch_case(
        tmp_path,
        """
comm = new_comm(rank=0)
watch = NcclWatch(comm, 0)
start = time.monotonic()
out["error"] = error_of(lambda: watch.wait(lambda: False, 0.3, "barrier"))
out["seconds"] = time.monotonic() - start
out["aborts"] = fake.fake_abort_count()
polls = []
done = lambda: polls.append(1) or len(polls) > 5  # finishes on the sixth poll
out["done_error"] = error_of(lambda: NcclWatch(new_comm(), 1).wait(done, 30.0, "x"))
out["polls"] = len(polls)
out["aborts_after_done"] = fake.fake_abort_count()
""",
    )
    assert out["error"].startswith("[rank 0] barrier: not finished after 0.3 s (timeout)"), out
    assert "aborted" in out["error"]
    assert 0.3 <= out["seconds"] < 5.0, out
    assert out["aborts"] == 1
    assert out["done_error"] is None and out["polls"] == 6  # a wait that ends is no error
    assert out["aborts_after_done"] == 1


def test_failed_nccl_call_carries_nccl_last_error(tmp_path):
    out = _run_watch_case(
        tmp_path,
        """
comm = new_comm(rank=1)
fake.fake_set_call_result(5)
fake.fake_set_last_error(b"invalid usage: count mismatch seen by rank 1")
out["error"] = error_of(lambda: comm.all_reduce(0, 0, 4, 0, 0, 4))  # 4: algorithm "nccl"
out["later"] = error_of(lambda: comm.all_reduce(0, 0, 0, 0, 0, 1))  # ring: refused at once
""",
    )
    error = out["error"]
    assert error.startswith("[rank 1] all_reduce: "), error
    assert "failed earlier and cannot be used" in out["later"], out  # the first failure poisons
    assert "failed: NCCL error 5 (fake error)" in error
    assert "NCCL's last error: invalid usage: count mismatch seen by rank 1" in error


def test_nccl_without_get_last_error_still_loads_and_reports(tmp_path):
    """ncclGetLastError came in NCCL 2.13: an older library loads, and errors say less."""
    out = _run_watch_case(
        tmp_path,
        """
comm = new_comm(rank=0)
out["last"] = comm.last_error()
fake.fake_set_async_error(6)
out["async"] = comm.async_error()
""",
        "DROP_LAST_ERROR",
    )
    assert out["last"] == ""
    assert out["async"] == "NCCL error 6 (fake remote error)"
