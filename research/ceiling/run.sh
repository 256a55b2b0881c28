#!/usr/bin/env bash
# Runs research/ceiling/ceiling on every case of a suite file (default benches/shapes/suite.json;
# the other shape files in benches/shapes/ take the same form).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
suite=$(realpath "${1:-$root/benches/shapes/suite.json}")
args=$(python3 -c 'import json,sys
for c in json.load(open(sys.argv[1]))["cases"]:
    print(c["tokens"], c["hidden_size"], c["n_routed_experts"], c["top_k"], end=" ")' "$suite")
exec "$root/research/ceiling/ceiling" $args
