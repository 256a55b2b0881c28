#!/usr/bin/env bash
# Sets the PyTorch-dtype plan's 64/128-column crossing on this GPU by measurement, in one run of
# one build (docs/perf-log/backward.md, "After v38"). From the repository root, on a machine with
# a Hopper GPU and torch:
#
#   scripts/plan_crossing.sh LIB OUT_DIR
#
# LIB: libmoe_routing.so (C ABI; the ops load it through ctypes). Steps:
#   1. the sweep: GLM-4.5's shape in PyTorch's dtypes at whole tiles 10-23, each plan forced
#      (MOE_ROUTING_BACKWARD_PLAN), alternated h64, h128, h128, h64 (public_range.py --no-eager);
#   2. the crossing: the first tile from which 128 columns win at it and at the next, less half
#      a tile; unit64 u = 2.8 / crossing + 1/3 (plan() in cpp/src/fused_backward.cu);
#   3. the public range with the built-in anchor and with u (MOE_ROUTING_BACKWARD_UNIT64),
#      alternated base, u, u, base.
# OUT_DIR receives crossing.json (every pass, per case), unit64.txt, public-ab.json and the log.
# (`scripts/gpu-check.sh BIN OUT crossing` runs it, then its benches with u set: the results the
# constant u would give, to be committed as the device's anchor.)
set -uo pipefail
lib=${1:?LIB}; out=${2:?OUT_DIR}
mkdir -p "$out/runs" && out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python" MOE_ROUTING_TORCH_OP=0 MOE_ROUTING_LIB="$lib"
unset MOE_ROUTING_BACKWARD_PLAN MOE_ROUTING_BACKWARD_UNIT64
log="$out/plan_crossing.log"
python3 - "$out/sweep.json" <<'PY'
import json, sys
suite = json.load(open("benches/shapes/public_range.json"))
base = dict(suite["cases"][0])
suite["about"] = "the plan's crossing sweep: GLM-4.5's shape at whole 128-token tiles 10-23"
suite["cases"] = [dict(base, name=f"x{t}t", tokens=128 * t) for t in range(10, 24)]
json.dump(suite, open(sys.argv[1], "w"), indent=1)
PY
n=0
for plan in h64 h128 h128 h64; do
  n=$((n + 1)); echo "== sweep $n: $plan" | tee -a "$log"
  MOE_ROUTING_BACKWARD_PLAN=$plan timeout 300 python3 python/benches/public_range.py --no-eager \
    --repeats 20 --suite "$out/sweep.json" --json "$out/runs/sweep$n-$plan.json" >> "$log" 2>&1 ||
    echo "!! sweep $n: exit $?" | tee -a "$log"
done
python3 - "$out" <<'PY' | tee -a "$log"
import glob, json, os, sys
out = sys.argv[1]
runs = {os.path.basename(f)[:-5]: json.load(open(f))
        for f in sorted(glob.glob(f"{out}/runs/sweep*.json"))}
if not any(k.endswith("-h64") for k in runs) or not any(k.endswith("-h128") for k in runs):
    sys.exit("no sweep of one of the plans: no crossing")
json.dump({"device": next(iter(runs.values()))["device"], "runs": runs},
          open(f"{out}/crossing.json", "w"), indent=1)
names = [c["name"] for c in next(iter(runs.values()))["cases"]]
print("case  " + "".join(f"{k:>13}" for k in runs) + "   h64 - h128")
diff = {}
for i, name in enumerate(names):
    us = {k: r["cases"][i]["kernel_us"] for k, r in runs.items()}
    mean = lambda p: sum(v for k, v in us.items() if k.endswith(p)) / sum(k.endswith(p) for k in us)
    tiles = int(name[1:-1])
    diff[tiles] = mean("-h64") - mean("-h128")
    print(f"{name:<6}" + "".join(f"{v:13.2f}" for v in us.values()) + f"   {diff[tiles]:+.2f}")
tiles = sorted(diff)
first = next((t for j, t in enumerate(tiles)
              if diff[t] > 0 and (j + 1 == len(tiles) or diff[tiles[j + 1]] > 0)), tiles[-1] + 1)
u = 2.8 / (first - 0.5) + 1 / 3
print(f"crossing {first - 0.5} tiles: unit64 {u:.3f}")
open(f"{out}/unit64.txt", "w").write(f"{u:.3f}\n")
PY
u=$(cat "$out/unit64.txt" 2>/dev/null) || { echo "!! no unit64"; exit 1; }
n=0
for v in base u u base; do
  n=$((n + 1)); echo "== public range $n: $v" | tee -a "$log"
  if [ $v = u ]; then export MOE_ROUTING_BACKWARD_UNIT64=$u; else unset MOE_ROUTING_BACKWARD_UNIT64; fi
  timeout 300 python3 python/benches/public_range.py --no-eager \
    --json "$out/runs/public$n-$v.json" >> "$log" 2>&1 || echo "!! public $n: exit $?" | tee -a "$log"
done
unset MOE_ROUTING_BACKWARD_UNIT64
python3 - "$out" <<'PY' | tee -a "$log"
import glob, json, os, sys
out = sys.argv[1]
runs = {os.path.basename(f)[:-5]: json.load(open(f))
        for f in sorted(glob.glob(f"{out}/runs/public*.json"))}
if runs:
    json.dump(runs, open(f"{out}/public-ab.json", "w"), indent=1)
    first = next(iter(runs.values()))
    print("case  " + "".join(f"{k:>15}" for k in runs) + "  copy")
    for i, c in enumerate(first["cases"]):
        print(f"{c['name']:<6}" + "".join(f"{r['cases'][i]['kernel_us']:15.2f}" for r in runs.values())
              + f"  {c['copy_us']:.2f}")
    print("mean  " + "".join(f"{r['mean_kernel_us']:15.2f}" for r in runs.values()))
PY
exit 0
