#!/usr/bin/env bash
# Apply (or check, or revert) megatron-mm-balance's patches to a Megatron-LM checkout
# (or a Megatron-Bridge checkout: patches/megatron-bridge-<tag>/, docs/bridge.md).
#
#   scripts/apply_patches.sh MEGATRON_LM_DIR            apply (idempotent: applied files are skipped)
#   scripts/apply_patches.sh MEGATRON_LM_DIR --check    dry run: print each file pending/applied/conflict
#   scripts/apply_patches.sh MEGATRON_LM_DIR --revert   undo the applied patches, byte for byte (idempotent)
#   scripts/apply_patches.sh MEGATRON_LM_DIR --force    (with any mode) a release of a newer minor line
#                                                       than any patch set: try the newest set
#   scripts/apply_patches.sh --supported                print the supported releases
#
# Supported releases and their patch sets: patches/<tag>/*.patch (see SUPPORTED_TAGS below).
# The release is detected from git (`git describe --tags`, nearest core_v* tag) when the
# directory is the root of a git checkout, else from megatron/core/package_info.py. A
# patch release of a supported minor line (core_v0.19.2, core_v0.18.0, ...) gets that
# line's patch set, applied as for a branch (below) and said so in the first line. A
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
NEWEST_TAG=${SUPPORTED_TAGS[${#SUPPORTED_TAGS[@]}-1]}

usage() { echo "usage: $0 MEGATRON_LM_DIR [--check|--revert] [--force]" >&2; exit 2; }
die() { echo "apply_patches: $*" >&2; exit 1; }

if [ "${1:-}" = --supported ]; then echo "$SUPPORTED_LIST"; exit 0; fi    # for other scripts' messages
[ $# -ge 1 ] && [ $# -le 3 ] || usage
DIR=$1; shift
MODE=apply FORCE=0
HOW="" VERSION=""            # how the Megatron-LM release was matched (exact, line, forced)
for a in "$@"; do
  case "$a" in
    --check|--revert) [ $MODE = apply ] || usage; MODE=$a ;;
    --force) FORCE=1 ;;
    *) usage ;;
  esac
done
command -v git >/dev/null || die "git is needed (git apply); install git"
[ -d "$DIR" ] || die "$DIR: no such directory (give the root of a Megatron-LM checkout)"
DIR=$(cd "$DIR" && pwd)

# A git checkout whose top is DIR (tags, 3-way applies and their state live in its .git).
IS_GIT=0
if top=$(git -C "$DIR" rev-parse --show-toplevel 2>/dev/null) && [ "$(cd "$top" && pwd)" = "$DIR" ]; then
  IS_GIT=1
fi

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
# A version's candidates, in order: the nearest core_v* tag (git checkout), then
# megatron/core/package_info.py. Each is matched exactly against a supported release
# first, then by its minor line: a patch release (0.19.2, 0.18.0, ...) of a supported
# line gets that line's patch set, applied like any branch (3-way where a hunk's context
# moved; all or nothing). A release of a newer line (0.20) is refused unless --force,
# which tries the newest patch set, still all or nothing.
info_version() {
  local f=$DIR/megatron/core/package_info.py v pre
  v=$(sed -n 's/^\(MAJOR\|MINOR\|PATCH\) *= *\([0-9]*\).*/\2/p' "$f" 2>/dev/null | paste -sd. -)
  pre=$(sed -n "s/^PRE_RELEASE *= *[\"']\([^\"']*\)[\"'].*/\1/p" "$f" 2>/dev/null | head -1)
  echo "$v$pre"
}
minor_line() { sed -n 's/^\([0-9][0-9]*\.[0-9][0-9]*\)\..*/\1/p' <<<"$1"; }   # 0.19.2 -> 0.19
line_tag() {                       # the supported tag of a minor line (empty if none)
  local t
  for t in "${SUPPORTED_TAGS[@]}"; do [ "$(minor_line "${t#core_v}")" != "$1" ] || echo "$t"; done
}
RELEASE="" FOUND="" VERSIONS=()
if [ $IS_GIT = 1 ] && desc=$(git -C "$DIR" describe --tags --match 'core_v*' HEAD 2>/dev/null); then
  tag=$(git -C "$DIR" describe --tags --match 'core_v*' --abbrev=0 HEAD)
  FOUND="git describe: $desc"
  if [ -n "${INFO_VERSION[$tag]:-}" ]; then RELEASE=$tag VERSION=${tag#core_v} HOW=exact; fi
  VERSIONS+=("${tag#core_v}")
fi
if [ -z "$RELEASE" ]; then
  have=$(info_version)
  FOUND="${FOUND:+$FOUND; }megatron/core/package_info.py: ${have:-no version}"
  for t in "${SUPPORTED_TAGS[@]}"; do
    if [ "${INFO_VERSION[$t]}" = "$have" ]; then RELEASE=$t VERSION=${t#core_v} HOW=exact; fi
  done
  [ -z "$have" ] || VERSIONS+=("$have")
fi
if [ -z "$RELEASE" ]; then
  for v in "${VERSIONS[@]}"; do
    t=$(line_tag "$(minor_line "$v")")
    if [ -n "$t" ]; then RELEASE=$t VERSION=$v HOW=line; break; fi
  done
fi
if [ -z "$RELEASE" ]; then
  v=${VERSIONS[0]:-} newest=$(minor_line "${NEWEST_TAG#core_v}")
  newer=0
  if l=$(minor_line "$v") && [ -n "$l" ] && [ "$l" != "$newest" ] \
     && [ "$(printf '%s\n%s\n' "$newest" "$l" | sort -V | tail -1)" = "$l" ]; then newer=1; fi
  if [ $FORCE = 1 ] && [ $newer = 1 ]; then
    RELEASE=$NEWEST_TAG VERSION=$v HOW=forced
  elif [ $FORCE = 1 ]; then
    die "$DIR is not a supported Megatron-LM release ($FOUND); supported releases: $SUPPORTED_LIST and their patch releases; --force only tries the newest patch set ($NEWEST_TAG) on a release of a newer line. Nothing was changed."
  elif [ $newer = 1 ]; then
    die "$DIR is not a supported Megatron-LM release ($FOUND): the $l line is newer than every patch set; supported releases: $SUPPORTED_LIST and their patch releases; --force tries the newest patch set ($NEWEST_TAG), all or nothing. Nothing was changed."
  else
    die "$DIR is not a supported Megatron-LM release ($FOUND); supported releases: $SUPPORTED_LIST and their patch releases. Nothing was changed."
  fi
fi
fi    # Megatron-LM
PATCH_DIR=$PATCH_ROOT/$RELEASE
shopt -s nullglob
PATCHES=("$PATCH_DIR"/*.patch)
[ ${#PATCHES[@]} -gt 0 ] || die "no patches in $PATCH_DIR"
if [ -z "$BRIDGE_RELEASE" ]; then
case $HOW in
  exact) echo "Megatron-LM $RELEASE ($FOUND)" ;;
  line)
    quirk=""; [ "${INFO_VERSION[$RELEASE]}" = "${RELEASE#core_v}" ] || quirk=", whose package_info.py says ${INFO_VERSION[$RELEASE]}"
    echo "Megatron-LM core_v$VERSION ($FOUND): a patch release (or another commit) of the $(minor_line "$VERSION") line, not itself tested (the tested one is $RELEASE$quirk); using that line's patch set patches/$RELEASE/ (3-way where a hunk's context moved, all or nothing)" ;;
  forced) echo "Megatron-LM core_v$VERSION ($FOUND): not a supported release; --force: trying the newest patch set patches/$RELEASE/, all or nothing" ;;
esac
fi

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
  case $HOW in
    forced) why="--force: the newest patch set ($RELEASE) does not fit core_v$VERSION there" ;;
    line) why="changes of core_v$VERSION (or local ones) where the hook goes" ;;
    *) why="local changes where the hook goes" ;;
  esac
  die "$list: the $RELEASE patch neither applies (plain or 3-way) nor is applied to $DIR: $why; supported releases: $SUPPORTED_LIST. Nothing was changed."
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
