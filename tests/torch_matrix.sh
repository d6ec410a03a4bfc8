#!/usr/bin/env bash
# Build hebrus_torch's extension and run the test suite on each supported torch, one venv per version
# (CI tests the README's torch 2.13.0 only; this is the on-demand check of the others, docs/install.md).
#
#   tests/torch_matrix.sh                      # 2.13.0 2.14.1 2.15.0
#   tests/torch_matrix.sh 2.15.0 -- -x tests/test_qsa_ops.py   # one version, pytest arguments after --
#
# For each version: a venv $HEBRUS_MATRIX_DIR/t<major><minor> (created and filled on first use: torch==VERSION
# and the test, hf and serve extras' packages), a fresh copy of this checkout's tracked and untracked files
# in $HEBRUS_MATRIX_DIR/src-VERSION, `pip install --no-build-isolation -e` of that copy (the recommended
# install: the extension is built against the venv's torch), `python -m hebrus_torch --report` (fails
# unless the extension loaded with its native kernels), the .mm glue type-check against that torch's
# headers (Linux), then pytest with a JUnit report; the last lines are the counts per version.
#
# Environment: HEBRUS_MATRIX_DIR (default ~/.cache/hebrus_torch_matrix; keep it outside the checkout),
# PYTHON (the interpreter the venvs are made from, default python3), TORCH_INDEX_URL (an index for torch,
# e.g. https://download.pytorch.org/whl/cpu), MAX_JOBS (compile jobs, default 1), PYTEST_TIMEOUT (seconds
# for one suite, default 2400). Anything pip reads (PIP_CONSTRAINT, ...) passes through.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${HEBRUS_MATRIX_DIR:-$HOME/.cache/hebrus_torch_matrix}"
PYTHON="${PYTHON:-python3}"
export MAX_JOBS="${MAX_JOBS:-1}"
DEPS=(numpy ninja setuptools wheel "pytest>=8" "hypothesis>=6" "openai>=1.98.0" transformers==5.23.0 fastapi uvicorn
      starlette "pydantic>=2" rich "accelerate>=1.1.0")

versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
pytest_args=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(2.13.0 2.14.1 2.15.0)
[ ${#pytest_args[@]} -eq 0 ] && pytest_args=(-q)

case "$DIR/" in "$ROOT"/*) echo "HEBRUS_MATRIX_DIR must lie outside the checkout ($ROOT)" >&2; exit 2;; esac
mkdir -p "$DIR"

# Counts of a JUnit XML report: "passed P, skipped S, failed F" (errors count as failed).
counts() {
  "$1" - "$2" <<'PY'
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
total, skipped, failed = (sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "skipped", "failures"))
failed += sum(int(s.get("errors", 0)) for s in suites)
print(f"passed {total - skipped - failed}, skipped {skipped}, failed {failed}")
PY
}

summary=()
status=0
for v in "${versions[@]}"; do
  series="$(echo "$v" | cut -d. -f1-2)"
  venv="$DIR/t$(echo "$series" | tr -d .)"
  src="$DIR/src-$v"
  log="$DIR/log-$v.txt"
  echo "== torch $v: venv $venv, source copy $src, log $log"
  (
    set -e
    if [ ! -f "$venv/.hebrus-deps-$v" ]; then
      rm -rf "$venv"
      "$PYTHON" -m venv "$venv"
      "$venv/bin/pip" install -q --upgrade pip
      "$venv/bin/pip" install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$v"
      "$venv/bin/pip" install -q "${DEPS[@]}"
      touch "$venv/.hebrus-deps-$v"
    fi
    "$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
    rm -rf "$src" && mkdir -p "$src"
    (cd "$ROOT" && git ls-files -z -co --exclude-standard | xargs -0 tar -cf - 2>/dev/null) | tar -xf - -C "$src"
    "$venv/bin/pip" install -v --no-build-isolation --no-deps -e "$src"
    cd "$src"
    "$venv/bin/python" -m hebrus_torch --report
    if [ "$(uname)" = Linux ]; then "$venv/bin/python" tests/metal/check_mm_syntax.py; fi
  ) > "$log" 2>&1
  if [ $? -ne 0 ]; then
    summary+=("torch $v: BUILD OR CHECK FAILED (see $log)")
    status=1
    continue
  fi
  rm -f "$DIR/junit-$v.xml"
  # The Metal emulator's compiled kernels are kept per torch version between runs (the copy is fresh).
  (cd "$src" && HEBRUS_METAL_EMU_BUILD="$DIR/metal_emu-$v" timeout "${PYTEST_TIMEOUT:-2400}" "$venv/bin/python" -m pytest -p no:cacheprovider \
      --junitxml="$DIR/junit-$v.xml" "${pytest_args[@]}") >> "$log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  if [ -f "$DIR/junit-$v.xml" ]; then
    summary+=("torch $v: extension built and loaded; tests: $(counts "$venv/bin/python" "$DIR/junit-$v.xml") (pytest exit $rc)")
  else
    summary+=("torch $v: pytest exit $rc, no report (see $log)")
  fi
done
printf '%s\n' "${summary[@]}"
exit $status
