# from the repository root: the same load four times, alternating, each on a freshly launched colocated
# CPU stack (tiny random model): without / with a json_schema response_format on every request (x2)
set -e
D=benchmarks/results/2026-12-02/cpu-grammar-1
for mode in free json free2 json2; do
  extra=""; case "$mode" in json*) extra="--json-schema";; esac
  .venv/bin/python -m launcher.cli bench serve --launch colocated --api completions \
    --num-requests 24 --max-concurrency 8 --input-len 32 --output-len 48 --seed 28 \
    --request-timeout-s 600 --ready-timeout-s 300 $extra --out $D/serve_$mode.json
done
