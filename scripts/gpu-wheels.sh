#!/usr/bin/env bash
# The pure-Python wheels the prepared GPU check needs on the lent GPU machine, built here: hydra-core, omegaconf
# and antlr4-python3-runtime (what `posttrainllm.config.load` composes the sweep with), at the versions this
# checkout's venv has (`pip show`). That machine (/work/.library/device/KINDS.md, nvidia-h200: Python 3.12,
# torch 2.11, triton 3.6, numpy, pandas, matplotlib, pyyaml, packaging) has no network and none of the three.
# Everything else gpucheck imports is there (traced with `python -X importtime -m posttrainllm.lab.gpucheck`
# and an import of every posttrainllm module: torch, triton, numpy, pandas, matplotlib, PyYAML, packaging, ...;
# hydra-submitit-launcher is a Hydra plugin here, found only if installed, and unused by gpucheck).
#
#   scripts/gpu-wheels.sh [DIR] [--offline]     # DIR: .whl by default (ignored by git: /.whl/ in .gitignore)
#
# How: `pip download --only-binary=:all:` for hydra-core and omegaconf (py3-none-any wheels on PyPI) and
# `pip wheel --no-deps --no-build-isolation` for antlr4-python3-runtime 4.9.3 (an sdist on PyPI; pip's cache
# keeps the wheel it built). Where pip cannot reach an index (offline), or with --offline, each wheel is
# repacked from the venv's installed copy instead (its RECORD: the files the wheel installed, minus
# INSTALLER/REQUESTED/direct_url.json and scripts outside site-packages). Then it checks the result the way
# scripts/gpu-check.sh installs it: `pip install --no-index --no-deps --no-compile --target` into a temporary
# folder, and `import hydra, omegaconf; import posttrainllm.lab.gpucheck` with that folder first on PYTHONPATH.
#
# The device call (the `run` tool of this workplace; ~8 minutes of the H200 by lab/approval.py's rough estimate,
# 450 s of point budget plus calibration and compiles; a fresh machine also spends a minute or more starting):
#
#   scripts/gpu-wheels.sh                                     # here, once: writes .whl/*.whl (~0.4 MB)
#   run  command:   scripts/gpu-check.sh "$OUT/gpu" .whl
#        carry:     [".whl"]
#        timeout_s: 600
#
# $OUT/gpu comes back at most two folders down (calibration.json, summary.json, <point>/*.json): import it with
# `posttrainllm receipt import <files_at>/gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=.whl
offline=0
for arg in "$@"; do
  case "$arg" in
    --offline) offline=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) dir=$arg ;;
  esac
done
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
packages=(hydra-core omegaconf antlr4-python3-runtime)

version_of() {  # the installed version, as pip show prints it
  "$py" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'
}

declare -A pinned
for name in "${packages[@]}"; do
  pinned[$name]=$(version_of "$name")
  [ -n "${pinned[$name]}" ] || { echo "gpu-wheels: $name is not installed in $py's environment" >&2; exit 2; }
done

mkdir -p "$dir"
rm -f "$dir"/*.whl

repack() {  # NAME VERSION: a wheel of the installed distribution, from its RECORD
  "$py" - "$1" "$2" "$dir" <<'EOF'
import base64, hashlib, importlib.metadata as md, sys, zipfile
from pathlib import Path

name, version, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
dist = md.distribution(name)
if dist.version != version:
    sys.exit(f"gpu-wheels: {name} {dist.version} installed, {version} asked for")
info = next(p for p in dist.files if p.parts[0].endswith(".dist-info"))
info_dir = info.parts[0]
wheel_meta = dist.read_text("WHEEL") or ""
if "Root-Is-Purelib: true" not in wheel_meta or "py3-none-any" not in wheel_meta:
    sys.exit(f"gpu-wheels: {name} is not a pure-Python py3-none-any distribution:\n{wheel_meta}")
skip = {f"{info_dir}/{n}" for n in ("INSTALLER", "REQUESTED", "RECORD", "direct_url.json")}
norm = dist.metadata["Name"].replace("-", "_").replace(".", "_")
target = out / f"{norm}-{dist.version}-py3-none-any.whl"
record = []
with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as whl:
    for path in sorted(dist.files, key=str):
        rel = path.as_posix()
        if rel.startswith("..") or "__pycache__" in path.parts or rel in skip:
            continue
        data = path.locate().read_bytes()
        whl.writestr(rel, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{rel},sha256={digest},{len(data)}")
    record.append(f"{info_dir}/RECORD,,")
    whl.writestr(f"{info_dir}/RECORD", "\n".join(record) + "\n")
print(f"gpu-wheels: repacked {target.name} from {dist.locate_file('')}")
EOF
}

fetch() {  # NAME VERSION: through pip (index or its cache); 2 minutes at most
  if [ "$1" = antlr4-python3-runtime ]; then
    timeout 120 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$1==$2"
  else
    timeout 120 "$py" -m pip download -q --no-deps --only-binary=:all: -d "$dir" "$1==$2"
  fi
}

for name in "${packages[@]}"; do
  version=${pinned[$name]}
  if [ "$offline" = 0 ] && fetch "$name" "$version" 2>/tmp/gpu-wheels-pip.$$; then
    echo "gpu-wheels: $name $version from pip"
  else
    [ "$offline" = 1 ] || { echo "gpu-wheels: pip could not fetch $name $version (offline?): repacking" >&2;
                            tail -n 2 /tmp/gpu-wheels-pip.$$ >&2 || true; }
    rm -f "$dir"/"$(echo "$name" | tr - _)"-*.whl
    repack "$name" "$version"
  fi
done
rm -f /tmp/gpu-wheels-pip.$$

# -- check: pure Python, needs nothing the GPU machine lacks, installs and imports as gpu-check.sh does it
"$py" - "$dir" <<'EOF'
import re, sys, zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ours = {"hydra-core", "omegaconf", "antlr4-python3-runtime"}
there = {"packaging", "pyyaml", "typing-extensions"}  # on the GPU machine (KINDS.md's nvidia-h200 package list)
target = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}  # its python3
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
names = {}
for w in wheels:
    if not w.name.endswith("-py3-none-any.whl"):
        sys.exit(f"gpu-wheels: {w.name} is not a pure-Python wheel")
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    name = re.search(r"^Name: (.+)$", meta, re.M).group(1).strip().lower().replace("_", "-")
    names[name] = names.get(name, 0) + 1
    python = re.search(r"^Requires-Python: (.+)$", meta, re.M)
    if python and not SpecifierSet(python.group(1).strip()).contains(target["python_full_version"]):
        sys.exit(f"gpu-wheels: {w.name} wants Python {python.group(1).strip()}, the GPU machine has 3.12")
    for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        req = Requirement(line.strip())
        if req.marker is not None and not req.marker.evaluate(target):
            continue  # an extra, or only for another Python
        dep = req.name.lower().replace("_", "-")
        if dep not in ours | there:
            sys.exit(f"gpu-wheels: {w.name} needs {dep}, which neither these wheels nor the GPU machine have")
if set(names) != ours or any(n != 1 for n in names.values()):
    sys.exit(f"gpu-wheels: want one wheel each of {sorted(ours)}, have {names}")
print(f"gpu-wheels: {len(wheels)} wheels in {sys.argv[1]}: " + ", ".join(w.name for w in wheels))
EOF

site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$dir"/*.whl
PYTHONPATH="$site:$(pwd)" "$py" -c "
import sys
import hydra, omegaconf, antlr4
for m in (hydra, omegaconf, antlr4):
    assert m.__file__.startswith(sys.argv[1]), f'{m.__name__} imported from {m.__file__}, not the wheels'
import posttrainllm.lab.gpucheck
print('gpu-wheels: installs and imports as scripts/gpu-check.sh does (hydra', hydra.__version__,
      'omegaconf', omegaconf.__version__ + ')')
" "$site"
