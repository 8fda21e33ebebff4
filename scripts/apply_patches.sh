#!/usr/bin/env bash
# Apply (or check, or revert) megatron-mm-balance's patches to a Megatron-LM checkout
# (or a Megatron-Bridge checkout: patches/megatron-bridge-<tag>/, docs/bridge.md).
#
#   scripts/apply_patches.sh MEGATRON_LM_DIR            apply (idempotent: applied files are skipped)
#   scripts/apply_patches.sh MEGATRON_LM_DIR --check    dry run: print each file pending/applied/conflict
#   scripts/apply_patches.sh MEGATRON_LM_DIR --revert   undo the applied patches, byte for byte (idempotent)
#   scripts/apply_patches.sh --supported                print the supported releases
#
# Supported releases and their patch sets: patches/<tag>/*.patch (see SUPPORTED below).
# The release is detected from git (`git describe --tags`, nearest core_v* tag) when the
# directory is the root of a git checkout, else from megatron/core/package_info.py. A
# checkout at another commit of a supported release (a branch with local commits) or a
# plain source tree is accepted when every hunk applies:
#   1. plain `git apply`;
#   2. in a git checkout, where a plain apply fails because local changes moved the hunk's
#      context, `git apply --3way` (against a scratch index, so the user's index is left
#      alone). The file's previous content is kept under the checkout's git directory
#      (mm-balance-patches/) so that --revert restores it byte for byte.
# Every file is classified before anything is written: a run either patches every pending
# file or changes nothing (unknown release, or a hunk that applies neither way).
set -euo pipefail

# tag -> version in that tag's megatron/core/package_info.py (the core_v0.19.0 tag's
# package_info.py already says 0.19.1).
SUPPORTED_TAGS=(core_v0.16.1 core_v0.17.1 core_v0.18.2 core_v0.19.0)
declare -A INFO_VERSION=([core_v0.16.1]=0.16.1 [core_v0.17.1]=0.17.1 [core_v0.18.2]=0.18.2 [core_v0.19.0]=0.19.1)
HERE=$(cd "$(dirname "$0")/.." && pwd)
PATCH_ROOT=${MM_BALANCE_PATCH_DIR:-$HERE/patches}
SUPPORTED_LIST=$(IFS=,; echo "${SUPPORTED_TAGS[*]}" | sed 's/,/, /g')

usage() { echo "usage: $0 MEGATRON_LM_DIR [--check|--revert]" >&2; exit 2; }
die() { echo "apply_patches: $*" >&2; exit 1; }

if [ "${1:-}" = --supported ]; then echo "$SUPPORTED_LIST"; exit 0; fi    # for other scripts' messages
[ $# -ge 1 ] && [ $# -le 2 ] || usage
DIR=$1
MODE=${2:-apply}
case "$MODE" in apply|--check|--revert) ;; *) usage ;; esac
command -v git >/dev/null || die "git is needed (git apply); install git"
[ -d "$DIR" ] || die "$DIR: no such directory (give the root of a Megatron-LM checkout)"
DIR=$(cd "$DIR" && pwd)

# --- Megatron-Bridge checkouts (a product of its own: its own releases and patch sets) ------
# A directory with src/megatron/bridge/ is a Megatron-Bridge checkout: its release comes from
# git (nearest v* tag) or from src/megatron/bridge/package_info.py (the v0.6.0 tag's says
# 0.6.1), and its patches from patches/megatron-bridge-<tag>/. Everything after the release
# detection (classify, all or nothing, --check/--revert) is shared with Megatron-LM.
BRIDGE_TAGS=(v0.6.0)
declare -A BRIDGE_INFO_VERSION=([v0.6.0]=0.6.1)
BRIDGE_RELEASE=""
detect_bridge_release() {
  local desc tag have found=""
  if [ "$(git -C "$DIR" rev-parse --show-toplevel 2>/dev/null)" = "$DIR" ] \
     && desc=$(git -C "$DIR" describe --tags --match 'v*' HEAD 2>/dev/null); then
    tag=$(git -C "$DIR" describe --tags --match 'v*' --abbrev=0 HEAD)
    found="git describe: $desc"
    [ -n "${BRIDGE_INFO_VERSION[$tag]:-}" ] && BRIDGE_RELEASE=$tag
  fi
  if [ -z "$BRIDGE_RELEASE" ]; then
    have=$(sed -n 's/^\(MAJOR\|MINOR\|PATCH\) *= *\([0-9]*\).*/\2/p' "$DIR/src/megatron/bridge/package_info.py" | paste -sd. -)
    found="${found:+$found; }src/megatron/bridge/package_info.py: ${have:-no version}"
    for t in "${BRIDGE_TAGS[@]}"; do
      [ "${BRIDGE_INFO_VERSION[$t]}" = "$have" ] && BRIDGE_RELEASE=$t
    done
  fi
  SUPPORTED_LIST="Megatron-Bridge $(IFS=,; echo "${BRIDGE_TAGS[*]}" | sed 's/,/, /g')"
  [ -n "$BRIDGE_RELEASE" ] || die "$DIR is not a supported Megatron-Bridge release ($found); supported: $SUPPORTED_LIST. Nothing was changed."
  RELEASE=megatron-bridge-$BRIDGE_RELEASE
  echo "Megatron-Bridge $BRIDGE_RELEASE ($found)"
}
if [ -d "$DIR/src/megatron/bridge" ]; then
  detect_bridge_release
fi

if [ -z "$BRIDGE_RELEASE" ]; then    # Megatron-LM (the block below, unchanged)
[ -f "$DIR/megatron/training/training.py" ] || die "$DIR is not a Megatron-LM checkout (no megatron/training/training.py)"

# --- which release -------------------------------------------------------------------
IS_GIT=0
if top=$(git -C "$DIR" rev-parse --show-toplevel 2>/dev/null) && [ "$(cd "$top" && pwd)" = "$DIR" ]; then
  IS_GIT=1
fi
info_version() {
  sed -n 's/^\(MAJOR\|MINOR\|PATCH\) *= *\([0-9]*\).*/\2/p' "$DIR/megatron/core/package_info.py" 2>/dev/null | paste -sd. -
}
RELEASE="" FOUND=""
if [ $IS_GIT = 1 ] && desc=$(git -C "$DIR" describe --tags --match 'core_v*' HEAD 2>/dev/null); then
  tag=$(git -C "$DIR" describe --tags --match 'core_v*' --abbrev=0 HEAD)
  FOUND="git describe: $desc"
  [ -n "${INFO_VERSION[$tag]:-}" ] && RELEASE=$tag
fi
if [ -z "$RELEASE" ]; then
  have=$(info_version)
  FOUND="${FOUND:+$FOUND; }megatron/core/package_info.py: ${have:-no version}"
  for t in "${SUPPORTED_TAGS[@]}"; do
    [ "${INFO_VERSION[$t]}" = "$have" ] && RELEASE=$t
  done
fi
[ -n "$RELEASE" ] || die "$DIR is not a supported Megatron-LM release ($FOUND); supported releases: $SUPPORTED_LIST. Nothing was changed."
fi    # Megatron-LM
IS_GIT=0
if top=$(git -C "$DIR" rev-parse --show-toplevel 2>/dev/null) && [ "$(cd "$top" && pwd)" = "$DIR" ]; then
  IS_GIT=1
fi
PATCH_DIR=$PATCH_ROOT/$RELEASE
shopt -s nullglob
PATCHES=("$PATCH_DIR"/*.patch)
[ ${#PATCHES[@]} -gt 0 ] || die "no patches in $PATCH_DIR"
[ -n "$BRIDGE_RELEASE" ] || echo "Megatron-LM $RELEASE ($FOUND)"

# --- helpers -----------------------------------------------------------------------------
# Outside a git checkout, git apply must not discover an enclosing repository (it would
# resolve paths against that one's root): stop discovery at DIR's parent.
gapply() { (cd "$DIR" && GIT_CEILING_DIRECTORIES=$(dirname "$DIR") git apply "$@"); }
targets() { sed -n 's|^diff --git a/\([^ ]*\) b/.*|\1|p' "$1"; }     # the files a patch touches
STATE_DIR=""
if [ $IS_GIT = 1 ]; then
  STATE_DIR=$(git -C "$DIR" rev-parse --absolute-git-dir)/mm-balance-patches/$RELEASE
fi
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
# `git apply --3way` against a copy of the index that holds the files as they are now, so
# that uncommitted edits take part and the user's index is not touched. $1: patch, $2: --check or empty.
threeway() {
  local idx=$SCRATCH/index
  cp "$(git -C "$DIR" rev-parse --absolute-git-dir)/index" "$idx" 2>/dev/null || rm -f "$idx"
  (cd "$DIR" && targets "$1" | GIT_INDEX_FILE=$idx xargs git add -- && GIT_INDEX_FILE=$idx git apply --3way ${2:-} "$1") 2>&1
}
# Were this patch's files changed by a 3-way apply, and are they unchanged since?
applied3() {
  local s=$STATE_DIR/$(basename "$1")
  [ $IS_GIT = 1 ] && [ -f "$s/sha256" ] && (cd "$DIR" && sha256sum --check --status "$s/sha256" 2>/dev/null)
}

# --- classify every file before touching anything --------------------------------------------
declare -a STATE
bad=()
for i in "${!PATCHES[@]}"; do
  p=${PATCHES[$i]}
  files=$(targets "$p")
  missing=$(cd "$DIR" && for f in $files; do [ -f "$f" ] || echo "$f"; done)
  if [ -n "$missing" ]; then
    STATE[$i]=conflict; bad+=($missing)
  elif applied3 "$p"; then
    STATE[$i]=applied3
  elif gapply --check -R "$p" 2>/dev/null; then
    STATE[$i]=applied
  elif gapply --check "$p" 2>/dev/null; then
    STATE[$i]=pending
  elif [ $IS_GIT = 1 ] && out=$(threeway "$p" --check) && ! grep -q "with conflicts" <<<"$out"; then
    STATE[$i]=pending3
  else
    STATE[$i]=conflict; bad+=($files)
  fi
  for f in $files; do
    case "${STATE[$i]}" in
      applied3) echo "$f: applied (3-way merge; $(basename "$p"))" ;;
      pending3) echo "$f: pending (needs a 3-way merge: local changes around the hunk; $(basename "$p"))" ;;
      *) echo "$f: ${STATE[$i]} ($(basename "$p"))" ;;
    esac
  done
done
if [ ${#bad[@]} -gt 0 ]; then
  list=$(IFS=,; echo "${bad[*]}" | sed 's/,/, /g')
  die "$list: the $RELEASE patch neither applies (plain or 3-way) nor is applied to $DIR: local changes where the hook goes; supported releases: $SUPPORTED_LIST. Nothing was changed."
fi

case "$MODE" in
  --check)
    echo "check ok: ${#PATCHES[@]} patches pending or applied ($RELEASE)"
    ;;
  apply)
    n=0
    for i in "${!PATCHES[@]}"; do
      p=${PATCHES[$i]}; name=$(basename "$p"); files=$(targets "$p")
      case "${STATE[$i]}" in
        pending)
          gapply "$p"; [ -z "$STATE_DIR" ] || rm -rf "${STATE_DIR:?}/$name"; n=$((n + 1)) ;;
        pending3)
          s=$STATE_DIR/$name; rm -rf "$s"; mkdir -p "$s/orig"
          (cd "$DIR" && cp -p --parents $files "$s/orig/")
          out=$(threeway "$p") || { (cd "$s/orig" && cp -p --parents $files "$DIR/"); die "$name: git apply --3way failed: $out"; }
          (cd "$DIR" && sha256sum $files) > "$s/sha256"
          for f in $files; do
            echo "$f: applied with git apply --3way (a plain apply failed on local changes around the hunk); --revert restores the previous file"
          done
          n=$((n + 1)) ;;
      esac
    done
    echo "applied $n patch(es) to $DIR ($(( ${#PATCHES[@]} - n )) already applied)"
    ;;
  --revert)
    n=0
    for (( i=${#PATCHES[@]}-1; i>=0; i-- )); do
      p=${PATCHES[$i]}; name=$(basename "$p"); files=$(targets "$p")
      case "${STATE[$i]}" in
        applied) gapply -R "$p"; n=$((n + 1)) ;;
        applied3)
          for f in $files; do
            cat "$STATE_DIR/$name/orig/$f" > "$DIR/$f"
            echo "$f: restored as it was before the 3-way apply"
          done
          rm -rf "${STATE_DIR:?}/$name"; n=$((n + 1)) ;;
      esac
    done
    echo "reverted $n patch(es) in $DIR"
    ;;
esac
