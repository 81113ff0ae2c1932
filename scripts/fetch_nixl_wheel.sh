#!/usr/bin/env bash
# Download the NIXL wheels (and pyzmq, which the KV side channel needs and the GPU image lacks) for
# the GPU machine's Python 3.12 / manylinux x86_64 into .whl-nixl/ at the repository root, a folder
# git ignores (via .git/info/exclude) and the device tool can carry (`carry: [".whl-nixl"]`).
#
#   nixl-cu13 1.5.1 (57 MB, the UCX/CUDA 13 build) + the `nixl` shim 1.5.1 (`import nixl`) + pyzmq.
#
# Usage: scripts/fetch_nixl_wheel.sh            (idempotent; re-downloads nothing already there)
# On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-nixl/*.whl
#   export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail

root="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
dest="$root/.whl-nixl"
py="${PYTHON:-python3}"
[ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python"

exclude="$(git -C "$root" rev-parse --git-path info/exclude)"
case "$exclude" in /*) ;; *) exclude="$root/$exclude" ;; esac
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl-nixl/' "$exclude" 2>/dev/null || echo '/.whl-nixl/' >> "$exclude"
mkdir -p "$dest"

fetch() {  # NAME==VERSION
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "$1"
}

fetch nixl-cu13==1.5.1
fetch nixl==1.5.1
fetch pyzmq==27.3.0

# One version of each package only: two stop the whole --no-index install.
for name in nixl_cu13 nixl pyzmq; do
  n="$(ls "$dest" | grep -c "^${name}-[0-9]" || true)"
  if [ "$n" -ne 1 ]; then echo "expected one ${name} wheel in $dest, found $n" >&2; exit 1; fi
done
ls -l "$dest"
du -sh "$dest"
