#!/usr/bin/env bash
# Where a decode step's GPU time goes, kernel by kernel, read from the hardware counters
# by Nsight Compute (ncu) on a GPU host:
#
#   tests/bench/profile-decode.sh MODEL.gguf [--batch B] [--prompt-len N] [--device D] [--prefill]
#
# --prefill: the same table for the prefill's forward pass of N prompt tokens (the
# pass with the most kernel time) instead of the last decode step.
# Runs `m40 bench` (prefill of a random prompt, then 3 greedy decode steps of B
# sequences) under ncu with one metric pass per kernel, then prints, for the last decode
# step: each kernel's time, DRAM bytes and achieved bandwidth, grouped by kernel name, the
# step's summed kernel time against the step time m40 bench measures without the
# profiler (the difference is launch gaps and host work), and the weight-read roofline.
# ncu serializes kernels, so the summed times are per-kernel truths but not the step's
# wall time. Clocks are left alone (--clock-control none) and caches are not flushed
# between kernels (--cache-control none), as in a real step.
#
# Environment: M40 (default build/m40), NCU (default ncu), BANDWIDTH GB/s (default 3020).
set -u
cd "$(dirname "$0")/../.." || exit 1
M40=${M40:-build/m40}
NCU=${NCU:-ncu}
BANDWIDTH=${BANDWIDTH:-3020}
BATCH=1 PROMPT=512 DEVICE=0 MODEL= PREFILL=0
while [ $# -gt 0 ]; do
    case "$1" in
        --batch) BATCH=$2; shift ;;
        --prompt-len) PROMPT=$2; shift ;;
        --device) DEVICE=$2; shift ;;
        --prefill) PREFILL=1 ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) [ -z "$MODEL" ] || { echo "profile-decode.sh: one model" >&2; exit 2; }; MODEL=$1 ;;
    esac
    shift
done
[ -n "$MODEL" ] || { echo "usage: $0 MODEL.gguf [--batch B] [--prompt-len N] [--device D] [--prefill]" >&2; exit 2; }
command -v "$NCU" >/dev/null 2>&1 || { echo "profile-decode.sh: $NCU not found (Nsight Compute)" >&2; exit 2; }
[ -x "$M40" ] || { echo "profile-decode.sh: $M40 missing: build it first" >&2; exit 2; }

# prompts of several sequences share forward calls (up to CHUNK tokens each), so the
# profiled run stays a handful of prefill calls at large batches
CHUNK=$((BATCH * PROMPT < 4096 ? BATCH * PROMPT : 4096))
[ "$CHUNK" -ge "$PROMPT" ] || CHUNK=$PROMPT
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# unprofiled step time for the comparison
"$M40" bench --device "$DEVICE" "$MODEL" --prompt-len "$PROMPT" --chunk "$CHUNK" --gen 64 --reps 3 --batch "$BATCH" >"$tmp/bench.txt" 2>&1 ||
    { cat "$tmp/bench.txt" >&2; exit 1; }
"$NCU" --clock-control none --cache-control none --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    "$M40" bench --device "$DEVICE" "$MODEL" --prompt-len "$PROMPT" --chunk "$CHUNK" --gen 3 --reps 1 --batch "$BATCH" \
    >"$tmp/ncu.csv" 2>"$tmp/ncu.err" || { tail -20 "$tmp/ncu.err" >&2; exit 1; }

python3 - "$tmp/ncu.csv" "$tmp/bench.txt" "$BANDWIDTH" "$PREFILL" "$CHUNK" <<'EOF'
import csv, re, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, units, data = rows[0], rows[1], rows[2:]
col = {n: i for i, n in enumerate(head)}
def num(r, name, unit_scale):
    v = r[col[name]].replace(",", "")
    u = units[col[name]]
    return float(v) * unit_scale.get(u, 1.0) if v else 0.0
T = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3, "second": 1.0, "s": 1.0}
B = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
ks = []
for r in data:
    name = re.sub(r"\(.*", "", r[col["Kernel Name"]])
    ks.append((name, num(r, "gpu__time_duration.sum", T),
               num(r, "dram__bytes_read.sum", B) + num(r, "dram__bytes_write.sum", B)))
# forward passes start with the embedding kernel
starts = [i for i, k in enumerate(ks) if "embed" in k[0]]
if len(starts) < 2:
    sys.exit("profile-decode.sh: could not find the forward passes (embedding kernels) in the ncu output")
prefill = sys.argv[4] == "1"
if prefill:  # the pass with the most kernel time: the prompt's chunk
    bounds = starts + [len(ks)]
    passes = [ks[bounds[i]:bounds[i + 1]] for i in range(len(starts))]
    step = max(passes, key=lambda p: sum(k[1] for k in p))
else:
    step = ks[starts[-1]:]
tot_t = sum(k[1] for k in step)
tot_b = sum(k[2] for k in step)
groups = {}
for name, t, b in step:
    g = groups.setdefault(name, [0, 0.0, 0.0])
    g[0] += 1; g[1] += t; g[2] += b
bench = open(sys.argv[2]).read()
m = re.search(r"median:\s+prefill [\d.]+ tok/s, decode [\d.]+ tok/s \(batch \d+, ([\d.]+) steps/s\)", bench)
step_s = 1.0 / float(m.group(1)) if m else None
if prefill:
    mp = re.search(r"median:\s+prefill ([\d.]+) tok/s", bench)
    step_s = int(sys.argv[5]) / float(mp.group(1)) if mp else None
w = re.search(r"roofline: decode reads the weights once per step: ([\d.e+]+) GB", bench)
bw = float(sys.argv[3]) * 1e9
print(f"{'prefill pass' if prefill else 'last decode step'}: {len(step)} kernels, {tot_t * 1e3:.3f} ms of kernel time, {tot_b / 1e9:.3f} GB of DRAM traffic"
      f" ({tot_b / tot_t / 1e9 if tot_t else 0:.0f} GB/s while kernels ran)")
if step_s:
    print(f"m40 bench {'pass' if prefill else 'step'} (no profiler): {step_s * 1e3:.3f} ms -> {1e3 * (step_s - tot_t):.3f} ms outside kernels "
          f"(launch gaps, host work)")
if w:
    wb = float(w.group(1)) * 1e9
    print(f"weight bytes {wb / 1e9:.3f} GB -> roofline step {wb / bw * 1e3:.3f} ms at {bw / 1e9:.0f} GB/s")
print(f"{'kernel':<58} {'n':>4} {'ms':>8} {'%step':>6} {'MB':>9} {'GB/s':>7} {'%bw':>5}")
for name, (n, t, b) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
    print(f"{name[:58]:<58} {n:>4} {t * 1e3:>8.3f} {100 * t / tot_t:>6.1f} {b / 1e6:>9.1f} "
          f"{b / t / 1e9 if t else 0:>7.0f} {100 * b / t / bw if t else 0:>5.1f}")
EOF
