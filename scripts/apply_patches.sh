#!/usr/bin/env bash
# Apply (or check, or revert) megatron-mm-balance's patches to a Megatron-LM checkout.
#
#   scripts/apply_patches.sh MEGATRON_LM_DIR            apply (idempotent: applied patches are skipped)
#   scripts/apply_patches.sh MEGATRON_LM_DIR --check    dry run: report each patch, change nothing
#   scripts/apply_patches.sh MEGATRON_LM_DIR --revert   undo the applied patches (idempotent)
#
# The patches are unified diffs against Megatron-LM tag core_v0.16.1
# (commit 55ac7082517c3878ae653c07c09c534b8aed49f6). A git checkout must be at that
# commit; a source tree without .git must say version 0.16.1 in
# megatron/core/package_info.py. Every patch is checked with `git apply --check`
# (or, when already applied, `git apply --check -R`) before anything is written,
# so a run either applies all pending patches or changes nothing.
set -euo pipefail

TAG=core_v0.16.1
COMMIT=55ac7082517c3878ae653c07c09c534b8aed49f6
VERSION=0.16.1
HERE=$(cd "$(dirname "$0")/.." && pwd)
PATCH_DIR=${MM_BALANCE_PATCH_DIR:-$HERE/patches}

usage() { echo "usage: $0 MEGATRON_LM_DIR [--check|--revert]" >&2; exit 2; }
die() { echo "apply_patches: $*" >&2; exit 1; }

[ $# -ge 1 ] && [ $# -le 2 ] || usage
DIR=$1
MODE=${2:-apply}
case "$MODE" in apply|--check|--revert) ;; *) usage ;; esac
command -v git >/dev/null || die "git is needed (git apply); install git"
[ -d "$DIR" ] || die "$DIR: no such directory (give the root of a Megatron-LM checkout)"
DIR=$(cd "$DIR" && pwd)
[ -f "$DIR/megatron/training/training.py" ] || die "$DIR is not a Megatron-LM checkout (no megatron/training/training.py)"

shopt -s nullglob
PATCHES=("$PATCH_DIR"/*.patch)
[ ${#PATCHES[@]} -gt 0 ] || die "no patches in $PATCH_DIR"

# --- version check -----------------------------------------------------------------
if top=$(git -C "$DIR" rev-parse --show-toplevel 2>/dev/null) && [ "$(cd "$top" && pwd)" = "$DIR" ]; then
  head=$(git -C "$DIR" rev-parse HEAD)
  if [ "$head" != "$COMMIT" ]; then
    desc=$(git -C "$DIR" describe --tags --always 2>/dev/null || echo "$head")
    cat >&2 <<MSG
apply_patches: $DIR is at $desc ($head), but the patches are for Megatron-LM $TAG ($COMMIT).
Check out that tag first, for example:
    git -C $DIR fetch --tags origin
    git -C $DIR checkout $TAG
or keep your branch and make a separate work tree at the tag:
    git -C $DIR worktree add $DIR-$TAG $TAG && $0 $DIR-$TAG
(if you applied the patches before switching, run '$0 $DIR --revert' at the old commit first)
MSG
    exit 1
  fi
else
  info="$DIR/megatron/core/package_info.py"
  have=$(sed -n 's/^\(MAJOR\|MINOR\|PATCH\) *= *\([0-9]*\).*/\2/p' "$info" 2>/dev/null | paste -sd. -)
  if [ "$have" != "$VERSION" ]; then
    die "$DIR is Megatron-LM ${have:-of unknown version} (not a git checkout); the patches are for $TAG: get it with 'git clone --branch $TAG https://github.com/NVIDIA/Megatron-LM.git'"
  fi
fi

# --- classify every patch before touching anything -----------------------------------
# git apply runs from inside $DIR so that paths resolve against the checkout root.
# GIT_CEILING_DIRECTORIES: a source tree unpacked inside another git work tree must not be
# treated as a subdirectory of it (git apply would then skip every path, silently).
gapply() { (cd "$DIR" && GIT_CEILING_DIRECTORIES="$(dirname "$DIR")" git apply "$@"); }
declare -a STATE
bad=0
for i in "${!PATCHES[@]}"; do
  p=${PATCHES[$i]}
  if gapply --check -R "$p" 2>/dev/null; then
    STATE[$i]=applied
  elif gapply --check "$p" 2>/dev/null; then
    STATE[$i]=pending
  else
    STATE[$i]=conflict
    bad=1
  fi
  echo "$(basename "$p"): ${STATE[$i]}"
done
if [ $bad -ne 0 ]; then
  echo "apply_patches: some patches neither apply nor are applied; the files they touch were" >&2
  echo "modified locally. Details (git apply --check):" >&2
  for i in "${!PATCHES[@]}"; do
    [ "${STATE[$i]}" = conflict ] && (gapply --check "${PATCHES[$i]}" >&2 || true)
  done
  echo "Restore them ('git -C $DIR checkout -- <file>') and run again; nothing was changed." >&2
  exit 1
fi

case "$MODE" in
  --check)
    echo "check ok: ${#PATCHES[@]} patches apply cleanly or are already applied to $DIR"
    ;;
  apply)
    n=0
    for i in "${!PATCHES[@]}"; do
      [ "${STATE[$i]}" = pending ] || continue
      gapply "${PATCHES[$i]}"; n=$((n + 1))
    done
    echo "applied $n patch(es) to $DIR ($(( ${#PATCHES[@]} - n )) already applied)"
    ;;
  --revert)
    n=0
    for (( i=${#PATCHES[@]}-1; i>=0; i-- )); do
      [ "${STATE[$i]}" = applied ] || continue
      gapply -R "${PATCHES[$i]}"; n=$((n + 1))
    done
    echo "reverted $n patch(es) in $DIR"
    ;;
esac
