#!/usr/bin/env bash
# Installs what the demo and the tests need into the project venv, on a fresh machine too:
# a venv with pinned SGLang (0.5.23) and this package (editable). Re-runs are quick: the
# install is skipped while pyproject.toml and setup.py are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${SGL_ATOM_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

die() { echo "sgl_atom setup: $*" >&2; exit 1; }

"$PYTHON" -c 'import sys; assert sys.version_info[:2] in ((3,10),(3,11),(3,12))' 2>/dev/null \
  || die "needs Python 3.10-3.12 (found $("$PYTHON" --version 2>&1)): install python3.11 or set PYTHON"

parent=$(dirname "$VENV")
if [ ! -d "$VENV" ]; then
  mkdir -p "$parent" 2>/dev/null || true
  [ -w "$parent" ] || die "cannot create the venv: $parent is read-only. Use a writable clone, or set SGL_ATOM_VENV=/a/writable/dir/venv"
  echo "sgl_atom setup: creating venv at $VENV"
  "$PYTHON" -m venv "$VENV.partial" || { rm -rf "$VENV.partial"; die "python -m venv failed (on Debian: apt-get install python3-venv)"; }
  mv "$VENV.partial" "$VENV"
fi

stamp="$VENV/.sgl_atom-install"
want=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VENV/bin/python" -c 'import sglang, sgl_atom' 2>/dev/null; then
  [ -w "$ROOT" ] || die "the checkout $ROOT is read-only, and an editable install writes sgl_atom.egg-info into it: use a writable clone"
  echo "sgl_atom setup: installing sglang==0.5.23 and sgl-atom (first time: ~4 min, ~11 GB)"
  "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c 'import sglang, sgl_atom' || die "install failed (see pip's output above)"
  echo "$want" > "$stamp"
fi
echo "sgl_atom setup: ready ($("$VENV/bin/python" -c 'import sglang; print("sglang", sglang.__version__)'))"
