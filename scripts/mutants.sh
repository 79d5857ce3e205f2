#!/usr/bin/env bash
# Mutation testing with cargo-mutants (`cargo install --locked cargo-mutants`).
#
#   scripts/mutants.sh                      the policy modules (listed in the script)
#   scripts/mutants.sh --changed [BASE]     the crates' source files this branch and
#                                           the work tree change against BASE (default
#                                           main; compared from their merge base)
#   scripts/mutants.sh PATH...              files, directories (every .rs below) or
#                                           globs ('crates/unshard/src/plan/*.rs')
#
# Each mutant (a plausible one-line bug) is built and tested; "caught" means a test
# failed. The run works on a snapshot of the tree (tracked and untracked files, in
# /tmp), mutated in place and built in this tree's target/ (so the dependencies are
# not rebuilt), so the tree can be edited meanwhile.
#
# The files are grouped by crate and each crate is run on its own (`-p`), judged
# by its own tests: unshard-pickle, unshard-cli and unshard-py by all of theirs,
# unshard by its unit tests and the CLI suites that merge, verify and refuse
# inputs. The counts (caught, missed, timeout, unviable) are printed per crate at
# the end, with the missed mutants; figures and the reasons for each missed mutant
# are in docs/testing.md.
#
# Environment:
#   MUTANTS_BUDGET  seconds before the whole run is stopped (default 3600); what
#                   was tested by then is in outcomes.json. --iterate resumes later.
#   MUTANTS_OUT     output directory (default /tmp/unshard-mutants); each crate's
#                   results go to $MUTANTS_OUT/<crate>/mutants.out/.
#   MUTANTS_TESTS   which tests judge a mutant, for every crate of the run (default
#                   per crate, above: for unshard "--lib --test claims --test merge
#                   --test verify", for the others all their tests).
#                   Several test-name filters go after `--` ("-- a::b c::d"):
#                   cargo test takes one name before it, and refuses a second
#                   with a usage error that counts every mutant as caught.
#   MUTANTS_PACKAGES      packages whose tests run, for every crate of the run
#                   (default: unshard,unshard-cli for unshard, else the crate).
#   MUTANTS_ARGS    extra arguments for cargo mutants (e.g. --iterate, --list).
#   MUTANTS_TEST_TIMEOUT  seconds a mutant's tests may take (default 300; a
#                   mutant that loops is stopped then and counted as a timeout).
#   MUTANTS_TESTS=--lib narrows only the test phase: the build still builds every
#                   test binary of the packages. To judge by the library's unit
#                   tests and build only their binary (2-5 s a mutant):
#                   MUTANTS_PACKAGES=unshard MUTANTS_TESTS=" "
#                   MUTANTS_ARGS="--cargo-arg=--lib".
#
# There is no baseline run: cargo-mutants would test only the mutated package
# there, without the CLI suites named above. Run the same tests unmutated first
# (`cargo test -p unshard -p unshard-cli --lib --test claims ...`) if in doubt.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n '3,9p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

command -v cargo-mutants >/dev/null || {
  echo "cargo-mutants is not installed: cargo install --locked cargo-mutants" >&2
  exit 2
}

files=()
case "${1:-}" in
  -h | --help) usage ;;
  --changed)
    [ "$#" -le 2 ] || usage
    base="${2:-main}"
    merge_base=$(git merge-base "$base" HEAD) || {
      echo "--changed $base: no merge base with HEAD (is $base a branch or commit?)" >&2
      exit 2
    }
    # Committed and uncommitted changes, deleted files left out.
    while IFS= read -r f; do
      files+=("$f")
    done < <(git diff --name-only --diff-filter=d "$merge_base" -- 'crates/' |
      grep -E '^crates/[^/]+/src/.+\.rs$' || true)
    if [ "${#files[@]}" -eq 0 ]; then
      echo "no source file under crates/*/src changed against $base"
      exit 0
    fi
    ;;
  -*) usage ;;
  "")
    files=(
      'crates/unshard/src/plan/*.rs'
      'crates/unshard/src/write/staging.rs'
      'crates/unshard/src/write/sink.rs'
      'crates/unshard/src/source/zip/*.rs'
      'crates/unshard/src/source/safetensors.rs'
      'crates/unshard/src/source/bytes/*.rs'
      'crates/unshard/src/verify/*.rs'
    )
    ;;
  *) files=("$@") ;;
esac

# Group the files by crate: crates/<dir>/... belongs to the package named in
# crates/<dir>/Cargo.toml. A directory stands for every .rs file below it.
declare -A globs=()
crates=()
for f in "${files[@]}"; do
  f="${f#./}"
  f="${f%/}"
  dir=$(echo "$f" | sed -n 's|^crates/\([^/*?]*\)/.*|\1|p')
  if [ -z "$dir" ] || [ ! -f "crates/$dir/Cargo.toml" ]; then
    echo "$f: not under crates/<crate>/ (paths are relative to the repository root)" >&2
    exit 2
  fi
  if [ -d "$f" ]; then f="$f/**/*.rs"; fi
  if [ -z "${globs[$dir]+set}" ]; then
    crates+=("$dir")
    globs[$dir]=""
  fi
  globs[$dir]+="$f"$'\n'
done

budget="${MUTANTS_BUDGET:-3600}"
deadline=$(($(date +%s) + budget))
out="${MUTANTS_OUT:-/tmp/unshard-mutants}"
repo=$PWD
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
# The snapshot keeps its place, and a file its time unless its content changed:
# cargo rebuilds what changed since the last run (a restored mutant included) and
# nothing else.
snapshot="$CARGO_TARGET_DIR/mutants-src"
mkdir -p "$snapshot"
exec 9> "$snapshot.lock"
flock -n 9 || {
  echo "another mutants.sh run uses $snapshot" >&2
  exit 2
}
copy_if_changed() { # FROM TO
  if ! cmp -s "$1" "$2"; then
    mkdir -p "$(dirname "$2")"
    cp "$1" "$2"
  fi
}
# lib.rs declares each module twice (public under the `internals` feature, private
# otherwise), and cargo-mutants lists the mutants of a file once per declaration:
# every mutant would be built and tested twice. In the snapshot the private
# declarations go through a macro, which cargo-mutants does not expand (the test
# builds enable `internals`, so they are never compiled there).
lib=crates/unshard/src/lib.rs
dedup_lib() { # FROM TO
  perl -0pe 's/#\[cfg\(not\(feature = "internals"\)\)\]\nmod (\w+);/private_mod!($1);/g;
    s/^(#!\[deny\(missing_docs\)\]\n)/$1macro_rules! private_mod {\n    (\$m:ident) => {\n        #[cfg(not(feature = "internals"))]\n        mod \$m;\n    };\n}\n/m' "$1" > "$2"
}
git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do
    if [ ! -f "$f" ]; then continue; fi
    if [ "$f" = "$lib" ]; then
      dedup_lib "$f" "$snapshot.lib.rs"
      copy_if_changed "$snapshot.lib.rs" "$snapshot/$f"
    else
      copy_if_changed "$f" "$snapshot/$f"
    fi
  done
(cd "$snapshot" && find . -type f -printf '%P\0') |
  while IFS= read -r -d '' f; do
    if [ ! -e "$f" ]; then rm -f "$snapshot/$f"; fi
  done

status=0
for dir in "${crates[@]}"; do
  package=$(sed -n 's/^name *= *"\(.*\)"/\1/p' "crates/$dir/Cargo.toml" | head -n 1)
  case "$package" in
    # The CLI suites that merge, verify and refuse inputs pin the engine's
    # policies; the library's unit tests pin the rest.
    unshard)
      default_packages=unshard,unshard-cli
      default_tests="--lib --test claims --test merge --test verify"
      ;;
    *)
      default_packages=$package
      default_tests=""
      ;;
  esac
  read -r -a tests <<< "${MUTANTS_TESTS-$default_tests}"
  test_args=()
  for t in "${tests[@]}"; do test_args+=("--cargo-test-arg=$t"); done
  file_args=()
  while IFS= read -r g; do
    [ -n "$g" ] && file_args+=(-f "$g")
  done <<< "${globs[$dir]}"

  left=$((deadline - $(date +%s)))
  if [ "$left" -le 0 ]; then
    echo "$package: not run, out of time" >&2
    status=124
    continue
  fi
  mkdir -p "$out/$package"
  echo "== $package: ${file_args[*]}"
  # SIGINT on the budget: cargo-mutants stops, kills its build, keeps what it has.
  run=0
  timeout --signal=INT --kill-after=120 "$left" \
    cargo mutants --dir "$snapshot" --in-place --no-shuffle -p "$package" \
      --baseline=skip --timeout "${MUTANTS_TEST_TIMEOUT:-300}" --build-timeout 900 \
      --test-package "${MUTANTS_PACKAGES:-$default_packages}" \
      "${test_args[@]}" "${file_args[@]}" --output "$out/$package" \
      ${MUTANTS_ARGS:-} || run=$?
  # cargo mutants exits 2 when mutants were missed, 3 on timeouts, 124 here when
  # out of time; the worst is kept.
  if [ "$run" -gt "$status" ]; then status=$run; fi
done

echo
for dir in "${crates[@]}"; do
  package=$(sed -n 's/^name *= *"\(.*\)"/\1/p' "crates/$dir/Cargo.toml" | head -n 1)
  results="$out/$package/mutants.out"
  line="$package:"
  for f in caught missed timeout unviable; do
    n=$(grep -c . "$results/$f.txt" 2>/dev/null || true)
    line+=" $f ${n:-0}"
  done
  echo "$line"
  if [ -s "$results/missed.txt" ]; then sed 's/^/  missed: /' "$results/missed.txt"; fi
done
exit "$status"
