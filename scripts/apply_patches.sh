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
#   scripts/apply_patches.sh DIR --check --overlay
#                                           which hooks the import-time overlay would apply to
#                                           DIR in memory (a read-only tree; nothing is written;
#                                           megatron_mm_balance.patching, docs/megatron.md)
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

HERE=$(cd "$(dirname "$0")/.." && pwd)
PATCH_ROOT=${MM_BALANCE_PATCH_DIR:-$HERE/patches}
# The patch sets, from patches/sets.tsv (the overlay reads the same file): per product its sets
# in order, what each tree's version file says (the core_v0.19.0 tag's package_info.py already
# says 0.19.1, Bridge v0.6.0's 0.6.1) and what each was made on (a tag, or main@<commit> for a
# line not yet released).
SUPPORTED_TAGS=() BRIDGE_TAGS=()
declare -A INFO_VERSION BRIDGE_INFO_VERSION MADE_ON
[ -f "$PATCH_ROOT/sets.tsv" ] || { echo "apply_patches: no $PATCH_ROOT/sets.tsv" >&2; exit 1; }
while IFS=$'\t' read -r product set version made_on; do
  case "$product" in
    megatron-lm) SUPPORTED_TAGS+=("$set"); INFO_VERSION[$set]=$version; key=$set ;;
    megatron-bridge) BRIDGE_TAGS+=("$set"); BRIDGE_INFO_VERSION[$set]=$version; key=megatron-bridge-$set ;;
    *) continue ;;
  esac
  MADE_ON[$key]=$made_on
done < <(grep -v '^#' "$PATCH_ROOT/sets.tsv")
# "core_v0.19.0, core_v0.20.0 (main@d98e8a64)": a set made on main says so.
supported_list() {
  local out="" t key
  for t in "$@"; do
    key=$t; [ -n "${INFO_VERSION[$t]:-}" ] || key=megatron-bridge-$t
    case "${MADE_ON[$key]}" in main@*) t="$t (${MADE_ON[$key]})" ;; esac
    out="${out:+$out, }$t"
  done
  echo "$out"
}
SUPPORTED_LIST=$(supported_list "${SUPPORTED_TAGS[@]}")
ORIG_ARGS=$*

usage() {
  echo "usage: $0 MEGATRON_LM_DIR|MEGATRON_BRIDGE_DIR [--check|--revert] [--force]" >&2
  echo "       $0 --installed [--python PYTHON] [--check|--revert] [--force]" >&2
  exit 2
}
die() { echo "apply_patches: $*" >&2; exit 1; }

if [ "${1:-}" = --supported ]; then echo "$SUPPORTED_LIST"; exit 0; fi    # for other scripts' messages
DIR="" MODE=apply FORCE=0 INSTALLED=0 PY_ARG="" OVERLAY=0
HOW="" VERSION=""            # how the release was matched (exact, line, forced), and its version
while [ $# -gt 0 ]; do
  case "$1" in
    --check|--revert) [ $MODE = apply ] || usage; MODE=$1 ;;
    --force) FORCE=1 ;;
    --installed) INSTALLED=1 ;;
    --overlay) OVERLAY=1 ;;
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
# The overlay writes nothing: only its check is asked here (the same sets, the same detection,
# in Python, which applies the hunks in memory as it will at import time).
if [ $OVERLAY = 1 ]; then
  [ "$MODE" = --check ] || die "--overlay goes with --check (the overlay writes nothing: MM_BALANCE_OVERLAY=1 with the launchers applies it at import)"
  OPTS=(); [ $FORCE = 0 ] || OPTS=(--force)
  PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" MM_BALANCE_PATCH_DIR=$PATCH_ROOT \
    exec "${PY:-${PYTHON:-python3}}" -m megatron_mm_balance.patching check "${OPTS[@]}" "$DIR"
fi

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
  SUPPORTED_LIST="Megatron-Bridge $(supported_list "${BRIDGE_TAGS[@]}")"
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
# The nearest tag names the release unless commits follow it and the version file says
# another line: main's history reaches an older release's tag, its version file says the line
# it is on (the version file then decides, below).
if [ $IS_GIT = 1 ] && desc=$(git -C "$DIR" describe --tags --match "$TAG_PREFIX*" HEAD 2>/dev/null); then
  tag=$(git -C "$DIR" describe --tags --match "$TAG_PREFIX*" --abbrev=0 HEAD)
  file_line=$(minor_line "$(info_version)")
  if [ "$desc" = "$tag" ] || [ -z "$file_line" ] || [ "$file_line" = "$(minor_line "${tag#"$TAG_PREFIX"}")" ]; then
    consider_release "${tag#"$TAG_PREFIX"}" "git describe: $desc"
  else
    FOUND="git describe: $desc, commits after that tag"
  fi
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
# --- helpers -----------------------------------------------------------------------------
# Outside a git checkout, git apply must not discover an enclosing repository (it would
# resolve paths against that one's root): stop discovery at DIR's parent.
# In an installed Bridge package the patches' leading src/ is stripped too (-p2).
gapply() { (cd "$DIR" && GIT_CEILING_DIRECTORIES=$(dirname "$DIR") git apply -p"$STRIP" "$@"); }
targets() {                                                          # the files a patch touches
  if [ "$STRIP" = 2 ]; then sed -n 's|^diff --git a/[^/]*/\([^ ]*\) b/.*|\1|p' "$1"
  else sed -n 's|^diff --git a/\([^ ]*\) b/.*|\1|p' "$1"; fi
}
GIT_DIR_ABS=""
[ $IS_GIT = 0 ] || GIT_DIR_ABS=$(git -C "$DIR" rev-parse --absolute-git-dir)
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
# `git apply --3way` against a copy of the index that holds the files as they are now, so
# that uncommitted edits take part and the user's index is not touched. $1: patch, $2: --check or empty.
threeway() {
  local idx=$SCRATCH/index
  cp "$GIT_DIR_ABS/index" "$idx" 2>/dev/null || rm -f "$idx"
  (cd "$DIR" && targets "$1" | GIT_INDEX_FILE=$idx xargs git add -- && GIT_INDEX_FILE=$idx git apply --3way ${2:-} "$1") 2>&1
}
# Were this patch's files changed by a 3-way apply of set $2, and are they unchanged since?
applied3() {
  local s=$GIT_DIR_ABS/mm-balance-patches/$2/$(basename "$1")
  [ $IS_GIT = 1 ] && [ -f "$s/sha256" ] && (cd "$DIR" && sha256sum --check --status "$s/sha256" 2>/dev/null)
}

# --- classify every file of a set before touching anything -------------------------------------
# classify SET ALLOW3: STATE[i] per patch of patches/SET/ (pending, applied, applied3, pending3 with
# ALLOW3=1, or conflict), BAD (the conflicting files), LINES (the per-file report).
classify() {
  local set=$1 allow3=$2 i p files missing
  PATCHES=("$PATCH_ROOT/$set"/*.patch)
  STATE=() BAD=() LINES=()
  for i in "${!PATCHES[@]}"; do
    p=${PATCHES[$i]}
    files=$(targets "$p")
    missing=$(cd "$DIR" && for f in $files; do [ -f "$f" ] || echo "$f"; done)
    if [ -n "$missing" ]; then
      STATE[$i]=conflict; BAD+=($missing)
    elif applied3 "$p" "$set"; then
      STATE[$i]=applied3
    elif gapply --check -R "$p" 2>/dev/null; then
      STATE[$i]=applied
    elif gapply --check "$p" 2>/dev/null; then
      STATE[$i]=pending
    elif [ "$allow3" = 1 ] && [ $IS_GIT = 1 ] && out=$(threeway "$p" --check) && ! grep -q "with conflicts" <<<"$out"; then
      STATE[$i]=pending3
    else
      STATE[$i]=conflict; BAD+=($files)
    fi
    for f in $files; do
      case "${STATE[$i]}" in
        applied3) LINES+=("$f: applied (3-way merge; $(basename "$p"))") ;;
        pending3) LINES+=("$f: pending (needs a 3-way merge: local changes around the hunk; $(basename "$p"))") ;;
        *) LINES+=("$f: ${STATE[$i]} ($(basename "$p"))") ;;
      esac
    done
  done
}

# --- which layout ------------------------------------------------------------------------------
# A set made on main (patches/sets.tsv: main@<commit>) serves trees laid out as main was then.
# A commit of that line from before (its version file already says the new version) can still
# have the previous line's layout: Bridge main pins such a Megatron-LM (2a75ac12, 0.20.0, laid
# out as core_v0.19.0). Both sets are tried: the one whose every hunk fits where it stands wins,
# and where both fit, the one that fixes more (the other's missing patch is a fix upstream has not
# made there yet); a 3-way merge is tried only when neither fits as it stands.
PATCH_NAME=$PATCH_PREFIX$RELEASE
CANDIDATES=("$RELEASE")
case "${MADE_ON[$PATCH_NAME]:-}" in
  main@*)
    prev=""
    for t in "${TAGS[@]}"; do [ "$t" = "$RELEASE" ] && break; prev=$t; done
    [ -z "$prev" ] || CANDIDATES+=("$prev") ;;
esac
shopt -s nullglob
CHOSEN="" LAYOUT_NOTE="" fits=()
if [ ${#CANDIDATES[@]} -gt 1 ]; then
  best=-1
  declare -A UNFIT
  for c in "${CANDIDATES[@]}"; do
    classify "$PATCH_PREFIX$c" 0
    if [ ${#BAD[@]} = 0 ]; then
      fits+=("$c")
      if [ ${#PATCHES[@]} -gt $best ]; then CHOSEN=$c best=${#PATCHES[@]}; fi
    else
      UNFIT[$c]="patches/$PATCH_PREFIX$c/ does not fit $(IFS=,; echo "${BAD[*]}" | sed 's/,/, /g')"
    fi
  done
  if [ -z "$CHOSEN" ]; then                       # neither as it stands: a 3-way merge, in order
    for c in "${CANDIDATES[@]}"; do
      classify "$PATCH_PREFIX$c" 1
      if [ ${#BAD[@]} = 0 ]; then CHOSEN=$c; break; fi
    done
  fi
  if [ -n "$CHOSEN" ]; then
    made=${MADE_ON[$PATCH_PREFIX$CHOSEN]}
    case "$made" in main@*) as=$made ;; *) as=$CHOSEN ;; esac
    if [ ${#fits[@]} -gt 1 ]; then
      LAYOUT_NOTE="laid out as $as (the sets of ${fits[0]} and ${fits[1]} both fit; $CHOSEN's fixes more)"
    else
      other=""
      for c in "${CANDIDATES[@]}"; do [ "$c" = "$CHOSEN" ] || other=${UNFIT[$c]:-}; done
      LAYOUT_NOTE="laid out as $as${other:+ ($other)}"
    fi
    RELEASE=$CHOSEN
  fi
fi
PATCH_NAME=$PATCH_PREFIX$RELEASE
PATCH_DIR=$PATCH_ROOT/$PATCH_NAME
[ -n "$(echo "$PATCH_DIR"/*.patch)" ] || die "no patches in $PATCH_DIR"
STATE_DIR=""
[ $IS_GIT = 0 ] || STATE_DIR=$GIT_DIR_ABS/mm-balance-patches/$PATCH_NAME
classify "$PATCH_NAME" 1
bad=("${BAD[@]}")
where=""; [ "$LAYOUT" != package ] || where=", installed package in $DIR"
moved="a hunk that moved is applied at its new lines"
[ $IS_GIT = 0 ] || moved="3-way where a hunk's context moved"
case $HOW in
  exact)
    if [ -n "$LAYOUT_NOTE" ]; then
      echo "$PRODUCT $TAG_PREFIX$VERSION ($FOUND$where): main before the $VERSION release, $LAYOUT_NOTE; patch set patches/$PATCH_NAME/ ($moved, all or nothing)"
    else
      echo "$PRODUCT $RELEASE ($FOUND$where)"
    fi ;;
  line)
    quirk=""; [ "${TAG_INFO[$RELEASE]}" = "${RELEASE#"$TAG_PREFIX"}" ] || quirk=", whose package_info.py says ${TAG_INFO[$RELEASE]}"
    echo "$PRODUCT $TAG_PREFIX$VERSION ($FOUND$where): a patch release (or another commit) of the $(minor_line "$VERSION") line, not itself tested (the tested one is $RELEASE$quirk${LAYOUT_NOTE:+; $LAYOUT_NOTE}); using that line's patch set patches/$PATCH_NAME/ ($moved, all or nothing)" ;;
  forced) echo "$PRODUCT $TAG_PREFIX$VERSION ($FOUND$where): not a supported release; --force: trying the newest patch set patches/$PATCH_NAME/${LAYOUT_NOTE:+ ($LAYOUT_NOTE)}, all or nothing" ;;
esac
# What upstream's own per-global-batch data seam looks like here (Megatron-LM): whether the
# tree has megatron/core/datasets/data_schedule.py and whether training.py calls its
# wrap_data_iterator (which would rebalance the same samples as we do).
if [ "$PRODUCT" = Megatron-LM ]; then
  seam="no megatron/core/datasets/data_schedule.py"
  if [ -f "$DIR/megatron/core/datasets/data_schedule.py" ]; then
    seam="megatron/core/datasets/data_schedule.py present, not called by training.py"
    grep -q "wrap_data_iterator(" "$DIR/megatron/training/training.py" 2>/dev/null \
      && seam="megatron/core/datasets/data_schedule.py present, training.py calls wrap_data_iterator (with --sequence-packing-scheduler: refused with --mm-balance)"
  fi
  echo "layout: $seam"
fi
printf '%s\n' "${LINES[@]}"
if [ ${#bad[@]} -gt 0 ]; then
  list=$(IFS=,; echo "${bad[*]}" | sed 's/,/, /g')
  case $HOW in
    forced) why="--force: the newest patch set ($RELEASE) does not fit $TAG_PREFIX$VERSION there" ;;
    line) why="changes of $TAG_PREFIX$VERSION (or local ones) where the hook goes" ;;
    *) why="local changes where the hook goes" ;;
  esac
  ways="plain or 3-way"; [ $IS_GIT = 1 ] || ways="git apply; no git history here for a 3-way merge"
  remedy="put the hook back by hand where the patch shows it (patches/$PATCH_NAME/), or check out the release unchanged"
  [ $IS_GIT = 1 ] || [ "$LAYOUT" = package ] || remedy="in a git clone of $PRODUCT with its history a hunk whose context moved merges 3-way; or $remedy"
  die "$list: the $PATCH_NAME patch neither applies ($ways) nor is applied to $DIR: $why; $remedy; supported releases: $SUPPORTED_LIST. Nothing was changed."
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
