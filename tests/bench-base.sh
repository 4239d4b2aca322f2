#!/usr/bin/env bash
# The benchmarks whose claim is "faster", run with a base binary and with the current one, one
# after the other in the same command, each pair printed together (`make bench` ends with it).
#
#   tests/bench-base.sh [COMMIT]     (default: $BENCH_BASE)
#
# The base is COMMIT's `rollarc`, built once with its own target directory under the cache
# (outside the tree: $ROLLARC_CACHE or ~/.cache/rollarc) from a temporary git worktree; or
# the binary $BENCH_BASE_BIN names, if set. $BENCH_WHAT lists the benchmarks (default: llm
# llm-train scheduler); one the base does not have is reported as such and skipped.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
new="$root/target/release/rollarc"
base_rev=${1:-${BENCH_BASE:-}}
if [ -z "$base_rev" ] && [ -z "${BENCH_BASE_BIN:-}" ]; then
    echo "bench-base: give a base commit (argument or BENCH_BASE) or a binary (BENCH_BASE_BIN)" >&2
    exit 2
fi
cache=${ROLLARC_CACHE:-$HOME/.cache/rollarc}/bench-base
what=${BENCH_WHAT:-llm llm-train scheduler}

[ -x "$new" ] || { echo "bench-base: $new is missing (cargo build --release -p engine --bin rollarc)" >&2; exit 2; }

if [ -n "${BENCH_BASE_BIN:-}" ]; then
    base="$BENCH_BASE_BIN"
    label="$BENCH_BASE_BIN"
else
    full=$(git -C "$root" rev-parse --verify "$base_rev^{commit}") || {
        echo "bench-base: $base_rev is not a commit of this repository" >&2
        exit 2
    }
    short=${full:0:10}
    base="$cache/$short/rollarc"
    label="$short"
    if [ ! -x "$base" ]; then
        echo "bench-base: building rollarc at $short once (its own target directory, $cache/$short)"
        work=$(mktemp -d)
        trap 'git -C "$root" worktree remove --force "$work" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
        git -C "$root" worktree add --detach "$work" "$full" >/dev/null
        mkdir -p "$cache/$short"
        (cd "$work" && cargo build --release -p engine --bin rollarc -j2 --target-dir "$cache/$short/target")
        cp "$cache/$short/target/release/rollarc" "$base.tmp" && mv "$base.tmp" "$base"
        # The binary is what is kept: the build's objects go.
        rm -rf "$cache/$short/target"
    fi
fi

for w in $what; do
    echo
    echo "=== bench --what $w: base ($label) then new ($(git -C "$root" rev-parse --short HEAD)) ==="
    if ! "$base" bench --help 2>/dev/null | grep -q -- "--what.*\b$w\b"; then
        echo "--- base: has no '$w' benchmark (added after it); new only"
    else
        echo "--- base"
        "$base" bench --what "$w"
    fi
    echo "--- new"
    "$new" bench --what "$w"
done
