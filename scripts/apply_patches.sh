#!/usr/bin/env bash
# Apply (or check, or revert) megatron-mm-balance's patches to a Megatron-LM checkout, or to
# Megatron-Bridge: a checkout or an installed package (patches/megatron-bridge-<tag>/,
# docs/bridge.md).
#
#   scripts/apply_patches.sh DIR            apply (idempotent: applied files are skipped)
#   scripts/apply_patches.sh DIR --check    dry run: print each file pending/applied/conflict
#   scripts/apply_patches.sh DIR --revert   undo the applied patches, byte for byte (idempotent)
#   scripts/apply_patches.sh DIR --force    (with any mode) a release of a newer minor line
#                                           than any patch set: try the newest set
#   scripts/apply_patches.sh --installed [--python PYTHON] [--check|--revert] [--force]
#                                           the Megatron-Bridge package PYTHON imports
#                                           (default $PYTHON, else python3), patched in place
#   scripts/apply_patches.sh --supported    print the supported Megatron-LM releases
#
# DIR is the root of a Megatron-LM checkout, the root of a Megatron-Bridge checkout
# (src/megatron/bridge/), or a directory holding an installed Megatron-Bridge package
# (site-packages/ with megatron/bridge/; the package directory megatron/bridge/ itself is
# accepted too). Bridge's patches name src/megatron/bridge/...: in an installed package they
# apply to megatron/bridge/... (one more leading path component stripped).
#
# Supported releases and their patch sets: patches/<tag>/*.patch (see SUPPORTED_TAGS below,
# BRIDGE_TAGS for Megatron-Bridge). The release is detected from git (`git describe --tags`,
# nearest core_v* tag, v* for Bridge) when the directory is the root of a git checkout, else
# from the version file (megatron/core/package_info.py; Bridge's package_info.py), and for an
# installed Bridge from its distribution's version (megatron_bridge-*.dist-info/METADATA).
# A patch release of a supported minor line (core_v0.19.2, core_v0.18.0, Bridge 0.6.2, ...)
# gets that line's patch set, applied as for a branch (below) and said so in the first line.
# A checkout at another commit of a supported release (a branch with local commits) or a
# plain source tree is accepted when every hunk applies:
#   1. plain `git apply` (which finds a hunk whose lines moved at its new place);
#   2. in a git checkout, where a plain apply fails because local changes moved the hunk's
#      context, `git apply --3way` (against a scratch index, so the user's index is left
#      alone). The file's previous content is kept under the checkout's git directory
#      (mm-balance-patches/) so that --revert restores it byte for byte. (An installed
#      package has no git history to merge against: there only step 1 applies.)
# Every file is classified before anything is written: a run either patches every pending
# file or changes nothing (unknown release, a hunk that applies neither way, or files this
# user cannot write).
set -euo pipefail

# tag -> version in that tag's megatron/core/package_info.py (the core_v0.19.0 tag's
# package_info.py already says 0.19.1).
SUPPORTED_TAGS=(core_v0.16.1 core_v0.17.1 core_v0.18.2 core_v0.19.0)
declare -A INFO_VERSION=([core_v0.16.1]=0.16.1 [core_v0.17.1]=0.17.1 [core_v0.18.2]=0.18.2 [core_v0.19.0]=0.19.1)
# Megatron-Bridge: its tags and their src/megatron/bridge/package_info.py versions (the v0.6.0
# tag's says 0.6.1); patches/megatron-bridge-v0.6.0/ serves the 0.6 line (0.6.1, 0.6.2 ...).
BRIDGE_TAGS=(v0.6.0)
declare -A BRIDGE_INFO_VERSION=([v0.6.0]=0.6.1)
HERE=$(cd "$(dirname "$0")/.." && pwd)
PATCH_ROOT=${MM_BALANCE_PATCH_DIR:-$HERE/patches}
SUPPORTED_LIST=$(IFS=,; echo "${SUPPORTED_TAGS[*]}" | sed 's/,/, /g')
ORIG_ARGS=$*

usage() {
  echo "usage: $0 MEGATRON_LM_DIR|MEGATRON_BRIDGE_DIR [--check|--revert] [--force]" >&2
  echo "       $0 --installed [--python PYTHON] [--check|--revert] [--force]" >&2
  exit 2
}
die() { echo "apply_patches: $*" >&2; exit 1; }

if [ "${1:-}" = --supported ]; then echo "$SUPPORTED_LIST"; exit 0; fi    # for other scripts' messages
DIR="" MODE=apply FORCE=0 INSTALLED=0 PY_ARG=""
HOW="" VERSION=""            # how the release was matched (exact, line, forced), and its version
while [ $# -gt 0 ]; do
  case "$1" in
    --check|--revert) [ $MODE = apply ] || usage; MODE=$1 ;;
    --force) FORCE=1 ;;
    --installed) INSTALLED=1 ;;
    --python) [ $# -ge 2 ] || usage; PY_ARG=$2; shift ;;
    -*) usage ;;
    *) [ -z "$DIR" ] || usage; DIR=$1 ;;
  esac
  shift
done
if [ $INSTALLED = 1 ]; then [ -z "$DIR" ] || usage; else [ -n "$DIR" ] && [ -z "$PY_ARG" ] || usage; fi
command -v git >/dev/null || die "git is needed (git apply); install git"

# --- an installed Megatron-Bridge: where the given python imports it from -------------------
# find_spec locates the package without running megatron/bridge/__init__.py (which imports
# torch and megatron-core).
installed_bridge() {
  "$1" -c '
import importlib.util, sys
try:
    spec = importlib.util.find_spec("megatron.bridge")
except ImportError:
    spec = None
if spec is None or not spec.submodule_search_locations:
    sys.exit(1)
print(list(spec.submodule_search_locations)[0])'
}
if [ $INSTALLED = 1 ]; then
  PY=${PY_ARG:-${PYTHON:-python3}}
  command -v "$PY" >/dev/null || die "--installed: cannot run $PY (give --python PYTHON, the python of the environment Megatron-Bridge is installed in)"
  DIR=$(installed_bridge "$PY") \
    || die "--installed: $PY cannot import megatron.bridge (pip install megatron-bridge into its environment, give --python the python that has it, or give the directory)"
  echo "Megatron-Bridge as $PY imports it: $DIR"
fi
[ -d "$DIR" ] || die "$DIR: no such directory (give the root of a Megatron-LM or Megatron-Bridge checkout, or --installed)"
DIR=$(cd "$DIR" && pwd)

# --- Megatron-Bridge's two layouts ------------------------------------------------------------
# checkout: DIR/src/megatron/bridge/ (patch paths as they are); package: DIR/megatron/bridge/
# with DIR a site-packages (or any directory on sys.path; patch paths without their src/).
# Given src/ or the megatron/bridge/ package directory, DIR becomes the root they belong to.
LAYOUT=""
if [ "$(basename "$DIR")" = bridge ] && [ "$(basename "$(dirname "$DIR")")" = megatron ] \
   && [ -f "$DIR/package_info.py" ]; then
  DIR=$(dirname "$(dirname "$DIR")")
fi
if [ "$(basename "$DIR")" = src ] && [ -d "$DIR/megatron/bridge" ] && [ ! -d "$DIR/src/megatron/bridge" ]; then
  DIR=$(dirname "$DIR")
fi
if [ -d "$DIR/src/megatron/bridge" ]; then
  LAYOUT=checkout
elif [ -f "$DIR/megatron/bridge/package_info.py" ] || [ -f "$DIR/megatron/bridge/__init__.py" ]; then
  LAYOUT=package
fi

# A git checkout whose top is DIR (tags, 3-way applies and their state live in its .git).
IS_GIT=0
if [ "$LAYOUT" != package ] && top=$(git -C "$DIR" rev-parse --show-toplevel 2>/dev/null) \
   && [ "$(cd "$top" && pwd)" = "$DIR" ]; then
  IS_GIT=1
fi

# --- which product ------------------------------------------------------------------------
# The release detection below is shared: a product's tags, their version-file versions,
# its tag prefix, the name of its patch sets and where its version file lives.
if [ -n "$LAYOUT" ]; then
  PRODUCT=Megatron-Bridge TAG_PREFIX=v PATCH_PREFIX=megatron-bridge-
  TAGS=("${BRIDGE_TAGS[@]}")
  declare -A TAG_INFO; for t in "${BRIDGE_TAGS[@]}"; do TAG_INFO[$t]=${BRIDGE_INFO_VERSION[$t]}; done
  if [ $LAYOUT = checkout ]; then INFO_FILE=src/megatron/bridge/package_info.py STRIP=1
  else INFO_FILE=megatron/bridge/package_info.py STRIP=2; fi
  SUPPORTED_LIST="Megatron-Bridge $(IFS=,; echo "${BRIDGE_TAGS[*]}" | sed 's/,/, /g')"
else
  [ -f "$DIR/megatron/training/training.py" ] \
    || die "$DIR is not a Megatron-LM checkout (no megatron/training/training.py) nor Megatron-Bridge (no src/megatron/bridge/, no installed megatron/bridge/)"
  PRODUCT=Megatron-LM TAG_PREFIX=core_v PATCH_PREFIX="" INFO_FILE=megatron/core/package_info.py STRIP=1
  TAGS=("${SUPPORTED_TAGS[@]}")
  declare -A TAG_INFO; for t in "${SUPPORTED_TAGS[@]}"; do TAG_INFO[$t]=${INFO_VERSION[$t]}; done
fi
NEWEST_TAG=${TAGS[${#TAGS[@]}-1]}

# --- which release -------------------------------------------------------------------
# A version's candidates, in order: the nearest tag (git checkout), then the version file
# (an installed Bridge: its distribution's version instead, when it has a dist-info). Each is
# matched exactly against a supported release first, then by its minor line: a patch
# release (0.19.2, 0.18.0, Bridge 0.6.2, ...) of a supported line gets that line's patch
# set, applied like any branch (3-way where a hunk's context moved; all or nothing). A
# release of a newer line (0.20, Bridge 0.7) is refused unless --force, which tries the
# newest patch set, still all or nothing.
info_version() {
  local f=$DIR/$INFO_FILE v pre
  v=$(sed -n 's/^\(MAJOR\|MINOR\|PATCH\) *= *\([0-9]*\).*/\2/p' "$f" 2>/dev/null | paste -sd. -)
  pre=$(sed -n "s/^PRE_RELEASE *= *[\"']\([^\"']*\)[\"'].*/\1/p" "$f" 2>/dev/null | head -1)
  echo "$v$pre"
}
minor_line() { sed -n 's/^\([0-9][0-9]*\.[0-9][0-9]*\)\..*/\1/p' <<<"$1"; }   # 0.19.2 -> 0.19
line_tag() {                       # the supported tag of a minor line (empty if none)
  local t
  for t in "${TAGS[@]}"; do [ "$(minor_line "${t#"$TAG_PREFIX"}")" != "$1" ] || echo "$t"; done
}
RELEASE="" FOUND="" VERSIONS=()
# A release version (a tag's, a distribution's): exact when it names a supported tag.
consider_release() {
  FOUND="${FOUND:+$FOUND; }$2"
  [ -n "$1" ] || return 0
  VERSIONS+=("$1")
  if [ -z "$RELEASE" ] && [ -n "${TAG_INFO[$TAG_PREFIX$1]:-}" ]; then RELEASE=$TAG_PREFIX$1 VERSION=$1 HOW=exact; fi
}
# A version file's version: exact when it is what a supported tag's version file says.
consider_info() {
  local t
  FOUND="${FOUND:+$FOUND; }$INFO_FILE: ${1:-no version}"
  [ -n "$1" ] || return 0
  VERSIONS+=("$1")
  for t in "${TAGS[@]}"; do
    if [ -z "$RELEASE" ] && [ "${TAG_INFO[$t]}" = "$1" ]; then RELEASE=$t VERSION=${t#"$TAG_PREFIX"} HOW=exact; fi
  done
}
if [ $IS_GIT = 1 ] && desc=$(git -C "$DIR" describe --tags --match "$TAG_PREFIX*" HEAD 2>/dev/null); then
  tag=$(git -C "$DIR" describe --tags --match "$TAG_PREFIX*" --abbrev=0 HEAD)
  consider_release "${tag#"$TAG_PREFIX"}" "git describe: $desc"
fi
if [ -z "$RELEASE" ] && [ "$LAYOUT" = package ]; then
  shopt -s nullglob
  dists=("$DIR"/megatron_bridge-*.dist-info/METADATA)
  shopt -u nullglob
  [ ${#dists[@]} -le 1 ] || die "$DIR holds ${#dists[@]} Megatron-Bridge distributions (${dists[*]#"$DIR"/}): remove the stale ones (pip uninstall megatron-bridge, then reinstall). Nothing was changed."
  if [ ${#dists[@]} = 1 ]; then
    consider_release "$(sed -n 's/^Version: *\([^ ]*\).*/\1/p' "${dists[0]}" | head -1)" \
                     "${dists[0]#"$DIR"/}: $(sed -n 's/^Version: *//p' "${dists[0]}" | head -1)"
  fi
fi
if [ -z "$RELEASE" ] && { [ "$LAYOUT" != package ] || [ ${#VERSIONS[@]} = 0 ]; }; then
  consider_info "$(info_version)"
fi
if [ -z "$RELEASE" ]; then
  for v in "${VERSIONS[@]}"; do
    t=$(line_tag "$(minor_line "$v")")
    if [ -n "$t" ]; then RELEASE=$t VERSION=$v HOW=line; break; fi
  done
fi
if [ -z "$RELEASE" ]; then
  v=${VERSIONS[0]:-} newest=$(minor_line "${NEWEST_TAG#"$TAG_PREFIX"}")
  newer=0
  if l=$(minor_line "$v") && [ -n "$l" ] && [ "$l" != "$newest" ] \
     && [ "$(printf '%s\n%s\n' "$newest" "$l" | sort -V | tail -1)" = "$l" ]; then newer=1; fi
  if [ $FORCE = 1 ] && [ $newer = 1 ]; then
    RELEASE=$NEWEST_TAG VERSION=$v HOW=forced
  elif [ $FORCE = 1 ]; then
    die "$DIR is not a supported $PRODUCT release ($FOUND); supported releases: $SUPPORTED_LIST and their patch releases; --force only tries the newest patch set ($NEWEST_TAG) on a release of a newer line. Nothing was changed."
  elif [ $newer = 1 ]; then
    die "$DIR is not a supported $PRODUCT release ($FOUND): the $l line is newer than every patch set; supported releases: $SUPPORTED_LIST and their patch releases; --force tries the newest patch set ($NEWEST_TAG), all or nothing. Nothing was changed."
  else
    die "$DIR is not a supported $PRODUCT release ($FOUND); supported releases: $SUPPORTED_LIST and their patch releases. Nothing was changed."
  fi
fi
PATCH_NAME=$PATCH_PREFIX$RELEASE
PATCH_DIR=$PATCH_ROOT/$PATCH_NAME
shopt -s nullglob
PATCHES=("$PATCH_DIR"/*.patch)
[ ${#PATCHES[@]} -gt 0 ] || die "no patches in $PATCH_DIR"
where=""; [ "$LAYOUT" != package ] || where=", installed package in $DIR"
moved="a hunk that moved is applied at its new lines"
[ $IS_GIT = 0 ] || moved="3-way where a hunk's context moved"
case $HOW in
  exact) echo "$PRODUCT $RELEASE ($FOUND$where)" ;;
  line)
    quirk=""; [ "${TAG_INFO[$RELEASE]}" = "${RELEASE#"$TAG_PREFIX"}" ] || quirk=", whose package_info.py says ${TAG_INFO[$RELEASE]}"
    echo "$PRODUCT $TAG_PREFIX$VERSION ($FOUND$where): a patch release (or another commit) of the $(minor_line "$VERSION") line, not itself tested (the tested one is $RELEASE$quirk); using that line's patch set patches/$PATCH_NAME/ ($moved, all or nothing)" ;;
  forced) echo "$PRODUCT $TAG_PREFIX$VERSION ($FOUND$where): not a supported release; --force: trying the newest patch set patches/$PATCH_NAME/, all or nothing" ;;
esac


# --- helpers -----------------------------------------------------------------------------
# Outside a git checkout, git apply must not discover an enclosing repository (it would
# resolve paths against that one's root): stop discovery at DIR's parent.
# In an installed Bridge package the patches' leading src/ is stripped too (-p2).
gapply() { (cd "$DIR" && GIT_CEILING_DIRECTORIES=$(dirname "$DIR") git apply -p"$STRIP" "$@"); }
targets() {                                                          # the files a patch touches
  if [ "$STRIP" = 2 ]; then sed -n 's|^diff --git a/[^/]*/\([^ ]*\) b/.*|\1|p' "$1"
  else sed -n 's|^diff --git a/\([^ ]*\) b/.*|\1|p' "$1"; fi
}
STATE_DIR=""
if [ $IS_GIT = 1 ]; then
  STATE_DIR=$(git -C "$DIR" rev-parse --absolute-git-dir)/mm-balance-patches/$PATCH_NAME
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
    forced) why="--force: the newest patch set ($RELEASE) does not fit $TAG_PREFIX$VERSION there" ;;
    line) why="changes of $TAG_PREFIX$VERSION (or local ones) where the hook goes" ;;
    *) why="local changes where the hook goes" ;;
  esac
  ways="plain or 3-way"; [ $IS_GIT = 1 ] || ways="git apply; no git history here for a 3-way merge"
  die "$list: the $PATCH_NAME patch neither applies ($ways) nor is applied to $DIR: $why; supported releases: $SUPPORTED_LIST. Nothing was changed."
fi

# --- can this user write what the mode changes? (an installed package often belongs to root) ---
# git apply replaces a file (new file, then rename): the file and its directory must be writable.
unwritable=()
for i in "${!PATCHES[@]}"; do
  case "$MODE:${STATE[$i]}" in apply:pending*|--revert:applied*) ;; *) continue ;; esac
  for f in $(targets "${PATCHES[$i]}"); do
    { [ -w "$DIR/$f" ] && [ -w "$(dirname "$DIR/$f")" ]; } || unwritable+=("$f")
  done
done
if [ ${#unwritable[@]} -gt 0 ]; then
  owner=$(stat -c %U "$DIR/${unwritable[0]}" 2>/dev/null || echo "its owner")
  elsewhere="or work on a copy you own (cp -a $DIR ~/)"
  [ "$LAYOUT" != package ] || elsewhere="or install Megatron-Bridge where you can write (python -m venv ENV && ENV/bin/pip install megatron-bridge==$VERSION, then --installed --python ENV/bin/python)"
  die "$DIR is not writable by $(id -un) (${unwritable[*]}): run it as $owner (e.g. sudo bash $0 $ORIG_ARGS; in a container, as a step of the image build), $elsewhere. Nothing was changed."
fi

case "$MODE" in
  --check)
    echo "check ok: ${#PATCHES[@]} patches pending or applied ($PATCH_NAME)"
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
