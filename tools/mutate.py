#!/usr/bin/env python3
"""Planted-bug (mutation) check of the test suite: does each listed bug make its tests fail?

    python tools/mutate.py                     # every mutation of tools/mutations.toml
    python tools/mutate.py --only ddp-avg-divisor,zero-shard-boundary
    python tools/mutate.py --check             # patterns still match? (no test runs)
    python tools/mutate.py --report benchmarks/results/<date>-mutations.md

Each entry of the list (``tools/mutations.toml``) names a file, a literal ``pattern`` that must
occur there exactly ``count`` times (default 1), its ``replacement``, the ``tests`` (pytest
node ids) that must catch it, and ``why`` it is a bug worth catching.

The working tree is never touched. The tree is copied into a scratch directory (default
``build/mutate/tree``, ignored by git) and every mutation is applied there, one at a time, and
undone afterwards, on Ctrl-C too. The scratch copy keeps its own build directory, so the C++
extension is rebuilt incrementally: a C++ mutation recompiles the files it touches (and the
file the previous one restored), a Python mutation reuses the last build. Python mutations run
first, so the pristine build serves all of them.

Per mutation: ``caught`` (its tests failed), ``MISSED`` (they passed), ``pattern not found``
(the code changed under the list: update the entry), ``error`` (the mutated tree did not
compile or build, or pytest could not run the tests: not a catch), ``timeout``. Before any
mutation the union of the named tests runs once on the pristine copy; if it fails, no verdict
can mean anything and the run stops. Exit status 0 only when every mutation was caught.

On the shared development machine, run it under ``/work/bin/dk-isolated`` like the tests.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_LIST = os.path.join(ROOT, "tools", "mutations.toml")
DEFAULT_WORKDIR = os.path.join(ROOT, "build", "mutate")
NATIVE_SUFFIXES = (".cc", ".cu", ".cuh", ".h", ".txt")  # C++ / CUDA sources, CMakeLists
FIELDS = ("id", "file", "pattern", "replacement", "tests", "why")


class ListError(ValueError):
    """The mutation list is malformed."""


class PatternNotFound(LookupError):
    """A mutation's pattern does not occur in its file as often as the list says."""


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    pattern: str
    replacement: str
    tests: Sequence[str]
    why: str
    count: int = 1

    @property
    def native(self) -> bool:
        """A C++ / CUDA / CMake change: the extension must be rebuilt."""
        return self.file.startswith("csrc/") or self.file.endswith(NATIVE_SUFFIXES)

    def apply(self, text: str) -> str:
        """``text`` with the pattern replaced; raises :class:`PatternNotFound` when the pattern
        does not occur exactly ``count`` times."""
        found = text.count(self.pattern)
        if found != self.count:
            raise PatternNotFound(
                f"pattern not found in {self.file}"
                if found == 0
                else f"pattern found {found} times in {self.file}, expected {self.count}"
            )
        return text.replace(self.pattern, self.replacement)


@dataclass
class Outcome:
    mutation: Mutation
    status: str  # caught | MISSED | pattern not found | error | timeout
    seconds: float = 0.0
    detail: str = ""  # the first failing test, or what went wrong
    log: str = field(default="", repr=False)

    @property
    def caught(self) -> bool:
        return self.status == "caught"


def load_mutations(path: str) -> List[Mutation]:
    """The list in ``path``, checked: every field present and non-empty, ids unique."""
    with open(path, "rb") as f:
        entries = tomllib.load(f).get("mutation", [])
    if not entries:
        raise ListError(f"{path}: no [[mutation]] entries")
    mutations, seen = [], set()
    for i, entry in enumerate(entries):
        missing = [k for k in FIELDS if not entry.get(k) and k != "replacement"]
        unknown = sorted(set(entry) - set(FIELDS) - {"count"})
        if missing or unknown or "replacement" not in entry:
            raise ListError(
                f"{path}: entry {i} ({entry.get('id', '?')}): missing {missing or ['replacement']}"
                if missing or "replacement" not in entry
                else f"{path}: entry {i} ({entry['id']}): unknown fields {unknown}"
            )
        if entry["id"] in seen:
            raise ListError(f"{path}: duplicate id {entry['id']!r}")
        if entry["pattern"] == entry["replacement"]:
            raise ListError(f"{path}: {entry['id']}: replacement equals the pattern")
        seen.add(entry["id"])
        mutations.append(Mutation(**{**entry, "tests": tuple(entry["tests"])}))
    return mutations


def classify(returncode: int) -> str:
    """pytest's exit status as a verdict: 1 = some test failed (caught), 0 = all passed
    (missed); anything else (interrupted, internal error, usage error such as a test id that
    does not exist, no tests collected) says nothing about the mutation."""
    return {0: "MISSED", 1: "caught"}.get(returncode, "error")


def first_failure(output: str) -> str:
    """The first ``FAILED`` / ``ERROR`` node id of pytest's short summary, if any."""
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return match.group(1) if match else ""


# ----------------------------------------------------------------------------- scratch tree


def tree_files(root: str) -> List[str]:
    """Files of the working tree as git sees them: tracked, plus untracked but not ignored."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout
    return sorted(
        p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(root, p))
    )


def _same_bytes(a: str, b: str) -> bool:
    if not os.path.exists(b) or os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def sync_tree(src: str, dst: str) -> None:
    """Makes ``dst`` a copy of ``src``'s files; unchanged files keep their timestamps (so the
    scratch build stays incremental); files gone from ``src`` are removed, build outputs and
    the compiled extension are kept."""
    wanted = tree_files(src)
    for rel in wanted:
        a, b = os.path.join(src, rel), os.path.join(dst, rel)
        if not _same_bytes(a, b):
            os.makedirs(os.path.dirname(b), exist_ok=True)
            shutil.copyfile(a, b)  # a fresh timestamp: newer than objects of an older copy
            shutil.copymode(a, b)
    keep = set(wanted)
    for dirpath, dirnames, filenames in os.walk(dst):
        rel_dir = os.path.relpath(dirpath, dst)
        if rel_dir.split(os.sep)[0] in ("build", ".git"):
            dirnames[:] = []
            continue
        if os.path.basename(dirpath) == "__pycache__":
            shutil.rmtree(dirpath)
            dirnames[:] = []
            continue
        for name in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel not in keep and not re.match(r"dist_kernels/_C.*\.so$", rel):
                os.remove(os.path.join(dirpath, name))


class Scratch:
    """The scratch copy: applies one mutation at a time and always restores the file."""

    def __init__(self, workdir: str, log) -> None:
        self.tree = os.path.join(workdir, "tree")
        self.log = log
        self._saved: Optional[tuple] = None
        self.pristine_build = False  # the extension was last built from unmutated sources

    def path(self, rel: str) -> str:
        return os.path.join(self.tree, rel)

    def apply(self, m: Mutation) -> None:
        with open(self.path(m.file), encoding="utf-8") as f:
            original = f.read()
        mutated = m.apply(original)
        self._saved = (m.file, original)
        with open(self.path(m.file), "w", encoding="utf-8") as f:
            f.write(mutated)

    def restore(self) -> None:
        if self._saved is not None:
            rel, original = self._saved
            with open(self.path(rel), "w", encoding="utf-8") as f:
                f.write(original)
            self._saved = None

    def build(self, cuda: bool) -> Optional[str]:
        """Rebuilds the extension in place (incrementally); returns the log tail on failure."""
        env = dict(os.environ, PYTHON=sys.executable)
        if not cuda:
            env["DK_WITH_CUDA"] = "0"
        start = time.monotonic()
        proc = subprocess.run(
            ["bash", "tools/dev_build.sh"],
            cwd=self.tree,
            env=env,
            capture_output=True,
            text=True,
        )
        self.log(f"  build: {time.monotonic() - start:.0f} s")
        if proc.returncode != 0:
            return (proc.stdout + proc.stderr)[-3000:]
        return None


# ----------------------------------------------------------------------------- running tests


class Runner:
    """Runs pytest on node ids inside the scratch tree, in a process group of its own."""

    def __init__(self, tree: str, timeout: float, pytest_args: Sequence[str]) -> None:
        self.tree, self.timeout, self.pytest_args = tree, timeout, list(pytest_args)
        self.proc: Optional[subprocess.Popen] = None

    def run(self, tests: Sequence[str], stop_first: bool = True) -> tuple:
        """``(returncode or None on timeout, output)``."""
        env = dict(os.environ, PYTHONPATH=self.tree, PYTHONDONTWRITEBYTECODE="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd += (["-x"] if stop_first else []) + self.pytest_args + list(tests)
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.tree,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = self.proc.communicate(timeout=self.timeout)
            return self.proc.returncode, out
        except subprocess.TimeoutExpired:
            self.kill()
            out, _ = self.proc.communicate()
            return None, out
        except BaseException:  # Ctrl-C: its own session does not get the SIGINT, so end it
            self.kill()
            self.proc.wait()
            raise
        finally:
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_one(m: Mutation, scratch: Scratch, runner: Runner, cuda: bool) -> Outcome:
    start = time.monotonic()

    def done(status: str, detail: str = "", log: str = "") -> Outcome:
        return Outcome(m, status, time.monotonic() - start, detail, log)

    try:
        scratch.apply(m)
    except PatternNotFound as e:
        return done("pattern not found", str(e))
    try:
        if m.file.endswith(".py"):
            try:
                with open(scratch.path(m.file), encoding="utf-8") as f:
                    compile(f.read(), m.file, "exec")
            except SyntaxError as e:
                return done("error", f"the mutated file does not compile: {e}")
        if m.native or not scratch.pristine_build:
            failure = scratch.build(cuda)
            scratch.pristine_build = failure is None and not m.native
            if failure is not None:
                return done("error", "the extension does not build", failure)
        code, out = runner.run(m.tests)
    finally:
        scratch.restore()
    if code is None:
        return done("timeout", f"tests ran past {runner.timeout:.0f} s", out[-3000:])
    status = classify(code)
    detail = first_failure(out) if status == "caught" else ""
    if status == "error":
        detail = f"pytest exit status {code}"
    return done(status, detail, out[-3000:])


def ordered(mutations: Sequence[Mutation]) -> List[Mutation]:
    """Python mutations first (one pristine build serves them), then C++ ones by file."""
    return sorted(mutations, key=lambda m: (m.native, m.file if m.native else ""))


# ----------------------------------------------------------------------------- reports


def table(outcomes: Sequence[Outcome]) -> str:
    width = max([len(o.mutation.id) for o in outcomes] + [8])
    lines = [f"{'mutation':{width}s}  {'result':17s} {'seconds':>7s}  caught by / detail"]
    for o in outcomes:
        lines.append(f"{o.mutation.id:{width}s}  {o.status:17s} {o.seconds:7.0f}  {o.detail}")
    return "\n".join(lines)


def summary(outcomes: Sequence[Outcome], total: int) -> str:
    counts: Dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    parts = [f"{n} {status}" for status, n in sorted(counts.items())]
    left = total - len(outcomes)
    return (
        f"{len(outcomes)} of {total} mutations run: "
        + ", ".join(parts)
        + (f" ({left} not run)" if left else "")
    )


def machine() -> str:
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return f"{platform.node()}, {os.cpu_count()} cpus, {platform.platform()}, load {load}"


def tree_version(root: str) -> str:
    """The commit the scratch copy was taken from, and whether the tree had changes on top."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"{head} (with uncommitted changes)" if dirty else head


def write_report(
    path: str, outcomes, total: int, command: str, started: str, started_on: str
) -> None:
    lines = [
        "# Mutation check: planted bugs against the test suite",
        "",
        f"- Date: {started} to {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- Machine at the start: {started_on}",
        f"- Machine at the end: {machine()}",
        f"- Tree: {tree_version(ROOT)}",
        f"- Command: `{command}`",
        f"- Result: {summary(outcomes, total)}",
        "",
        "| mutation | file | result | s | caught by / detail | why it is a bug |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        m = o.mutation
        why = m.why.replace("|", "\\|").replace("\n", " ")
        detail = o.detail.replace("|", "\\|")
        lines.append(f"| `{m.id}` | `{m.file}` | {o.status} | {o.seconds:.0f} | {detail} | {why} |")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------- main


def check_patterns(mutations: Sequence[Mutation], root: str) -> int:
    """Prints whether each pattern still matches the working tree; returns the stale count."""
    stale = 0
    for m in mutations:
        try:
            with open(os.path.join(root, m.file), encoding="utf-8") as f:
                m.apply(f.read())
            missing = [
                t for t in m.tests if not os.path.isfile(os.path.join(root, t.split("::")[0]))
            ]
            status = f"test file missing: {missing}" if missing else "ok"
        except FileNotFoundError:
            status = f"file not found: {m.file}"
        except PatternNotFound as e:
            status = str(e)
        stale += status != "ok"
        print(f"{m.id:40s} {status}")
    return stale


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", default=DEFAULT_LIST, help="the mutation list (TOML)")
    p.add_argument("--only", default="", help="comma-separated ids to run")
    p.add_argument("--check", action="store_true", help="check the patterns only, run nothing")
    p.add_argument("--workdir", default=DEFAULT_WORKDIR, help="scratch copy and its build")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per mutation's tests")
    p.add_argument("--no-baseline", action="store_true", help="skip the pristine run")
    p.add_argument("--cuda", action="store_true", help="build the CUDA sources too")
    p.add_argument("--report", help="write a markdown report here")
    p.add_argument("--json", help="write the outcomes as JSON here")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments (one string)")
    return p.parse_args(argv)


def select(mutations: List[Mutation], only: str) -> List[Mutation]:
    if not only:
        return mutations
    wanted = [s for s in only.split(",") if s]
    known = {m.id for m in mutations}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise SystemExit(f"mutate: unknown ids {unknown}")
    return [m for m in mutations if m.id in wanted]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    # Ctrl-C, and a kill or a CI timeout too, stop the run cleanly (even when started in the
    # background, where a shell leaves SIGINT ignored).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    mutations = select(load_mutations(args.list), args.only)
    if args.check:
        return 1 if check_patterns(mutations, ROOT) else 0
    started, started_on = datetime.datetime.now().isoformat(timespec="seconds"), machine()
    command = "python tools/mutate.py " + " ".join(argv if argv is not None else sys.argv[1:])

    def log(line: str) -> None:
        print(line, flush=True)

    os.makedirs(args.workdir, exist_ok=True)
    lock = open(os.path.join(args.workdir, "lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log(f"mutate: another run is using {args.workdir} (pass another --workdir)")
        return 2
    scratch = Scratch(args.workdir, log)
    runner = Runner(scratch.tree, args.timeout, args.pytest_args.split())
    outcomes: List[Outcome] = []
    try:
        log(f"scratch copy: {scratch.tree}")
        sync_tree(ROOT, scratch.tree)
        failure = scratch.build(args.cuda)
        if failure is not None:
            log(failure)
            return 2
        scratch.pristine_build = True
        if not args.no_baseline:
            union = sorted({t for m in mutations for t in m.tests})
            log(f"baseline: {len(union)} test ids on the pristine copy")
            baseline = Runner(scratch.tree, args.timeout * len(mutations), runner.pytest_args)
            code, out = baseline.run(union, stop_first=False)
            if code != 0:
                log(out[-5000:])
                why = "timed out" if code is None else f"failed (pytest exit status {code})"
                log(f"baseline {why}: fix the tests (or the list) before judging mutations")
                return 2
            log(f"baseline passed: {out.strip().splitlines()[-1]}")
        for i, m in enumerate(ordered(mutations), 1):
            log(f"[{i}/{len(mutations)}] {m.id} ({m.file})")
            outcome = run_one(m, scratch, runner, args.cuda)
            outcomes.append(outcome)
            log(f"  {outcome.status} in {outcome.seconds:.0f} s {outcome.detail}")
            if outcome.status in ("MISSED", "error", "timeout") and outcome.log:
                log("  " + outcome.log[-1500:].replace("\n", "\n  "))
    except KeyboardInterrupt:
        log("interrupted: the tests' processes ended, the scratch copy restored")
    finally:
        scratch.restore()
        if outcomes:
            log("\n" + table(outcomes) + "\n" + summary(outcomes, len(mutations)))
            if args.report:
                write_report(args.report, outcomes, len(mutations), command, started, started_on)
            if args.json:
                with open(args.json, "w") as f:
                    rows = [
                        {"id": o.mutation.id, "status": o.status, "detail": o.detail}
                        for o in outcomes
                    ]
                    json.dump(rows, f, indent=1)
    all_caught = len(outcomes) == len(mutations) and all(o.caught for o in outcomes)
    return 0 if all_caught else 1


if __name__ == "__main__":
    sys.exit(main())
