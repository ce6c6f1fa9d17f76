# Sourced by scripts/demo.sh and scripts/agent_demo.sh (bash, after `set -euo pipefail` and a cd
# to the repository root, with DEMO_DEFAULT_DIR and DEMO_STAGES set): the demos' environment,
# their output directory (replaced on every run) and stage().
out="${DEMO_DIR:-$DEMO_DEFAULT_DIR}"
megarl="${MEGARL:-.venv/bin/megarl}"
python="${PYTHON:-.venv/bin/python}"
read -r -a sft_args <<< "${SFT_ARGS:-}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"

times=()
stage() {  # stage NUMBER TITLE COMMAND...: run it, stop the demo if it fails, record its time
    local number=$1 title=$2 start=$SECONDS
    shift 2
    printf '\n=== stage %s/%s: %s\n$ %s\n' "$number" "$DEMO_STAGES" "$title" "$*"
    "$@" || { echo "=== stage $number failed (exit $?): $title" >&2; exit 1; }
    times+=("stage $number: $((SECONDS - start)) s  $title")
}

rm -rf "$out"  # the demo's own output: a run directory with checkpoints would be resumed
mkdir -p "$out"
