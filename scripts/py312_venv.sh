# Shared by scripts/setup_env_py312.sh and scripts/setup_env_bridge.sh (sourced, not run):
# find Python 3.12, create a venv without the system's site-packages, seed it with the other
# Python 3.12 venv's torch by hard links when that one has the same pinned pair, quiet pip.
#
#   MM_BALANCE_TORCH_FROM=DIR    the venv to take torch from (default: whichever of the repo's
#                                .venv-py312/ and .venv-bridge/ exists); "none" never shares.

# python3.12: $PYTHON312, pyenv's 3.12.1, or python3.12 on PATH.
find_python312() {
  if [ -n "${PYTHON312:-}" ]; then echo "$PYTHON312"; return; fi
  if command -v pyenv >/dev/null && [ -x "$(pyenv root)/versions/3.12.1/bin/python" ]; then
    echo "$(pyenv root)/versions/3.12.1/bin/python"; return
  fi
  command -v python3.12 || true
}

# make_venv312 NAME VENV: create VENV (no system site-packages) unless it exists; check it.
make_venv312() {
  local name=$1 venv=$2 base
  if [ ! -x "$venv/bin/python" ]; then
    base=$(find_python312)
    [ -n "$base" ] && "$base" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
      || { echo "$name: no Python 3.12 found (set PYTHON312=/path/to/python3.12)" >&2; exit 1; }
    "$base" -m venv "$venv"
  fi
  grep -q "^include-system-site-packages = false" "$venv/pyvenv.cfg" 2>/dev/null \
    || { echo "$name: $venv sees the system's site-packages (pyvenv.cfg); remove it and run again" >&2; exit 1; }
}

# share_torch VENV PIN...: hard-link the pinned torch pair from another Python 3.12 venv of
# this repository (scripts/share_torch.py says when and why not); when none has it, the
# Python-independent CUDA libraries (nvidia-*/cuda-* wheels, about 2 GB of the 4.7) from the
# main environment's interpreter (python3's prefix; MM_BALANCE_CUDA_LIBS_FROM=DIR another,
# "none" never). A no-op when nothing fits.
share_torch() {
  local venv=$1; shift
  local from=${MM_BALANCE_TORCH_FROM:-} seed libs
  [ "$from" = none ] && return 0
  for seed in ${from:-$PWD/.venv-py312 $PWD/.venv-bridge}; do
    [ -x "$seed/bin/python" ] || continue
    [ "$(cd "$seed" && pwd -P)" = "$(cd "$venv" && pwd -P)" ] && continue
    "$venv/bin/python" scripts/share_torch.py "$seed" "$venv" "$@" && return 0
  done
  libs=${MM_BALANCE_CUDA_LIBS_FROM:-$(python3 -c 'import sys; print(sys.prefix)' 2>/dev/null || true)}
  if [ -n "$libs" ] && [ "$libs" != none ]; then
    "$venv/bin/python" scripts/share_torch.py --cuda-libs "$libs" "$venv" || true
  fi
  return 0
}

# pip install, quiet, without pip's root and location warnings.
pipq312() {
  "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | grep -v -E "^(WARNING: (Running pip as|Location .* is ignored)|\[notice\])" || true
}

# have MODULE...: every module is findable in $PY (without importing: the CUDA build of torch
# takes seconds to import).
have() {
  "$PY" - "$@" <<'PYEOF'
import importlib.util, sys
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:      # a dotted name whose parent is absent
        return False
sys.exit(not all(found(m) for m in sys.argv[1:]))
PYEOF
}
