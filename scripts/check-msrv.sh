#!/usr/bin/env bash
# The workspace's `rust-version` (its MSRV) is true: no package the locked build compiles, the
# workspace's own and every dependency (normal, build and dev, of every member and feature), asks
# for a newer Rust; and the toolchain that builds here is the MSRV itself, so every build of
# `.ci/run` is a build with the MSRV. Fails naming each package that asks for more, or the
# toolchain when it is not the MSRV (a newer one would build code the MSRV cannot, unseen).
#
#   bash scripts/check-msrv.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cargo metadata --format-version 1 --locked --all-features | python3 -c '
import json, re, subprocess, sys

def version(text):
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))

meta = json.load(sys.stdin)
members = set(meta["workspace_members"])
ours = {p["rust_version"] for p in meta["packages"] if p["id"] in members}
if len(ours) != 1 or None in ours:
    sys.exit(f"check-msrv: the workspace members do not share one rust-version: {sorted(map(str, ours))}")
msrv = ours.pop()
# The packages of the resolved graph (what the lock file builds), not every version listed.
built = {node["id"] for node in meta["resolve"]["nodes"]}
newer = sorted(
    (p["name"], p["version"], p["rust_version"])
    for p in meta["packages"]
    if p["id"] in built and p.get("rust_version") and version(p["rust_version"]) > version(msrv)
)
for name, ver, rv in newer:
    print(f"check-msrv: {name} {ver} asks for Rust {rv}, newer than the workspace rust-version {msrv}")
rustc = subprocess.run(["rustc", "--version"], capture_output=True, text=True, check=True).stdout.split()[1]
if version(rustc)[:2] != version(msrv)[:2]:
    print(f"check-msrv: this toolchain is Rust {rustc}, not the MSRV {msrv}: the build here does not show that {msrv} builds the workspace")
    sys.exit(1)
if newer:
    sys.exit(1)
print(f"check-msrv: rust-version {msrv}; no package of the locked build asks for more; built here with rustc {rustc}")
'
