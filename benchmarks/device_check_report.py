"""The device check's report: benchmarks/device_check.sh calls this after every step.

    python benchmarks/device_check_report.py STEPS_TSV GPU BUDGET_S ELAPSED_S FINAL DIR [DIR...]

Reads the steps recorded so far (``name, status, rc, seconds, limit, log file, command``, one
tab-separated line each) and writes ``<date>-<gpu>.md`` (a summary table, then each step's
output) and ``.json`` (every step's command, status, exit code, seconds, limit and full output)
into every DIR. Run after each step, so a check stopped by its time limit still leaves a report
of what ran. Prints the written base name. Standard library only.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from typing import Dict, List

#: Step output kept in the Markdown (the JSON keeps all of it).
MD_OUTPUT_CHARS = 20000
#: A step that ran but did not pass, and what each status means.
STATUS_WORDS = {
    "ok": "passed",
    "failed": "exited non-zero",
    "timeout": "ran out of its time limit and was killed",
    "skipped": "not run (an earlier step it needs failed)",
    "missing": "not in this checkout (not a failure)",
}


def read_steps(path: str) -> List[Dict]:
    steps = []
    with open(path) as lines:
        for line in lines:
            name, status, rc, secs, limit, log, command = line.rstrip("\n").split("\t", 6)
            try:
                with open(log, errors="replace") as f:
                    output = f.read()
            except OSError:
                output = ""
            steps.append(
                {
                    "name": name,
                    "status": status,
                    "rc": int(rc),
                    "seconds": int(secs),
                    "limit_s": int(limit),
                    "command": command,
                    "output": output,
                }
            )
    return steps


def passed(steps: List[Dict]) -> bool:
    return all(s["status"] in ("ok", "missing") for s in steps)


def markdown(report: Dict) -> str:
    steps = report["steps"]
    if report["final"]:
        result = "passed" if report["passed"] else "FAILED"
    else:
        result = "running (partial report: written after every step)"
    lines = [
        f"# Device check, {report['date']}, {report['gpu']}",
        "",
        f"Result: **{result}** after {report['seconds']} s of a {report['budget_s']} s budget "
        "(`bash benchmarks/device_check.sh`; every step's full output is in the JSON beside).",
        "",
        "| step | status | rc | seconds | limit |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {s['name']} | {s['status']} | {s['rc']} | {s['seconds']} | {s['limit_s']} |"
        for s in steps
    ]
    for s in steps:
        lines += [
            "",
            f"## {s['name']}: {s['status']} ({STATUS_WORDS.get(s['status'], s['status'])})",
            "",
            f"`{s['command']}`",
            "",
            "```",
            s["output"].rstrip()[-MD_OUTPUT_CHARS:],
            "```",
        ]
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> int:
    steps_file, gpu, budget, elapsed, final, *dirs = argv
    steps = read_steps(steps_file)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "unknown-gpu"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    report = {
        "date": date,
        "gpu": gpu,
        "final": final == "1",
        "passed": passed(steps),
        "seconds": int(elapsed),
        "budget_s": int(budget),
        "steps": steps,
    }
    base = f"{date}-{slug}"
    for directory in dirs:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, base)
        # Write then rename, so a check killed mid-write leaves the previous complete report.
        for suffix, text in ((".json", json.dumps(report, indent=2)), (".md", markdown(report))):
            with open(path + suffix + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + suffix + ".tmp", path + suffix)
    print(base)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
