#!/usr/bin/env bash
# Runs tools/ceiling/ceiling on every case of a suite file (default ../shared/bench/suite.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
suite=${1:-../shared/bench/suite.json}
args=$(python3 -c 'import json,sys
for c in json.load(open(sys.argv[1]))["cases"]:
    print(c["tokens"], c["hidden_size"], c["n_routed_experts"], c["top_k"], end=" ")' "$suite")
exec tools/ceiling/ceiling $args
