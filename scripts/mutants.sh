#!/usr/bin/env bash
# Mutation testing of the policy code with cargo-mutants (`cargo install cargo-mutants`).
#
#   scripts/mutants.sh [FILE_GLOB...]
#
# Each mutant (a plausible one-line bug cargo-mutants writes into a copy of the
# tree in /tmp) is built and tested; "caught" means a test failed. The default
# files are the policy modules: the plan, the writer's commit path, the readers'
# bounds and verify. Results go to $MUTANTS_OUT (mutants.out/ inside it); figures
# and the reasons for each missed mutant are in docs/testing.md.
#
# Environment:
#   MUTANTS_BUDGET  seconds before the run is stopped (default 3600); what was
#                   tested by then is in outcomes.json. --iterate resumes later.
#   MUTANTS_JOBS    parallel builds (default 1: the machine is shared).
#   MUTANTS_OUT     output directory (default /tmp/unshard-mutants).
#   MUTANTS_TESTS   which tests judge a mutant (default: the library's unit tests
#                   and the CLI tests that pin the README's policies).
#                   Several test-name filters go after `--` ("-- a::b c::d"):
#                   cargo test takes one name before it, and refuses a second
#                   with a usage error that counts every mutant as caught.
#   MUTANTS_ARGS    extra arguments for cargo mutants (e.g. --iterate, --list).
#   MUTANTS_TEST_TIMEOUT  seconds a mutant's tests may take (default 300).
#   MUTANTS_IN_PLACE=1    mutate this tree and build in its target/ (no copy of the
#                   tree or of target/, so no rebuild of the dependencies; do not
#                   edit or build this tree meanwhile; cargo-mutants restores
#                   each file after its mutant, also when interrupted).
#   MUTANTS_PACKAGES      packages whose tests run (default unshard,unshard-cli).
#                   MUTANTS_TESTS=--lib narrows only the test phase: the build
#                   still builds every test binary of the packages. To judge by
#                   the library's unit tests and build only their binary (2-5 s a
#                   mutant in place): MUTANTS_PACKAGES=unshard MUTANTS_TESTS=" "
#                   MUTANTS_ARGS="-p unshard --cargo-arg=--lib".
#
# There is no baseline run: cargo-mutants would test only the mutated package
# there, without the CLI suites named above. Run the same tests unmutated first
# (`cargo test -p unshard -p unshard-cli --lib --test claims ...`) if in doubt.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo-mutants >/dev/null || {
  echo "cargo-mutants is not installed: cargo install cargo-mutants" >&2
  exit 2
}

if [ "$#" -gt 0 ]; then
  files=("$@")
else
  files=(
    'crates/unshard/src/plan/*.rs'
    'crates/unshard/src/write/staging.rs'
    'crates/unshard/src/write/sink.rs'
    'crates/unshard/src/source/zip/*.rs'
    'crates/unshard/src/source/safetensors.rs'
    'crates/unshard/src/source/bytes/*.rs'
    'crates/unshard/src/verify/*.rs'
  )
fi
file_args=()
for f in "${files[@]}"; do file_args+=(-f "$f"); done

budget="${MUTANTS_BUDGET:-3600}"
out="${MUTANTS_OUT:-/tmp/unshard-mutants}"
mkdir -p "$out"
# The unit tests, and the CLI suites that merge, verify and refuse inputs.
read -r -a tests <<< "${MUTANTS_TESTS:---lib --test claims --test merge --test verify}"
test_args=()
for t in "${tests[@]}"; do test_args+=("--cargo-test-arg=$t"); done

where=(--copy-target=true --jobs "${MUTANTS_JOBS:-1}")
if [ -n "${MUTANTS_IN_PLACE:-}" ]; then where=(--in-place); fi

# SIGINT on the budget: cargo-mutants stops, kills its build, keeps what it has.
status=0
timeout --signal=INT --kill-after=120 "$budget" \
  cargo mutants --no-shuffle "${where[@]}" \
    --baseline=skip --timeout "${MUTANTS_TEST_TIMEOUT:-300}" --build-timeout 900 \
    --test-package "${MUTANTS_PACKAGES:-unshard,unshard-cli}" \
    "${test_args[@]}" "${file_args[@]}" --output "$out" ${MUTANTS_ARGS:-} || status=$?
for f in caught missed timeout unviable; do
  n=$(grep -c . "$out/mutants.out/$f.txt" 2>/dev/null || true)
  echo "$f: ${n:-0}"
done
# cargo mutants exits 2 when mutants were missed, 124 here when out of time.
exit "$status"
