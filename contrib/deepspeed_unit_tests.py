"""Run DeepSpeed's own CPU-capable unit-test files under zkit's drop-in and under real DeepSpeed,
and print the pass/fail/skip counts side by side, one file a row.

    git -C <DeepSpeed clone> archive HEAD tests | tar -x -C /tmp/ds-src
    python contrib/deepspeed_unit_tests.py --src /tmp/ds-src            # both sides
    python contrib/deepspeed_unit_tests.py --src /tmp/ds-src --side zkit --json out.json

``--src`` (or ``ZKIT_DEEPSPEED_SRC``) is a DeepSpeed source tree holding ``tests/unit``; it is never
copied into this repository. The drop-in side runs ``.venv/bin/python`` (zkit and the ``deepspeed``
drop-in), the DeepSpeed side ``.venv-peers/bin/python`` (DeepSpeed 0.19.8, with pytest). Both run
with ``DS_ACCELERATOR=cpu`` from ``<src>/tests``, as DeepSpeed's own CPU workflow does
(``cd tests; pytest unit/``): its ``DistributedTest`` starts the ranks itself (forkserver
processes, gloo on CPU), so no launcher is needed.

Which files are run (``CPU_CAPABLE_FILES``) and what real DeepSpeed gives on them
(``zkit_deepspeed.unit_tests.DEEPSPEED_RESULTS``, with the reason for each difference) are
checked in; ``docs/deepspeed-coverage.md`` shows both.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "zkit-deepspeed" / "src"))

from zkit_deepspeed.unit_tests import CPU_CAPABLE_FILES, FileResult  # noqa: E402

INTERPRETERS = {"zkit": ROOT / ".venv" / "bin" / "python", "deepspeed": ROOT / ".venv-peers" / "bin" / "python"}


def run_file(python: Path, src: Path, test_file: str, timeout: float) -> FileResult:
    """One file's counts, from pytest's JUnit XML."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "junit.xml"
        cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}",
               f"unit/{test_file}"]
        try:
            proc = subprocess.run(cmd, cwd=src / "tests", env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return FileResult(errors=1, note=f"timed out after {timeout:.0f} s")
        if not xml_path.exists():
            lines = (proc.stdout + proc.stderr).strip().splitlines() or [f"exit status {proc.returncode}"]
            return FileResult(errors=1, note=lines[-1][:200])
        return parse_junit(xml_path)


def parse_junit(xml_path: Path) -> FileResult:
    """Counts of one pytest run. A file that does not import is one collection error (``errors``),
    its note the error's last line; a test whose set-up fails counts as failed, as pytest's
    summary line would not (it says "error"), because for this comparison both mean "not passed"."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    note = ""
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        error, failure = case.find("error"), case.find("failure")
        bad = error if error is not None else failure
        if error is not None and "collection failure" in (error.get("message") or ""):
            counts["errors"] += 1
            text = (error.text or "").strip().splitlines()
            note = note or (text[-1][:200] if text else "collection failure")
        elif bad is not None:
            counts["failed"] += 1
            message = (bad.get("message") or "").strip().splitlines()
            note = note or f"{case.get('name')}: {message[0][:160] if message else ''}"
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return FileResult(note=note, **counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default=os.environ.get("ZKIT_DEEPSPEED_SRC"),
                        help="a DeepSpeed source tree holding tests/unit (default: $ZKIT_DEEPSPEED_SRC)")
    parser.add_argument("--side", choices=["zkit", "deepspeed", "both"], default="both")
    parser.add_argument("--files", nargs="*", default=list(CPU_CAPABLE_FILES),
                        help="paths under tests/unit (default: the CPU-capable files)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per file and side")
    parser.add_argument("--json", help="also write the counts here")
    args = parser.parse_args(argv)
    if not args.src or not (Path(args.src) / "tests" / "unit").is_dir():
        parser.error("--src (or ZKIT_DEEPSPEED_SRC) must name a DeepSpeed source tree holding tests/unit")
    src = Path(args.src).resolve()
    sides = ["zkit", "deepspeed"] if args.side == "both" else [args.side]
    for side in sides:
        if not INTERPRETERS[side].exists():
            parser.error(f"{INTERPRETERS[side]} is missing (`make setup` / `make peers` builds it)")
    results: dict[str, dict[str, dict]] = {}
    print(f"{'file':58} " + " ".join(f"{s + ' p/f/s/e':>22}" for s in sides))
    for test_file in args.files:
        row = {side: run_file(INTERPRETERS[side], src, test_file, args.timeout) for side in sides}
        results[test_file] = {side: r.as_dict() for side, r in row.items()}
        differs = "  (differs)" if len(sides) == 2 and row["zkit"] != row["deepspeed"] else ""
        print(f"{test_file:58} " + " ".join(f"{row[s].counts():>22}" for s in sides) + differs, flush=True)
        for side in sides:
            if row[side].note and (row[side].errors or row[side].failed):
                print(f"    {side}: {row[side].note}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
