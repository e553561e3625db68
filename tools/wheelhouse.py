#!/usr/bin/env python
"""A folder of wheels for a machine without package access: requirements.txt with everything it pulls in, and the
project itself; torch left out by default (a GPU node has its own build, and NVIDIA's CUDA wheels with it).

    python tools/wheelhouse.py --out wheels [--with-torch] [--python-version 3.12 --platform manylinux2014_x86_64]
    make wheelhouse [WHEELHOUSE=wheels] [WITH_TORCH=1]       then on the node: make setup WHEELS=wheels

What pip would install is resolved once (`pip install --dry-run --ignore-installed --report`, torch pinned as the
Makefile installs it, so the rest resolves as it does here), then each package is downloaded by name and version
(`pip download --no-deps`, binary wheels only where --platform is given). On the node, `make setup WHEELS=DIR`
creates the venv with the system's packages visible (its torch) and installs with `pip --no-index --find-links DIR`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = "torch==2.13.0"   # the Makefile's
LEFT_OUT = ("torch", "nvidia-", "triton")   # torch and what comes with a CUDA build of it


def resolve(requirements: str, with_torch: bool) -> list[tuple[str, str]]:
    """[(name, version)] of everything `pip install -r requirements` would install on an empty machine."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report",
                        report, TORCH, "-r", requirements, "setuptools", "wheel"], check=True)
        items = json.load(open(report))["install"]
    out = [(i["metadata"]["name"], i["metadata"]["version"]) for i in items]
    return [(n, v) for n, v in out if with_torch or not n.lower().startswith(LEFT_OUT)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "wheels"), help="folder of the wheels (default wheels/)")
    ap.add_argument("--requirements", default=os.path.join(ROOT, "requirements.txt"))
    ap.add_argument("--with-torch", action="store_true", help=f"include {TORCH} (this machine's build) and its wheels")
    ap.add_argument("--python-version", help="the node's Python, e.g. 3.12 (binary wheels only)")
    ap.add_argument("--platform", action="append", help="the node's platform tag, e.g. manylinux2014_x86_64 "
                                                        "(repeatable; binary wheels only)")
    a = ap.parse_args(argv)
    if not os.path.isfile(a.requirements):
        print(f"error: {a.requirements} does not exist", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    packages = resolve(a.requirements, a.with_torch)
    print(f"{len(packages)} packages to {a.out}" + ("" if a.with_torch else " (torch left out)"), flush=True)
    target = []
    if a.python_version or a.platform:
        target = ["--only-binary=:all:"] + (["--python-version", a.python_version] if a.python_version else []) + \
            [x for p in a.platform or [] for x in ("--platform", p)]
    for k, (name, version) in enumerate(packages, 1):
        print(f"[{k}/{len(packages)}] {name}=={version}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", a.out, *target,
                        f"{name}=={version}"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", a.out,
                    ROOT], check=True)   # the project itself
    print(f"wrote {len(os.listdir(a.out))} files to {a.out}; on the node: make setup WHEELS={a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
